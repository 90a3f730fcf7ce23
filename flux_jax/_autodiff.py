"""custom_vjp rules of the fused ops.

The two ops are each other's adjoints (FLUX issue #176):
  ag_matmul:  y = AG(x) @ w      dx = matmul_rs(dy, w^T)     dw = AG(x)^T @ dy  (AG(x) kept from fwd)
  matmul_rs:  y = RS(x @ w)      dx = ag_matmul(dy, w^T)     dw = x^T @ AG(dy)  (AG(dy) from that call)
w^T is never materialized: the kernels take a `transpose_w` flag instead.
All arrays here are 2-D [rows, features] with operands already pcast to the
same manual-axis type (see _dispatch.unify_varying).
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from flux_jax._dispatch import FusedSpec

# Set by ag_matmul.py / matmul_rs.py to their primitives' bind functions:
# ag(x, w, spec, return_gathered) -> (out, gathered|None); rs(x, w, spec) -> out.
_bind = {}


def _flip(spec: FusedSpec) -> FusedSpec:
    return FusedSpec(spec.axis_name, spec.tp_size, not spec.transpose_w, spec.config, spec.forced)


def _weight_grad(a, dy, transpose_w: bool):
    """d(op(w)) for out = a @ op(w): [K, N] = a^T dy, or [N, K] = dy^T a when w is [N, K]."""
    if transpose_w:
        return lax.dot_general(dy, a, (((0,), (0,)), ((), ())))
    return lax.dot_general(a, dy, (((0,), (0,)), ((), ())))


# ---- AllGather -> GEMM ---------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def ag_core(x, w, spec: FusedSpec, return_gathered: bool):
    return _bind["ag"](x, w, spec, return_gathered)


def _ag_fwd(x, w, spec, return_gathered):
    out, x_full = _bind["ag"](x, w, spec, True)
    return (out, x_full if return_gathered else None), (x_full, w)


def _ag_bwd(spec, return_gathered, residuals, cotangents):
    x_full, w = residuals
    dy, dx_full = cotangents
    dx = rs_core(dy, w, _flip(spec))
    if return_gathered and dx_full is not None:
        # The gathered copy was an output too: AG's adjoint is a reduce-scatter.
        dx = dx + lax.psum_scatter(dx_full, spec.axis_name, scatter_dimension=0, tiled=True)
    return dx, _weight_grad(x_full, dy, spec.transpose_w)


ag_core.defvjp(_ag_fwd, _ag_bwd)


# ---- GEMM -> ReduceScatter -----------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rs_core(x, w, spec: FusedSpec):
    return _bind["rs"](x, w, spec)


def _rs_fwd(x, w, spec):
    return _bind["rs"](x, w, spec), (x, w)


def _rs_bwd(spec, residuals, dy):
    x, w = residuals
    dx, dy_full = ag_core(dy, w, _flip(spec), True)
    return dx, _weight_grad(x, dy_full, spec.transpose_w)


rs_core.defvjp(_rs_fwd, _rs_bwd)
