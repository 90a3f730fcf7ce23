"""The XLA twins: the pure-JAX definitions of the fused ops.

They are the contract's oracle, what impl="xla" runs and what impl="auto" falls back to; the
ops' descriptors (flux_jax/ops/) call these same functions for their twin path. Per-shard
functions, for use inside jax.shard_map.

With `fp8` (True or a flux_jax.Fp8 recipe) a twin quantizes as the fused FP8 ops do
(flux_jax/fp8.py) and runs XLA's FP8 GEMM next to lax's collective; its custom_vjp is the
straight-through backward of flux_jax/fp8.py, on lax's collectives. `w` may be a pre-quantized
flux_jax.Fp8Weight (fp8=None then means its recipe): no quantization of it, a zero cotangent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from flux_jax import _autodiff
from flux_jax import _lax_collectives as _lc
from flux_jax import fp8 as _fp8
from flux_jax._validation import axis_set, check_replicated
from flux_jax._validation import varying_axes as _varying


def ag_matmul_xla(x, w, *, axis_name: str | tuple[str, ...], axis: int = 0, return_gathered: bool = False, fp8=None):
    """all_gather(x over dimension `axis`) @ w, optionally with the gathered x."""
    recipe = _fp8.resolve("ag_matmul_xla", fp8, w)
    if _zero_size(x, w):
        return _ag_matmul_zero_size(x, w, axis_name, axis, return_gathered, recipe)
    if recipe is not None:
        x_front, w = _unify(axis_name, jnp.moveaxis(x, axis, 0), w)
        outs = _ag_matmul_fp8(x_front, w, axis_name, recipe, return_gathered, False, False)
        outs = [jnp.moveaxis(o, 0, axis) for o in outs]
        return tuple(outs) if return_gathered else outs[0]
    x_full = _lc.all_gather(x, axis_name, axis)
    out = jnp.dot(x_full, w)
    return (out, x_full) if return_gathered else out


def matmul_rs_xla(x, w, *, axis_name: str | tuple[str, ...], scatter_dimension: int = 0, fp8=None):
    """psum_scatter(x @ w over dimension `scatter_dimension`)."""
    recipe = _fp8.resolve("matmul_rs_xla", fp8, w)
    if _zero_size(x, w):  # x @ w is zeros or empty: so is every rank's part of its sum
        shape = list(x.shape[:-1]) + [w.shape[1]]
        shape[scatter_dimension] //= lax.axis_size(axis_name)
        return _zeros(shape, x.dtype, axis_name, x, w)
    if recipe is not None:
        x_front, w = _unify(axis_name, jnp.moveaxis(x, scatter_dimension, 0), w)
        return jnp.moveaxis(_matmul_rs_fp8(x_front, w, axis_name, recipe, False, False), 0, scatter_dimension)
    return _lc.psum_scatter(jnp.dot(x, w), axis_name, scatter_dimension)


def matmul_ar_xla(x, w, *, axis_name: str | tuple[str, ...], fp8=None):
    """psum(x @ w): every rank gets the whole sum."""
    recipe = _fp8.resolve("matmul_ar_xla", fp8, w)
    if _zero_size(x, w):  # the same on every rank, as psum's result
        return _zeros((*x.shape[:-1], w.shape[1]), x.dtype, axis_name, x, w, varying=False)
    if recipe is not None:
        x, w = _unify(axis_name, x, w)
        return _lc.psum(_local_fp8(x, w, recipe, False, False), axis_name)
    return _lc.psum(jnp.dot(x, w), axis_name)


def column_matmul_xla(x, w, *, axis_name: str | tuple[str, ...], fp8=None):
    """x @ w with x replicated over `axis_name`; the backward all-reduces dx = psum(dy @ w^T).

    Megatron's column-parallel linear without sequence parallelism ("f": identity forward,
    all-reduce backward). In a shard_map with check_vma=False, JAX's convention sums a replicated
    value's cotangent elsewhere (the shard_map boundary, psum's transpose), and dx stays local,
    as for a plain jnp.dot. With `fp8` the forward is XLA's FP8 GEMM (x per row, w per the
    recipe) and dx's GEMM takes dy per row in the backward format (straight-through).
    """
    recipe = _fp8.resolve("column_matmul_xla", fp8, w)
    check_replicated("column_matmul_xla", x, axis_name)
    if _zero_size(x, w):
        return _zeros((*x.shape[:-1], w.shape[1]), x.dtype, axis_name, x, w)
    # Both operands vary over every other manual axis either varies over (x stays as typed over
    # `axis_name`), so the custom_vjp's cotangents type-check; pcast's transpose sums them there.
    axes = axis_set(axis_name)
    others = (_varying(x) | _varying(w)) - axes
    return _column_matmul(_typed_like(x, others), _typed_like(w, others | axes), axis_name, recipe)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _column_matmul(x, w, axis_name, recipe):
    return jnp.dot(x, w) if recipe is None else _fp8.matmul(x, w, recipe)


def _column_matmul_fwd(x, w, axis_name, recipe):
    return _column_matmul(x, w, axis_name, recipe), (x, w)


def _column_matmul_bwd(axis_name, recipe, residuals, dy):
    x, w = residuals
    dx = jnp.dot(dy, w.T) if recipe is None else _local_fp8(dy, w, recipe, True, True)
    if axis_set(axis_name) <= _varying(w):  # types checked (w was cast to vary over the axis)
        dx = _lc.psum(dx, axis_name)
    dw = _autodiff.weight_grad(x, dy, w, False)  # None (a zero cotangent) for a frozen Fp8Weight
    return _typed_like(dx, _varying(x)), None if dw is None else _typed_like(dw, _varying(w))


def _typed_like(a, axes: frozenset):
    """`a` (each leaf of a pre-quantized weight) cast to vary over every manual axis in `axes` it
    does not vary over yet."""
    from flux_jax.ops._spec import pcast_to

    return pcast_to(a, axes)


_column_matmul.defvjp(_column_matmul_fwd, _column_matmul_bwd)


# ---- zero-size operands ------------------------------------------------------------------------
# No rows, K = 0 or N = 0: the product is zeros (K = 0) or empty, and so are its gradients. lax's
# collectives cannot lower a zero-size gathered or scattered dimension, and at N = 0 XLA:CPU
# crashed (SIGSEGV, jax 0.11.2) on the gradient of the plain all_gather-then-dot: nothing is moved.


def _zero_size(x, w) -> bool:
    """x or w (an array, or a pre-quantized weight's logical [K, N]) has no elements."""
    return 0 in x.shape or 0 in w.shape


def _zeros(shape, dtype, axis_name, *operands, varying: bool = True):
    """Zeros typed as the op's result: varying over the operands' manual axes and, unless
    `varying` is False (an all-reduced result), over `axis_name`."""
    axes = frozenset().union(*(_varying(a) for a in operands))
    tp_axes = axis_set(axis_name)
    axes = axes | tp_axes if varying else axes - tp_axes
    return _typed_like(jnp.zeros(shape, dtype), axes)


def _ag_matmul_zero_size(x, w, axis_name, axis, return_gathered, recipe):
    gathered = list(x.shape)
    gathered[axis] *= lax.axis_size(axis_name)
    out = _zeros((*gathered[:-1], w.shape[1]), x.dtype, axis_name, x, w)
    if not return_gathered:
        return out
    if 0 in x.shape:
        return out, _zeros(gathered, x.dtype, axis_name, x)
    if recipe is not None:  # the rows as the FP8 GEMM read them, straight-through as in the FP8 twin
        rows = _fp8.dequantize(*_fp8.quantize_rows(x, recipe), x.dtype)
        x = x + lax.stop_gradient(rows - x)
    return out, _lc.all_gather(x, axis_name, axis)


# ---- FP8 twins: x [rows, ..., k] with the gathered / scattered dimension first -----------------


def _unify(axis_name, *xs):
    # The custom_vjp's cotangents must carry their primals' manual-axis types: make x and w vary
    # alike first (pcast's transpose sums the weight gradient where w was invariant).
    from flux_jax.ops._spec import unify_varying

    return unify_varying(axis_name, *xs)


def _gather(axis_name):
    return lambda a: _lc.all_gather(a, axis_name)


def _scatter(a, axis_name):
    return _lc.psum_scatter(a, axis_name)


# Each FP8 twin's forward rule computes through its own custom_vjp and its backward through the
# paired twin's (as the fused ops' rules do, flux_jax/_autodiff.py), so a second reverse pass
# treats every quantization as straight-through, as the fused ops do.


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _ag_matmul_fp8(x, w, axis_name, recipe, return_gathered, transpose_w, grad):
    return _fp8.gathered_matmul(
        x, w, recipe, _gather(axis_name), transpose_w=transpose_w, grad=grad, return_gathered=return_gathered
    )


def _ag_matmul_fp8_fwd(x, w, axis_name, recipe, return_gathered, transpose_w, grad):
    out, x_full = _ag_matmul_fp8(x, w, axis_name, recipe, True, transpose_w, grad)
    return ([out, x_full] if return_gathered else [out]), (x_full, w)


def _ag_matmul_fp8_bwd(axis_name, recipe, return_gathered, transpose_w, grad, residuals, cotangents):
    x_full, w = residuals
    dy = cotangents[0]
    dx = _matmul_rs_fp8(dy, w, axis_name, recipe, not transpose_w, True)
    if return_gathered:
        dx = dx + _scatter(cotangents[1], axis_name)
    return dx, _autodiff.weight_grad(x_full, dy, w, transpose_w)


_ag_matmul_fp8.defvjp(_ag_matmul_fp8_fwd, _ag_matmul_fp8_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _matmul_rs_fp8(x, w, axis_name, recipe, transpose_w, grad):
    return _scatter(_fp8.matmul(x, w, recipe, transpose_w=transpose_w, grad=grad), axis_name)


def _matmul_rs_fp8_fwd(x, w, axis_name, recipe, transpose_w, grad):
    return _matmul_rs_fp8(x, w, axis_name, recipe, transpose_w, grad), (x, w)


def _matmul_rs_fp8_bwd(axis_name, recipe, transpose_w, grad, residuals, dy):
    x, w = residuals
    dx, dy_full = _ag_matmul_fp8(dy, w, axis_name, recipe, True, not transpose_w, True)
    return dx, _autodiff.weight_grad(x, dy_full, w, transpose_w)


_matmul_rs_fp8.defvjp(_matmul_rs_fp8_fwd, _matmul_rs_fp8_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _local_fp8(x, w, recipe, transpose_w, grad):
    """x @ op(w) through FP8 on this rank (matmul_ar's GEMM; psum's transpose handles the axis)."""
    return _fp8.matmul(x, w, recipe, transpose_w=transpose_w, grad=grad)


def _local_fp8_fwd(x, w, recipe, transpose_w, grad):
    return _local_fp8(x, w, recipe, transpose_w, grad), (x, w)


def _local_fp8_bwd(recipe, transpose_w, grad, residuals, dy):
    x, w = residuals
    return local_input_grad(dy, w, recipe, transpose_w=transpose_w), _autodiff.weight_grad(x, dy, w, transpose_w)


_local_fp8.defvjp(_local_fp8_fwd, _local_fp8_bwd)


def local_input_grad(dy, w, recipe, *, transpose_w: bool = False):
    """dy @ op(w)^T, the input gradient of x @ op(w) taken on this rank (matmul_ar's and
    column_matmul's dx): XLA's dot, or with a recipe the FP8 GEMM of dy per row in the backward
    format, itself through _local_fp8, so a further reverse pass stays straight-through (it
    does not differentiate the quantization)."""
    if recipe is None:
        return jnp.dot(dy, w if transpose_w else w.T)
    return _local_fp8(dy, w, recipe, not transpose_w, True)
