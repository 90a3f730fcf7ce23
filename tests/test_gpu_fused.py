"""The CUDA fused kernels on real GPUs (Hopper, 2 GPUs for TP=2).

Skipped where there are fewer than 2 GPUs; FLUX_JAX_REQUIRE_GPU=1 turns the
skip into a failure. Every check compares with
a float64 oracle on fresh random data, outputs poisoned with NaN first.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import flux_jax
from flux_jax import _config

from helpers import assert_matches, assert_nan_or_right, missing_peer_times_out_then_reset, place, random_array, to64
from helpers import gpu_mesh as _mesh
from helpers import op_fn as _op_fn

SHAPES = [  # global (M, K, N): aligned, unaligned m_local, K/N not multiples of 64, tiny
    (4096, 2048, 4096),
    (1000, 528, 784),  # m_local = 500: tiles straddle chunks; K/N per rank multiples of 8 only
    (256, 8192, 1024),
    (2, 64, 16),
    (8192, 1024, 2048),
]


@pytest.mark.parametrize("path", ["overlap", "latency"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_matches_oracle(gpus, op, dtype, shape, path):
    M, K, N = shape
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    x, w = random_array(rng, (M, K), dtype), random_array(rng, (K, N), dtype, scale=1 / np.sqrt(K))
    with flux_jax.config(fused_path=path):
        fused, specs = _op_fn(op, mesh, "fused")
    twin, _ = _op_fn(op, mesh, "xla")
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    ref = to64(x) @ to64(w)
    assert_matches(fused(xs, ws), ref, twin(xs, ws), dtype, f"{op} {shape} {dtype}")
    assert not flux_jax.device_errors()


@pytest.mark.parametrize("tile_n", [0, 192, 256])
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize(
    "shape", [(2048, 4096, 6144), (1000, 528, 784), (8192, 1024, 2048)], ids=lambda s: "x".join(map(str, s))
)
def test_tile_widths_match_oracle(gpus, op, shape, tile_n):
    """Both overlap GEMM tile widths (GpuTuning.tile_n; 0 = by waves, which takes 192 for AG at
    2048x4096x6144), forward and with the transposed weight of a backward pass (no narrow
    instance there: it must fall back to 256), over two calls."""
    M, K, N = shape
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    x, w = random_array(rng, (M, K), "bfloat16"), random_array(rng, (K, N), "bfloat16", scale=1 / np.sqrt(K))
    with flux_jax.config(fused_path="overlap"), _config.gpu_tuning(tile_n=tile_n):
        fused, specs = _op_fn(op, mesh, "fused")
        grad = jax.jit(jax.grad(lambda x, w: jnp.sum(fused(x, w).astype(jnp.float32) ** 2), argnums=(0, 1)))
    twin, _ = _op_fn(op, mesh, "xla")
    twin_grad = jax.jit(jax.grad(lambda x, w: jnp.sum(twin(x, w).astype(jnp.float32) ** 2), argnums=(0, 1)))
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    ref = to64(x) @ to64(w)
    for call in range(2):
        assert_matches(fused(xs, ws), ref, twin(xs, ws), "bfloat16", f"{op} {shape} tile_n={tile_n} call {call}")
    for got, want, name in zip(grad(xs, ws), twin_grad(xs, ws), ("dx", "dw")):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.all(np.isfinite(got)), name
        err = np.max(np.abs(got - want)) / np.max(np.abs(want))
        assert err < 2e-2, f"{op} {shape} tile_n={tile_n} {name}: relative error {err:.2e}"
    assert not flux_jax.device_errors()


def test_fused_refuses_shapes_the_kernels_cannot_take(gpus):
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    x, w = random_array(rng, (256, 520), "bfloat16"), random_array(rng, (520, 776), "bfloat16")
    f, specs = _op_fn("ag", mesh, "fused")  # n_local = 388: not a multiple of 8
    with pytest.raises(flux_jax.FusedUnavailableError, match="multiples of 8"):
        f(place(mesh, x, specs[0]), place(mesh, w, specs[1]))
    auto, _ = _op_fn("ag", mesh, "auto")
    assert_matches(
        auto(place(mesh, x, specs[0]), place(mesh, w, specs[1])),
        to64(x) @ to64(w),
        auto(place(mesh, x, specs[0]), place(mesh, w, specs[1])),
        "bfloat16",
        "auto fallback",
    )


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_gradients_match_twin(gpus, op):
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    M, K, N = 2048, 1024, 1536
    x, w = random_array(rng, (M, K), "bfloat16"), random_array(rng, (K, N), "bfloat16", scale=1 / 32)
    ct = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)

    def grads(impl):
        f, specs = _op_fn(op, mesh, impl)
        loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * ct)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(place(mesh, x, specs[0]), place(mesh, w, specs[1]))

    dx, dw = grads("fused")
    tdx, tdw = grads("xla")
    assert_matches(dx, np.asarray(ct, np.float64) @ to64(w).T, tdx, "bfloat16", "dx")
    assert_matches(dw, to64(x).T @ np.asarray(ct, np.float64), tdw, "bfloat16", "dw")


@pytest.mark.parametrize(
    "paths",
    [("overlap", "overlap"), ("latency", "latency"), ("overlap", "latency"), ("latency", "overlap")],
    ids="-".join,
)
def test_1000_back_to_back_calls_with_xla_collectives_in_between(gpus, paths):
    """ag -> psum (XLA collective on its own stream) -> rs, 500 times in one scan; each op on
    either path (mixed paths share one workspace and one epoch counter)."""
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    x = random_array(rng, (1024, 512), "bfloat16")
    w1 = random_array(rng, (512, 1024), "bfloat16", scale=1 / 24)
    w2 = random_array(rng, (1024, 512), "bfloat16", scale=1 / 32)

    def program(impl):
        def body(h, w1, w2):
            def step(h, _):
                with flux_jax.config(fused_path=paths[0]):
                    y = flux_jax.ag_matmul(h, w1, axis_name="tp", impl=impl)
                y = y + jax.lax.psum(jnp.mean(y), "tp").astype(y.dtype)
                with flux_jax.config(fused_path=paths[1]):
                    h = flux_jax.matmul_rs(jnp.tanh(y), w2, axis_name="tp", impl=impl)
                return jnp.tanh(h), None

            return jax.lax.scan(step, h, None, length=500)[0]

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp")))

    args = (place(mesh, x, P("tp")), place(mesh, w1, P(None, "tp")), place(mesh, w2, P("tp")))
    out = np.asarray(program("fused")(*args), np.float32)
    assert np.all(np.isfinite(out))
    ref = np.asarray(program("xla")(*args), np.float32)
    # 500 chained bf16 steps drift; the tanh keeps both bounded in [-1, 1].
    assert np.mean(np.abs(out - ref)) < 0.05, np.mean(np.abs(out - ref))
    assert not flux_jax.device_errors()


def test_back_to_back_latency_calls_of_different_sizes(gpus):
    """ag (1 MiB chunks) -> rs (0.5 MiB chunks) on the latency path, 300 times, with only
    8-column GEMMs in between: each smaller call follows a larger one, whose slots the peer may
    still be reading, so the parity halves of the slot area must not overlap across sizes.
    Small integers keep every product and sum exact, so the result must equal the twin's bit
    for bit (a balanced loop rarely loses the old race; correct data at mixed sizes is what
    this checks for sure)."""
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    x = rng.integers(-1, 2, (1024, 1024)).astype(jnp.bfloat16)  # per rank [512, 1024]: 1 MiB chunks
    w1 = np.zeros((1024, 16), np.float32)  # 4 entries of +-1 per column: |y| <= 4
    for col in range(16):
        w1[rng.choice(1024, 4, replace=False), col] = rng.choice([-1.0, 1.0], 4)
    w1 = w1.astype(jnp.bfloat16)
    w2 = rng.integers(-1, 2, (16, 512)).astype(jnp.bfloat16)  # rs chunks [512, 512]: 0.5 MiB
    signs = jnp.asarray(rng.choice([-1.0, 1.0], 300), jnp.bfloat16)

    def program(impl):
        def body(x, w1, w2):
            def step(acc, sign):
                y = flux_jax.ag_matmul(x * sign, w1, axis_name="tp", impl=impl)
                r = flux_jax.matmul_rs(y, w2, axis_name="tp", impl=impl)
                return acc + r.astype(jnp.float32), None

            with flux_jax.config(fused_path="latency"):
                acc0 = jax.lax.pcast(jnp.zeros((512, 512), jnp.float32), ("tp",), to="varying")
                return jax.lax.scan(step, acc0, signs)[0]

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp")))

    args = (place(mesh, x, P("tp")), place(mesh, w1, P(None, "tp")), place(mesh, w2, P("tp")))
    fused = program("fused")
    hlo = fused.lower(*args).as_text()
    assert "flux_jax_all_gather" in hlo and "flux_jax_reduce_scatter" in hlo
    out, ref = np.asarray(fused(*args)), np.asarray(program("xla")(*args))
    # Not trivially zero (a max-magnitude bound flaked: a random walk of 300 signed steps can stay
    # under 100 everywhere, e.g. 54 on 2026-11-30).
    assert np.count_nonzero(ref) > ref.size // 2
    np.testing.assert_array_equal(out, ref)
    assert not flux_jax.device_errors()


@pytest.mark.parametrize("path", ["overlap", "latency"])
def test_rs_is_bitwise_deterministic(gpus, path):
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    x, w = random_array(rng, (4096, 4096), "bfloat16"), random_array(rng, (4096, 2048), "bfloat16", scale=1 / 64)
    with flux_jax.config(fused_path=path):
        f, specs = _op_fn("rs", mesh, "fused")
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    first = np.asarray(f(xs, ws))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(xs, ws)), first)


@pytest.mark.parametrize(
    "shape, piece_bytes",
    [((8192, 1024, 2048), 0), ((2000, 272, 1032), 128 * 1032 * 2), ((8000, 272, 1032), 1032 * 2)],
    ids=["8pieces", "tail_pieces", "pieces_of_250_rows"],
)
def test_rs_first_stage_settings_are_bitwise_the_default(gpus, shape, piece_bytes):
    """How the pushed stage is launched and released changes when bytes move, never which:
    GpuTuning.rs_stage_launches (launches of whole pieces) and rs_tile_signal (pieces
    released by tile counters the epilogue raises; 250-row pieces make tiles straddle two)
    give, over 3 calls each (the counters only grow), the oracle and bitwise the result
    of one launch released by its end; -1 (automatic) picks 2 at these small K."""
    M, K, N = shape
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    x, w = random_array(rng, (M, K), "bfloat16"), random_array(rng, (K, N), "bfloat16", scale=1 / 16)
    t, specs = _op_fn("rs", mesh, "xla")
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    twin = t(xs, ws)
    results = {}
    for launches, signal in ((1, 0), (0, 0), (3, 0), (16, 0), (1, 1), (1, 2), (3, 1), (0, 2), (1, -1)):
        with (
            flux_jax.config(fused_path="overlap", debug_poison_outputs=True),
            _config.gpu_tuning(rs_stage_launches=launches, piece_bytes=piece_bytes, rs_tile_signal=signal),
        ):
            f, _ = _op_fn("rs", mesh, "fused")
        results[launches, signal] = [np.asarray(f(xs, ws)) for _ in range(3)]
        assert_matches(
            results[launches, signal][0],
            to64(x) @ to64(w),
            twin,
            "bfloat16",
            f"rs {shape} launches={launches} tile_signal={signal}",
        )
    for key, got in results.items():
        for call in got:
            np.testing.assert_array_equal(call, results[1, 0][0], err_msg=str(key))
    assert not flux_jax.device_errors()


@pytest.mark.parametrize("shape", [(4096, 2048, 4096), (1000, 528, 784)], ids=["aligned", "m_local_500"])
def test_return_gathered_is_x_on_every_rank(gpus, shape):
    """The gathered copy (kept for dW in training): local chunk by the copy engine next to the
    GEMM, remote chunks after it; poisoned first, so a chunk left unwritten fails."""
    M, K, N = shape
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    x, w = random_array(rng, (M, K), "bfloat16"), random_array(rng, (K, N), "bfloat16", scale=1 / 16)
    t, _ = _op_fn("ag", mesh, "xla")
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
    with flux_jax.config(fused_path="overlap", debug_poison_outputs=True):
        out, gathered = f(xs, ws)
    np.testing.assert_array_equal(np.asarray(gathered), np.tile(np.asarray(x), (2, 1)))
    assert_matches(out, to64(x) @ to64(w), t(xs, ws), "bfloat16", f"ag {shape} with the gathered copy")


def test_2d_mesh_and_auto_axes(gpus):
    mesh = _mesh(gpus, (1, 2), ("dp", "tp"), AxisType.Auto)
    rng = np.random.default_rng()
    x, w = random_array(rng, (512, 256), "bfloat16"), random_array(rng, (256, 512), "bfloat16", scale=1 / 16)
    for op in ("ag", "rs"):
        f, specs = _op_fn(op, mesh, "fused")
        t, _ = _op_fn(op, mesh, "xla")
        assert_matches(f(x, w), to64(x) @ to64(w), t(x, w), "bfloat16", f"{op} on 1x2 mesh")


def test_recompilation_and_workspace_growth(gpus):
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    for M in (256, 4096, 512, 8192):  # grows twice, then reuses
        x, w = random_array(rng, (M, 1024), "bfloat16"), random_array(rng, (1024, 1024), "bfloat16", scale=1 / 32)
        for op in ("ag", "rs"):
            f, specs = _op_fn(op, mesh, "fused")
            t, _ = _op_fn(op, mesh, "xla")
            xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
            assert_matches(f(xs, ws), to64(x) @ to64(w), t(xs, ws), "bfloat16", f"{op} M={M}")
    assert all(b > 0 for b in flux_jax.workspace_bytes().values())


def test_missing_peer_times_out_then_reset(gpus):
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    x, w = random_array(rng, (512, 256), "bfloat16"), random_array(rng, (256, 256), "bfloat16")
    with flux_jax.config(timeout_s=0.5, debug_drop_rank=1, fused_path="overlap"):
        f, specs = _op_fn("ag", mesh, "fused")
        xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
        out = f(xs, ws)
    twin, _ = _op_fn("ag", mesh, "xla")
    assert_nan_or_right(out, to64(x) @ to64(w), twin(xs, ws), "bfloat16", "ag overlap, rank 1 silent")
    errors = flux_jax.device_errors()
    assert errors and "timed out" in next(iter(errors.values()))
    with flux_jax.config(fused_path="overlap"):
        good, _ = _op_fn("ag", mesh, "fused")
    with pytest.raises(Exception, match=r"timed out \(rank \d waited for rank 1 to reach the op; epoch \d+"):
        np.asarray(good(xs, ws))
    flux_jax.reset()
    assert not flux_jax.device_errors()
    assert_matches(good(xs, ws), to64(x) @ to64(w), twin(xs, ws), "bfloat16", "after reset")


def test_rs_overlap_missing_peer_is_nan_or_right(gpus):
    """matmul_rs's overlap ring with rank 1 silent: a partial-sum wait that gives up after its
    tile's epilogue read alpha makes the tile's C NaN, so no element comes out finite and wrong."""
    missing_peer_times_out_then_reset(gpus, "rs", "overlap", 512, "waited for rank 1 to reach the op")


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_latency_path_small_m(gpus, op):
    """Decode / chunked-prefill sizes on the latency path, random K and N (multiples of 8 per rank)."""
    mesh = _mesh(gpus)
    rng = np.random.default_rng()
    for M in (2, 8, 16, 64, 128, 256, 512, 1024):
        K, N = (int(v) * 16 for v in rng.integers(1, 160, size=2))
        x, w = random_array(rng, (M, K), "bfloat16"), random_array(rng, (K, N), "bfloat16", scale=1 / np.sqrt(K))
        with flux_jax.config(fused_path="latency", debug_poison_outputs=True):
            f, specs = _op_fn(op, mesh, "fused")
        t, _ = _op_fn(op, mesh, "xla")
        xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
        hlo = f.lower(xs, ws).as_text()
        assert "flux_jax_all_gather" in hlo or "flux_jax_reduce_scatter" in hlo
        assert_matches(f(xs, ws), to64(x) @ to64(w), t(xs, ws), "bfloat16", f"{op} M={M} K={K} N={N}")
    assert not flux_jax.device_errors()


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_latency_path_missing_peer_times_out_then_reset(gpus, op):
    name = "all_gather" if op == "ag" else "reduce_scatter"
    missing_peer_times_out_then_reset(gpus, op, "latency", 128, f"waited in {name} for block")
