"""Choosing between the fused kernel and the XLA twin (impl="auto"|"fused"|"xla")."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flux_jax import _native
from flux_jax._config import Config, get_config
from flux_jax._errors import FusedUnavailableError
from flux_jax._validation import AxisInfo


@dataclasses.dataclass(frozen=True)
class FusedSpec:
    """Static description of one fused call (hashable: a custom_vjp nondiff arg)."""

    axis_name: str
    tp_size: int
    transpose_w: bool
    config: Config
    forced: bool  # impl="fused": an error, not the twin, where the mesh rules fusion out


def _non_hopper_gpus() -> list[str]:
    """Local GPUs that are not sm_90 (the CUDA kernels are built for sm_90a)."""
    bad = []
    for d in jax.local_devices():
        if d.platform == "gpu" and str(getattr(d, "compute_capability", "9.0")) != "9.0":
            bad.append(f"{d.device_kind} (sm {d.compute_capability})")
    return bad


def fused_unavailable_reason(op: str, info: AxisInfo, k: int, n: int, dtype) -> str | None:
    """Why the fused kernel cannot run here, or None if it can."""
    if not info.fully_manual:
        return (
            "the enclosing shard_map leaves some mesh axes to the automatic partitioner; the "
            "fused kernels need every mesh axis of size > 1 mapped"
        )
    if info.platform == "cpu":
        return None
    if info.platform in ("cuda", "gpu"):
        if not _native.has_cuda_kernel(op):
            built = _native.build_info()
            what = "without CUDA" if not built["cuda"] else "without this CUDA kernel yet"
            return f"this flux_jax build was compiled {what} (flux_jax.build_info(): {built})"
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"the CUDA kernels take bfloat16 or float16 inputs, not {jnp.dtype(dtype).name}"
        if k % 8 or n % 8:
            return f"the CUDA kernels need K and N to be multiples of 8 (got K={k}, N={n})"
        bad = _non_hopper_gpus()
        if bad:
            return f"the CUDA kernels need Hopper (sm_90) GPUs; found {bad}"
        return None
    return f"no fused kernel for platform {info.platform!r} (cpu and cuda are supported)"


def _auto_prefers_fused(op: str, info: AxisInfo, rows: int, k: int, n: int, dtype) -> bool:
    """impl="auto": fused only where it is implemented *and* measured faster."""
    if info.platform == "cpu":
        # The CPU backend is a protocol reference, slower than XLA:CPU's dot.
        return False
    from flux_jax import _heuristics  # GPU crossover table, from measurements

    return _heuristics.fused_is_faster(op, info.tp_size, rows, k, n, jnp.dtype(dtype))


def resolve(op: str, impl: str, info: AxisInfo, rows: int, k: int, n: int, dtype) -> str:
    """Returns "fused" or "xla"; raises FusedUnavailableError for an impossible "fused"."""
    if impl == "xla":
        return "xla"
    reason = fused_unavailable_reason(op, info, k, n, dtype)
    if impl == "fused":
        if reason is not None:
            raise FusedUnavailableError(f'flux_jax.{op}(impl="fused") cannot run here: {reason}')
        return "fused"
    if reason is not None:
        return "xla"
    return "fused" if _auto_prefers_fused(op, info, rows, k, n, dtype) else "xla"


def make_spec(info: AxisInfo, transpose_w: bool, forced: bool) -> FusedSpec:
    return FusedSpec(info.axis_name, info.tp_size, transpose_w, get_config(), forced)


def batch_rows(prim, args, dims, **params):
    """vmap rule shared by the fused primitives: the batch axis becomes a middle dimension.

    Gather/scatter run over the leading (row) axis and rows are contiguous per rank, so
    x[B, rows, K] is computed as x[rows, B, K] flattened to [rows*B, K]; every output
    [rows', ...] comes back as [rows'/B... ] with the batch on axis 1. Only x may be batched.
    """
    x, w, rank = args
    x_dim, w_dim, rank_dim = dims  # None: not batched
    if w_dim is not None or rank_dim is not None:
        raise NotImplementedError(
            f"flux_jax: vmap of {prim.name} over the weight is not supported (vmap over x only; "
            "for a batch of weights use the XLA twin, impl='xla')")
    x = jnp.moveaxis(x, x_dim, 1)
    rows, batch, k = x.shape
    outs = prim.bind(x.reshape(rows * batch, k), w, rank, **params)
    outs = [o.reshape(o.shape[0] // batch, batch, o.shape[1]) for o in outs]
    return outs, [1] * len(outs)


def _varying(x) -> frozenset:
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(t, "vma", ()))


def unify_varying(axis_name: str, *xs):
    """pcast every operand to vary over the union of their manual axes and `axis_name`.

    The fused primitive's results then carry the right manual-axis type, and
    pcast's transpose adds the psums that invariant operands need in the
    backward pass (e.g. a weight replicated over a data-parallel axis).
    """
    target = frozenset({axis_name}).union(*(_varying(x) for x in xs))
    out = []
    for x in xs:
        missing = tuple(sorted(target - _varying(x)))
        out.append(jax.lax.pcast(x, missing, to="varying") if missing else x)
    return out
