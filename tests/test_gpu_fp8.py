"""FP8 operands on GPUs: XLA's FP8 GEMM in the twin, and the fused latency composition (our
CUDA all_gather moving the e4m3 rows and their float32 scales, our reduce_scatter moving the FP8
GEMM's partial) against the FP8 twin, forward and backward.

One GPU (a mesh axis of size 1: the program, the FFI dtypes and XLA's FP8 GEMM) and two GPUs
(TP=2: the collectives' kernels); skipped without them unless FLUX_JAX_REQUIRE_GPU=1. The CPU
tests of the same contract, with the error bounds derived, are in test_fp8.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import flux_jax

from helpers import gpu_mesh, place, random_array, to64

# e4m3 keeps 3 mantissa bits: each operand moves by at most 2^-4 of itself (test_fp8.py derives
# the bound); the max-norm error of a product of random operands stays well inside 2 * 2^-4.
FP8_REL = 2 * 2.0**-4


def _fn(op, mesh, impl, **kw):
    if op == "ag":
        specs, out = (P("tp", None), P(None, "tp")), P(None, "tp")
        body = functools.partial(flux_jax.ag_matmul, axis_name="tp", impl=impl, fp8=True, **kw)
    else:
        specs, out = (P(None, "tp"), P("tp", None)), P("tp", None) if op == "rs" else P()
        fn = flux_jax.matmul_rs if op == "rs" else flux_jax.matmul_ar
        body = functools.partial(fn, axis_name="tp", impl=impl, fp8=True, **kw)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out)), specs


def _rel(a, b):
    a, b = to64(a), to64(b)
    assert np.all(np.isfinite(a)), "NaN/inf: an element was not written (poisoned)"
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _check(gpus, tp, op, shape, dtype="bfloat16"):
    M, K, N = shape
    mesh = gpu_mesh(gpus, (tp,))
    rng = np.random.default_rng()
    x, w = random_array(rng, (M, K), dtype), random_array(rng, (K, N), dtype, scale=1 / np.sqrt(K))
    fused, specs = _fn(op, mesh, "fused")
    twin, _ = _fn(op, mesh, "xla")
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    hlo = fused.lower(xs, ws).as_text()
    assert f"custom_call @flux_jax_{'all_gather' if op == 'ag' else 'reduce_scatter'}" in hlo
    out, twin_out = fused(xs, ws), twin(xs, ws)
    assert out.dtype == x.dtype
    ref = to64(x) @ to64(w)
    err = _rel(out, ref)
    assert 2.0**-9 < err < FP8_REL, f"{op} {shape}: error {err:.3e} vs the exact product"
    assert _rel(out, twin_out) < 2 * 2.0**-8, f"{op} {shape}: fused vs FP8 twin"
    assert not flux_jax.device_errors()


def test_twin_gemm_is_xlas_fp8_gemm(one_gpu):
    """The FP8 twin's dot on e4m3 operands compiles to cuBLASLt's FP8 GEMM on Hopper."""
    mesh = gpu_mesh(one_gpu, (1,))
    rng = np.random.default_rng()
    x, w = random_array(rng, (512, 1024), "bfloat16"), random_array(rng, (1024, 768), "bfloat16", 1 / 32)
    twin, specs = _fn("ag", mesh, "xla")
    args = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    compiled = twin.lower(*args).compile().as_text()
    assert "f8" in "".join(line for line in compiled.splitlines() if "custom-call" in line and "cublas" in line), (
        "no FP8 cuBLAS GEMM in the compiled twin"
    )
    assert 2.0**-9 < _rel(twin(*args), to64(x) @ to64(w)) < FP8_REL


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_fused_matches_twin_on_one_gpu(one_gpu, op):
    _check(one_gpu, 1, op, (256, 1024, 512))


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize(
    "shape", [(4096, 2048, 4096), (96, 8192, 1024), (2, 64, 16), (6, 1040, 528)], ids=lambda s: "x".join(map(str, s))
)
def test_fused_matches_twin(gpus, op, shape):
    """TP=2; rows per rank 1 and 3 make the scales' all_gather pad them to 16 bytes."""
    _check(gpus, 2, op, shape)


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
@pytest.mark.parametrize("shape", [(64, 4096, 2048), (104, 1568, 784)], ids=lambda s: "x".join(map(str, s)))
def test_fp8_decode_path_matches_twin(gpus, op, shape):
    """TP=2, fused_path="decode": ag_matmul's push kernel moves the e4m3 rows and their scales,
    its FP8 decode GEMM scales them in its epilogue; matmul_rs's (matmul_ar's) FP8 decode GEMM
    scales and reduce-scatters (all-reduces) each tile in its epilogue; no collective besides."""
    M, K, N = shape
    mesh = gpu_mesh(gpus, (2,))
    rng = np.random.default_rng()
    x, w = random_array(rng, (M, K), "bfloat16"), random_array(rng, (K, N), "bfloat16", scale=1 / np.sqrt(K))
    with flux_jax.config(fused_path="decode"):
        fused, specs = _fn(op, mesh, "fused")
        xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
        hlo = fused.lower(xs, ws).as_text()
        outs = [fused(xs, ws) for _ in range(3)]  # both parities of the workspace
    assert f"custom_call @flux_jax_{ {'ag': 'ag_matmul', 'rs': 'matmul_rs', 'ar': 'matmul_ar'}[op] }" in hlo
    assert not any(f"@flux_jax_{c}" in hlo for c in ("all_gather", "reduce_scatter", "all_reduce"))
    twin, _ = _fn(op, mesh, "xla")
    twin_out = twin(xs, ws)
    for out in outs:
        assert 2.0**-9 < _rel(out, to64(x) @ to64(w)) < FP8_REL
        assert _rel(out, twin_out) < 2 * 2.0**-8, f"{op} {shape}: fused vs FP8 twin"
    assert not flux_jax.device_errors()


def test_gradients_match_the_fp8_twin(gpus):
    """ag -> tanh -> rs at TP=2: the backward's FP8 collectives (e5m2 rows of dy) on the GPU."""
    mesh = gpu_mesh(gpus, (2,))
    rng = np.random.default_rng()
    s, d, f = 512, 1024, 2048
    x = random_array(rng, (s, d), "bfloat16")
    w1, w2 = random_array(rng, (d, f), "bfloat16", d**-0.5), random_array(rng, (f, d), "bfloat16", f**-0.5)
    ct = random_array(rng, (s, d), jnp.float32)
    specs = (P("tp", None), P(None, "tp"), P("tp", None), P("tp", None))
    args = tuple(place(mesh, a, sp) for a, sp in zip((x, w1, w2, ct), specs))

    def grads(impl, fp8):
        def body(x, w1, w2, ct):
            h = flux_jax.ag_matmul(x, w1, axis_name="tp", impl=impl, fp8=fp8)
            y = flux_jax.matmul_rs(jnp.tanh(h), w2, axis_name="tp", impl=impl, fp8=fp8)
            return jax.lax.psum(jnp.sum(y.astype(jnp.float32) * ct), "tp")

        loss = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)

    fused, twin, plain = grads("fused", True), grads("xla", True), grads("xla", None)
    for name, a, b, c in zip(("dx", "dw1", "dw2"), fused, twin, plain):
        assert _rel(a, b) < 4 * 2.0**-8, f"{name}: fused vs FP8 twin"
        rel = float(np.linalg.norm(to64(a) - to64(c)) / np.linalg.norm(to64(c)))
        assert rel < 0.25, f"{name}: relative error {rel:.3f} vs the unquantized gradient"
    assert not flux_jax.device_errors()
