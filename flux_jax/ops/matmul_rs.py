"""GEMM -> ReduceScatter: `matmul_rs(x, w) == psum_scatter(x @ w over `scatter_dimension`)`."""

from __future__ import annotations

import math

import jax.numpy as jnp

from flux_jax import _autodiff, _region, _validation, twins
from flux_jax import _lax_collectives as _lc
from flux_jax import fp8 as _fp8
from flux_jax.ops import _common
from flux_jax.ops._spec import REGISTRY, Call, OpSpec, define, local_gemm, weight_2d

NAME = "matmul_rs"


def _out_shapes(x_shape, w_shape, call: Call):
    return [(x_shape[0] // call.tp, *x_shape[1:-1], w_shape[0] if call.transpose_w else w_shape[1])]


def _gemm(x_shape, w_shape, call: Call):
    return math.prod(x_shape[:-1]), x_shape[-1], (w_shape[0] if call.transpose_w else w_shape[1])


def _twin(x, w, call: Call):
    if call.fp8 is not None:  # the FP8 twin's forward (its custom_vjp lives in twins.py)
        return [_lc.psum_scatter(local_gemm(x, w, call), call.axis_name)]
    return [twins.matmul_rs_xla(x, weight_2d(w, call.transpose_w), axis_name=call.axis_name)]


def _latency(x, w, call: Call, collective):
    partial = local_gemm(x, w, call)
    return [collective("reduce_scatter", partial, (x.shape[0] // call.tp, *partial.shape[1:]))]


def _fp8_fused(x, w, call: Call, collective, fused):
    """The FP8 overlap and decode paths: the op's own custom call on the FP8 operands."""
    del collective  # the scales stay local: each rank's GEMM scales its own rows
    return _fp8.fused_matmul(x, w, call.fp8, fused, transpose_w=call.transpose_w, grad=call.backward)


def _fwd(x, w, call: Call):
    return SPEC.core(x, w, call), (x, w)


def _bwd(call: Call, residuals, cotangents):
    x, w = residuals
    (dy,) = cotangents
    ag = REGISTRY["ag_matmul"]
    dx, dy_full = ag.core(dy, w, _common.backward_call(ag, dy, w, call))
    return dx, _autodiff.weight_grad(x, dy_full, w, call.transpose_w)


SPEC = define(
    OpSpec(NAME, _out_shapes, _gemm, _twin, _latency, _fwd, _bwd, fp8_overlap=_fp8_fused, fp8_decode=_fp8_fused)
)


def matmul_rs(x, w, *, axis_name: str | tuple[str, ...], scatter_dimension: int = 0, impl: str = "auto", fp8=None):
    """GEMM -> ReduceScatter, for use inside `jax.shard_map`.

    Computes exactly
    `lax.psum_scatter(jnp.dot(x, w), axis_name, scatter_dimension=scatter_dimension, tiled=True)`
    (with `fp8`, that GEMM on FP8 operands).

    Sharding contract (per shard, TP degree tp = size of `axis_name`):
      x: [..., M (at `scatter_dimension`), ..., k_local], this rank's slice of the contraction;
      w: [k_local, N], this rank's rows of the weight (row-parallel);
      returns x's shape with dimension `scatter_dimension` cut to M/tp (rank r gets the r-th
      block of the sum over ranks of x @ w) and the last one N. M must be divisible by tp.

    Args:
      x, w: float32, bfloat16 or float16 arrays of the same dtype; or w a pre-quantized
        `flux_jax.Fp8Weight` (see `ag_matmul`).
      axis_name: the mesh axis to reduce-scatter over (the tensor-parallel axis). A tuple of
        mesh axes makes one TP axis over their devices, ranked row-major in the order named (as
        `lax.axis_index` counts them).
      scatter_dimension: the dimension of the result to scatter (any but the last).
      impl: "fused", "xla" or "auto" (see `ag_matmul`).
      fp8: None / False, True or an `Fp8` recipe (see `ag_matmul`): x is quantized per row and
        w per tensor (or per output column), each rank runs the FP8 GEMM (float32 accumulation,
        the scales after) and the partial, in x's dtype, is reduce-scattered (impl="fused": our
        FP8 overlap kernel in the overlap region, the scales in its GEMM's epilogue, for bfloat16
        x with K % 16 == 0 and N % 8 == 0, else XLA's FP8 GEMM and our reduce_scatter; impl="xla":
        lax.psum_scatter).

    The fused CPU and GPU kernels sum the partials in a fixed rank order, so results are
    bitwise reproducible. Differentiable (custom_vjp): the input gradient is a fused
    ag_matmul(dy, w^T) whose gathered dy also feeds the weight gradient. With `fp8`: dx is the
    FP8 ag_matmul of dy (float8_e5m2 rows, gathered with their scales) and w^T (e4m3); dw =
    x^T AG(dy) runs in x's dtype on the dequantized gathered dy (its contraction runs over the
    rows, where the per-row scales live).
    """
    _validation.check_impl(NAME, impl)
    _validation.check_operands(NAME, x, w)
    recipe = _fp8.resolve(NAME, fp8, w)
    dim = _validation.check_dimension(NAME, x, scatter_dimension, "scatter_dimension")
    info = _validation.check_axis(NAME, axis_name)
    w = _region.whole_weight(w)  # FSDP weights on Explicit automatic axes
    _validation.check_divisible(NAME, x, dim, info.tp_size, axis_name)
    x_front = jnp.moveaxis(x, dim, 0)
    call = _common.plan_call(SPEC, x_front, w, info, impl, fp8=recipe)
    if call is None:
        return twins.matmul_rs_xla(x, w, axis_name=info.axis_name, scatter_dimension=dim, fp8=recipe)
    (out,) = _common.run(SPEC, x_front, w, call)
    return jnp.moveaxis(out, 0, dim)
