"""The latency path (Config.fused_path="latency"): our collective custom call + XLA's GEMM.

On CPU it runs the same channel protocol as the fused ops, so the Python composition (lowering,
manual-axis types, autodiff through both ops, the collective's reduction order) is tested here;
the CUDA kernels are tested in test_gpu_fused.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import flux_jax

from helpers import DTYPES, ag_specs, assert_matches, cpu_mesh, place, random_array, rs_specs, to64


def _fn(op, mesh, ndim, impl="fused", tp_axis="tp"):
    """A fresh jit(shard_map(op)): the configuration is read when it is traced."""
    specs = ag_specs if op == "ag" else rs_specs
    x_spec, w_spec, out_spec = specs(mesh, tp_axis, ndim)
    body = functools.partial(flux_jax.ag_matmul if op == "ag" else flux_jax.matmul_rs, axis_name=tp_axis, impl=impl)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)), (x_spec, w_spec)


def _operands(rng, op, tp, m_local, k, n, dtype, mid=()):
    if op == "ag":
        return random_array(rng, (tp * m_local, *mid, k), dtype), random_array(rng, (k, tp * n), dtype)
    return random_array(rng, (tp * m_local, *mid, tp * k), dtype), random_array(rng, (tp * k, n), dtype)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("m_local,k,n", [(1, 24, 8), (5, 40, 16)])
def test_matches_oracle(op, dtype_name, m_local, k, n):
    rng = np.random.default_rng()
    mesh = cpu_mesh((8,), ("tp",))
    x, w = _operands(rng, op, 8, m_local, k, n, DTYPES[dtype_name])
    with flux_jax.config(fused_path="latency", debug_poison_outputs=True):
        fn, (x_spec, w_spec) = _fn(op, mesh, 2)
        xs, ws = place(mesh, x, x_spec), place(mesh, w, w_spec)
        out = fn(xs, ws)
        hlo = fn.lower(xs, ws).as_text()
    twin, _ = _fn(op, mesh, 2, "xla")
    target = "flux_jax_all_gather" if op == "ag" else "flux_jax_reduce_scatter"
    assert f"custom_call @{target}" in hlo and "flux_jax_ag_matmul" not in hlo and "flux_jax_matmul_rs" not in hlo
    ref = np.tensordot(to64(x), to64(w), axes=1)
    assert_matches(out, ref, twin(xs, ws), dtype_name, f"{op} latency path")


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_2d_mesh_with_middle_dims(op, axis_type):
    rng = np.random.default_rng()
    mesh = cpu_mesh((2, 4), ("dp", "tp"), axis_type)
    x, w = _operands(rng, op, 4, 3, 16, 8, jnp.bfloat16, mid=(4,))
    with flux_jax.config(fused_path="latency"):
        fn, (x_spec, w_spec) = _fn(op, mesh, 3)
        xs, ws = place(mesh, x, x_spec), place(mesh, w, w_spec)
        out = fn(xs, ws)
    twin, _ = _fn(op, mesh, 3, "xla")
    assert_matches(out, np.tensordot(to64(x), to64(w), axes=1), twin(xs, ws), "bfloat16", f"{op} 2-D mesh")


def test_gradients_and_return_gathered_match_twin():
    """Backward of each op runs the other op on the latency path too."""
    rng = np.random.default_rng()
    mesh = cpu_mesh((4, 2), ("dp", "tp"))
    x = random_array(rng, (8, 16), jnp.float32)
    w1 = random_array(rng, (16, 24), jnp.float32)
    w2 = random_array(rng, (24, 16), jnp.float32)

    def loss(impl, x, w1, w2):
        def body(x, w1, w2):
            h, gathered = flux_jax.ag_matmul(x, w1, axis_name="tp", impl=impl, return_gathered=True)
            y = flux_jax.matmul_rs(jnp.tanh(h), w2, axis_name="tp", impl=impl)
            return jax.lax.psum(jnp.sum(y * y) + 1e-3 * jnp.sum(gathered), "tp")

        f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp", None)), out_specs=P())
        return f(x, w1, w2)

    args = (place(mesh, x, P("tp")), place(mesh, w1, P(None, "tp")), place(mesh, w2, P("tp", None)))
    with flux_jax.config(fused_path="latency"):
        grad_fn = jax.jit(jax.value_and_grad(functools.partial(loss, "fused"), argnums=(0, 1, 2)))
        hlo = grad_fn.lower(*args).as_text()
        got = grad_fn(*args)
    want = jax.jit(jax.value_and_grad(functools.partial(loss, "xla"), argnums=(0, 1, 2)))(*args)
    assert hlo.count("custom_call @flux_jax_all_gather") >= 2  # fwd ag + bwd of rs
    assert hlo.count("custom_call @flux_jax_reduce_scatter") >= 2  # fwd rs + bwd of ag
    for g, t in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(t), rtol=2e-4, atol=2e-4)


def test_reduce_scatter_is_bitwise_reproducible():
    rng = np.random.default_rng()
    mesh = cpu_mesh((8,), ("tp",))
    x, w = _operands(rng, "rs", 8, 4, 32, 16, jnp.bfloat16)
    with flux_jax.config(fused_path="latency", debug_jitter_us=200):
        fn, (x_spec, w_spec) = _fn("rs", mesh, 2)
        xs, ws = place(mesh, x, x_spec), place(mesh, w, w_spec)
        first = np.asarray(fn(xs, ws))
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(fn(xs, ws)), first)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_missing_peer_times_out_with_diagnostic(op):
    rng = np.random.default_rng()
    mesh = cpu_mesh((8,), ("tp",))
    x, w = _operands(rng, op, 8, 2, 16, 8, jnp.float32)
    with flux_jax.config(fused_path="latency", timeout_s=0.3, debug_drop_rank=5):
        fn, (x_spec, w_spec) = _fn(op, mesh, 2)
        name = "all_gather" if op == "ag" else "reduce_scatter"
        with pytest.raises(Exception, match=rf"{name}.* timed out after 0.3 s .*from rank 5 \(epoch 1"):
            np.asarray(fn(place(mesh, x, x_spec), place(mesh, w, w_spec)))
    flux_jax.reset()


def test_config_rejects_unknown_path():
    with pytest.raises(ValueError, match="fused_path"):
        flux_jax.Config(fused_path="fast")
