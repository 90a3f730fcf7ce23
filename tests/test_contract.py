"""Both ops against a float64 oracle: dtypes, awkward shapes, meshes, axis types."""

import numpy as np
import pytest
from jax.sharding import AxisType

from helpers import DTYPES, assert_matches, cpu_mesh, fused_fn, place, random_array, to64

# (mesh shape, axis names, tp axis, x shape factory) -- global shapes.
MESHES = [
    ((8,), ("tp",), "tp"),
    ((2, 4), ("dp", "tp"), "tp"),
    ((2, 4), ("tp", "dp"), "tp"),
    ((4, 2), ("dp", "tp"), "tp"),
    ((4, 2), ("tp", "dp"), "tp"),
]


def _case(rng, op, mesh_shape, names, tp_axis, m_local, mid, k, n, dtype_name, axis_type, impl):
    mesh = cpu_mesh(mesh_shape, names, axis_type)
    tp = mesh.shape[tp_axis]
    others = int(np.prod([mesh.shape[a] for a in names if a != tp_axis]))
    dtype = DTYPES[dtype_name]
    rows = tp * m_local
    middle = (others * mid,) if mid else ()
    if op == "ag":
        x = random_array(rng, (rows, *middle, k), dtype)
        w = random_array(rng, (k, tp * n), dtype)
    else:
        x = random_array(rng, (rows, *middle, tp * k), dtype)
        w = random_array(rng, (tp * k, n), dtype)
    ref = np.tensordot(to64(x), to64(w), axes=1)
    fn, (x_spec, w_spec) = fused_fn(op, mesh, tp_axis, x.ndim, impl)
    twin, _ = fused_fn(op, mesh, tp_axis, x.ndim, "xla")
    xs, ws = place(mesh, x, x_spec), place(mesh, w, w_spec)
    return fn(xs, ws), twin(xs, ws), ref


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("m_local,mid,k,n", [(1, 0, 24, 5), (3, 0, 40, 12), (2, 1, 16, 8)])
def test_1d_mesh_dtypes_and_awkward_shapes(op, dtype_name, m_local, mid, k, n):
    rng = np.random.default_rng()
    out, twin_out, ref = _case(rng, op, (8,), ("tp",), "tp", m_local, mid, k, n, dtype_name, AxisType.Explicit, "fused")
    assert_matches(out, ref, twin_out, dtype_name, f"{op} fused")
    assert_matches(twin_out, ref, twin_out, dtype_name, f"{op} twin")


@pytest.mark.parametrize("mesh_shape,names,tp_axis", MESHES[1:])
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_2d_meshes_tp_on_either_axis(op, mesh_shape, names, tp_axis, axis_type):
    rng = np.random.default_rng()
    out, twin_out, ref = _case(rng, op, mesh_shape, names, tp_axis, 2, 2, 24, 6, "bfloat16", axis_type, "fused")
    assert_matches(out, ref, twin_out, "bfloat16", f"{op} fused on {names}={mesh_shape}")


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_permuted_device_order(op):
    """Device ordinal != rank: the mesh lists devices in a scrambled order."""
    rng = np.random.default_rng()
    mesh = cpu_mesh((2, 4), ("dp", "tp"), device_order=[5, 2, 7, 0, 3, 6, 1, 4])
    k, n, tp = 16, 8, 4
    if op == "ag":
        x, w = random_array(rng, (tp * 3, 2, k), "float32"), random_array(rng, (k, tp * n), "float32")
    else:
        x, w = random_array(rng, (tp * 3, 2, tp * k), "float32"), random_array(rng, (tp * k, n), "float32")
    fn, (x_spec, w_spec) = fused_fn(op, mesh, "tp", 3, "fused")
    twin, _ = fused_fn(op, mesh, "tp", 3, "xla")
    xs, ws = place(mesh, x, x_spec), place(mesh, w, w_spec)
    ref = np.tensordot(to64(x), to64(w), axes=1)
    assert_matches(fn(xs, ws), ref, twin(xs, ws), "float32", f"{op} permuted mesh")


def test_return_gathered():
    import functools

    import jax
    from jax.sharding import PartitionSpec as P

    import flux_jax

    rng = np.random.default_rng()
    mesh = cpu_mesh((8,), ("tp",))
    x, w = random_array(rng, (16, 3, 24), "bfloat16"), random_array(rng, (24, 64), "bfloat16")
    outs = {}
    for impl in ("fused", "xla"):
        body = functools.partial(flux_jax.ag_matmul, axis_name="tp", impl=impl, return_gathered=True)
        f = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P("tp"), P(None, "tp")),
                out_specs=(P(None, None, "tp"), P("tp")),
                check_vma=False,
            )
        )
        outs[impl] = f(place(mesh, x, P("tp")), place(mesh, w, P(None, "tp")))
    (out, gathered), (twin_out, twin_gathered) = outs["fused"], outs["xla"]
    # Each rank's gathered copy is the full x; out_specs P("tp") stacks the 8 copies.
    np.testing.assert_array_equal(np.asarray(gathered, np.float32), np.tile(np.asarray(x, np.float32), (8, 1, 1)))
    np.testing.assert_array_equal(np.asarray(twin_gathered), np.asarray(gathered))
    assert_matches(out, np.tensordot(to64(x), to64(w), axes=1), twin_out, "bfloat16", "return_gathered out")


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_global_view_helpers(op):
    import jax

    import flux_jax

    rng = np.random.default_rng()
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        mesh = cpu_mesh((2, 4), ("dp", "tp"), axis_type)
        x, w = random_array(rng, (8, 2, 32), "float32"), random_array(rng, (32, 16), "float32")
        helper = flux_jax.ag_matmul_sharded if op == "ag" else flux_jax.matmul_rs_sharded
        f = jax.jit(lambda x, w, impl: helper(x, w, mesh=mesh, axis_name="tp", impl=impl), static_argnums=2)
        ref = np.tensordot(to64(x), to64(w), axes=1)
        assert_matches(f(x, w, "fused"), ref, f(x, w, "xla"), "float32", f"{op} helper {axis_type}")


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_vmap_over_x_and_its_gradient(op):
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import flux_jax

    rng = np.random.default_rng()
    mesh = cpu_mesh((8,), ("tp",), AxisType.Auto)
    fn = flux_jax.ag_matmul if op == "ag" else flux_jax.matmul_rs
    if op == "ag":  # batch of 3 sequences, each [16 rows (2 per rank), 24]
        x, w = random_array(rng, (3, 16, 24), "float32"), random_array(rng, (24, 32), "float32")
        specs, out = (P(None, "tp"), P(None, "tp")), P(None, None, "tp")
    else:
        x, w = random_array(rng, (3, 16, 32), "float32"), random_array(rng, (32, 24), "float32")
        specs, out = (P(None, None, "tp"), P("tp")), P(None, "tp")

    def run(impl):
        per_example = functools.partial(fn, axis_name="tp", impl=impl)
        f = jax.shard_map(
            lambda x, w: jax.vmap(per_example, in_axes=(0, None))(x, w), mesh=mesh, in_specs=specs, out_specs=out
        )
        value = jax.jit(f)(x, w)
        grads = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1)))(x, w)
        return value, grads

    (v, (dx, dw)), (tv, (tdx, tdw)) = run("fused"), run("xla")
    ref = np.einsum("bmk,kn->bmn", to64(x), to64(w))
    assert_matches(v, ref, tv, "float32", f"vmap {op}")
    np.testing.assert_allclose(np.asarray(dx), np.asarray(tdx), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(tdw), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
@pytest.mark.parametrize("x_batched", [False, True], ids=["shared_x", "batched_x"])
def test_vmap_over_the_weight_runs_one_fused_call_per_weight(op, x_batched):
    """Stacked expert weights: vmap over w (and x) runs the op once per weight, in sequence, each
    fused; values and gradients equal the twin's."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import flux_jax

    rng = np.random.default_rng()
    mesh = cpu_mesh((4,), ("tp",), AxisType.Auto)
    e, rows, k, n = 3, 16, 24, 32
    fn = {"ag": flux_jax.ag_matmul, "rs": flux_jax.matmul_rs, "ar": flux_jax.matmul_ar}[op]
    x_shape = (rows, k) if op == "ag" else (rows, 4 * k)
    w = random_array(rng, (e, k, n) if op == "ag" else (e, 4 * k, n), "float32")
    x = random_array(rng, ((e,) if x_batched else ()) + x_shape, "float32")
    x_spec = {"ag": P("tp"), "rs": P(None, "tp"), "ar": P(None, "tp")}[op]
    w_spec = P(None, None, "tp") if op == "ag" else P(None, "tp")
    out_spec = {"ag": P(None, None, "tp"), "rs": P(None, "tp"), "ar": P()}[op]
    if x_batched:
        x_spec = P(None, *x_spec)

    def run(impl):
        per_expert = functools.partial(fn, axis_name="tp", impl=impl)
        in_axes = (0 if x_batched else None, 0)
        body = lambda x, w: jax.vmap(per_expert, in_axes=in_axes)(x, w)  # noqa: E731
        f = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
        value = jax.jit(f)(x, w)
        grads = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1)))(x, w)
        return value, grads, jax.jit(f).lower(x, w).compile().as_text()

    (v, (dx, dw), hlo), (tv, (tdx, tdw), _) = run("fused"), run("xla")
    assert f'custom_call_target="flux_jax_{ {"ag": "ag_matmul", "rs": "matmul_rs", "ar": "matmul_ar"}[op] }"' in hlo
    xs = to64(x) if x_batched else np.broadcast_to(to64(x), (e, *x_shape))
    ref = np.einsum("emk,ekn->emn", xs, to64(w))
    assert_matches(v, ref, tv, "float32", f"vmap over w, {op}")
    np.testing.assert_allclose(np.asarray(dx), np.asarray(tdx), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(tdw), rtol=1e-4, atol=1e-4)
