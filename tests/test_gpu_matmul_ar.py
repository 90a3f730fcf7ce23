"""matmul_ar's CUDA paths on real GPUs (Hopper, 2 GPUs for TP=2): the latency path (XLA's GEMM
next to the one-kernel all_reduce), the one-custom-call path (our GEMM, then that kernel) and the
decode path (one decode GEMM whose epilogue all-reduces).

Skipped where there are fewer than 2 GPUs (FLUX_JAX_REQUIRE_GPU=1 turns the skip into a failure).
Every check compares with a float64 oracle on fresh random data, outputs poisoned with NaN first,
and the output's shards bit for bit across the ranks.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import flux_jax

from helpers import assert_matches, assert_nan_or_right, gpu_mesh, place, random_array, to64

PATHS = ["latency", "overlap", "decode"]  # decode: bf16 up to 128 rows, else the latency path


def _fn(mesh, impl):
    """jit(shard_map(matmul_ar)) bound to the flux_jax config current here."""
    cfg = dataclasses.asdict(flux_jax.get_config())

    def body(x, w):
        with flux_jax.config(**cfg):
            return flux_jax.matmul_ar(x, w, axis_name="tp", impl=impl)

    specs = (P(None, "tp"), P("tp", None))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())), specs


def _same_bits_on_every_rank(out):
    shards = [np.asarray(s.data).view(np.uint16) for s in out.addressable_shards]
    assert len(shards) >= 2 and all(np.array_equal(s, shards[0]) for s in shards[1:])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "shape",
    [(1, 4096, 4096), (16, 8192, 1024), (96, 528, 784), (256, 14336, 4096), (2048, 1024, 1536)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_matches_oracle_with_the_same_bits_on_every_rank(gpus, path, dtype, shape):
    M, K, N = shape
    mesh = gpu_mesh(gpus)
    rng = np.random.default_rng()
    x, w = random_array(rng, (M, K), dtype), random_array(rng, (K, N), dtype, scale=1 / np.sqrt(K))
    with flux_jax.config(fused_path=path):
        fused, specs = _fn(mesh, "fused")
    twin, _ = _fn(mesh, "xla")
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    for _ in range(3):  # changing parities of the slot area
        out = fused(xs, ws)
        assert_matches(out, to64(x) @ to64(w), twin(xs, ws), dtype, f"matmul_ar {path} {shape} {dtype}")
        _same_bits_on_every_rank(out)
    assert not flux_jax.device_errors()


def test_gradients_match_twin(gpus):
    mesh = gpu_mesh(gpus)
    rng = np.random.default_rng()
    x = random_array(rng, (64, 2048), "bfloat16")
    w1 = random_array(rng, (2048, 1024), "bfloat16", scale=1 / np.sqrt(2048))
    w2 = random_array(rng, (1024, 2048), "bfloat16", scale=1 / np.sqrt(1024))

    def loss(impl, x, w1, w2):
        def body(x, w1, w2):
            h = flux_jax.column_matmul(x, w1, axis_name="tp", impl=impl)
            return jnp.sum(flux_jax.matmul_ar(jax.nn.gelu(h), w2, axis_name="tp", impl=impl).astype(jnp.float32))

        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "tp"), P("tp", None)), out_specs=P())(x, w1, w2)

    args = (place(mesh, x, P()), place(mesh, w1, P(None, "tp")), place(mesh, w2, P("tp", None)))
    got = jax.jit(jax.grad(functools.partial(loss, "fused"), argnums=(0, 1, 2)))(*args)
    want = jax.jit(jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2)))(*args)
    for g, t in zip(got, want):
        g, t = to64(g), to64(t)
        assert np.max(np.abs(g - t)) <= 3e-2 * np.max(np.abs(t))
    assert not flux_jax.device_errors()


@pytest.mark.parametrize("path", PATHS)
def test_missing_peer_times_out_then_reset(gpus, path):
    """Rank 1 never signals: NaN or right, never finite and wrong; the device error names the
    all_reduce wait; after flux_jax.reset() the same call is right again."""
    mesh = gpu_mesh(gpus)
    rng = np.random.default_rng()
    x, w = random_array(rng, (32, 512), "bfloat16"), random_array(rng, (512, 256), "bfloat16", scale=1 / 16)
    twin, specs = _fn(mesh, "xla")
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    ref = to64(x) @ to64(w)
    with flux_jax.config(timeout_s=0.5, debug_drop_rank=1, fused_path=path):
        f, _ = _fn(mesh, "fused")
        out = f(xs, ws)
    assert_nan_or_right(out, ref, twin(xs, ws), "bfloat16", f"matmul_ar {path}, rank 1 silent")
    errors = flux_jax.device_errors()
    site = "waited in matmul_ar's decode GEMM" if path == "decode" else "waited in all_reduce"
    assert errors and any(site in e for e in errors.values()), errors
    flux_jax.reset()
    assert not flux_jax.device_errors()
    with flux_jax.config(fused_path=path):
        good, _ = _fn(mesh, "fused")
    assert_matches(good(xs, ws), ref, twin(xs, ws), "bfloat16", "after reset")
