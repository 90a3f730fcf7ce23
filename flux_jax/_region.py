"""How a fused call splits x over the mesh axes a partially manual shard_map leaves automatic.

The lowering runs the custom call in a nested manual region over those axes (flux_jax/_lowering.py,
docs/design.md "Inside existing models"); the ops plan each call for the shard of x a device runs
there, so both ask this module which dimensions of x the automatic axes split.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from flux_jax._errors import FusedUnavailableError
from flux_jax._validation import entry_axes as _names


def type_spec(aval) -> list | None:
    """The PartitionSpec entries of `aval`'s type (jax.typeof of an array), one per dimension
    (Explicit mesh axes only; Auto and manual ones are not part of a type), or None where the
    type carries no sharding."""
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    return None if spec is None else list(spec) + [None] * (len(aval.shape) - len(spec))


def x_spec(shape, sharding_spec, auto: tuple, mesh, op: str, rows_free: bool) -> P:
    """x's partition spec over the automatic axes `auto` of `mesh` (concrete or abstract).

    Explicit axes: the split x's type holds (`sharding_spec`, type_spec's entries; None: no
    split), which must be kept; K cannot be split, nor the gathered / scattered rows (dimension
    0) unless `rows_free` (matmul_ar: no rows cross ranks). Auto axes: the first middle dimension
    (any row dimension if `rows_free`) that the axes' devices split evenly (a batch); x is
    replicated over them if none does.
    """
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    explicit = any(types[a] == AxisType.Explicit for a in auto)
    dims = sharding_spec or [None] * len(shape)
    if explicit or any(a in _names(e) for e in dims for a in auto):
        if _names(dims[-1]):
            raise FusedUnavailableError(
                f"flux_jax.{op}: x is sharded {P(*dims)} over the automatic mesh axes {auto} on its "
                "contraction dimension; the fused ops split only its row (batch) dimensions over them"
            )
        if _names(dims[0]) and not rows_free:
            raise FusedUnavailableError(
                f"flux_jax.{op}: x (its gathered / scattered dimension moved first: {P(*dims)}) is "
                f"sharded over the automatic mesh axes {auto} on the dimension it gathers / scatters over "
                "the TP axis; the fused op splits only the other row (batch) dimensions over them"
            )
        return P(*[tuple(a for a in _names(e) if a in auto) or None for e in dims])
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    split = int(np.prod([sizes[a] for a in auto]))
    out = [None] * len(shape)
    for d in range(0 if rows_free else 1, len(shape) - 1):
        if shape[d] % split == 0:
            out[d] = auto if len(auto) > 1 else auto[0]
            break
    return P(*out)


def shard_shape(shape, spec: P, mesh) -> tuple:
    """The shape of one device's shard of an array of `shape` split as `spec` over `mesh`."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    entries = list(spec) + [None] * (len(shape) - len(spec))
    return tuple(n // int(np.prod([sizes[a] for a in _names(e)])) for n, e in zip(shape, entries))


def whole_weight(w):
    """`w` (an array or a pre-quantized weight's leaves) unsplit over the Explicit mesh axes its
    type splits (FSDP parameters in a shard_map that leaves those axes automatic): the GEMM needs
    this rank's whole weight, and with Explicit axes nothing gathers it implicitly. The gradient
    comes back split as w was (reshard's transpose)."""

    def gather(leaf):
        spec = type_spec(jax.typeof(leaf))
        if spec is None or not any(entry is not None for entry in spec):
            return leaf
        return jax.sharding.reshard(leaf, P(*[None] * leaf.ndim))

    return jax.tree.map(gather, w)
