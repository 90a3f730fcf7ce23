"""The XLA twins: the pure-JAX definitions of the fused ops.

They are the contract's oracle, what impl="xla" runs and what impl="auto" falls back to; the
ops' descriptors (flux_jax/ops/) call these same functions for their twin path. Per-shard
functions, for use inside jax.shard_map.

With `fp8` (True or a flux_jax.Fp8 recipe) a twin quantizes as the fused FP8 ops do
(flux_jax/fp8.py) and runs XLA's FP8 GEMM next to lax's collective; its custom_vjp is the
straight-through backward of flux_jax/fp8.py, on lax's collectives.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from flux_jax import _autodiff
from flux_jax import fp8 as _fp8


def ag_matmul_xla(x, w, *, axis_name: str, axis: int = 0, return_gathered: bool = False, fp8=None):
    """all_gather(x over dimension `axis`) @ w, optionally with the gathered x."""
    recipe = _fp8.resolve("ag_matmul_xla", fp8)
    if recipe is not None:
        x_front, w = _unify(axis_name, jnp.moveaxis(x, axis, 0), w)
        outs = _ag_matmul_fp8(x_front, w, axis_name, recipe, return_gathered)
        outs = [jnp.moveaxis(o, 0, axis) for o in outs]
        return tuple(outs) if return_gathered else outs[0]
    x_full = lax.all_gather(x, axis_name, axis=axis, tiled=True)
    out = jnp.dot(x_full, w)
    return (out, x_full) if return_gathered else out


def matmul_rs_xla(x, w, *, axis_name: str, scatter_dimension: int = 0, fp8=None):
    """psum_scatter(x @ w over dimension `scatter_dimension`)."""
    recipe = _fp8.resolve("matmul_rs_xla", fp8)
    if recipe is not None:
        x_front, w = _unify(axis_name, jnp.moveaxis(x, scatter_dimension, 0), w)
        return jnp.moveaxis(_matmul_rs_fp8(x_front, w, axis_name, recipe), 0, scatter_dimension)
    return lax.psum_scatter(jnp.dot(x, w), axis_name, scatter_dimension=scatter_dimension, tiled=True)


# ---- FP8 twins: x [rows, ..., k] with the gathered / scattered dimension first -----------------


def _unify(axis_name, *xs):
    # The custom_vjp's cotangents must carry their primals' manual-axis types: make x and w vary
    # alike first (pcast's transpose sums the weight gradient where w was invariant).
    from flux_jax.ops._spec import unify_varying

    return unify_varying(axis_name, *xs)


def _gather(axis_name):
    return lambda a: lax.all_gather(a, axis_name, axis=0, tiled=True)


def _scatter(a, axis_name):
    return lax.psum_scatter(a, axis_name, scatter_dimension=0, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _ag_matmul_fp8(x, w, axis_name, recipe, return_gathered):
    return _fp8.gathered_matmul(x, w, recipe, _gather(axis_name), lax.axis_size(axis_name),
                                return_gathered=return_gathered)


def _ag_matmul_fp8_fwd(x, w, axis_name, recipe, return_gathered):
    out, x_full = _fp8.gathered_matmul(x, w, recipe, _gather(axis_name), lax.axis_size(axis_name),
                                       return_gathered=True)
    return ([out, x_full] if return_gathered else [out]), (x_full, w)


def _ag_matmul_fp8_bwd(axis_name, recipe, return_gathered, residuals, cotangents):
    x_full, w = residuals
    dy = cotangents[0]
    dx = _scatter(_fp8.matmul(dy, w, recipe, transpose_w=True, grad=True), axis_name)
    if return_gathered:
        dx = dx + _scatter(cotangents[1], axis_name)
    return dx, _autodiff.weight_grad(x_full, dy, False)


_ag_matmul_fp8.defvjp(_ag_matmul_fp8_fwd, _ag_matmul_fp8_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul_rs_fp8(x, w, axis_name, recipe):
    return _scatter(_fp8.matmul(x, w, recipe), axis_name)


def _matmul_rs_fp8_fwd(x, w, axis_name, recipe):
    return _matmul_rs_fp8(x, w, axis_name, recipe), (x, w)


def _matmul_rs_fp8_bwd(axis_name, recipe, residuals, dy):
    x, w = residuals
    dx, dy_full = _fp8.gathered_matmul(dy, w, recipe, _gather(axis_name), lax.axis_size(axis_name),
                                       transpose_w=True, grad=True, return_gathered=True)
    return dx, _autodiff.weight_grad(x, dy_full, False)


_matmul_rs_fp8.defvjp(_matmul_rs_fp8_fwd, _matmul_rs_fp8_bwd)
