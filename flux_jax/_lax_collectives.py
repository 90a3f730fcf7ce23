"""lax's collectives as the twins and the ops' pure-JAX code use them, with one XLA:CPU workaround.

XLA:CPU aborts the process ("Invalid binary instruction opcode copy", in its AllReducePromotion
pass; jax 0.11.2 and 0.12) when it compiles a bfloat16 psum or psum_scatter inside a shard_map
that leaves a mesh axis automatic (`axis_names={"tp"}` in a GSPMD model); float32 and float16
compile. That pass exists to reduce bfloat16 in float32, so on CPU these helpers do that
themselves: the program is the one XLA means to run, and the results are the bits it gives in a
fully manual shard_map. Every other platform gets lax's collective unchanged: on a GPU or TPU mesh
at trace time; on a CPU mesh (which may be exported for GPUs) or one that names no platform,
through lax.platform_dependent, which lowers only the branch of the lowering's platform.
all_gather is here for its transpose: a bfloat16 all_gather's gradient is such a psum_scatter.

A second workaround, every platform, JAX 0.11 only: in a shard_map that leaves only Explicit mesh
axes automatic (dp around a manual tp), JAX 0.11 cannot type psum_scatter, nor all_gather's
transpose ("Length of sharding.spec ... must be equal to aval's ndim (0)"; 0.12 can). There
psum_scatter runs in a nested manual region over those axes, each device on its own block, as the
fused ops' lowering does (the scattered dimension first unsplit over them), and all_gather's
transpose is that psum_scatter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import config as jax_config  # private: whether the enclosing shard_map checks types
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from flux_jax import _region

_TYPES_REDUCE_SCATTER = jax.__version_info__ >= (0, 12)


def psum(a, axis_name):
    """lax.psum(a, axis_name)."""
    return _reduced(lambda v: lax.psum(v, axis_name), a)


def psum_scatter(a, axis_name, scatter_dimension: int = 0):
    """lax.psum_scatter(a, axis_name, scatter_dimension=scatter_dimension, tiled=True)."""

    def scatter(v):
        return _reduced(lambda u: lax.psum_scatter(u, axis_name, scatter_dimension=scatter_dimension, tiled=True), v)

    return _per_explicit_block(scatter, a, scatter_dimension)


def all_gather(a, axis_name, axis: int = 0):
    """lax.all_gather(a, axis_name, axis=axis, tiled=True); its transpose is psum_scatter above."""
    blocks = _explicit_blocks()
    if a.dtype != jnp.bfloat16 and not blocks:
        return lax.all_gather(a, axis_name, axis=axis, tiled=True)
    return _all_gather(_unsplit(a, axis)[0] if blocks else a, axis_name, axis)


def _explicit_blocks() -> frozenset:
    """The automatic mesh axes psum_scatter runs per block of (none: lax's own runs)."""
    if _TYPES_REDUCE_SCATTER or not jax_config._check_vma.value:  # no check_vma: lax's own types
        return frozenset()
    mesh = jax.sharding.get_abstract_mesh()
    manual = frozenset(getattr(mesh, "manual_axes", ()))
    types = {n: t for n, t in zip(mesh.axis_names, mesh.axis_types) if n not in manual}
    if not types or any(t != AxisType.Explicit for t in types.values()):
        return frozenset()  # (a nested region beside Auto axes aborts XLA 0.11: left to lax)
    return frozenset(types)


def _unsplit(a, dim: int):
    """`a` with dimension `dim` unsplit over the Explicit axes (the others as they were), and
    that spec."""
    spec = _region.type_spec(jax.typeof(a))
    if spec[dim] is None:
        return a, P(*spec)
    spec[dim] = None
    return jax.sharding.reshard(a, P(*spec)), P(*spec)


def _per_explicit_block(collective, a, dim: int):
    """collective(a), in a nested manual region over _explicit_blocks() (if any), with `dim`
    (the scattered dimension) unsplit over them first."""
    axes = _explicit_blocks()
    if not axes:
        return collective(a)
    whole, spec = _unsplit(a, dim)
    return jax.shard_map(collective, out_specs=spec, axis_names=set(axes))(whole)


def _reduced(reduce, a):
    if a.dtype != jnp.bfloat16:
        return reduce(a)

    def in_float32(v):
        return reduce(v.astype(jnp.float32)).astype(v.dtype)

    if _mesh_platform() not in (None, "cpu"):
        return reduce(a)
    return lax.platform_dependent(a, cpu=in_float32, default=reduce)


def _mesh_platform() -> str | None:
    """The platform of the mesh being traced over (inside shard_map), None where it names none."""
    try:
        return jax.sharding.get_abstract_mesh().abstract_device.platform
    except AttributeError:  # no devices behind the abstract mesh
        return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _all_gather(a, axis_name, axis):
    """lax.all_gather whose transpose is psum_scatter above (bfloat16; Explicit blocks)."""
    return lax.all_gather(a, axis_name, axis=axis, tiled=True)


def _all_gather_fwd(a, axis_name, axis):
    return _all_gather(a, axis_name, axis), None


def _all_gather_bwd(axis_name, axis, _, dy):
    return (psum_scatter(dy, axis_name, axis),)


_all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)
