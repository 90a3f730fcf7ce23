"""A TP axis over several mesh axes (`axis_name=("x", "y")`): every op runs fused over their
devices, ranks row-major in the order named (as lax.axis_index counts), and matches its twin and
the float32 reference, forward and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import flux_jax

from helpers import assert_matches, cpu_mesh, random_array, to64

AXES = [("x", "y"), ("y", "x")]


def _op(op, axes, impl, fp8=None):
    """(per-shard fn, in_specs, out_spec, global reference) of `op` with its TP axis over `axes`."""
    kw = dict(axis_name=axes, impl=impl, fp8=fp8)
    if op == "ag":
        return functools.partial(flux_jax.ag_matmul, **kw), (P(axes), P(None, axes)), P(None, axes)
    if op == "rs":
        return functools.partial(flux_jax.matmul_rs, **kw), (P(None, axes), P(axes)), P(axes)
    if op == "ar":
        return functools.partial(flux_jax.matmul_ar, **kw), (P(None, axes), P(axes)), P()
    return functools.partial(flux_jax.column_matmul, **kw), (P(), P(None, axes)), P(None, axes)


def _run(op, axes, impl, x, w, ct, mesh):
    fn, in_specs, out_spec = _op(op, axes, impl)
    f = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec)
    out = jax.jit(f)(x, w)
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * ct), argnums=(0, 1)))(x, w)
    return out, *grads


@pytest.mark.parametrize("axes", AXES, ids=lambda a: "-".join(a))
@pytest.mark.parametrize("op", ["ag", "rs", "ar", "column"])
def test_tp_over_two_mesh_axes_matches_twin_and_reference(op, axes):
    rng = np.random.default_rng()
    mesh = cpu_mesh((2, 4), ("x", "y"), AxisType.Auto)
    M, K, N = 32, 64, 48
    x, w = random_array(rng, (M, K), "float32"), random_array(rng, (K, N), "float32")
    ct = rng.standard_normal((M, N)).astype(np.float32)
    x64, w64 = to64(x), to64(w)
    want = (x64 @ w64, ct @ w64.T, x64.T @ ct)
    got = _run(op, axes, "fused", x, w, ct, mesh)
    twin = _run(op, axes, "xla", x, w, ct, mesh)
    for name, g, t, r in zip(("out", "dx", "dw"), got, twin, want):
        assert_matches(g, r, t, "float32", f"{op} over {axes}: {name}")


def test_tp_over_two_axes_with_a_third_left_to_the_partitioner():
    """A 3-D mesh: the TP axis over ("x", "y") in a shard_map that leaves "dp" automatic."""
    rng = np.random.default_rng()
    mesh = cpu_mesh((2, 2, 2), ("dp", "x", "y"), AxisType.Auto)
    axes = ("x", "y")
    x, w = random_array(rng, (16, 4, 32), "float32"), random_array(rng, (32, 24), "float32")

    def body(x, w):
        return flux_jax.ag_matmul(x, w, axis_name=axes, impl="fused")

    with jax.set_mesh(mesh):
        f = jax.shard_map(body, in_specs=(P(axes), P(None, axes)), out_specs=P(None, None, axes), axis_names=set(axes))
        xs = jax.device_put(x, jax.NamedSharding(mesh, P(axes, "dp")))
        out = jax.jit(f)(xs, w)
        hlo = jax.jit(f).lower(xs, w).as_text()
    assert "flux_jax_ag_matmul" in hlo
    ref = np.einsum("mbk,kn->mbn", to64(x), to64(w))
    assert_matches(out, ref, jnp.einsum("mbk,kn->mbn", x, w), "float32", "ag over (x, y), dp automatic")


def test_fp8_over_two_mesh_axes_equals_its_twin():
    rng = np.random.default_rng()
    mesh = cpu_mesh((2, 4), ("x", "y"), AxisType.Auto)
    axes = ("y", "x")
    x, w = random_array(rng, (64, 64), "bfloat16"), random_array(rng, (64, 32), "bfloat16")
    outs = {}
    for impl in ("fused", "xla"):
        fn, in_specs, out_spec = _op("ag", axes, impl, fp8=True)
        outs[impl] = to64(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec))(x, w))
    assert np.all(np.isfinite(outs["fused"]))
    np.testing.assert_allclose(outs["fused"], outs["xla"], rtol=2e-2, atol=2e-2)


def test_axis_name_checks():
    mesh = cpu_mesh((2, 4), ("x", "y"), AxisType.Auto)
    x, w = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16), jnp.ones((16, 8))

    def call(axis_name, spec_axes=("x", "y")):
        f = jax.shard_map(
            functools.partial(flux_jax.ag_matmul, axis_name=axis_name),
            mesh=mesh,
            in_specs=(P(spec_axes), P(None, spec_axes)),
            out_specs=P(None, spec_axes),
        )
        return jax.jit(f)(x, w)

    with pytest.raises(ValueError, match="distinct"):
        call(("x", "x"))
    with pytest.raises(ValueError, match="a tuple of str"):
        call(())
    with pytest.raises(ValueError, match="a tuple of str"):
        call(["x", "y"])  # a list is not hashable: lax's collectives take a tuple
    with pytest.raises(ValueError, match="axis 'z' is mapped"):
        call(("x", "z"))
    np.testing.assert_array_equal(call(("x",), "x"), call("x", "x"))  # a 1-tuple is that one axis


def test_global_view_helper_over_two_mesh_axes():
    rng = np.random.default_rng()
    mesh = cpu_mesh((2, 4), ("x", "y"), AxisType.Auto)
    x, w = random_array(rng, (32, 64), "float32"), random_array(rng, (64, 48), "float32")
    out = flux_jax.matmul_rs_sharded(x, w, mesh=mesh, axis_name=("x", "y"), impl="fused")
    assert_matches(out, to64(x) @ to64(w), jnp.dot(x, w), "float32", "matmul_rs_sharded over (x, y)")
    with pytest.raises(ValueError, match="divisible by the size of axis"):
        flux_jax.matmul_rs_sharded(x[:, :60], w[:60], mesh=mesh, axis_name=("x", "y"))
