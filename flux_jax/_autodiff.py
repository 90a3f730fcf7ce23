"""custom_vjp cores of the fused ops, built from their descriptors' VJP rules.

The ops pair as each other's adjoints (FLUX issue #176); each OpSpec's fwd/bwd say how:
  ag_matmul:  y = AG(x) @ w      dx = matmul_rs(dy, w^T)     dw = AG(x)^T @ dy  (AG(x) kept from fwd)
  matmul_rs:  y = RS(x @ w)      dx = ag_matmul(dy, w^T)     dw = x^T @ AG(dy)  (AG(dy) from that call)
w^T is never materialized: the kernels read the weight transposed (`Call.transpose_w`).
Each fwd rule computes its outputs through the core itself, not the bare primitive, and each bwd
through the paired op's core: a second reverse pass (grad of grad) then differentiates them with
these same rules (the primitive has no JVP of its own). The lowered program is unchanged.
A pre-quantized weight (flux_jax.Fp8Weight) is frozen: its cotangent is a symbolic zero (None),
while dx flows as above.
"""

from __future__ import annotations

import jax
from jax import lax

from flux_jax import _region
from flux_jax.fp8 import Fp8Weight


def make_core(primal, fwd, bwd):
    """core(x, w, call) = primal(x, w, call), differentiable through fwd / bwd (an OpSpec's)."""
    core = jax.custom_vjp(primal, nondiff_argnums=(2,))
    core.defvjp(fwd, bwd)
    return core


def weight_grad(a, dy, w, transpose_w: bool):
    """d(op(w)) for out = a @ op(w) with a [rows, ..., K], dy [rows, ..., N]: [K, N] = a^T dy,
    or [N, K] = dy^T a when w is [N, K] (every dimension but the last contracted). Where the
    contracted dimensions are sharded over Explicit mesh axes (a batch split over data
    parallelism), the gradient takes w's sharding (the sum over them included). In w's dtype;
    None (a zero cotangent, as custom_vjp takes it) for a pre-quantized, frozen, weight."""
    if isinstance(w, Fp8Weight):
        return None
    lead = tuple(range(a.ndim - 1))
    spec = _region.type_spec(jax.typeof(a))
    out_sharding = None
    if spec is not None and any(entry is not None for entry in spec[: a.ndim - 1]):
        out_sharding = jax.typeof(w).sharding
    if transpose_w:
        dw = lax.dot_general(dy, a, ((lead, lead), ((), ())), out_sharding=out_sharding)
    else:
        dw = lax.dot_general(a, dy, ((lead, lead), ((), ())), out_sharding=out_sharding)
    return dw.astype(w.dtype)
