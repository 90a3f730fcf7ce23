"""Greedy decoding with a KV cache, tensor-parallel without sequence parallelism (flux_jax.matmul_ar).

    python examples/decode.py              # 8 CPU devices, TP=4: fused vs the XLA twin
    python examples/decode.py --tp 2 --dtype bfloat16 --impl fused   # on a 2-GPU host

Inference decode at small TP: every TP rank holds the whole (one-token) activations; the heads
and the MLP's hidden units are split over TP. Per block and token, QKV and gate+up are local
GEMMs (flux_jax.column_matmul forward) and the attention-out and down projections are
flux_jax.matmul_ar, GEMM + all-reduce in one op: two fused all-reduces per block, each with the
same bits on every rank. Each rank keeps the KV cache of its own kv heads.

The model is flux_jax.flax.GPT(sequence_parallel=False) with random weights (nothing is
downloaded or trained), so the text is gibberish; what the script checks: the fused and twin
decodes produce the same tokens and logits within float rounding, the logits are the same bits
on every TP rank, and the cached decode equals the model's full forward pass on the same text.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# 8 CPU devices when there is no accelerator (harmless on a GPU host).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flux_jax
from flux_jax.flax import GPT, GPTConfig, check_config, rotary_embedding, sharded_call

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training.text import CharVocab, generate_corpus  # noqa: E402

PROMPT = "the "
CACHE = P(None, None, None, "tp", None)  # [layers, T, B, kv_heads, head_dim]: kv heads over TP


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=4, help="tensor-parallel ranks (devices)")
    p.add_argument("--tokens", type=int, default=12, help="tokens to generate after the prompt")
    p.add_argument("--batch", type=int, default=2, help="sequences decoded together")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument(
        "--impl",
        choices=["fused", "auto"],
        default="fused",
        help="flux_jax implementation compared against the XLA twin (impl='xla')",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tp < 1:
        p.error(f"--tp must be >= 1, got {args.tp}")
    if args.tp > len(jax.devices()):
        p.error(f"--tp {args.tp} needs {args.tp} devices; {len(jax.devices())} are visible")
    if args.dtype == "float16" and jax.default_backend() == "cpu":
        p.error("--dtype float16 needs a GPU: XLA:CPU has no float16 attention (dot_general F16_F16_F32)")
    try:  # shapes that cannot shard: a usage error naming the numbers, before anything runs
        check_config(model_config(args, 1, args.impl), tp_mesh(args))
    except ValueError as e:
        p.error(str(e))
    return args


def tp_mesh(args) -> jax.sharding.Mesh:
    return jax.make_mesh((args.tp,), ("tp",), devices=jax.devices()[: args.tp])


def model_config(args, vocab_size: int, impl: str) -> GPTConfig:
    return GPTConfig(
        vocab_size=vocab_size,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        ffn=args.ffn,
        impl=impl,
        dtype=args.dtype,
        param_dtype="float32",
        sequence_parallel=False,
    )


def attend(attn, x, pos, k_cache, v_cache):
    """One token of grouped-query attention against this rank's cache (its kv heads).

    x [1, B, D] (the same on every rank), pos: the token's position; caches [T, B, kv_local, Dh].
    """
    qkv = attn.qkv(x)  # column_matmul: [1, B, kv_local, q_per_kv + 2, Dh]
    g = attn.q_per_kv
    position = jnp.reshape(pos, (1,))
    q = rotary_embedding(qkv[..., :g, :], position, attn.rope_theta)[0]  # [B, kv_local, g, Dh]
    k = rotary_embedding(qkv[..., g, :], position, attn.rope_theta)  # [1, B, kv_local, Dh]
    v = qkv[..., g + 1, :]
    k_cache = lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), pos, axis=0)
    v_cache = lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), pos, axis=0)
    scores = jnp.einsum("bkgd,tbkd->bkgt", q.astype(jnp.float32), k_cache.astype(jnp.float32))
    scores = scores / np.sqrt(attn.head_dim)
    scores = jnp.where(jnp.arange(k_cache.shape[0]) <= pos, scores, -jnp.inf)
    out = jnp.einsum("bkgt,tbkd->bkgd", jax.nn.softmax(scores, axis=-1), v_cache.astype(jnp.float32))
    out = out.astype(x.dtype).reshape(1, x.shape[1], -1)  # query head order = the out rows' order
    return attn.out(out), k_cache, v_cache  # matmul_ar: [1, B, D] on every rank


def decode_shard(model, token, pos, k_caches, v_caches):
    """Per shard: token [B] at position `pos` -> float32 logits [B, vocab] and the new caches."""
    dtype = jnp.dtype(model.config.dtype)
    x = jnp.take(model.embedding[...], token, axis=0)[None].astype(dtype)  # [1, B, D]
    new_k, new_v = [], []
    for i, block in enumerate(model.blocks):
        h, k, v = attend(block.attn, block.attn_norm(x), pos, k_caches[i], v_caches[i])
        x = x + h
        x = x + block.mlp(block.mlp_norm(x))  # gate+up: column_matmul; down: matmul_ar
        new_k.append(k)
        new_v.append(v)
    x = model.final_norm(x)
    logits = jnp.einsum("sbd,dv->bv", x, model.lm_head[...].astype(dtype), preferred_element_type=jnp.float32)
    return logits, jnp.stack(new_k), jnp.stack(new_v)


def make_step(graphdef, mesh):
    """One decode step over the mesh (global arrays in and out)."""

    def step(params, token, pos, k_caches, v_caches):
        model = nnx.merge(graphdef, params)
        return sharded_call(
            model,
            decode_shard,
            token,
            pos,
            k_caches,
            v_caches,
            mesh=mesh,
            in_specs=(P(), P(), CACHE, CACHE),
            out_specs=(P(), CACHE, CACHE),
        )

    return step


def same_bits_on_every_rank(a: jax.Array) -> bool:
    shards = [np.asarray(s.data) for s in a.addressable_shards]
    return all(np.array_equal(s.view(np.uint8), shards[0].view(np.uint8)) for s in shards[1:])


def decode(args, vocab, impl: str) -> dict:
    """Greedy decoding of PROMPT + args.tokens tokens; the same weights (seed) for every impl."""
    mesh = tp_mesh(args)
    model = GPT(model_config(args, len(vocab), impl), mesh=mesh, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    step = jax.jit(make_step(graphdef, mesh), donate_argnums=(3, 4))
    length = len(PROMPT) + args.tokens
    head_dim = args.hidden // args.heads
    cache_shape = (args.layers, length, args.batch, args.kv_heads, head_dim)
    caches = [jax.device_put(jnp.zeros(cache_shape, args.dtype), NamedSharding(mesh, CACHE)) for _ in range(2)]
    tokens = np.zeros((args.batch, length), np.int32)
    tokens[:, : len(PROMPT)] = vocab.encode(PROMPT)
    tokens[1:, 0] = vocab.encode("a")[0]  # the other sequences start differently
    logits_seen, replicated, times = [], True, []
    for pos in range(length - 1):
        t0 = time.perf_counter()
        logits, *caches = step(params, jnp.asarray(tokens[:, pos]), jnp.int32(pos), *caches)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
        replicated &= same_bits_on_every_rank(logits)
        logits_seen.append(np.asarray(logits))
        if pos + 1 >= len(PROMPT):  # past the prompt: greedy
            tokens[:, pos + 1] = np.argmax(logits_seen[-1], axis=-1)
    # The cached decode against the model's full forward pass over the decoded text.
    full = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, jnp.asarray(tokens[:, :-1])))
    cache_err = float(np.max(np.abs(full - np.stack(logits_seen, axis=1))) / np.max(np.abs(full)))
    text = [vocab.decode(row) for row in tokens]
    explained = flux_jax.explain(make_step(graphdef, mesh), params, jnp.asarray(tokens[:, 0]), jnp.int32(0), *caches)
    return dict(
        impl=impl,
        tokens=tokens,
        text=text,
        logits=np.stack(logits_seen, axis=1),
        replicated=replicated,
        cache_err=cache_err,
        step_ms=1e3 * float(np.median(times[1:])),
        plans=sorted({f"{s.op}: {s.plan.path}" for s in explained if not s.backward}),
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    vocab = CharVocab(generate_corpus(20_000))
    print(
        f"flux_jax {flux_jax.__version__} | {args.tp} x {jax.devices()[0].platform} | GPT {args.layers} layers, "
        f"hidden {args.hidden}, heads {args.heads}/{args.kv_heads} kv, ffn {args.ffn}, {args.dtype} | "
        f"batch {args.batch}, prompt {PROMPT!r} + {args.tokens} tokens"
    )
    runs = {impl: decode(args, vocab, impl) for impl in (args.impl, "xla")}
    for impl, r in runs.items():
        print(f"impl={impl:5s} {r['text']}  ({r['step_ms']:.2f} ms/token; {', '.join(r['plans'])})")
        print(
            f"           logits the same bits on every TP rank: {r['replicated']}; "
            f"cached decode vs full forward: {r['cache_err']:.1e}"
        )
    fused, twin = runs[args.impl], runs["xla"]
    logit_diff = float(np.max(np.abs(fused["logits"] - twin["logits"])) / np.max(np.abs(twin["logits"])))
    same_tokens = bool(np.array_equal(fused["tokens"], twin["tokens"]))
    tolerance = 1e-4 if args.dtype == "float32" else 5e-2
    ok = same_tokens and logit_diff <= tolerance and fused["replicated"] and fused["cache_err"] <= tolerance
    print(
        f"{args.impl} vs xla: tokens {'equal' if same_tokens else 'DIFFER'}, largest logit difference "
        f"{logit_diff:.1e} (relative) -> {'MATCH' if ok else 'MISMATCH'}"
    )
    return dict(runs=runs, same_tokens=same_tokens, logit_diff=logit_diff, ok=ok)


if __name__ == "__main__":
    raise SystemExit(0 if main()["ok"] else 1)
