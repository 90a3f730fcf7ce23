"""Grouped-query causal self-attention with heads sharded over tensor parallelism.

Per shard the block sees the sequence-sharded activations x [S/tp, B, D]:

  qkv = ColumnParallelLinear(x)      AllGather(S) + GEMM -> [S, B, kv/tp, q_per_kv + 2, Dh]
  q, k, v, rotary embeddings         this rank's kv groups, full sequence
  causal softmax attention           local: heads never talk to each other
  out = RowParallelLinear(attn)      GEMM + ReduceScatter(S) -> [S/tp, B, D]

The fused QKV kernel is [D, kv_heads, q_per_kv + 2, head_dim]: for every kv
head, its q_per_kv query heads, then its key, then its value. Splitting the
kv-head axis over TP gives each rank whole groups, so one ag_matmul replaces
three. Query head h = g * q_per_kv + j belongs to kv head g, the grouping that
jax.nn.dot_product_attention uses, and the out-projection's rows follow the
same head order, so rank r's attention output meets rank r's rows of it.

With `sequence_parallel=False` x is the whole sequence on every rank, [S, B, D], and the two
projections are column_matmul (QKV) and matmul_ar (out): the same heads per rank, no gather.
`seq_axis=1` takes batch-first activations [B, S/tp, D] (a GSPMD model's layout).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from flux_jax.flax.linear import ColumnParallelLinear, RowParallelLinear, axis_size, check_divisible


def rotary_embedding(x: jax.Array, positions: jax.Array, theta: float = 10000.0, seq_axis: int = 0) -> jax.Array:
    """Rotary position embedding ("rotate half" convention) of x [S, ..., head_dim] at `positions` [S]
    (the sequence at dimension `seq_axis` of x)."""
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [S, head_dim/2]
    shape = [1] * x.ndim
    shape[seq_axis], shape[-1] = angles.shape
    angles = angles.reshape(shape)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class GroupedQueryAttention(nnx.Module):
    """Causal GQA with a fused QKV projection (ag_matmul) and an out-projection (matmul_rs).

    Per shard: x [S/tp, B, hidden] -> [S/tp, B, hidden]. Each rank computes
    heads/tp query heads and kv_heads/tp kv heads over the whole sequence.

    Args:
      hidden: model width D.
      heads, kv_heads: query and key/value heads; heads % kv_heads == 0 and
        both divisible by the TP size.
      head_dim: defaults to hidden // heads.
      attention_implementation: passed to jax.nn.dot_product_attention
        (None/"xla": plain XLA; "cudnn": cuDNN flash attention on NVIDIA GPUs).
      sequence_parallel: x is this rank's slice of the sequence (True) or all of it (False).
      seq_axis: 0 for [S, B, D] activations, 1 for batch-first [B, S, D].
      fsdp_axis: inside a GSPMD model, the mesh axis that also shards the kernels' hidden dimension.
      fp8: the QKV and out projections on FP8 operands (False, True or a flux_jax.Fp8).
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        *,
        mesh: jax.sharding.Mesh,
        tp_axis: str | tuple[str, ...] = "tp",
        head_dim: int | None = None,
        rope_theta: float = 10000.0,
        impl: str = "auto",
        dtype=None,
        param_dtype=jnp.float32,
        attention_implementation: str | None = None,
        out_init: Callable | None = None,
        sequence_parallel: bool = True,
        seq_axis: int = 0,
        fsdp_axis: str | None = None,
        fp8=False,
        rngs: nnx.Rngs,
    ):
        tp = axis_size(mesh, tp_axis)
        if seq_axis not in (0, 1):
            raise ValueError(f"seq_axis must be 0 ([S, B, D]) or 1 ([B, S, D]), got {seq_axis}")
        if heads % kv_heads:
            raise ValueError(
                f"heads={heads} is not a multiple of kv_heads={kv_heads} (grouped-query "
                "attention shares each kv head among heads/kv_heads query heads)"
            )
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"hidden={hidden} is not divisible by heads={heads}; pass head_dim")
            head_dim = hidden // heads
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} is odd: rotary embeddings rotate pairs of a head's features")
        check_divisible("heads", heads, tp_axis, tp, "query heads are sharded over TP")
        check_divisible("kv_heads", kv_heads, tp_axis, tp, "key/value heads are sharded over TP")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_per_kv = heads // kv_heads
        self.rope_theta = rope_theta
        self.attention_implementation = attention_implementation
        self.seq_axis = seq_axis
        common = dict(
            mesh=mesh,
            tp_axis=tp_axis,
            impl=impl,
            dtype=dtype,
            param_dtype=param_dtype,
            sequence_parallel=sequence_parallel,
            seq_axis=seq_axis,
            fsdp_axis=fsdp_axis,
            fp8=fp8,
            rngs=rngs,
        )
        self.qkv = ColumnParallelLinear(hidden, (kv_heads, self.q_per_kv + 2, head_dim), **common)
        self.out = RowParallelLinear(heads * head_dim, hidden, kernel_init=out_init, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Per shard: [S/tp, B, hidden] -> [S/tp, B, hidden] ([S, B, hidden] on every rank
        without sequence parallelism; batch-first with seq_axis=1)."""
        qkv = self.qkv(x)  # [S, B, kv_local, q_per_kv + 2, Dh] (seq_axis=1: [B, S, ...])
        s = self.seq_axis
        seq, kv_local = qkv.shape[s], qkv.shape[2]
        batch = qkv.shape[1 - s]
        g = self.q_per_kv
        positions = jnp.arange(seq)  # the full sequence is here (gathered, or never split)
        q = rotary_embedding(qkv[..., :g, :], positions, self.rope_theta, seq_axis=s)
        k = rotary_embedding(qkv[..., g, :], positions, self.rope_theta, seq_axis=s)
        v = qkv[..., g + 1, :]
        # dot_product_attention wants [B, T, heads, Dh]; query head index = group * g + j.
        q = q.reshape(*qkv.shape[:2], kv_local * g, self.head_dim)
        if s == 0:
            q, k, v = (a.transpose(1, 0, 2, 3) for a in (q, k, v))
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention_implementation)
        if s == 0:
            return self.out(attn.transpose(1, 0, 2, 3).reshape(seq, batch, kv_local * g * self.head_dim))
        return self.out(attn.reshape(batch, seq, kv_local * g * self.head_dim))
