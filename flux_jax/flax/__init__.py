"""Tensor- and sequence-parallel Flax (nnx) layers built on flux_jax's fused ops.

Layers (per shard: call them inside one jax.shard_map over every mesh axis,
e.g. through `sharded_call`, or over the TP axis only inside a GSPMD model):
  ColumnParallelLinear   AllGather(sequence) -> GEMM          (flux_jax.ag_matmul)
  RowParallelLinear      GEMM -> ReduceScatter(sequence)      (flux_jax.matmul_rs)
  GroupedQueryAttention  fused QKV column layer, rotary, causal attention, out row layer
  SwiGLUMLP              fused gate+up column layer, down row layer
  RMSNorm, DecoderBlock
Model (global view): GPT(GPTConfig(...), mesh=mesh, rngs=...)(tokens) -> logits; with
GPTConfig(gspmd=True, fsdp_axis=...) a GSPMD model whose blocks alone are manual over TP.
Without sequence parallelism (sequence_parallel=False on any of them, or GPTConfig): every TP
rank holds the whole sequence; column layers run column_matmul, row layers matmul_ar.
Inference with FP8 kernels quantized once: quantize_kernels(model) (or layer.quantize_kernel()).

See docs/flax.md for the sharding picture and the design.
"""

from flux_jax.flax.attention import GroupedQueryAttention, rotary_embedding
from flux_jax.flax.block import DecoderBlock, RMSNorm, SwiGLUMLP
from flux_jax.flax.linear import ColumnParallelLinear, Fp8Kernel, RowParallelLinear, quantize_kernels
from flux_jax.flax.model import GPT, GPTConfig, check_config, check_tokens_shape
from flux_jax.flax.sharding import batch_axis_entry, data_axes, sharded_call

__all__ = [
    "ColumnParallelLinear",
    "DecoderBlock",
    "Fp8Kernel",
    "GPT",
    "GPTConfig",
    "GroupedQueryAttention",
    "RMSNorm",
    "RowParallelLinear",
    "SwiGLUMLP",
    "batch_axis_entry",
    "check_config",
    "check_tokens_shape",
    "data_axes",
    "quantize_kernels",
    "rotary_embedding",
    "sharded_call",
]
