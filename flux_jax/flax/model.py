"""A small GPT-style decoder on a dp x tp mesh: embedding, N decoder blocks, final norm, LM head.

`GPT.__call__` takes global token ids [B, S] and returns global logits
[B, S, vocab]. Inside, the whole forward runs in one jax.shard_map over every
mesh axis: the batch is split over the data-parallel axes (all axes except
`tp_axis`) and the sequence over `tp_axis` (Megatron sequence parallelism), or,
with `sequence_parallel=False`, every rank of `tp_axis` holds the whole sequence
(the row projections all-reduce: flux_jax.matmul_ar).

With `GPTConfig(gspmd=True)` the model is a GSPMD program instead: global batch-first
activations [B, S, D], and each block alone runs in a jax.shard_map that maps only `tp_axis`
(the flux_jax layers); the partitioner splits the batch over the other axes and, with
`fsdp_axis`, gathers the parameters sharded over that axis.

The LM head is a replicated [hidden, vocab] matmul on each rank's own tokens:
the vocabularies this model targets are small (characters, bytes), so a
vocab-parallel head would cost an all-gather of the sequence and a sharded
softmax to save a few kB of weights. Its gradient, like those of the embedding
and the norms, is summed over all ranks automatically.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from flux_jax.flax.block import DecoderBlock, RMSNorm
from flux_jax.flax.linear import axis_size, check_divisible, check_fp8, check_fsdp_axis, check_impl
from flux_jax.flax.sharding import (
    batch_axis_entry,
    data_axes,
    data_parallel_size,
    normalize_tp_axis,
    sharded_call,
    tp_axis_names,
)
from flux_jax.fp8 import Fp8


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape and numerics of a GPT model (hashable: it is static in the nnx graph).

    Attributes:
      vocab_size: number of token ids.
      hidden, layers, heads, kv_heads, ffn: model width, depth, query heads,
        key/value heads (grouped-query attention), MLP hidden units.
      head_dim: per-head width; None means hidden // heads.
      impl: flux_jax implementation of the four projections: "fused", "xla", "auto".
      dtype: compute dtype of the matmuls and activations; param_dtype: storage.
      attention_implementation: jax.nn.dot_product_attention backend (None, "xla", "cudnn").
      remat: recompute each block's activations in the backward pass (saves memory).
      tp_axis: name of the tensor-parallel mesh axis, or a tuple of mesh axes forming one TP axis
        (ranks row-major in the order named); every other mesh axis is data parallel.
      sequence_parallel: shard the sequence over `tp_axis` between blocks (ag_matmul /
        matmul_rs), or keep it whole on every rank (column_matmul / matmul_ar).
      fp8: the four projections' GEMMs on FP8 operands: False, True or a flux_jax.Fp8 recipe
        (flux_jax/fp8.py); the embedding, attention and LM head keep `dtype`.
      gspmd: False: one shard_map over every mesh axis around the whole forward (per-shard code,
        activations [S, B, D]). True: a GSPMD model: global code with batch-first activations
        [B, S, D], each block in a shard_map over `tp_axis` only, the other axes automatic; call
        it under jax.jit inside `with jax.set_mesh(mesh):`.
      fsdp_axis: with gspmd, a data-parallel mesh axis that also shards the hidden dimension of the
        embedding, the LM head and the four projections' kernels (FSDP); None: parameters are
        replicated over the data-parallel axes.
    """

    vocab_size: int
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 1024
    head_dim: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    impl: str = "auto"
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention_implementation: str | None = None
    remat: bool = False
    tp_axis: str | tuple[str, ...] = "tp"
    sequence_parallel: bool = True
    fp8: bool | Fp8 = False
    gspmd: bool = False
    fsdp_axis: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "tp_axis", normalize_tp_axis(self.tp_axis))  # a 1-tuple is its name


def check_config(config: GPTConfig, mesh: jax.sharding.Mesh) -> None:
    """Raises ValueError, naming the numbers, for a config that cannot shard on `mesh`."""
    check_impl(config.impl)
    check_fp8("GPTConfig", config.fp8)
    tp = axis_size(mesh, config.tp_axis)
    name = config.tp_axis
    for field in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn"):
        if getattr(config, field) < 1:
            raise ValueError(f"{field} must be >= 1, got {getattr(config, field)}")
    if config.heads % config.kv_heads:
        raise ValueError(
            f"heads={config.heads} is not a multiple of kv_heads={config.kv_heads} "
            "(grouped-query attention shares each kv head among heads/kv_heads query heads)"
        )
    check_divisible("heads", config.heads, name, tp, "query heads are sharded over TP")
    check_divisible("kv_heads", config.kv_heads, name, tp, "key/value heads are sharded over TP")
    if config.head_dim is None:
        check_divisible("hidden", config.hidden, name, tp, "each rank holds hidden/tp of the attention width")
        if config.hidden % config.heads:
            raise ValueError(
                f"hidden={config.hidden} is not divisible by heads={config.heads} "
                "(head_dim = hidden / heads); pass head_dim explicitly"
            )
    head_dim = config.head_dim if config.head_dim is not None else config.hidden // config.heads
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int (or None: hidden / heads), got {config.head_dim!r}")
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} is odd: rotary embeddings rotate pairs of a head's features")
    check_divisible("ffn", config.ffn, name, tp, "the MLP's hidden units are sharded over TP")
    if config.fsdp_axis is not None and not config.gspmd:
        raise ValueError(
            f"fsdp_axis={config.fsdp_axis!r} needs gspmd=True: in one shard_map over every axis each "
            "rank would see only its FSDP slice of the weights"
        )
    check_fsdp_axis(mesh, config.fsdp_axis, name, "hidden", config.hidden)
    explicit = [a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit]
    if config.gspmd and explicit:
        raise ValueError(
            f"gspmd=True needs a mesh of Auto axes (jax.sharding.AxisType.Auto), but {explicit} "
            "are Explicit: the partitioner shards the code outside the TP regions"
        )
    for field in ("dtype", "param_dtype"):
        jnp.dtype(getattr(config, field))  # raises TypeError for an unknown dtype name


def check_tokens_shape(shape, mesh: jax.sharding.Mesh, tp_axis="tp", sequence_parallel: bool = True) -> None:
    """Raises ValueError, naming the numbers, for a [batch, seq] that cannot shard on `mesh`."""
    if len(shape) != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(shape)}")
    batch, seq = shape
    tp, dp = axis_size(mesh, tp_axis), data_parallel_size(mesh, tp_axis)
    if sequence_parallel:
        check_divisible("seq", seq, tp_axis, tp, "the sequence is sharded over TP (sequence parallelism)")
    if batch % dp:
        axes = " x ".join(f"{a}={mesh.shape[a]}" for a in data_axes(mesh, tp_axis))
        raise ValueError(
            f"batch={batch} is not divisible by the data-parallel size {dp} ({axes}): "
            "the batch is sharded over every mesh axis except the TP axis"
        )


class GPT(nnx.Module):
    """Decoder-only transformer whose blocks run tensor- and sequence-parallel with flux_jax.

    Build it with the mesh it will run on; parameters are created sharded as
    annotated (nnx.with_partitioning): the projections over `tp_axis`, their hidden
    dimension and that of the embedding and LM head over `fsdp_axis` if given,
    everything else replicated.

      model = GPT(GPTConfig(vocab_size=96, impl="fused"), mesh=mesh, rngs=nnx.Rngs(0))
      logits = model(tokens)        # global [B, S] -> [B, S, vocab] float32
    """

    def __init__(self, config: GPTConfig, *, mesh: jax.sharding.Mesh, rngs: nnx.Rngs):
        check_config(config, mesh)
        self.config, self.mesh = config, mesh
        param_dtype, dtype = jnp.dtype(config.param_dtype), jnp.dtype(config.dtype)
        fsdp = config.fsdp_axis
        embed_init = nnx.initializers.normal(1.0 / config.hidden**0.5)
        self.embedding = nnx.Param(
            nnx.with_partitioning(embed_init, (None, fsdp), mesh=mesh)(
                rngs.params(), (config.vocab_size, config.hidden), param_dtype
            )
        )
        # GPT-2 style: residual branches start small so the stack starts near identity.
        out_init = nnx.initializers.variance_scaling(1.0 / (2 * config.layers), "fan_in", "truncated_normal")
        self.blocks = nnx.List(
            [
                DecoderBlock(
                    config.hidden,
                    config.heads,
                    config.kv_heads,
                    config.ffn,
                    mesh=mesh,
                    tp_axis=config.tp_axis,
                    head_dim=config.head_dim,
                    rope_theta=config.rope_theta,
                    norm_eps=config.norm_eps,
                    impl=config.impl,
                    dtype=dtype,
                    param_dtype=param_dtype,
                    attention_implementation=config.attention_implementation,
                    out_init=out_init,
                    sequence_parallel=config.sequence_parallel,
                    seq_axis=1 if config.gspmd else 0,
                    fsdp_axis=fsdp,
                    fp8=config.fp8,
                    rngs=rngs,
                )
                for _ in range(config.layers)
            ]
        )
        self.final_norm = RMSNorm(config.hidden, mesh=mesh, eps=config.norm_eps, param_dtype=param_dtype)
        # Small logits at init: the first loss is about ln(vocab_size), a uniform guess.
        head_init = nnx.initializers.variance_scaling(0.01, "fan_in", "truncated_normal")
        self.lm_head = nnx.Param(
            nnx.with_partitioning(head_init, (fsdp, None), mesh=mesh)(
                rngs.params(), (config.hidden, config.vocab_size), param_dtype
            )
        )

    def token_spec(self) -> P:
        """PartitionSpec of tokens [B, S]: batch over the data axes, sequence over TP (or
        replicated over TP without sequence parallelism)."""
        seq = self.config.tp_axis if self.config.sequence_parallel else None
        return P(batch_axis_entry(self.mesh, self.config.tp_axis), seq)

    def forward_shard(self, tokens: jax.Array) -> jax.Array:
        """Per shard: tokens [B/dp, S/tp] -> float32 logits [B/dp, S/tp, vocab] ([B/dp, S] ->
        [B/dp, S, vocab] without sequence parallelism)."""
        dtype = jnp.dtype(self.config.dtype)
        x = jnp.take(self.embedding[...], tokens.T, axis=0).astype(dtype)  # [S/tp, B/dp, D]
        for block in self.blocks:
            x = self._block(block, x)
        x = self.final_norm(x)
        # One 2-D GEMM [S*B, D] x [D, V]: XLA:CPU has no bf16 x bf16 -> f32 kernel for the 3-D
        # einsum "sbd,dv->bsv" (DotThunk), but runs the 2-D one.
        seq, batch, hidden = x.shape
        logits = jnp.dot(
            x.reshape(seq * batch, hidden), self.lm_head[...].astype(dtype), preferred_element_type=jnp.float32
        )
        return logits.reshape(seq, batch, -1).transpose(1, 0, 2)

    def forward_gspmd(self, tokens: jax.Array) -> jax.Array:
        """Global tokens [B, S] -> float32 logits [B, S, vocab] as a GSPMD program (gspmd=True).

        Outside the blocks the code is global and the partitioner shards it (the batch over the
        data-parallel axes, the sequence over TP). Each block runs in a shard_map over `tp_axis`
        only: per TP rank x is [B, S/tp, D] (or [B, S, D] without sequence parallelism), with the
        batch still split over the automatic axes, where the flux_jax custom calls run on each
        device's own batch."""
        config = self.config
        dtype = jnp.dtype(config.dtype)
        activations = jax.NamedSharding(self.mesh, P(*self.token_spec(), None))
        # FSDP: the embedding is gathered for its use (as the blocks' kernels are for their TP
        # regions) and its gradient reduce-scattered; gathering rows from the hidden-sharded
        # table instead would leave activations split over hidden, not over the batch.
        table = jax.lax.with_sharding_constraint(self.embedding[...], jax.NamedSharding(self.mesh, P()))
        x = jnp.take(table, tokens, axis=0).astype(dtype)  # [B, S, D]
        x = jax.lax.with_sharding_constraint(x, activations)
        region = P(None, config.tp_axis if config.sequence_parallel else None)
        for block in self.blocks:
            x = sharded_call(
                block,
                self._block,
                x,
                mesh=self.mesh,
                in_specs=(region,),
                out_specs=region,
                axis_names=set(tp_axis_names(config.tp_axis)),
            )
        # [B, S, D] x [D, V] as it is: a reshape to [B*S, D] would merge the batch (split over the
        # data axes) with the sequence (split over tp), which the partitioner does by gathering.
        logits = jnp.dot(self.final_norm(x), self.lm_head[...].astype(dtype), preferred_element_type=jnp.float32)
        return jax.lax.with_sharding_constraint(logits, activations)

    def _block(self, block: DecoderBlock, x: jax.Array) -> jax.Array:
        if self.config.remat:
            return nnx.remat(DecoderBlock.__call__)(block, x)
        return block(x)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Global tokens [B, S] (int) -> logits [B, S, vocab] (float32), sharded like the tokens."""
        check_tokens_shape(tokens.shape, self.mesh, self.config.tp_axis, self.config.sequence_parallel)
        if self.config.gspmd:
            return self.forward_gspmd(tokens)
        spec = self.token_spec()
        return sharded_call(self, GPT.forward_shard, tokens, mesh=self.mesh, in_specs=(spec,), out_specs=P(*spec, None))
