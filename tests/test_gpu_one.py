"""The fused ops through JAX on ONE GPU, over a mesh axis of size 1.

With a TP group of one rank the kernels move no rows, but every other layer runs for real: the
planner, the lowering's typed attributes, the FFI handlers' decoding (rank-free CUDA binding,
N-D operands), the workspace, the overlap GEMM instances and the latency path's collectives.
Skipped without a GPU, unless FLUX_JAX_REQUIRE_GPU=1. Outputs are poisoned first (conftest) and
checked against a float64 oracle with XLA-derived tolerances.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import flux_jax

from helpers import assert_matches, place, random_array, to64

SHAPES = [(2048, 1024, 1536), (1000, 528, 784), (64, 256, 512)]  # (M, K, N)


def _mesh(one_gpu):
    return jax.sharding.Mesh(np.array(one_gpu[:1]), ("tp",), axis_types=(AxisType.Explicit,))


def _fn(op, mesh, impl, ndim=2, **kw):
    lead = [None] * (ndim - 2)
    if op == "ag":
        body = functools.partial(flux_jax.ag_matmul, axis_name="tp", impl=impl, **kw)
        specs, out = (P("tp", *lead, None), P(None, "tp")), P(None, *lead, "tp")
    else:
        body = functools.partial(flux_jax.matmul_rs, axis_name="tp", impl=impl, **kw)
        specs, out = (P(None, *lead, "tp"), P("tp", None)), P("tp", *lead, None)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out)), specs


@pytest.mark.parametrize("path", ["overlap", "latency"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_one_gpu_matches_oracle(one_gpu, op, dtype, shape, path):
    M, K, N = shape
    mesh = _mesh(one_gpu)
    rng = np.random.default_rng()
    x, w = random_array(rng, (M, K), dtype), random_array(rng, (K, N), dtype, scale=1 / np.sqrt(K))
    with flux_jax.config(fused_path=path):
        fused, specs = _fn(op, mesh, "fused")
        xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
        text = fused.lower(xs, ws).as_text()
        out = fused(xs, ws)
    target = {
        "overlap": f"flux_jax_{'ag_matmul' if op == 'ag' else 'matmul_rs'}",
        "latency": f"flux_jax_{'all_gather' if op == 'ag' else 'reduce_scatter'}",
    }[path]
    assert target in text
    twin, _ = _fn(op, mesh, "xla")
    assert_matches(out, to64(x) @ to64(w), twin(xs, ws), dtype, f"{op} {shape} {dtype} {path}")
    assert not flux_jax.device_errors()


def _grads(f, xs, ws, ct):
    """(dx, dw) of sum(f(x, w) * ct)."""
    loss = lambda a, b: jnp.sum(f(a, b).astype(jnp.float32) * ct)  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, ws)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_one_gpu_middle_dimensions_and_gradients(one_gpu, op):
    mesh = _mesh(one_gpu)
    rng = np.random.default_rng()
    x = random_array(rng, (256, 4, 512), "bfloat16")
    w = random_array(rng, (512, 768), "bfloat16", scale=1 / np.sqrt(512))
    fused, specs = _fn(op, mesh, "fused", ndim=3)
    twin, _ = _fn(op, mesh, "xla", ndim=3)
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    ref = np.einsum("bsk,kn->bsn", to64(x), to64(w))
    assert_matches(fused(xs, ws), ref, twin(xs, ws), "bfloat16", f"{op} 3-D")
    ct = jnp.asarray(rng.standard_normal(ref.shape), jnp.float32)
    (dx, dw), (tdx, tdw) = _grads(fused, xs, ws, ct), _grads(twin, xs, ws, ct)
    ct64 = np.asarray(ct, np.float64)
    assert_matches(dx, np.einsum("bsn,kn->bsk", ct64, to64(w)), tdx, "bfloat16", f"{op} dx")
    assert_matches(dw, np.einsum("bsk,bsn->kn", to64(x), ct64), tdw, "bfloat16", f"{op} dw")
    assert not flux_jax.device_errors()


# (M, K, N) for the forced overlap instances: whole 128x320 tiles (N = 5120 and 2560, as the rule
# picks them) and partial row, column and cluster tiles.
FORCED_SHAPES = [(2048, 1024, 5120), (1000, 528, 784), (384, 2048, 2560)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kernel", ["128x320_c2x1", "128x128_pp_c2x1", "128x192"])
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("shape", FORCED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_one_gpu_forced_gemm_instance_matches_oracle(one_gpu, kernel, op, shape, dtype):
    """One overlap GEMM instance forced (GpuTuning.gemm_kernel): the forward reads the [K, N]
    weight, the backward's dx the transposed one (the instance's K-major twin)."""
    from flux_jax import _config

    M, K, N = shape
    mesh = _mesh(one_gpu)
    rng = np.random.default_rng()
    x, w = random_array(rng, (M, K), dtype), random_array(rng, (K, N), dtype, scale=1 / np.sqrt(K))
    ct = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    fused, specs = _fn(op, mesh, "fused")
    twin, _ = _fn(op, mesh, "xla")
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    with flux_jax.config(fused_path="overlap"), _config.gpu_tuning(gemm_kernel=kernel):
        out = fused(xs, ws)
        (dx, dw), (tdx, tdw) = _grads(fused, xs, ws, ct), _grads(twin, xs, ws, ct)
    what = f"{kernel} {op} {shape} {dtype}"
    assert_matches(out, to64(x) @ to64(w), twin(xs, ws), dtype, what)
    ct64 = np.asarray(ct, np.float64)
    assert_matches(dx, ct64 @ to64(w).T, tdx, dtype, f"{what} dx")
    assert_matches(dw, to64(x).T @ ct64, tdw, dtype, f"{what} dw")
    assert not flux_jax.device_errors()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("shape", FORCED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_one_gpu_forced_kn_weight_instance_matches_oracle(one_gpu, op, shape, dtype):
    """Ping-pong 128x192 in 2x1 clusters exists for the [K, N] weight only (the forward): forced,
    the forward matches; the backward's dx (the transposed weight) has no such instance, an error
    naming it."""
    from flux_jax import _config

    M, K, N = shape
    mesh = _mesh(one_gpu)
    rng = np.random.default_rng()
    x, w = random_array(rng, (M, K), dtype), random_array(rng, (K, N), dtype, scale=1 / np.sqrt(K))
    fused, specs = _fn(op, mesh, "fused")
    twin, _ = _fn(op, mesh, "xla")
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    with flux_jax.config(fused_path="overlap"), _config.gpu_tuning(gemm_kernel="128x192_pp_c2x1"):
        out = fused(xs, ws)
        assert_matches(out, to64(x) @ to64(w), twin(xs, ws), dtype, f"128x192_pp_c2x1 {op} {shape} {dtype}")
        ct = jnp.ones((M, N), jnp.float32)
        with pytest.raises(Exception, match=r"128x192 tiles in 2x1 clusters \(ping-pong\).*transposed weight"):
            jax.block_until_ready(_grads(fused, xs, ws, ct))
    assert not flux_jax.device_errors()


# (M, K, N) with the weight [N, K]: whole tiles of 160 and 224 columns (N = 2560, 3584) and
# partial row, column and cluster tiles.
TRANSPOSED_ONLY_SHAPES = [(2048, 1024, 2560), (2048, 1024, 3584), (1000, 528, 800)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kernel", ["128x160_c2x1", "128x224"])
@pytest.mark.parametrize("shape", TRANSPOSED_ONLY_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_one_gpu_forced_transposed_weight_instance_matches_oracle(one_gpu, shape, kernel, dtype):
    """The 128x160 instance in 2x1 clusters and the 128x224 one exist for the transposed weight
    only (a backward's dx): ag_matmul's primitive bound with transpose_w, as the backward binds
    it, forced to each."""
    from benchmarks.variants import flux_gemm_fn

    M, K, N = shape
    mesh = _mesh(one_gpu)
    rng = np.random.default_rng()
    x, w_nk = random_array(rng, (M, K), dtype), random_array(rng, (N, K), dtype, scale=1 / np.sqrt(K))
    body = flux_gemm_fn("tp", transpose_w=True, tuning={"gemm_kernel": kernel}, poison=True)
    fused = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P()), out_specs=P("tp", None)))
    twin = jax.jit(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.float32).astype(a.dtype))
    xs, ws = place(mesh, x, P("tp", None)), place(mesh, w_nk, P())
    out = fused(xs, ws)
    assert_matches(out, to64(x) @ to64(w_nk).T, twin(xs, ws), dtype, f"{kernel} w^T {shape} {dtype}")
    assert not flux_jax.device_errors()


def _fp8_operands(rng, M, K, N):
    """x [M, K] and w [K, N] in bf16 for the FP8 checks, w's columns spread over 0.1-4x in
    magnitude (so per-column scales differ)."""
    x = random_array(rng, (M, K), "bfloat16")
    w = random_array(rng, (K, N), "bfloat16", scale=1 / np.sqrt(K)) * jnp.linspace(0.1, 4, N, dtype=jnp.bfloat16)
    return x, w


def _fp8_exact(x, w, recipe):
    """float64 product of the quantized operands (the quantization both the fused op and the
    twin run): what an exact FP8 GEMM would give before its output rounding."""
    from flux_jax import fp8

    xq, xs = fp8.quantize_rows(x, recipe)
    wq, ws = fp8.quantize_weight(w, recipe)
    return np.tensordot(to64(xq) * to64(xs), to64(wq) * to64(ws), axes=1)


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("shape", SHAPES + [(4096, 2048, 2048)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("weight_scaling", ["tensor", "column"])
def test_one_gpu_fp8_overlap_matches_the_quantized_product(one_gpu, op, shape, weight_scaling):
    """The FP8 overlap GEMM (e4m3 x e4m3, scales in the epilogue) against the float64 product of
    the same quantized operands, within 4x the FP8 twin's (XLA's FP8 GEMM) own error."""
    M, K, N = shape
    mesh = _mesh(one_gpu)
    rng = np.random.default_rng()
    recipe = flux_jax.Fp8(weight_scaling=weight_scaling)
    x, w = _fp8_operands(rng, M, K, N)
    with flux_jax.config(fused_path="overlap"):
        fused, specs = _fn(op, mesh, "fused", fp8=recipe)
        xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
        text = fused.lower(xs, ws).as_text()
        out = fused(xs, ws)
    assert f"flux_jax_{'ag_matmul' if op == 'ag' else 'matmul_rs'}" in text and "f8E4M3FN" in text
    twin, _ = _fn(op, mesh, "xla", fp8=recipe)
    assert_matches(out, _fp8_exact(x, w, recipe), twin(xs, ws), "bfloat16", f"fp8 {op} {shape} {weight_scaling}")
    assert not flux_jax.device_errors()


@pytest.mark.parametrize("kernel", ["128x256", "128x128_pp_c2x1", "128x160_pp_c2x1", "128x192_pp_c2x1"])
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("shape", FORCED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_one_gpu_fp8_forced_instance_matches_the_quantized_product(one_gpu, kernel, op, shape):
    """One FP8 overlap instance of the forward's e4m3 GEMM forced (the backward's e5m2 instances:
    below): against the float64 product of the quantized operands, as above."""
    from flux_jax import _config

    M, K, N = shape
    mesh = _mesh(one_gpu)
    rng = np.random.default_rng()
    recipe = flux_jax.Fp8(weight_scaling="column")
    x, w = _fp8_operands(rng, M, K, N)
    fused, specs = _fn(op, mesh, "fused", fp8=recipe)
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    with flux_jax.config(fused_path="overlap"), _config.gpu_tuning(gemm_kernel=kernel):
        out = fused(xs, ws)
    twin, _ = _fn(op, mesh, "xla", fp8=recipe)
    assert_matches(out, _fp8_exact(x, w, recipe), twin(xs, ws), "bfloat16", f"fp8 {kernel} {op} {shape}")
    assert not flux_jax.device_errors()


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_one_gpu_fp8_middle_dimensions_and_gradients(one_gpu, op):
    """3-D operands through the FP8 overlap path. dx (the backward GEMM: e5m2 rows, our e5m2 x
    e4m3 GEMM in both) equals the FP8 twin's. dw is checked against float64 on the dequantized
    FP8 rows the forward gathered: the twin is no reference there, as XLA on GPU folds its
    dequantize (f8 -> f32 -> bf16 converts) away (excess precision) and computes dw on x itself."""
    mesh = _mesh(one_gpu)
    rng = np.random.default_rng()
    x = random_array(rng, (256, 4, 512), "bfloat16")
    w = random_array(rng, (512, 768), "bfloat16", scale=1 / np.sqrt(512))
    fused, specs = _fn(op, mesh, "fused", ndim=3, fp8=True)
    twin, _ = _fn(op, mesh, "xla", ndim=3, fp8=True)
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    recipe = flux_jax.Fp8()
    ref = _fp8_exact(x.reshape(-1, 512), w, recipe).reshape(256, 4, 768)
    with flux_jax.config(fused_path="overlap"):
        assert_matches(fused(xs, ws), ref, twin(xs, ws), "bfloat16", f"fp8 {op} 3-D")
        ct = jnp.asarray(rng.standard_normal(ref.shape), jnp.float32)
        (dx, dw), (tdx, _) = _grads(fused, xs, ws, ct), _grads(twin, xs, ws, ct)
    got, want = to64(dx), to64(tdx)
    assert np.all(np.isfinite(got)) and np.linalg.norm(got - want) <= 2.0**-8 * np.linalg.norm(want), "dx"
    ct_b = to64(ct.astype(jnp.bfloat16)).reshape(-1, 768)  # the cotangent reaches the op in bf16
    if op == "ag":  # dw = AG(x)^T dy on the dequantized gathered e4m3 rows of x
        from flux_jax import fp8

        xq, x_scale = fp8.quantize_rows(x.reshape(-1, 512), recipe)
        x_rows = to64(fp8.dequantize(xq, x_scale, jnp.bfloat16))
        dw_ref = x_rows.T @ ct_b
    else:  # dw = x^T AG(dy) on the dequantized gathered e5m2 rows of dy
        from flux_jax import fp8

        dyq, dy_scale = fp8.quantize_rows(ct.astype(jnp.bfloat16).reshape(-1, 768), recipe, grad=True)
        dw_ref = to64(x).reshape(-1, 512).T @ to64(fp8.dequantize(dyq, dy_scale, jnp.bfloat16))
    got = to64(dw)
    assert np.all(np.isfinite(got)) and np.linalg.norm(got - dw_ref) <= 2.0**-7 * np.linalg.norm(dw_ref), "dw"
    assert not flux_jax.device_errors()


# (rows, K, N): dx is rows x K, N deep. At 2048 x 2560 the rule picks ping-pong 128x160 tiles.
E5M2_SHAPES = [(2048, 1024, 2048), (1000, 512, 768), (2048, 2560, 1024)]


@pytest.mark.parametrize("kernel", ["auto", "128x128_pp_c2x1", "128x160_pp_c2x1", "128x192_pp_c2x1"])
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("shape", E5M2_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_one_gpu_fp8_backward_e5m2_gemm_matches_the_quantized_product(one_gpu, kernel, op, shape):
    """dx of the FP8 ops runs our e5m2 x e4m3 GEMM (dy's e5m2 rows, one scale each, times w in
    e4m3), by the rule or with one of its instances forced: against the float64 product of the
    same quantized operands, within 4x the FP8 twin's (XLA's FP8 GEMM on the same operands) own
    error; the backward's custom call carries e5m2."""
    from flux_jax import _config, fp8

    M, K, N = shape
    mesh = _mesh(one_gpu)
    rng = np.random.default_rng()
    x = random_array(rng, (M, K), "bfloat16")
    w = random_array(rng, (K, N), "bfloat16", scale=1 / np.sqrt(K))
    ct = jnp.asarray(rng.standard_normal((M, N)), jnp.float32) * jnp.linspace(0.1, 4, M)[:, None]
    recipe = flux_jax.Fp8()
    with flux_jax.config(fused_path="overlap"):
        fused, specs = _fn(op, mesh, "fused", fp8=recipe)
        twin, _ = _fn(op, mesh, "xla", fp8=recipe)
        xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
        loss = lambda a, b: jnp.sum(fused(a, b).astype(jnp.float32) * ct)  # noqa: E731
        with _config.gpu_tuning(gemm_kernel=kernel):
            text = jax.jit(jax.grad(loss)).lower(xs, ws).as_text()
            dx, _ = _grads(fused, xs, ws, ct)
        tdx, _ = _grads(twin, xs, ws, ct)
    backward_op = "matmul_rs" if op == "ag" else "ag_matmul"
    calls = [line for line in text.splitlines() if f"flux_jax_{backward_op}" in line]
    assert any("f8E5M2" in line for line in calls), calls
    dyq, dy_scale = fp8.quantize_rows(ct.astype(jnp.bfloat16), recipe, grad=True)
    wq, w_scale = fp8.quantize_weight(w, recipe)
    ref = (to64(dyq) * to64(dy_scale)) @ (to64(wq) * to64(w_scale)).T
    assert_matches(dx, ref, tdx, "bfloat16", f"fp8 dx {kernel} {op} {shape}")
    assert not flux_jax.device_errors()


def test_one_gpu_fp8_only_instance_forced_on_bfloat16_is_an_error(one_gpu):
    """128x160_pp_c2x1 is an FP8 instance: bfloat16 has no such instance, which is an error
    naming it."""
    from flux_jax import _config

    mesh = _mesh(one_gpu)
    rng = np.random.default_rng()
    x, w = _fp8_operands(rng, 512, 256, 384)
    plain, specs = _fn("ag", mesh, "fused")
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    with flux_jax.config(fused_path="overlap"), _config.gpu_tuning(gemm_kernel="128x160_pp_c2x1"):
        with pytest.raises(
            Exception, match=r"no overlap GEMM instance with 128x160 tiles in 2x1 clusters \(ping-pong\)"
        ):
            jax.block_until_ready(plain(xs, ws))


# (rows, K, N): the 64-row tile staged (8 rows), 64 and 128 rows, 100 (a partial 128-row tile),
# 256 rows in two 128-row tiles (narrow N) and 192 / 256 in one 256-row tile (N >= 8192: 256
# tiles of 128 rows would exceed the SMs).
DECODE_GEMM_SHAPES = [(8, 776, 1544), (64, 1024, 2048), (100, 520, 1032), (128, 2048, 4096), (256, 1024, 1024)]
DECODE_GEMM_SHAPES += [(192, 520, 8192), (256, 1024, 8200)]


@pytest.mark.parametrize("shape", DECODE_GEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_one_gpu_decode_gemm_matches_oracle(one_gpu, shape):
    """ag_matmul's decode GEMM alone at tp = 1 (GpuTuning.gemm_kernel="decode": no push, no flags),
    bf16, each row tile it has (64, 128, 256 rows along the tile's N)."""
    from flux_jax import _config

    M, K, N = shape
    mesh = _mesh(one_gpu)
    rng = np.random.default_rng()
    x, w = random_array(rng, (M, K), "bfloat16"), random_array(rng, (K, N), "bfloat16", scale=1 / np.sqrt(K))
    fused, specs = _fn("ag", mesh, "fused")
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    with flux_jax.config(fused_path="overlap"), _config.gpu_tuning(gemm_kernel="decode"):
        outs = [fused(xs, ws) for _ in range(2)]
    twin, _ = _fn("ag", mesh, "xla")
    for out in outs:
        assert_matches(out, to64(x) @ to64(w), twin(xs, ws), "bfloat16", f"decode GEMM {shape}")
    assert not flux_jax.device_errors()


@pytest.mark.parametrize("path", ["decode", "overlap", "latency"])
@pytest.mark.parametrize("shape", [(1, 1024, 2048), (64, 4096, 3072), (100, 776, 1544), (128, 2048, 4096)])
def test_one_gpu_matmul_ar_matches_oracle(one_gpu, shape, path):
    """matmul_ar's paths at tp = 1, bf16; decode: one decode GEMM whose epilogue all-reduces
    (here with no peer), x staged where its rows are not whole tiles, two blocks of rows above 64."""
    M, K, N = shape
    mesh = _mesh(one_gpu)
    rng = np.random.default_rng()
    x, w = random_array(rng, (M, K), "bfloat16"), random_array(rng, (K, N), "bfloat16", scale=1 / np.sqrt(K))

    def fn(impl):
        body = functools.partial(flux_jax.matmul_ar, axis_name="tp", impl=impl)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P()))

    xs, ws = place(mesh, x, P(None, "tp")), place(mesh, w, P("tp", None))
    with flux_jax.config(fused_path=path):
        fused = fn("fused")
        sites = flux_jax.explain(fused, xs, ws)
        outs = [fused(xs, ws) for _ in range(3)]  # both parities of the workspace
    assert [s.plan.path for s in sites] == [path]
    for out in outs:
        assert_matches(out, to64(x) @ to64(w), fn("xla")(xs, ws), "bfloat16", f"matmul_ar {shape} {path}")
    assert not flux_jax.device_errors()


def _check_matmul_ar_fp8(one_gpu, shape, path):
    M, K, N = shape
    mesh = _mesh(one_gpu)
    rng = np.random.default_rng()
    recipe = flux_jax.Fp8(weight_scaling="column")
    x, w = _fp8_operands(rng, M, K, N)

    def fn(impl):
        body = functools.partial(flux_jax.matmul_ar, axis_name="tp", impl=impl, fp8=recipe)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P()))

    xs, ws = place(mesh, x, P(None, "tp")), place(mesh, w, P("tp", None))
    with flux_jax.config(fused_path=path):
        fused = fn("fused")
        sites = flux_jax.explain(fused, xs, ws)
        text = fused.lower(xs, ws).as_text()
        outs = [fused(xs, ws) for _ in range(3)]  # both parities of the workspace
    assert [site.plan.path for site in sites] == [path]
    want = {"overlap": "flux_jax_matmul_rs", "latency": "flux_jax_all_reduce", "decode": "flux_jax_matmul_ar"}[path]
    assert want in text and "f8E4M3FN" in text
    for out in outs:
        assert_matches(out, _fp8_exact(x, w, recipe), fn("xla")(xs, ws), "bfloat16", f"fp8 matmul_ar {shape} {path}")
    assert not flux_jax.device_errors()


@pytest.mark.parametrize("path", ["overlap", "latency"])
@pytest.mark.parametrize("shape", SHAPES + [(1024, 14336, 1024)], ids=lambda s: "x".join(map(str, s)))
def test_one_gpu_matmul_ar_fp8_matches_the_quantized_product(one_gpu, shape, path):
    """FP8 matmul_ar at tp = 1: overlap is the two-shot's first half, matmul_rs's FP8 overlap GEMM
    (no all_gather with one rank); latency is XLA's FP8 GEMM and our all_reduce."""
    _check_matmul_ar_fp8(one_gpu, shape, path)


DECODE_FP8_SHAPES = [
    (1, 1024, 2048),
    (64, 4096, 3072),
    (100, 784, 1544),
    (128, 2048, 4096),
    (16, 7168, 8192),
    (64, 14336, 4096),
]


@pytest.mark.parametrize("shape", DECODE_FP8_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_one_gpu_matmul_ar_fp8_decode_matches_the_quantized_product(one_gpu, shape):
    """FP8 matmul_ar's decode path at tp = 1: the FP8 decode GEMM (w's column scales along its
    tile's M, x's row scales along its N, predicated past the last row; x staged where its rows are
    not whole tiles; two blocks of rows above 64) with its all-reducing epilogue and no peer. The
    long-K shapes hold its accumulation to the twin's error."""
    _check_matmul_ar_fp8(one_gpu, shape, "decode")


def test_one_gpu_explain_names_the_paths(one_gpu):
    mesh = _mesh(one_gpu)
    x = jnp.ones((256, 512), jnp.bfloat16)
    w = jnp.ones((512, 512), jnp.bfloat16)
    f = jax.shard_map(
        functools.partial(flux_jax.ag_matmul, axis_name="tp", impl="fused"),
        mesh=mesh,
        in_specs=(P("tp", None), P(None, "tp")),
        out_specs=P(None, "tp"),
    )
    sites = flux_jax.explain(f, place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))
    assert len(sites) == 1 and sites[0].plan.fused and sites[0].problem.platform == "cuda"
    with flux_jax.config(fused_path="overlap"):
        text = str(flux_jax.explain(f, place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp")))[0])
    from flux_jax import _overlap_gemm

    # the overlap GEMM's instance is chosen for this GPU's SMs and DRAM bandwidth (the attributes)
    sms, dram_gbps = _overlap_gemm.local_gpu()
    assert sms == one_gpu[0].core_count and 2000 <= dram_gbps <= 10000, (sms, dram_gbps)
    gpu = f"{sms} SMs, {dram_gbps / 1000:.1f} TB/s DRAM"
    assert text.endswith(f"; overlap GEMM: cooperative 128x256 tiles, row tiles in groups of 8 ({gpu})"), text


@pytest.mark.parametrize("path", ["overlap", "latency"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_one_gpu_tp_axis_over_two_mesh_axes(one_gpu, op, path):
    """axis_name=("x", "y") over two size-1 mesh axes: the CUDA lowering's device table for a
    tuple of axes, forward and gradients against float32, on each path (the default picks the
    latency path for ag_matmul at this size)."""
    mesh = jax.sharding.Mesh(np.array(one_gpu[:1]).reshape(1, 1), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    axes = ("x", "y")
    rng = np.random.default_rng()
    x = random_array(rng, (2048, 1024), "bfloat16")
    w = random_array(rng, (1024, 1536), "bfloat16", scale=1 / np.sqrt(1024))
    ct = rng.standard_normal((2048, 1536)).astype(np.float32)

    def fn(impl):
        if op == "ag":
            body = functools.partial(flux_jax.ag_matmul, axis_name=axes, impl=impl)
            specs, out = (P(axes), P(None, axes)), P(None, axes)
        else:
            body = functools.partial(flux_jax.matmul_rs, axis_name=axes, impl=impl)
            specs, out = (P(None, axes), P(axes)), P(axes)
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out)

    fused, twin = fn("fused"), fn("xla")
    target = {
        "overlap": f"flux_jax_{'ag_matmul' if op == 'ag' else 'matmul_rs'}",
        "latency": f"flux_jax_{'all_gather' if op == 'ag' else 'reduce_scatter'}",
    }[path]
    x64, w64 = to64(x), to64(w)
    with flux_jax.config(fused_path=path):
        assert target in jax.jit(fused).lower(x, w).as_text()
        out = jax.jit(fused)(x, w)
        dx, dw = _grads(fused, x, w, ct)
    assert_matches(out, x64 @ w64, jax.jit(twin)(x, w), "bfloat16", f"{op} over {axes} ({path})")
    tdx, tdw = _grads(twin, x, w, ct)
    assert_matches(dx, ct @ w64.T, tdx, "bfloat16", f"{op} over {axes} ({path}): dx")
    assert_matches(dw, x64.T @ ct, tdw, "bfloat16", f"{op} over {axes} ({path}): dw")
    assert not flux_jax.device_errors()


@pytest.mark.parametrize("path", ["overlap", "latency"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_one_gpu_vmap_over_stacked_weights(one_gpu, op, path):
    """vmap over w (stacked experts): one fused call per weight in sequence (lax.map), on the GPU's
    handlers and workspace; values and gradients against the twin."""
    mesh = _mesh(one_gpu)
    rng = np.random.default_rng()
    e, m, k, n = 3, 512, 256, 384
    x = random_array(rng, (m, k), "bfloat16")
    w = random_array(rng, (e, k, n), "bfloat16", scale=1 / np.sqrt(k))
    fn = flux_jax.ag_matmul if op == "ag" else flux_jax.matmul_rs
    x_spec, w_spec = (P("tp"), P(None, None, "tp")) if op == "ag" else (P(None, "tp"), P(None, "tp"))
    out_spec = P(None, None, "tp") if op == "ag" else P(None, "tp")

    def run(impl):
        per_expert = functools.partial(fn, axis_name="tp", impl=impl)
        body = lambda x, w: jax.vmap(per_expert, in_axes=(None, 0))(x, w)  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec))

    xs, ws = place(mesh, x, x_spec), place(mesh, w, w_spec)
    target = {
        "overlap": f"flux_jax_{'ag_matmul' if op == 'ag' else 'matmul_rs'}",
        "latency": f"flux_jax_{'all_gather' if op == 'ag' else 'reduce_scatter'}",
    }[path]
    ct = rng.standard_normal((e, m, n)).astype(np.float32)
    with flux_jax.config(fused_path=path):
        fused = run("fused")
        assert target in fused.lower(xs, ws).as_text()
        out = fused(xs, ws)
        dx, dw = _grads(fused, xs, ws, ct)
    twin = run("xla")
    x64, w64 = to64(x), to64(w)
    assert_matches(out, np.einsum("mk,ekn->emn", x64, w64), twin(xs, ws), "bfloat16", f"vmap over w, {op} {path}")
    tdx, tdw = _grads(twin, xs, ws, ct)
    assert_matches(dx, np.einsum("emn,ekn->mk", ct, w64), tdx, "bfloat16", f"vmap over w, {op} {path}: dx")
    assert_matches(dw, np.einsum("mk,emn->ekn", x64, ct), tdw, "bfloat16", f"vmap over w, {op} {path}: dw")
    assert not flux_jax.device_errors()


def test_one_gpu_runs_the_cuda_branch_of_a_multi_platform_export(one_gpu):
    """jax.export(..., platforms=("cpu", "cuda")) of the ag -> tanh -> rs block, serialized, restored
    and run on the GPU: the CUDA branch's fused calls against the twin."""
    from jax import export

    mesh = _mesh(one_gpu)
    rng = np.random.default_rng()
    x = random_array(rng, (2048, 1024), "bfloat16")
    w1 = random_array(rng, (1024, 1536), "bfloat16", scale=1 / np.sqrt(1024))
    w2 = random_array(rng, (1536, 1024), "bfloat16", scale=1 / np.sqrt(1536))
    specs = (P("tp"), P(None, "tp"), P("tp"))

    def block(impl):
        def body(x, w1, w2):
            h = flux_jax.ag_matmul(x, w1, axis_name="tp", impl=impl)
            return flux_jax.matmul_rs(jnp.tanh(h), w2, axis_name="tp", impl=impl)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("tp")))

    args = [place(mesh, a, s) for a, s in zip((x, w1, w2), specs)]
    exported = export.export(
        block("fused"), platforms=("cpu", "cuda"), disabled_checks=flux_jax.export_disabled_checks()
    )(*args)
    restored = export.deserialize(exported.serialize())
    out = jax.jit(restored.call)(*args)
    ref = np.tanh(to64(x) @ to64(w1)) @ to64(w2)
    assert_matches(out, ref, block("xla")(*args), "bfloat16", "exported block on the GPU")
    assert not flux_jax.device_errors()
