"""RMSNorm, the SwiGLU MLP and the pre-norm decoder block (all per-shard modules).

Between blocks the activations are sequence-parallel, x [S/tp, B, D]: norms
and residual adds run on this rank's tokens only, and every collective sits
inside one of the four projections (QKV, attention out, gate+up, down). With
`sequence_parallel=False` every rank holds the whole sequence, x [S, B, D], and
the projections are column_matmul / matmul_ar. `seq_axis=1` takes batch-first activations
[B, S/tp, D] (a GSPMD model's layout); norms and residual adds do not care.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from flux_jax.flax.attention import GroupedQueryAttention
from flux_jax.flax.linear import ColumnParallelLinear, RowParallelLinear, axis_size, check_divisible


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over the last axis, computed in float32. The scale is replicated."""

    def __init__(
        self,
        features: int,
        *,
        mesh: jax.sharding.Mesh,
        eps: float = 1e-6,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        del rngs  # deterministic init; accepted for a uniform constructor signature
        init = nnx.with_partitioning(nnx.initializers.ones, (None,), mesh=mesh)
        self.scale = nnx.Param(init(jax.random.key(0), (features,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class SwiGLUMLP(nnx.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one ColumnParallelLinear.

    Per shard: x [S/tp, ..., hidden] -> [S/tp, ..., hidden]. The fused kernel
    is [hidden, ffn, 2] ([..., 0] gate, [..., 1] up) and TP splits the ffn axis,
    so each rank holds matching gate and up columns and the down projection's
    matching rows. `seq_axis` and `fsdp_axis` go to both projections.
    """

    def __init__(
        self,
        hidden: int,
        ffn: int,
        *,
        mesh: jax.sharding.Mesh,
        tp_axis: str | tuple[str, ...] = "tp",
        impl: str = "auto",
        dtype=None,
        param_dtype=jnp.float32,
        out_init: Callable | None = None,
        sequence_parallel: bool = True,
        seq_axis: int = 0,
        fsdp_axis: str | None = None,
        fp8=False,
        rngs: nnx.Rngs,
    ):
        check_divisible("ffn", ffn, tp_axis, axis_size(mesh, tp_axis), "the MLP's hidden units are sharded over TP")
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
        self.gate_up = ColumnParallelLinear(hidden, (ffn, 2), **common)
        self.down = RowParallelLinear(ffn, hidden, kernel_init=out_init, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate_up = self.gate_up(x)  # [S, ..., ffn/tp, 2]
        h = jax.nn.silu(gate_up[..., 0]) * gate_up[..., 1]
        return self.down(h)


class DecoderBlock(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x)).

    Per shard: x [S/tp, B, hidden] -> [S/tp, B, hidden]. Four flux_jax calls
    forward (two ag_matmul, two matmul_rs), and their adjoints backward. With
    `sequence_parallel=False`: x [S, B, hidden] on every rank, two fused matmul_ar
    forward and two (column_matmul's) backward. `seq_axis=1`: batch-first x [B, S/tp, hidden];
    `fsdp_axis`: the projections' hidden dimension sharded over it too (GSPMD models only).
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        ffn: int,
        *,
        mesh: jax.sharding.Mesh,
        tp_axis: str | tuple[str, ...] = "tp",
        head_dim: int | None = None,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-6,
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
        common = dict(
            mesh=mesh,
            tp_axis=tp_axis,
            impl=impl,
            dtype=dtype,
            param_dtype=param_dtype,
            out_init=out_init,
            sequence_parallel=sequence_parallel,
            seq_axis=seq_axis,
            fsdp_axis=fsdp_axis,
            fp8=fp8,
            rngs=rngs,
        )
        self.attn_norm = RMSNorm(hidden, mesh=mesh, eps=norm_eps, param_dtype=param_dtype)
        self.attn = GroupedQueryAttention(
            hidden,
            heads,
            kv_heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            attention_implementation=attention_implementation,
            **common,
        )
        self.mlp_norm = RMSNorm(hidden, mesh=mesh, eps=norm_eps, param_dtype=param_dtype)
        self.mlp = SwiGLUMLP(hidden, ffn, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))
