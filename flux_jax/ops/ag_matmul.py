"""AllGather -> GEMM: `ag_matmul(x, w) == all_gather(x over `axis`) @ w`, per shard."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np

from flux_jax import _autodiff, _region, _validation, twins
from flux_jax import _lax_collectives as _lc
from flux_jax import fp8 as _fp8
from flux_jax.ops import _common
from flux_jax.ops._spec import REGISTRY, Call, OpSpec, define, gathered_gemm, weight_2d

NAME = "ag_matmul"


def _out_shapes(x_shape, w_shape, call: Call):
    n = w_shape[0] if call.transpose_w else w_shape[1]
    lead = (call.tp * x_shape[0], *x_shape[1:-1])
    return [(*lead, n)] + ([(*lead, x_shape[-1])] if call.return_gathered else [])


def _gemm(x_shape, w_shape, call: Call):
    rows = call.tp * math.prod(x_shape[:-1])
    return rows, x_shape[-1], (w_shape[0] if call.transpose_w else w_shape[1])


def _twin(x, w, call: Call):
    if call.fp8 is not None:  # the FP8 twin's forward (its custom_vjp lives in twins.py)
        return gathered_gemm(x, w, call, lambda a: _lc.all_gather(a, call.axis_name))
    out = twins.ag_matmul_xla(
        x, weight_2d(w, call.transpose_w), axis_name=call.axis_name, return_gathered=call.return_gathered
    )
    return list(out) if call.return_gathered else [out]


def _latency(x, w, call: Call, collective):
    def gather(a):
        return collective("all_gather", a, (call.tp * a.shape[0], *a.shape[1:]))

    return gathered_gemm(x, w, call, gather, blocking_gather=True)


def _fp8_fused(x, w, call: Call, collective, fused, *, scales_travel=False):
    """The FP8 overlap path (the row scales gathered first) and decode path (they travel with
    the rows, pushed by the decode kernel's push kernel)."""

    def gather(a):
        return collective("all_gather", a, (call.tp * a.shape[0], *a.shape[1:]))

    return _fp8.fused_gathered_matmul(
        x,
        w,
        call.fp8,
        gather,
        fused,
        transpose_w=call.transpose_w,
        grad=call.backward,
        return_gathered=call.return_gathered,
        scales_travel=scales_travel,
    )


def _fwd(x, w, call: Call):
    out, x_full = SPEC.core(x, w, dataclasses.replace(call, return_gathered=True))
    return ([out, x_full] if call.return_gathered else [out]), (x_full, w)


def _bwd(call: Call, residuals, cotangents):
    x_full, w = residuals
    dy = cotangents[0]
    rs = REGISTRY["matmul_rs"]
    (dx,) = rs.core(dy, w, _common.backward_call(rs, dy, w, call))
    if call.return_gathered and cotangents[1] is not None:
        # The gathered copy was an output too: all_gather's adjoint is a reduce-scatter.
        dx = dx + _lc.psum_scatter(cotangents[1], call.axis_name)
    return dx, _autodiff.weight_grad(x_full, dy, w, call.transpose_w)


SPEC = define(
    OpSpec(
        NAME,
        _out_shapes,
        _gemm,
        _twin,
        _latency,
        _fwd,
        _bwd,
        fp8_overlap=_fp8_fused,
        fp8_decode=functools.partial(_fp8_fused, scales_travel=True),
    )
)


def ag_matmul(
    x,
    w,
    *,
    axis_name: str | tuple[str, ...],
    axis: int = 0,
    impl: str = "auto",
    return_gathered: bool = False,
    fp8=None,
):
    """AllGather -> GEMM, for use inside `jax.shard_map`.

    Computes exactly `jnp.dot(lax.all_gather(x, axis_name, axis=axis, tiled=True), w)` (with
    `fp8`, that GEMM on FP8 operands).

    Sharding contract (per shard, TP degree tp = size of `axis_name`):
      x: [..., m_local (at `axis`), ..., K], this rank's slice of dimension `axis` (rank r holds
         r*m_local:(r+1)*m_local);
      w: [K, n_local], this rank's columns of the weight (column-parallel);
      returns x's shape with dimension `axis` grown to tp*m_local and the last one n_local.
    With `return_gathered=True` also returns the gathered x.

    Args:
      x, w: float32, bfloat16 or float16 arrays of the same dtype; or w a pre-quantized
        `flux_jax.Fp8Weight` of this rank's [K, n_local] (its leaves sharded by
        `Fp8Weight.partition_spec`), run as with `fp8` but never quantized again.
      axis_name: the mesh axis to gather over (the tensor-parallel axis). A tuple of
        mesh axes makes one TP axis over their devices, ranked row-major in the order named (as
        `lax.axis_index` counts them).
      axis: the dimension of x to gather (any but the last; negative counts from the end).
      impl: "fused" (the FFI kernel: CPU backend or CUDA; an error where it cannot run),
        "xla" (the pure-JAX twin), or "auto" (fused where it is implemented and measured
        faster, else the twin; `flux_jax.explain` says which ran and why).
      return_gathered: also return the gathered x (e.g. to reuse in a backward pass); with
        `fp8`, the gathered FP8 rows dequantized to x's dtype.
      fp8: None / False (no quantization), True (the default recipe `flux_jax.Fp8()`) or an
        `Fp8` recipe: x is quantized to float8_e4m3fn with one scale per row (each rank's rows
        travel with their own scales), w per tensor (or per output column); the gather moves
        the FP8 rows and their float32 scales, the GEMM runs on FP8 operands with float32
        accumulation and the scales after, and the result has x's dtype. impl="fused" runs our
        FP8 overlap kernel in the overlap region (on GPUs without an FP8 tuning table: 2048 rows
        and more, as for bfloat16; the rows gathered inside our FP8 GEMM, the scales in its
        epilogue; bfloat16 x, K % 16 == 0, N % 8 == 0) or, for other calls and
        Config.fused_path="latency", our all_gather next to XLA's FP8 GEMM; impl="xla" is the
        same quantization with lax.all_gather; impl="auto" takes the path a tuning table's FP8
        entries chose (python -m flux_jax.tune --dtype fp8; docs/tuning.md), else the twin. See
        flux_jax/fp8.py and docs/design.md.
        With an Fp8Weight w: None or True runs the default recipe with the weight's scaling, an
        Fp8 recipe must have the weight's weight_scaling (else ValueError), False is a TypeError.

    Differentiable (custom_vjp): the input gradient is a fused matmul_rs(dy, w^T) and the
    weight gradient reuses the gathered x. With `fp8` the quantization is straight-through:
    dx = matmul_rs(dy, w^T) runs as an FP8 GEMM (dy in float8_e5m2, one scale per row, w in
    e4m3) before its reduce-scatter; dw = AG(x)^T dy runs in x's dtype on the dequantized
    gathered rows, because its contraction runs over the rows, where the per-row scales live
    (an epilogue can only scale the output's rows and columns). A pre-quantized w is frozen
    (zero cotangent); dx is as above, w's q read transposed with its per-tensor scale, or (per
    column scales, on dx's contraction) w dequantized and quantized again per row of w.
    """
    _validation.check_impl(NAME, impl)
    if not isinstance(return_gathered, (bool, np.bool_)):
        raise TypeError(f"{NAME}: return_gathered must be a bool, got {return_gathered!r}")
    _validation.check_operands(NAME, x, w)
    recipe = _fp8.resolve(NAME, fp8, w)
    axis = _validation.check_dimension(NAME, x, axis, "axis")
    info = _validation.check_axis(NAME, axis_name)
    w = _region.whole_weight(w)  # FSDP weights on Explicit automatic axes
    x_front = jnp.moveaxis(x, axis, 0)
    call = _common.plan_call(SPEC, x_front, w, info, impl, fp8=recipe, return_gathered=return_gathered)
    if call is None:
        return twins.ag_matmul_xla(
            x, w, axis_name=info.axis_name, axis=axis, return_gathered=return_gathered, fp8=recipe
        )
    outs = _common.run(SPEC, x_front, w, call)
    out = jnp.moveaxis(outs[0], 0, axis)
    return (out, jnp.moveaxis(outs[1], 0, axis)) if return_gathered else out
