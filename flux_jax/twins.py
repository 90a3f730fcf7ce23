"""The XLA twins: the pure-JAX definitions of the fused ops.

They are the contract's oracle, what impl="xla" runs and what impl="auto" falls back to; the
ops' descriptors (flux_jax/ops/) call these same functions for their twin path. Per-shard
functions, for use inside jax.shard_map.
"""

from __future__ import annotations

import functools

import jax
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


def matmul_ar_xla(x, w, *, axis_name: str):
    """psum(x @ w): every rank gets the whole sum."""
    return lax.psum(jnp.dot(x, w), axis_name)


def column_matmul_xla(x, w, *, axis_name: str):
    """x @ w with x replicated over `axis_name`; the backward all-reduces dx = psum(dy @ w^T).

    Megatron's column-parallel linear without sequence parallelism ("f": identity forward,
    all-reduce backward). In a shard_map with check_vma=False, JAX's convention sums a replicated
    value's cotangent elsewhere (the shard_map boundary, psum's transpose), and dx stays local,
    as for a plain jnp.dot.
    """
    # Both operands vary over every other manual axis either varies over (x stays as typed over
    # `axis_name`), so the custom_vjp's cotangents type-check; pcast's transpose sums them there.
    others = (_varying(x) | _varying(w)) - {axis_name}
    return _column_matmul(_typed_like(x, others), _typed_like(w, others | {axis_name}), axis_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _column_matmul(x, w, axis_name):
    return jnp.dot(x, w)


def _column_matmul_fwd(x, w, axis_name):
    return jnp.dot(x, w), (x, w)


def _column_matmul_bwd(axis_name, residuals, dy):
    x, w = residuals
    dx = jnp.dot(dy, w.T)
    if axis_name in _varying(w):  # types checked (w was cast to vary over the axis)
        dx = lax.psum(dx, axis_name)
    lead = tuple(range(x.ndim - 1))
    dw = lax.dot_general(x, dy, ((lead, lead), ((), ())))
    return _typed_like(dx, _varying(x)), _typed_like(dw.astype(w.dtype), _varying(w))


def _typed_like(a, axes: frozenset):
    """`a` cast to vary over every manual axis in `axes` it does not vary over yet."""
    missing = tuple(sorted(frozenset(axes) - _varying(a)))
    return lax.pcast(a, missing, to="varying") if missing else a


def _varying(a) -> frozenset:
    mat = getattr(jax.typeof(a), "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


_column_matmul.defvjp(_column_matmul_fwd, _column_matmul_bwd)
