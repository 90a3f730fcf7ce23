"""The decode path (Config.fused_path="decode"): which calls take it, and that they compute the op.

On GPU ag_matmul's decode path pushes the rows with SM stores while a GEMM in the weight's
orientation streams the weight (cpp/kernels/cuda/ag_matmul_decode.cu); the kernels are tested in
test_gpu_decode.py. Here: the lowering (for CUDA, on CPU devices: only shapes matter) picks the
decode kernels exactly where they exist and the latency path elsewhere, and on CPU, whose handler
ignores the attribute, the results and gradients are the op's.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import flux_jax
from flux_jax import _lowering
from helpers import assert_matches, cpu_mesh, place, random_array, to64

needs_cuda_build = pytest.mark.skipif(not flux_jax._native.has_cuda_kernel("ag_matmul"),
                                      reason="built without CUDA kernels")


def _lowered_for_cuda(op, m, k, n, dtype, tp=2, grad=False, path="decode"):
    """StableHLO of the op lowered for CUDA (global shapes m x k @ k x n, TP = tp)."""
    mesh = cpu_mesh((tp,), ("tp",))
    rng = np.random.default_rng(0)
    if op == "ag":
        specs, out_spec, fn = (P("tp", None), P(None, "tp")), P(None, "tp"), flux_jax.ag_matmul
    else:
        specs, out_spec, fn = (P(None, "tp"), P("tp", None)), P("tp", None), flux_jax.matmul_rs
    op_fn = jax.shard_map(functools.partial(fn, axis_name="tp", impl="fused"), mesh=mesh, in_specs=specs,
                          out_specs=out_spec)
    f = op_fn
    if grad:
        f = jax.grad(lambda x, w: jnp.sum(op_fn(x, w).astype(jnp.float32) ** 2), argnums=(0, 1))
    x = place(mesh, random_array(rng, (m, k), dtype), specs[0])
    w = place(mesh, random_array(rng, (k, n), dtype), specs[1])
    with flux_jax.config(fused_path=path):
        return jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()


def _decode_calls(text):
    return len(re.findall(r"custom_call @flux_jax_ag_matmul\(.*decode_path = true", text))


@needs_cuda_build
@pytest.mark.parametrize("m", [2, 64, 128])
def test_decode_lowering_where_the_kernels_exist(m):
    text = _lowered_for_cuda("ag", m, 64, 32, "bfloat16")
    assert _decode_calls(text) == 1, text
    assert "flux_jax_all_gather" not in text


@needs_cuda_build
@pytest.mark.parametrize("op, m, dtype, tp", [
    ("ag", 256, "bfloat16", 2),     # more rows than the widest decode tile
    ("ag", 64, "float16", 2),       # no float16 instance
    ("ag", 64, "float32", 2),
    ("rs", 64, "bfloat16", 2),      # no decode kernel for matmul_rs yet
])
def test_latency_lowering_elsewhere(op, m, dtype, tp):
    text = _lowered_for_cuda(op, m, 64, 32 * tp, dtype, tp=tp)
    assert _decode_calls(text) == 0
    assert ("flux_jax_all_gather" if op == "ag" else "flux_jax_reduce_scatter") in text


@needs_cuda_build
def test_backward_of_decode_ag_takes_the_latency_path():
    """The backward's matmul_rs (transposed weight) has no decode kernel: the latency path."""
    text = _lowered_for_cuda("ag", 64, 64, 32, "bfloat16", grad=True)
    assert _decode_calls(text) == 1
    assert "flux_jax_reduce_scatter" in text


@needs_cuda_build
def test_auto_takes_the_decode_path_where_it_measured_faster():
    """impl="fused" with fused_path="auto": decode at <= 128 rows and a per-rank n <= 8192 (bf16),
    the latency path for a wider weight (_heuristics.py, s14)."""
    assert _decode_calls(_lowered_for_cuda("ag", 64, 64, 2 * 4096, "bfloat16", path="auto")) == 1
    wide = _lowered_for_cuda("ag", 64, 64, 2 * 14336, "bfloat16", path="auto")
    assert _decode_calls(wide) == 0 and "flux_jax_all_gather" in wide


def test_decode_supported_matches_the_kernels():
    ag, bf16 = "flux_jax_ag_matmul", jnp.bfloat16
    assert _lowering.decode_supported(ag, 2, (64, 8192), False, bf16)
    assert _lowering.decode_supported(ag, 8, (16, 8192), False, bf16)
    assert not _lowering.decode_supported(ag, 2, (65, 8192), False, bf16)  # 130 rows
    assert not _lowering.decode_supported(ag, 2, (64, 8192), True, bf16)
    assert not _lowering.decode_supported(ag, 1, (64, 8192), False, bf16)
    assert not _lowering.decode_supported(ag, 16, (8, 8192), False, bf16)  # more ranks than it serves
    assert not _lowering.decode_supported("flux_jax_matmul_rs", 2, (64, 8192), False, bf16)


@pytest.mark.parametrize("m_local", [1, 5, 16])
def test_cpu_results_and_gradients_with_decode_config(m_local):
    """The configuration reaches the CPU handler (which ignores it): the op and its VJP unchanged."""
    rng = np.random.default_rng()
    mesh = cpu_mesh((8,), ("tp",))
    x = random_array(rng, (8 * m_local, 24), jnp.bfloat16)
    w = random_array(rng, (24, 64), jnp.bfloat16)

    def fn(impl):
        body = functools.partial(flux_jax.ag_matmul, axis_name="tp", impl=impl)
        return jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"))

    xs, ws = place(mesh, x, P("tp", None)), place(mesh, w, P(None, "tp"))
    with flux_jax.config(fused_path="decode", debug_poison_outputs=True):
        fused = jax.jit(fn("fused"))
        out = fused(xs, ws)
        grads = jax.jit(jax.grad(lambda a, b: jnp.sum(fn("fused")(a, b).astype(jnp.float32) ** 2),
                                 argnums=(0, 1)))(xs, ws)
    twin = jax.jit(fn("xla"))
    assert_matches(out, to64(x) @ to64(w), twin(xs, ws), "bfloat16", "ag, decode config")
    want = jax.jit(jax.grad(lambda a, b: jnp.sum(fn("xla")(a, b).astype(jnp.float32) ** 2), argnums=(0, 1)))(xs, ws)
    for g, t in zip(grads, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(t, np.float32), rtol=2e-2, atol=2e-2)


def test_config_validates_decode_settings():
    assert flux_jax.Config(fused_path="decode").fused_path == "decode"
    assert flux_jax.Config(gpu_decode_early_launch=0).gpu_decode_early_launch == 0
    with pytest.raises(ValueError, match="gpu_decode_early_launch"):
        flux_jax.Config(gpu_decode_early_launch=2)
    with pytest.raises(ValueError, match='"decode"'):
        flux_jax.Config(fused_path="decoder")
