"""GEMM -> ReduceScatter: `matmul_rs(x, w) == psum_scatter(x @ w, axis 0)`, per shard."""

from __future__ import annotations

import functools

import jax
from jax.extend.core import Primitive
from jax.interpreters import batching

from flux_jax import _autodiff, _dispatch, _lowering, _native, _validation, twins

OP = "matmul_rs"

matmul_rs_p = Primitive("flux_jax_matmul_rs")
matmul_rs_p.multiple_results = True


def _abstract_eval(x, w, rank, *, axis_name, tp_size, transpose_w, config, forced):
    del rank, axis_name, config, forced
    n = w.shape[0] if transpose_w else w.shape[1]
    return [x.update(shape=(x.shape[0] // tp_size, n))]


matmul_rs_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[matmul_rs_p] = functools.partial(_dispatch.batch_rows, matmul_rs_p)
_lowering.register_fused_lowering(
    matmul_rs_p, _native.MATMUL_RS_TARGET, lambda: _native.has_cuda_kernel(OP)
)


def _bind(x, w, spec):
    rank = _dispatch.unify_varying(spec.axis_name, jax.lax.axis_index(spec.axis_name))[0]
    (out,) = matmul_rs_p.bind(
        x,
        w,
        rank,
        axis_name=spec.axis_name,
        tp_size=spec.tp_size,
        transpose_w=spec.transpose_w,
        config=spec.config,
        forced=spec.forced,
    )
    return out


_autodiff._bind["rs"] = _bind


def matmul_rs(x, w, *, axis_name: str, impl: str = "auto"):
    """GEMM -> ReduceScatter over the leading axis, for use inside `jax.shard_map`.

    Computes exactly `lax.psum_scatter(jnp.dot(x, w), axis_name, scatter_dimension=0, tiled=True)`.

    Sharding contract (per shard, TP degree tp = size of `axis_name`):
      x: [M, ..., k_local], every row, this rank's slice of the contraction dim;
      w: [k_local, N], this rank's rows of the weight (row-parallel);
      returns [M/tp, ..., N]: rank r gets rows r*M/tp:(r+1)*M/tp of the sum
      over ranks of x @ w. M must be divisible by tp.

    Args:
      x, w: float32, bfloat16 or float16 arrays of the same dtype.
      axis_name: the mesh axis to reduce-scatter over (the tensor-parallel axis).
      impl: "fused", "xla" or "auto" (see `ag_matmul`).

    The fused CPU and GPU kernels sum the partials in a fixed order, so results
    are bitwise reproducible. Differentiable (custom_vjp): the input gradient is
    a fused ag_matmul(dy, w^T) whose gathered dy also feeds the weight gradient.
    """
    _validation.check_impl(OP, impl)
    _validation.check_operands(OP, x, w)
    info = _validation.check_axis(OP, axis_name)
    _validation.check_rows_divisible(OP, x, info.tp_size, axis_name)
    rows, k, n = _validation.rows_of(x), x.shape[-1], w.shape[1]
    if _dispatch.resolve(OP, impl, info, rows, k, n, x.dtype) == "xla":
        return twins.matmul_rs_xla(x, w, axis_name=axis_name)

    x2, w = _dispatch.unify_varying(axis_name, x.reshape(rows, k), w)
    out = _autodiff.rs_core(x2, w, _dispatch.make_spec(info, False, impl == "fused"))
    return out.reshape(x.shape[0] // info.tp_size, *x.shape[1:-1], n)
