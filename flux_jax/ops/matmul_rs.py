"""GEMM -> ReduceScatter: `matmul_rs(x, w) == psum_scatter(x @ w over `scatter_dimension`)`."""

from __future__ import annotations

import math

import jax.numpy as jnp

from flux_jax import _autodiff, _validation, twins
from flux_jax.ops import _common
from flux_jax.ops._spec import REGISTRY, Call, OpSpec, bind, define, weight_2d

NAME = "matmul_rs"


def _out_shapes(x_shape, w_shape, call: Call):
    return [(x_shape[0] // call.tp, *x_shape[1:-1], w_shape[0] if call.transpose_w else w_shape[1])]


def _gemm(x_shape, w_shape, call: Call):
    return math.prod(x_shape[:-1]), x_shape[-1], (w_shape[0] if call.transpose_w else w_shape[1])


def _twin(x, w, call: Call):
    return [twins.matmul_rs_xla(x, weight_2d(w, call.transpose_w), axis_name=call.axis_name)]


def _latency(x, w, call: Call, collective):
    partial = jnp.dot(x, weight_2d(w, call.transpose_w))
    return [collective("reduce_scatter", partial, (x.shape[0] // call.tp, *partial.shape[1:]))]


def _fwd(x, w, call: Call):
    return bind(SPEC, x, w, call), (x, w)


def _bwd(call: Call, residuals, cotangents):
    x, w = residuals
    (dy,) = cotangents
    ag = REGISTRY["ag_matmul"]
    dx, dy_full = ag.core(dy, w, _common.backward_call(ag, dy, w, call))
    return dx, _autodiff.weight_grad(x, dy_full, w, call.transpose_w)


SPEC = define(OpSpec(NAME, _out_shapes, _gemm, _twin, _latency, _fwd, _bwd))


def matmul_rs(x, w, *, axis_name: str, scatter_dimension: int = 0, impl: str = "auto"):
    """GEMM -> ReduceScatter, for use inside `jax.shard_map`.

    Computes exactly
    `lax.psum_scatter(jnp.dot(x, w), axis_name, scatter_dimension=scatter_dimension, tiled=True)`.

    Sharding contract (per shard, TP degree tp = size of `axis_name`):
      x: [..., M (at `scatter_dimension`), ..., k_local], this rank's slice of the contraction;
      w: [k_local, N], this rank's rows of the weight (row-parallel);
      returns x's shape with dimension `scatter_dimension` cut to M/tp (rank r gets the r-th
      block of the sum over ranks of x @ w) and the last one N. M must be divisible by tp.

    Args:
      x, w: float32, bfloat16 or float16 arrays of the same dtype.
      axis_name: the mesh axis to reduce-scatter over (the tensor-parallel axis).
      scatter_dimension: the dimension of the result to scatter (any but the last).
      impl: "fused", "xla" or "auto" (see `ag_matmul`).

    The fused CPU and GPU kernels sum the partials in a fixed rank order, so results are
    bitwise reproducible. Differentiable (custom_vjp): the input gradient is a fused
    ag_matmul(dy, w^T) whose gathered dy also feeds the weight gradient.
    """
    _validation.check_impl(NAME, impl)
    _validation.check_operands(NAME, x, w)
    dim = _validation.check_dimension(NAME, x, scatter_dimension, "scatter_dimension")
    info = _validation.check_axis(NAME, axis_name)
    _validation.check_divisible(NAME, x, dim, info.tp_size, axis_name)
    x_front = jnp.moveaxis(x, dim, 0)
    call = _common.plan_call(SPEC, x_front, w, info, impl)
    if call is None:
        return twins.matmul_rs_xla(x, w, axis_name=axis_name, scatter_dimension=dim)
    (out,) = _common.run(SPEC, x_front, w, call)
    return jnp.moveaxis(out, 0, dim)
