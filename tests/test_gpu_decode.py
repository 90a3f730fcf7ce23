"""The decode paths on real GPUs (cpp/kernels/cuda/{ag_matmul,matmul_rs}_decode.cu, decode_gemm.cuh).

Skipped like test_gpu_fused.py (FLUX_JAX_REQUIRE_GPU=1 turns the skip into a failure). Every check
compares with a float64 oracle on fresh random data, outputs poisoned with NaN first, and checks
in the lowered program that the decode kernels (not the latency path) ran.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import flux_jax
from flux_jax import _config

from helpers import assert_matches, missing_peer_times_out_then_reset, place, random_array, to64
from helpers import gpu_mesh as _mesh
from helpers import op_fn as _op_fn


def _is_decode(f, *args, op="ag"):
    target = "flux_jax_ag_matmul" if op == "ag" else "flux_jax_matmul_rs"
    return re.search(rf"{target}\(.*decode_path = true", f.lower(*args).as_text()) is not None


def _decode_gradients_match(mesh, op, x, w, xs, ws, rng):
    """The VJP of `op` traced with fused_path="decode" (its transposed-weight op on the latency
    path) against the twin's and the float64 oracle, for a random cotangent."""
    ct = jnp.asarray(rng.standard_normal((x.shape[0], w.shape[1])), jnp.float32)

    def grads(impl):
        f, _ = _op_fn(op, mesh, impl)
        loss = lambda a, b: jnp.sum(f(a, b).astype(jnp.float32) * ct)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, ws)

    with flux_jax.config(fused_path="decode"):
        dx, dw = grads("fused")
    tdx, tdw = grads("xla")
    assert_matches(dx, np.asarray(ct, np.float64) @ to64(w).T, tdx, "bfloat16", f"{op} dx")
    assert_matches(dw, to64(x).T @ np.asarray(ct, np.float64), tdw, "bfloat16", f"{op} dw")
    assert not flux_jax.device_errors()


@pytest.mark.parametrize("early_launch", [1, 0], ids=["early_launch", "after_push"])
def test_decode_matches_oracle(gpus, early_launch):
    """Rows 2..256 in all (both tile widths, partial tiles, two 128-row tiles whose rows come from
    one or two senders), random K and N per rank (multiples of 8), and LLaMA-70B qkv-like shapes."""
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    shapes = [
        (M, *(int(v) * 8 for v in rng.integers(1, 700, size=2)))
        for M in (2, 8, 16, 30, 64, 66, 100, 128, 130, 196, 256)
    ]
    shapes += [(64, 8192, 2 * 5120), (256, 8192, 2 * 5120)]
    for M, K, N in shapes:
        N *= 2  # global N: per-rank N a multiple of 8
        x, w = random_array(rng, (M, K), "bfloat16"), random_array(rng, (K, N), "bfloat16", scale=1 / np.sqrt(K))
        with (
            flux_jax.config(fused_path="decode", debug_poison_outputs=True),
            _config.gpu_tuning(decode_early_launch=early_launch),
        ):
            f, specs = _op_fn("ag", mesh, "fused")
        t, _ = _op_fn("ag", mesh, "xla")
        xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
        assert _is_decode(f, xs, ws), (M, K, N)
        assert_matches(f(xs, ws), to64(x) @ to64(w), t(xs, ws), "bfloat16", f"ag decode M={M} K={K} N={N}")
    assert not flux_jax.device_errors()


def test_rs_decode_matches_oracle(gpus):
    """matmul_rs at 2..128 rows (staged rows where they do not fill a row tile), random K and N
    (multiples of 8), and the LLaMA-70B out-projection at M = 64: the epilogue's tile-by-tile
    reduce-scatter against the float64 oracle."""
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    shapes = [(M, *(int(v) * 8 for v in rng.integers(1, 700, size=2))) for M in (2, 8, 16, 30, 64, 66, 100, 128)]
    shapes.append((64, 4096, 8192))
    for M, K, N in shapes:
        K *= 2  # global K: per-rank K a multiple of 8
        x, w = random_array(rng, (M, K), "bfloat16"), random_array(rng, (K, N), "bfloat16", scale=1 / np.sqrt(K))
        with flux_jax.config(fused_path="decode", debug_poison_outputs=True):
            f, specs = _op_fn("rs", mesh, "fused")
        t, _ = _op_fn("rs", mesh, "xla")
        xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
        assert _is_decode(f, xs, ws, op="rs"), (M, K, N)
        assert_matches(f(xs, ws), to64(x) @ to64(w), t(xs, ws), "bfloat16", f"rs decode M={M} K={K} N={N}")
    assert not flux_jax.device_errors()


def test_rs_decode_deterministic_and_gradients(gpus):
    """Two runs bitwise equal; the VJP (its ag_matmul on the latency path) against the twin."""
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    x, w = random_array(rng, (96, 1024), "bfloat16"), random_array(rng, (1024, 768), "bfloat16", scale=1 / 32)
    with flux_jax.config(fused_path="decode"):
        f, specs = _op_fn("rs", mesh, "fused")
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    first, second = np.asarray(f(xs, ws)), np.asarray(f(xs, ws))
    np.testing.assert_array_equal(first, second)

    _decode_gradients_match(mesh, "rs", x, w, xs, ws, rng)


def test_decode_back_to_back_with_other_paths_bitwise(gpus):
    """300 steps of ag (decode, 128 rows) -> rs (decode and latency) -> ag (overlap) -> psum: every
    op shares the slot area's parity halves and one epoch sequence with the others. Small integers
    keep every product and sum exact, so the result must equal the twin's bit for bit."""
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    x = rng.integers(-1, 2, (128, 1024)).astype(jnp.bfloat16)
    w1 = np.zeros((1024, 16), np.float32)  # 4 entries of +-1 per column: |y| <= 4
    for col in range(16):
        w1[rng.choice(1024, 4, replace=False), col] = rng.choice([-1.0, 1.0], 4)
    w1 = w1.astype(jnp.bfloat16)
    w2 = rng.integers(-1, 2, (16, 1024)).astype(jnp.bfloat16)
    w3 = rng.integers(-1, 2, (1024, 256)).astype(jnp.bfloat16)
    signs = jnp.asarray(rng.choice([-1.0, 1.0], 300), jnp.bfloat16)

    def program(impl):
        def body(x, w1, w2, w3):
            def step(acc, sign):
                with flux_jax.config(fused_path="decode"):
                    y = flux_jax.ag_matmul(x * sign, w1, axis_name="tp", impl=impl)  # [128, 8]
                with flux_jax.config(fused_path="decode"):
                    r = flux_jax.matmul_rs(y, w2, axis_name="tp", impl=impl)  # [64, 1024], |r| <= 64
                with flux_jax.config(fused_path="latency"):
                    r = r + flux_jax.matmul_rs(y, -w2, axis_name="tp", impl=impl) + r
                with flux_jax.config(fused_path="overlap"):
                    z = flux_jax.ag_matmul(jnp.sign(r), w3, axis_name="tp", impl=impl)  # [128, 128]
                z = z + jax.lax.psum(jnp.sign(z[:1, :1]), "tp").astype(z.dtype)
                return acc + z.astype(jnp.float32), None

            acc0 = jax.lax.pcast(jnp.zeros((128, 128), jnp.float32), ("tp",), to="varying")
            return jax.lax.scan(step, acc0, signs)[0]

        return jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp"), P(None, "tp")), out_specs=P(None, "tp")
            )
        )

    args = (
        place(mesh, x, P("tp")),
        place(mesh, w1, P(None, "tp")),
        place(mesh, w2, P("tp")),
        place(mesh, w3, P(None, "tp")),
    )
    fused = program("fused")
    hlo = fused.lower(*args).as_text()
    assert re.search(r"flux_jax_ag_matmul\(.*decode_path = true", hlo)
    assert re.search(r"flux_jax_matmul_rs\(.*decode_path = true", hlo) and "flux_jax_reduce_scatter" in hlo
    out, ref = np.asarray(fused(*args)), np.asarray(program("xla")(*args))
    assert np.count_nonzero(ref) > ref.size // 2  # not trivially zero
    np.testing.assert_array_equal(out, ref)
    assert not flux_jax.device_errors()


def test_decode_gathered_and_gradients(gpus):
    """return_gathered (the slot area copied after the GEMM) and the VJP (its matmul_rs on the
    latency path) against the twin."""
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    x, w = random_array(rng, (96, 512), "bfloat16"), random_array(rng, (512, 768), "bfloat16", scale=1 / 24)
    body = functools.partial(flux_jax.ag_matmul, axis_name="tp", impl="fused", return_gathered=True)
    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("tp", None), P(None, "tp")),
            out_specs=(P(None, "tp"), P("tp", None)),
            check_vma=False,
        )
    )
    xs, ws = place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp"))
    with flux_jax.config(fused_path="decode", debug_poison_outputs=True):
        out, gathered = f(xs, ws)
    np.testing.assert_array_equal(np.asarray(gathered), np.tile(np.asarray(x), (2, 1)))
    t, _ = _op_fn("ag", mesh, "xla")
    assert_matches(out, to64(x) @ to64(w), t(xs, ws), "bfloat16", "ag decode with the gathered copy")

    _decode_gradients_match(mesh, "ag", x, w, xs, ws, rng)


def test_decode_missing_peer_times_out_then_reset(gpus):
    missing_peer_times_out_then_reset(gpus, "ag", "decode", 64, "waited in ag_matmul's decode GEMM for push block")


def test_rs_decode_missing_peer_times_out_then_reset(gpus):
    missing_peer_times_out_then_reset(
        gpus, "rs", "decode", 64, "waited in matmul_rs's decode GEMM for the partial sums of output tile"
    )
