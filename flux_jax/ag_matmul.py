"""AllGather -> GEMM: `ag_matmul(x, w) == all_gather(x, axis 0) @ w`, per shard."""

from __future__ import annotations

import functools

import jax
from jax.extend.core import Primitive
from jax.interpreters import batching

from flux_jax import _autodiff, _dispatch, _lowering, _native, _validation, twins

OP = "ag_matmul"

ag_matmul_p = Primitive("flux_jax_ag_matmul")
ag_matmul_p.multiple_results = True


def _abstract_eval(x, w, rank, *, axis_name, tp_size, transpose_w, config, forced, return_gathered):
    del rank, axis_name, config, forced
    n = w.shape[0] if transpose_w else w.shape[1]
    outs = [x.update(shape=(tp_size * x.shape[0], n))]
    if return_gathered:
        outs.append(x.update(shape=(tp_size * x.shape[0], x.shape[1])))
    return outs


ag_matmul_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[ag_matmul_p] = functools.partial(_dispatch.batch_rows, ag_matmul_p)
_lowering.register_fused_lowering(
    ag_matmul_p, _native.AG_MATMUL_TARGET, lambda: _native.has_cuda_kernel(OP)
)


def _bind(x, w, spec, return_gathered):
    rank = _dispatch.unify_varying(spec.axis_name, jax.lax.axis_index(spec.axis_name))[0]
    outs = ag_matmul_p.bind(
        x,
        w,
        rank,
        axis_name=spec.axis_name,
        tp_size=spec.tp_size,
        transpose_w=spec.transpose_w,
        config=spec.config,
        forced=spec.forced,
        return_gathered=return_gathered,
    )
    return (outs[0], outs[1]) if return_gathered else (outs[0], None)


_autodiff._bind["ag"] = _bind


def ag_matmul(x, w, *, axis_name: str, impl: str = "auto", return_gathered: bool = False):
    """AllGather -> GEMM over the leading axis, for use inside `jax.shard_map`.

    Computes exactly `jnp.dot(lax.all_gather(x, axis_name, axis=0, tiled=True), w)`.

    Sharding contract (per shard, TP degree tp = size of `axis_name`):
      x: [m_local, ..., K], this rank's rows (rank r holds rows r*m_local:(r+1)*m_local);
      w: [K, n_local], this rank's columns of the weight (column-parallel);
      returns [tp*m_local, ..., n_local]: every row, this rank's columns.
    With `return_gathered=True` also returns the gathered x, [tp*m_local, ..., K].

    Args:
      x, w: float32, bfloat16 or float16 arrays of the same dtype.
      axis_name: the mesh axis to gather over (the tensor-parallel axis).
      impl: "fused" (the FFI kernel: CPU backend or CUDA; an error where it cannot
        run), "xla" (the pure-JAX twin), or "auto" (fused where it is implemented
        and measured faster, else the twin).
      return_gathered: also return the gathered x (e.g. to reuse in a backward pass).

    Differentiable with `jax.grad` (custom_vjp): the input gradient is a fused
    matmul_rs(dy, w^T) and the weight gradient reuses the gathered x.
    """
    _validation.check_impl(OP, impl)
    _validation.check_operands(OP, x, w)
    info = _validation.check_axis(OP, axis_name)
    rows, k, n = _validation.rows_of(x), x.shape[-1], w.shape[1]
    if _dispatch.resolve(OP, impl, info, rows * info.tp_size, k, n, x.dtype) == "xla":
        return twins.ag_matmul_xla(x, w, axis_name=axis_name, return_gathered=return_gathered)

    x2, w = _dispatch.unify_varying(axis_name, x.reshape(rows, k), w)
    out, x_full = _autodiff.ag_core(x2, w, _dispatch.make_spec(info, False, impl == "fused"), return_gathered)
    lead = (info.tp_size * x.shape[0], *x.shape[1:-1])
    out = out.reshape(*lead, n)
    return (out, x_full.reshape(*lead, k)) if return_gathered else out
