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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def psum(a, axis_name):
    """lax.psum(a, axis_name)."""
    return _reduced(lambda v: lax.psum(v, axis_name), a)


def psum_scatter(a, axis_name, scatter_dimension: int = 0):
    """lax.psum_scatter(a, axis_name, scatter_dimension=scatter_dimension, tiled=True)."""
    return _reduced(lambda v: lax.psum_scatter(v, axis_name, scatter_dimension=scatter_dimension, tiled=True), a)


def all_gather(a, axis_name, axis: int = 0):
    """lax.all_gather(a, axis_name, axis=axis, tiled=True); its transpose is psum_scatter above."""
    if a.dtype != jnp.bfloat16:
        return lax.all_gather(a, axis_name, axis=axis, tiled=True)
    return _bf16_all_gather(a, axis_name, axis)


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
def _bf16_all_gather(a, axis_name, axis):
    return lax.all_gather(a, axis_name, axis=axis, tiled=True)


def _bf16_all_gather_fwd(a, axis_name, axis):
    return _bf16_all_gather(a, axis_name, axis), None


def _bf16_all_gather_bwd(axis_name, axis, _, dy):
    return (psum_scatter(dy, axis_name, axis),)


_bf16_all_gather.defvjp(_bf16_all_gather_fwd, _bf16_all_gather_bwd)
