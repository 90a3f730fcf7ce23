"""GEMM -> AllReduce: `matmul_ar(x, w) == psum(x @ w over `axis`)`, and its column-parallel
partner `column_matmul`, whose backward is a fused matmul_ar.

Tensor parallelism without sequence parallelism (inference decode, small TP): the row-parallel
projection's partial sums are all-reduced and every rank keeps the whole output. Paths:
  CPU    "overlap": one custom call, flux_jax_matmul_ar (GEMM, push of the float32 partial,
         rank-ordered sum) at every size (the protocol reference); "latency": XLA's GEMM next to
         our flux_jax_all_reduce.
  CUDA   "latency": XLA's GEMM next to our one-kernel all_reduce (NVLink stores, per-block
         epoch flags, rank-ordered float32 sum); "overlap": one custom call whose handler enqueues
         our GEMM into the workspace and then the same all_reduce kernel, or from 1024 rows
         divisible by tp the two-shot: matmul_rs's overlap call then our flux_jax_all_gather (each
         chunk of rows summed once, by its owner, in matmul_rs's order; _plan.composed_overlap);
         "decode" (bfloat16, the [k, N] weight, M <= 128, tp x M x N <= 2^22): one decode GEMM
         whose epilogue pushes each output tile to every peer and sums the tp partials tile by
         tile (a one-shot all-reduce, one launch).
Every path sums the tp partials in one fixed order in float32 and rounds once (rank order
0..tp-1, or matmul_rs's for the two-shot overlap), so the output is bitwise the same on every rank.
With FP8 operands (`fp8=`) the overlap path is the two-shot one on every platform, its first half
matmul_rs's FP8 overlap call (the row scales applied in the GEMM's epilogue); the latency path is
XLA's FP8 GEMM next to our all_reduce.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp

from flux_jax import _autodiff, _explain, _plan, _region, _validation, twins
from flux_jax import _lax_collectives as _lc
from flux_jax import fp8 as _fp8
from flux_jax._config import get_config, get_gpu_tuning
from flux_jax._validation import axis_set
from flux_jax.ops import _common
from flux_jax.ops._spec import (
    Call,
    OpSpec,
    _varying,
    define,
    local_gemm,
    pcast_to,
    unify_varying,
    weight_2d,
)

NAME = "matmul_ar"


def _out_shapes(x_shape, w_shape, call: Call):
    return [(*x_shape[:-1], w_shape[0] if call.transpose_w else w_shape[1])]


def _gemm(x_shape, w_shape, call: Call):
    return math.prod(x_shape[:-1]), x_shape[-1], (w_shape[0] if call.transpose_w else w_shape[1])


def _twin(x, w, call: Call):
    if call.fp8 is not None:  # the FP8 twin's forward (its custom_vjp lives in twins.py)
        return [_lc.psum(local_gemm(x, w, call), call.axis_name)]
    return [twins.matmul_ar_xla(x, weight_2d(w, call.transpose_w), axis_name=call.axis_name)]


def _latency(x, w, call: Call, collective):
    partial = local_gemm(x, w, call)
    return [collective("all_reduce", partial, partial.shape)]


def _two_shot(x, w, call: Call, collective, fused):
    """The overlap path where rows % tp == 0 (flux_jax/_plan.composed_overlap): matmul_rs's
    overlap call sums chunk r of the rows on rank r, its reduce-scatter overlapped with the GEMM;
    our all_gather then gives every rank every chunk, each summed once (the same bits everywhere)."""
    rows, k, n = _gemm(x.shape, w.shape, call)
    chunk = fused("matmul_rs", x.reshape(rows, k), w, (rows // call.tp, n))
    out = collective("all_gather", chunk, (rows, n))
    return [out.reshape(*x.shape[:-1], n)]


def _fp8_overlap(x, w, call: Call, collective, fused):
    """The two-shot overlap on FP8 operands: matmul_rs's FP8 overlap call (x quantized per row,
    each rank's scales applied in its own GEMM's epilogue, chunk r of the rows summed on rank r),
    then our all_gather of the chunks in x's dtype (none at tp = 1)."""
    rows, k, n = _gemm(x.shape, w.shape, call)
    rs_call = functools.partial(fused, op="matmul_rs")
    (chunk,) = _fp8.fused_matmul(
        x.reshape(rows, k), w, call.fp8, rs_call, transpose_w=call.transpose_w, grad=call.backward
    )
    out = chunk if call.tp == 1 else collective("all_gather", chunk, (rows, n))
    return [out.reshape(*x.shape[:-1], n)]


def _fp8_decode(x, w, call: Call, collective, fused):
    """The FP8 decode path: the op's own custom call on the FP8 operands (each rank's row scales
    applied in its own GEMM's epilogue, the all-reduce in the same epilogue)."""
    del collective  # the scales stay local
    rows, k, n = _gemm(x.shape, w.shape, call)
    (out,) = _fp8.fused_matmul(x.reshape(rows, k), w, call.fp8, fused, transpose_w=call.transpose_w, grad=call.backward)
    return [out.reshape(*x.shape[:-1], n)]


def _fwd(x, w, call: Call):
    return SPEC.core(x, w, call), (x, w)


def _bwd(call: Call, residuals, cotangents):
    """The output is replicated, so is its cotangent: both gradients are local GEMMs."""
    x, w = residuals
    (dy,) = cotangents
    if not _types_checked(w, call.axis_name):
        # shard_map(check_vma=False): JAX's convention there is that a replicated value's
        # cotangent is a per-rank partial (psum transposes to psum); follow the twin.
        dy = _lc.psum(dy, call.axis_name)
    dy = unify_varying(call.axis_name, dy, x)[0]  # typed as x: varying over the axis
    dx = twins.local_input_grad(dy, w, call.fp8, transpose_w=call.transpose_w)
    return dx.astype(x.dtype), _autodiff.weight_grad(x, dy, w, call.transpose_w)


SPEC = define(
    OpSpec(
        NAME,
        _out_shapes,
        _gemm,
        _twin,
        _latency,
        _fwd,
        _bwd,
        replicated=True,
        fp8_overlap=_fp8_overlap,
        fp8_decode=_fp8_decode,
        composed_overlap=_two_shot,
    )
)


def matmul_ar(x, w, *, axis_name: str | tuple[str, ...], impl: str = "auto", fp8=None):
    """GEMM -> AllReduce, for use inside `jax.shard_map`.

    Computes exactly `lax.psum(jnp.dot(x, w), axis_name)`: float32 accumulation, the output in
    x's dtype, and the same bits on every rank (the tp partials are summed in rank order
    0..tp-1 on every path).

    Sharding contract (per shard, TP degree tp = size of `axis_name`):
      x: [M, ..., k_local], this rank's slice of the contraction;
      w: [k_local, N], this rank's rows of the weight (row-parallel);
      returns [M, ..., N], the sum over ranks of x @ w, replicated over `axis_name` (typed
      invariant over it, as lax.psum's output).

    Args:
      x, w: float32, bfloat16 or float16 arrays of the same dtype; or w a pre-quantized
        `flux_jax.Fp8Weight` (see `ag_matmul`).
      axis_name: the mesh axis to all-reduce over (the tensor-parallel axis). A tuple of
        mesh axes makes one TP axis over their devices, ranked row-major in the order named (as
        `lax.axis_index` counts them).
      impl: "fused", "xla" or "auto" (see `ag_matmul`). "auto" follows a tuning table's
        matmul_ar entries (python -m flux_jax.tune --no-sequence-parallel; docs/tuning.md), else
        the twin at tp > 1 on GPUs; "fused" takes the decode kernel where it serves
        the call (bfloat16, the [k, N] weight, M <= 128, tp x M x N <= 2^22), the two-shot
        overlap from 1024 rows divisible by tp, else the latency path (XLA's GEMM + our all_reduce).
      fp8: None / False, True or an `Fp8` recipe (see `ag_matmul`): x is quantized per row and
        w per tensor (or per output column), each rank runs the FP8 GEMM (float32 accumulation,
        the scales after) and the partials, in x's dtype, are all-reduced. impl="fused": the
        two-shot overlap (matmul_rs's FP8 overlap kernel, then our all_gather) for bfloat16 x
        with rows divisible by tp, K % 16 == 0 and N % 8 == 0 (on GPUs from 1024 rows), else
        XLA's FP8 GEMM and our all_reduce; impl="xla": lax.psum. The output is the same on
        every rank (each chunk of rows is summed once, in one order).

    Differentiable (custom_vjp): the cotangent of the replicated output is replicated, so
    dx = dy @ w^T and dw = x^T @ dy are local GEMMs with no communication. With `fp8`, dx is
    the FP8 GEMM of dy (per row, in the recipe's backward format) and w; dw runs in x's dtype
    (straight-through, as for `matmul_rs`).
    """
    _validation.check_impl(NAME, impl)
    _validation.check_operands(NAME, x, w)
    recipe = _fp8.resolve(NAME, fp8, w)
    info = _validation.check_axis(NAME, axis_name)
    w = _region.whole_weight(w)  # FSDP weights on Explicit automatic axes
    call = _common.plan_call(SPEC, x, w, info, impl, fp8=recipe)
    if call is None:
        return twins.matmul_ar_xla(x, w, axis_name=info.axis_name, fp8=recipe)
    (out,) = _common.run(SPEC, x, w, call)
    return out


# ---- the column-parallel side ---------------------------------------------------------------


def column_matmul(x, w, *, axis_name: str | tuple[str, ...], impl: str = "auto", fp8=None):
    """Column-parallel GEMM on a replicated input, for use inside `jax.shard_map`.

    Forward: y = x @ w, a local GEMM. Backward: dx = matmul_ar(dy, w^T) (the all-reduce of the
    input gradient that a replicated input needs, fused with its GEMM) and dw = x^T @ dy.
    With `matmul_ar` as the row-parallel side, a Megatron block without sequence parallelism has
    one fused op in each direction.

    Sharding contract (per shard, TP degree tp = size of `axis_name`):
      x: [M, ..., K], the same on every rank of `axis_name` (replicated; an x typed as varying
        over the axis, e.g. rows from lax.all_gather, is an error: use ag_matmul there);
      w: [K, n_local], this rank's columns of the weight (column-parallel);
      returns [M, ..., n_local].

    Args:
      x, w: float32, bfloat16 or float16 arrays of the same dtype; or w a pre-quantized
        `flux_jax.Fp8Weight` (see `ag_matmul`).
      axis_name: the mesh axis the weight's columns are split over. A tuple of
        mesh axes makes one TP axis over their devices, ranked row-major in the order named (as
        `lax.axis_index` counts them).
      impl: what the backward's all-reduce runs: "fused", "xla" or "auto", with the meaning
        they have for `matmul_ar` (its plan is made, and `flux_jax.explain` lists it, when the
        forward is traced). "xla" is `flux_jax.column_matmul_xla`.
      fp8: None / False, True or an `Fp8` recipe (see `ag_matmul`): the forward is XLA's FP8
        GEMM (x per row, w per the recipe); the backward's matmul_ar takes dy per row in the
        recipe's backward format (float8_e5m2 by default) and w^T; dw runs in x's dtype.
    """
    _validation.check_impl("column_matmul", impl)
    _validation.check_operands("column_matmul", x, w)
    recipe = _fp8.resolve("column_matmul", fp8, w)
    info = _validation.check_axis("column_matmul", axis_name)
    w = _region.whole_weight(w)  # FSDP weights on Explicit automatic axes
    _validation.check_replicated("column_matmul", x, info.axis_name)
    call = _backward_call(x, w, info, impl, recipe)
    if call is None:
        return twins.column_matmul_xla(x, w, axis_name=info.axis_name, fp8=recipe)
    # x stays typed as it comes (replicated: invariant over the axis); both operands vary over
    # every other manual axis either of them varies over, so the cotangents type-check.
    others = (_varying(x) | _varying(w)) - axis_set(info.axis_name)
    x = pcast_to(x, others)
    w = pcast_to(w, others | axis_set(info.axis_name))
    return _column_core(x, w, call)


def _backward_call(x, w, info, impl: str, recipe) -> Call | None:
    """The Call of the backward's matmul_ar(dy, w^T), planned now; None for the twin."""
    dy_shape = (*_common.device_shape(SPEC, x)[:-1], w.shape[1])
    fp8_format = None if recipe is None else recipe.x_dtype(True).name
    problem = SPEC.problem(dy_shape, w.shape, x.dtype, info.tp_size, info.platform, True, fp8_format)
    config = get_config()
    plan = _plan.plan(problem, impl, config)
    _common.logger.debug("flux_jax.column_matmul (backward matmul_ar): %s -> %s", problem.describe(), plan.describe())
    _explain.record(NAME, problem, plan, backward=True)
    if not plan.fused:
        return None
    return Call(
        info.axis_name,
        info.tp_size,
        True,
        impl,
        True,
        plan,
        config,
        get_gpu_tuning(),
        platform=info.platform,
        fp8=recipe,
        problem=problem,
    )


def _column_primal(x, w, call: Call):
    return jnp.dot(x, w) if call.fp8 is None else _fp8.matmul(x, w, call.fp8)


def _column_fwd(x, w, call: Call):
    return _column_core(x, w, call), (x, w)


def _column_bwd(call: Call, residuals, dy):
    x, w = residuals
    if not _types_checked(w, call.axis_name):
        # shard_map(check_vma=False): the sum of dx over the axis is JAX's (the shard_map boundary
        # or the transpose of whatever replicated x), as for jnp.dot and the twin: dx stays local.
        dx = twins.local_input_grad(dy, w, call.fp8)
        return dx.astype(x.dtype), _autodiff.weight_grad(x, dy, w, False)
    dy, w_u = unify_varying(call.axis_name, dy, w)
    (dx,) = SPEC.core(dy, w_u, call)  # [M, ..., K] = sum over ranks of dy @ w^T, replicated
    dw = _autodiff.weight_grad(x, dy, w, False)
    return pcast_to(dx, _varying(x)), None if dw is None else pcast_to(dw, _varying(w))


_column_core = _autodiff.make_core(_column_primal, _column_fwd, _column_bwd)


def _types_checked(w, axis_name) -> bool:
    """Whether the enclosing shard_map checks manual-axis types (check_vma=True): the weight was
    cast to vary over the axis when the op was called, which leaves no trace without checking."""
    return axis_set(axis_name) <= _varying(w)
