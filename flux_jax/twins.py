"""The XLA twins: the pure-JAX definitions of the fused ops.

They are the contract's oracle, what impl="xla" runs and what impl="auto" falls back to; the
ops' descriptors (flux_jax/ops/) call these same functions for their twin path. Per-shard
functions, for use inside jax.shard_map.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def ag_matmul_xla(x, w, *, axis_name: str, axis: int = 0, return_gathered: bool = False):
    """all_gather(x over dimension `axis`) @ w, optionally with the gathered x."""
    x_full = lax.all_gather(x, axis_name, axis=axis, tiled=True)
    out = jnp.dot(x_full, w)
    return (out, x_full) if return_gathered else out


def matmul_rs_xla(x, w, *, axis_name: str, scatter_dimension: int = 0):
    """psum_scatter(x @ w over dimension `scatter_dimension`)."""
    return lax.psum_scatter(jnp.dot(x, w), axis_name, scatter_dimension=scatter_dimension, tiled=True)
