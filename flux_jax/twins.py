"""The XLA twins: pure-JAX definitions of the fused ops.

They are the oracle of the contract and the fallback of impl="auto". Both are
per-shard functions for use inside jax.shard_map.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def ag_matmul_xla(x, w, *, axis_name: str, return_gathered: bool = False):
    """all_gather(x, axis 0) @ w, optionally with the gathered x."""
    x_full = lax.all_gather(x, axis_name, axis=0, tiled=True)
    out = jnp.dot(x_full, w)
    return (out, x_full) if return_gathered else out


def matmul_rs_xla(x, w, *, axis_name: str):
    """psum_scatter(x @ w, axis 0)."""
    return lax.psum_scatter(jnp.dot(x, w), axis_name, scatter_dimension=0, tiled=True)
