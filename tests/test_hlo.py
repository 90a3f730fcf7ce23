"""The compiled fused program holds our custom calls and no XLA all-gather /
reduce-scatter, forward and backward; the twin's holds the XLA collectives."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import flux_jax

from helpers import cpu_mesh, place, random_array


def _compiled_text(op, impl, grad):
    mesh = cpu_mesh((8,), ("tp",))
    rng = np.random.default_rng()
    if op == "ag":
        specs, out_spec, fn = (P("tp", None), P(None, "tp")), P(None, "tp"), flux_jax.ag_matmul
    else:
        specs, out_spec, fn = (P(None, "tp"), P("tp", None)), P("tp", None), flux_jax.matmul_rs
    f = jax.shard_map(functools.partial(fn, axis_name="tp", impl=impl), mesh=mesh, in_specs=specs, out_specs=out_spec)
    if grad:
        g = jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1))
    else:
        g = f
    x = place(mesh, random_array(rng, (16, 32), "bfloat16"), specs[0])
    w = place(mesh, random_array(rng, (32, 16), "bfloat16"), specs[1])
    return jax.jit(g).lower(x, w).compile().as_text()


def _count(text, pattern):
    return len(re.findall(pattern, text))


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
def test_fused_hlo_has_custom_calls_and_no_xla_collectives(op, grad):
    text = _compiled_text(op, "fused", grad)
    assert _count(text, r"all-gather(-start)?\(") == 0, "fused program still has an XLA all-gather"
    assert _count(text, r"reduce-scatter(-start)?\(") == 0, "fused program still has an XLA reduce-scatter"
    own = "flux_jax_ag_matmul" if op == "ag" else "flux_jax_matmul_rs"
    other = "flux_jax_matmul_rs" if op == "ag" else "flux_jax_ag_matmul"
    assert _count(text, f'custom_call_target="{own}"') == 1
    # The backward of each op is the other fused op.
    assert _count(text, f'custom_call_target="{other}"') == (1 if grad else 0)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_twin_hlo_has_xla_collective(op):
    text = _compiled_text(op, "xla", grad=False)
    assert "flux_jax_" not in text
    pattern = r"all-gather(-start)?\(" if op == "ag" else r"reduce-scatter(-start)?\("
    assert _count(text, pattern) >= 1


def _custom_call_operands(text):
    """{target: operand count} of the flux_jax custom calls in a StableHLO module."""
    calls = re.findall(r"stablehlo\.custom_call @(flux_jax_\w+)\(([^)]*)\)", text)
    return {target: len([a for a in args.split(",") if a.strip()]) for target, args in calls}


@pytest.mark.skipif(not flux_jax._native.has_cuda_kernel("ag_matmul"), reason="built without CUDA kernels")
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("path", ["overlap", "latency"])
def test_gpu_lowering_drops_the_rank_operand(op, path):
    """The CPU handlers cross-check lax.axis_index; the CUDA handlers take no rank (on GPU it
    would be device memory, and computing it cost a convert kernel per call). Lowered for CUDA
    here, on CPU devices: only the shapes matter."""
    mesh = cpu_mesh((2,), ("tp",))
    rng = np.random.default_rng()
    if op == "ag":
        specs, out_spec, fn = (P("tp", None), P(None, "tp")), P(None, "tp"), flux_jax.ag_matmul
        fused, collective = "flux_jax_ag_matmul", "flux_jax_all_gather"
    else:
        specs, out_spec, fn = (P(None, "tp"), P("tp", None)), P("tp", None), flux_jax.matmul_rs
        fused, collective = "flux_jax_matmul_rs", "flux_jax_reduce_scatter"
    f = jax.jit(
        jax.shard_map(
            functools.partial(fn, axis_name="tp", impl="fused"), mesh=mesh, in_specs=specs, out_specs=out_spec
        )
    )
    x = place(mesh, random_array(rng, (64, 32), "bfloat16"), specs[0])
    w = place(mesh, random_array(rng, (32, 64), "bfloat16"), specs[1])
    with flux_jax.config(fused_path=path):
        lowered = {
            p: _custom_call_operands(f.trace(x, w).lower(lowering_platforms=(p,)).as_text()) for p in ("cpu", "cuda")
        }
    # CPU: the fused op (x, w, rank) or the collective (x, rank); CUDA: the same without rank.
    assert lowered["cpu"] == ({fused: 3} if path == "overlap" else {collective: 2})
    assert lowered["cuda"] == ({fused: 2} if path == "overlap" else {collective: 1})
