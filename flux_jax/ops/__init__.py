"""The fused ops: one module per op, each an OpSpec (flux_jax/ops/_spec.py) and its public
function. `REGISTRY` maps op names to their descriptors."""

from flux_jax.ops._spec import REGISTRY, OpSpec
from flux_jax.ops.ag_matmul import ag_matmul
from flux_jax.ops.matmul_ar import column_matmul, matmul_ar
from flux_jax.ops.matmul_rs import matmul_rs

__all__ = ["REGISTRY", "OpSpec", "ag_matmul", "column_matmul", "matmul_ar", "matmul_rs"]
