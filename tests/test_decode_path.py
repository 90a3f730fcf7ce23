"""The decode path (Config.fused_path="decode"): which calls take it, and that they compute the op.

On GPU ag_matmul's decode path pushes the rows with SM stores while a GEMM in the weight's
orientation streams the weight (cpp/kernels/cuda/ag_matmul_decode.cu), and matmul_rs's runs the
same GEMM with an epilogue that reduce-scatters each output tile over NVLink
(matmul_rs_decode.cu); the kernels are tested in test_gpu_decode.py. Here: the lowering (for
CUDA, on CPU devices: only shapes matter) picks the decode kernels exactly where they exist and
the latency path elsewhere, and on CPU, whose handler ignores the attribute, the results and
gradients are the op's.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import flux_jax
from flux_jax import _config, _plan

from helpers import assert_matches, cpu_mesh, place, random_array, to64

needs_cuda_build = pytest.mark.skipif(
    not flux_jax._native.has_cuda_kernel("ag_matmul"), reason="built without CUDA kernels"
)


def _lowered_for_cuda(op, m, k, n, dtype, tp=2, grad=False, path="decode"):
    """StableHLO of the op lowered for CUDA (global shapes m x k @ k x n, TP = tp)."""
    mesh = cpu_mesh((tp,), ("tp",))
    rng = np.random.default_rng(0)
    if op == "ag":
        specs, out_spec, fn = (P("tp", None), P(None, "tp")), P(None, "tp"), flux_jax.ag_matmul
    else:
        specs, out_spec, fn = (P(None, "tp"), P("tp", None)), P("tp", None), flux_jax.matmul_rs
    op_fn = jax.shard_map(
        functools.partial(fn, axis_name="tp", impl="fused"), mesh=mesh, in_specs=specs, out_specs=out_spec
    )
    f = op_fn
    if grad:
        f = jax.grad(lambda x, w: jnp.sum(op_fn(x, w).astype(jnp.float32) ** 2), argnums=(0, 1))
    if m * k + k * n > 1 << 22:  # only shapes matter: no data for the large ones
        x = jax.ShapeDtypeStruct((m, k), jnp.dtype(dtype), sharding=jax.NamedSharding(mesh, specs[0]))
        w = jax.ShapeDtypeStruct((k, n), jnp.dtype(dtype), sharding=jax.NamedSharding(mesh, specs[1]))
    else:
        x = place(mesh, random_array(rng, (m, k), dtype), specs[0])
        w = place(mesh, random_array(rng, (k, n), dtype), specs[1])
    with flux_jax.config(fused_path=path):
        return jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()


def _decode_calls(text, op="ag"):
    target = "flux_jax_ag_matmul" if op == "ag" else "flux_jax_matmul_rs"
    return len(re.findall(rf"custom_call @{target}\(.*path = 1 : i32", text))


@needs_cuda_build
@pytest.mark.parametrize("m", [2, 64, 128, 130, 256])
def test_decode_lowering_where_the_kernels_exist(m):
    text = _lowered_for_cuda("ag", m, 64, 32, "bfloat16")
    assert _decode_calls(text) == 1, text
    assert "flux_jax_all_gather" not in text


@needs_cuda_build
@pytest.mark.parametrize("m", [2, 8, 64, 128])
def test_rs_decode_lowering_where_the_kernels_exist(m):
    text = _lowered_for_cuda("rs", m, 64, 32, "bfloat16")
    assert _decode_calls(text, "rs") == 1, text
    assert "flux_jax_reduce_scatter" not in text and "dot_general" not in text


@needs_cuda_build
@pytest.mark.parametrize(
    "op, m, dtype, tp",
    [
        ("ag", 264, "bfloat16", 2),  # more rows than two of the widest decode tiles
        ("ag", 64, "float16", 2),  # no float16 instance
        ("rs", 256, "bfloat16", 2),
        ("rs", 64, "float16", 2),
    ],
)
def test_latency_lowering_elsewhere(op, m, dtype, tp):
    text = _lowered_for_cuda(op, m, 64, 32 * tp, dtype, tp=tp)
    assert _decode_calls(text, op) == 0
    assert ("flux_jax_all_gather" if op == "ag" else "flux_jax_reduce_scatter") in text


@needs_cuda_build
def test_float32_on_cuda_is_a_clear_error_for_impl_fused():
    with pytest.raises(flux_jax.FusedUnavailableError, match="take bfloat16 or float16 inputs, not float32"):
        _lowered_for_cuda("ag", 64, 64, 64, "float32")


@needs_cuda_build
def test_backward_of_decode_ag_takes_the_latency_path():
    """The backward's matmul_rs (transposed weight) has no decode kernel: the latency path."""
    text = _lowered_for_cuda("ag", 64, 64, 32, "bfloat16", grad=True)
    assert _decode_calls(text) == 1
    assert _decode_calls(text, "rs") == 0
    assert "flux_jax_reduce_scatter" in text


@needs_cuda_build
def test_backward_of_decode_rs_takes_the_latency_path():
    """The backward's ag_matmul (transposed weight) has no decode kernel: the latency path."""
    text = _lowered_for_cuda("rs", 64, 64, 32, "bfloat16", grad=True)
    assert _decode_calls(text, "rs") == 1
    assert _decode_calls(text, "ag") == 0
    assert "flux_jax_all_gather" in text


@needs_cuda_build
def test_auto_takes_the_decode_path_where_it_measured_faster():
    """impl="fused" with fused_path="auto", lowered for a GPU from a host without one (the built-in
    H200 TP=2 table): decode for LLaMA-3 8B qkv at 64 rows, the latency path for its gate+up."""
    assert _decode_calls(_lowered_for_cuda("ag", 64, 4096, 2 * 3072, "bfloat16", path="auto")) == 1
    wide = _lowered_for_cuda("ag", 64, 4096, 2 * 14336, "bfloat16", path="auto")
    assert _decode_calls(wide) == 0 and "flux_jax_all_gather" in wide


@needs_cuda_build
def test_auto_takes_the_rs_decode_path_where_it_measured_faster():
    """matmul_rs: decode for the 8B out-projection at 64 and 128 rows (a per-rank weight of 8M
    elements), the latency path for the 70B out-projection at 128 rows (33.6M)."""
    assert _decode_calls(_lowered_for_cuda("rs", 64, 2 * 2048, 4096, "bfloat16", path="auto"), "rs") == 1
    assert _decode_calls(_lowered_for_cuda("rs", 128, 2 * 2048, 4096, "bfloat16", path="auto"), "rs") == 1
    big = _lowered_for_cuda("rs", 128, 2 * 4096, 8192, "bfloat16", path="auto")
    assert _decode_calls(big, "rs") == 0 and "flux_jax_reduce_scatter" in big


def _supported(op, tp, rows, k, n, transpose_w=False, dtype=jnp.bfloat16):
    problem = _plan.Problem(op, rows, k, n, np.dtype(dtype), tp, "cuda", transpose_w)
    return _plan.decode_supported(problem)


# (op, tp, rows, k, n, other Problem fields, whether the decode kernels serve it)
_DECODE_SUPPORT = [
    ("ag_matmul", 2, 128, 8192, 4096, {}, True),
    ("ag_matmul", 8, 128, 8192, 4096, {}, True),
    ("ag_matmul", 2, 130, 8192, 4096, {}, True),  # two row tiles
    ("ag_matmul", 2, 256, 8192, 4096, {}, True),
    ("ag_matmul", 2, 258, 8192, 4096, {}, False),
    ("ag_matmul", 2, 128, 8192, 4096, {"transpose_w": True}, False),
    ("ag_matmul", 1, 64, 8192, 4096, {}, False),
    ("ag_matmul", 16, 128, 8192, 4096, {}, False),  # more ranks than it serves
    # matmul_rs: x holds all rows (its K is sharded); n up to its low-latency area's limit
    ("matmul_rs", 2, 128, 4096, 8192, {}, True),
    ("matmul_rs", 8, 8, 4096, 32768, {}, True),
    ("matmul_rs", 2, 130, 4096, 8192, {}, False),
    ("matmul_rs", 2, 64, 4096, 32776, {}, False),
    ("matmul_rs", 2, 64, 4096, 8192, {"transpose_w": True}, False),
    ("matmul_rs", 2, 64, 4096, 8192, {"dtype": jnp.float16}, False),
    # matmul_ar: any rows up to 128 (no divisibility), tp = 1 too; tp x rows x N <= 2^22
    ("matmul_ar", 1, 64, 4096, 8192, {}, True),
    ("matmul_ar", 2, 1, 4096, 8192, {}, True),
    ("matmul_ar", 3, 127, 4096, 8192, {}, True),
    ("matmul_ar", 8, 64, 4096, 8192, {}, True),
    ("matmul_ar", 8, 128, 4096, 8192, {}, False),
    ("matmul_ar", 2, 129, 4096, 8192, {}, False),
    ("matmul_ar", 2, 64, 4096, 8192, {"transpose_w": True}, False),
    ("matmul_ar", 2, 64, 4096, 8192, {"dtype": jnp.float16}, False),
]


@pytest.mark.parametrize("op, tp, rows, k, n, kw, served", _DECODE_SUPPORT)
def test_decode_supported_matches_the_kernels(op, tp, rows, k, n, kw, served):
    assert _supported(op, tp, rows, k, n, **kw) == served


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
@pytest.mark.parametrize("m_local", [1, 5, 16])
def test_cpu_results_and_gradients_with_decode_config(op, m_local):
    """The configuration reaches the CPU handler (which ignores it): the op and its VJP unchanged."""
    rng = np.random.default_rng()
    mesh = cpu_mesh((8,), ("tp",))
    if op == "ag":
        x = random_array(rng, (8 * m_local, 24), jnp.bfloat16)
        w = random_array(rng, (24, 64), jnp.bfloat16)
        fn_, specs, out_spec = flux_jax.ag_matmul, (P("tp", None), P(None, "tp")), P(None, "tp")
    elif op == "rs":
        x = random_array(rng, (8 * m_local, 64), jnp.bfloat16)
        w = random_array(rng, (64, 24), jnp.bfloat16)
        fn_, specs, out_spec = flux_jax.matmul_rs, (P(None, "tp"), P("tp", None)), P("tp", None)
    else:  # matmul_ar: any row count, the output replicated
        x = random_array(rng, (m_local, 64), jnp.bfloat16)
        w = random_array(rng, (64, 24), jnp.bfloat16)
        fn_, specs, out_spec = flux_jax.matmul_ar, (P(None, "tp"), P("tp", None)), P()

    def fn(impl):
        body = functools.partial(fn_, axis_name="tp", impl=impl)
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec)

    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    ct = jnp.asarray(rng.standard_normal((x.shape[0], w.shape[1])), jnp.float32)

    def grads(impl):
        loss = lambda a, b: jnp.sum(fn(impl)(a, b).astype(jnp.float32) * ct)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, ws)

    with flux_jax.config(fused_path="decode", debug_poison_outputs=True):
        out = jax.jit(fn("fused"))(xs, ws)
        dx, dw = grads("fused")
    assert_matches(out, to64(x) @ to64(w), jax.jit(fn("xla"))(xs, ws), "bfloat16", f"{op}, decode config")
    tdx, tdw = grads("xla")
    ct64 = np.asarray(ct, np.float64)
    assert_matches(dx, ct64 @ to64(w).T, tdx, "bfloat16", f"{op} dx, decode config")
    assert_matches(dw, to64(x).T @ ct64, tdw, "bfloat16", f"{op} dw, decode config")


def test_config_validates_decode_settings():
    assert flux_jax.Config(fused_path="decode").fused_path == "decode"
    assert _config.GpuTuning(decode_early_launch=0).decode_early_launch == 0
    with pytest.raises(ValueError, match="decode_early_launch"):
        _config.GpuTuning(decode_early_launch=2)
    with pytest.raises(ValueError, match='"decode"'):
        flux_jax.Config(fused_path="decoder")
