"""Drop-in use inside existing models: any gather / scatter dimension, partially manual and nested
shard_maps, and a configuration that takes effect where it is set."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flux_jax

from helpers import assert_matches, cpu_mesh, random_array, rel_max_err, to64

B, S, D, N = 4, 16, 24, 32


def _compiled_text(f, *args):
    return f.lower(*args).compile().as_text()


def _data(dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    x = random_array(rng, (B, S, D), dtype)
    w = random_array(rng, (D, N), dtype, scale=1 / np.sqrt(D))
    ct = jnp.asarray(rng.standard_normal((B, S, N)), jnp.float32)
    return x, w, ct


def _ag_block(impl, axis):
    return functools.partial(flux_jax.ag_matmul, axis_name="tp", axis=axis, impl=impl)


def _rs_block(impl, dim):
    return functools.partial(flux_jax.matmul_rs, axis_name="tp", scatter_dimension=dim, impl=impl)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_batch_first_sequence_axis_with_gradients(op, dtype):
    """x [B, S, D] with the sequence (dimension 1) sharded over tp, equal to the twins."""
    mesh = cpu_mesh((4,), ("tp",))
    x, w, ct = _data(dtype)
    if op == "ag":
        specs, out = (P(None, "tp", None), P(None, "tp")), P(None, None, "tp")
        body = _ag_block
    else:
        specs, out = (P(None, None, "tp"), P("tp", None)), P(None, "tp", None)
        body = _rs_block

    def fn(impl):
        return jax.shard_map(body(impl, 1), mesh=mesh, in_specs=specs, out_specs=out)

    xs = jax.device_put(x, NamedSharding(mesh, specs[0]))
    ws = jax.device_put(w, NamedSharding(mesh, specs[1]))
    fused, twin = jax.jit(fn("fused")), jax.jit(fn("xla"))
    assert "flux_jax_" in _compiled_text(fused, xs, ws)
    ref = np.einsum("bsd,dn->bsn", to64(x), to64(w))
    assert_matches(fused(xs, ws), ref, twin(xs, ws), dtype, f"{op} axis=1")

    def grads(impl):
        loss = lambda a, b: jnp.sum(fn(impl)(a, b).astype(jnp.float32) * ct)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, ws)

    (dx, dw), (tdx, tdw) = grads("fused"), grads("xla")
    ct64 = np.asarray(ct, np.float64)
    assert_matches(dx, np.einsum("bsn,dn->bsd", ct64, to64(w)), tdx, dtype, f"{op} dx")
    assert_matches(dw, np.einsum("bsd,bsn->dn", to64(x), ct64), tdw, dtype, f"{op} dw")


@pytest.mark.parametrize("axis", [0, -2, 1])
def test_gather_dimension_of_a_4d_input(axis):
    mesh = cpu_mesh((2,), ("tp",))
    rng = np.random.default_rng(1)
    x = random_array(rng, (4, 6, 2, 8), "float32")
    spec = [None] * 4
    spec[axis % 4] = "tp"
    specs, out = (P(*spec), P(None, "tp")), P(None, None, None, "tp")
    f = lambda impl: jax.jit(jax.shard_map(_ag_block(impl, axis), mesh=mesh, in_specs=specs, out_specs=out))  # noqa: E731
    w = random_array(rng, (8, 4), "float32")
    xs, ws = jax.device_put(x, NamedSharding(mesh, specs[0])), jax.device_put(w, NamedSharding(mesh, specs[1]))
    np.testing.assert_allclose(np.asarray(f("fused")(xs, ws)), np.asarray(f("xla")(xs, ws)), rtol=1e-5, atol=1e-5)


def test_bad_gather_dimension_is_a_clear_error():
    mesh = cpu_mesh((2,), ("tp",))
    f = jax.shard_map(_ag_block("fused", 2), mesh=mesh, in_specs=(P(), P()), out_specs=P())
    with pytest.raises(ValueError, match=r"axis=2 must name a dimension of x float32\[4, 6, 8\] other than the last"):
        jax.jit(f)(jnp.ones((4, 6, 8)), jnp.ones((8, 4)))
    g = jax.shard_map(_rs_block("fused", 1), mesh=mesh, in_specs=(P(), P()), out_specs=P())
    with pytest.raises(ValueError, match=r"dimension 1 of x float32\[4, 5, 8\] \(5 rows\) must be divisible"):
        jax.jit(g)(jnp.ones((4, 5, 8)), jnp.ones((8, 4)))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_partially_manual_region_on_a_dp_tp_mesh(op, axis_type):
    """shard_map(axis_names={"tp"}) with dp left to the partitioner: the fused custom call runs on
    each device's own batch (no all-gather over dp), equal to the twin, gradients too."""
    mesh = cpu_mesh((2, 4), ("dp", "tp"), axis_type)
    x, w, ct = _data()
    if op == "ag":
        x_sh, w_sh, specs, out = P("dp", "tp"), P(None, "tp"), (P(None, "tp"), P(None, "tp")), P(None, None, "tp")
        body = _ag_block
    else:
        x_sh, w_sh, specs, out = P("dp", None, "tp"), P("tp"), (P(None, None, "tp"), P("tp")), P(None, "tp")
        body = _rs_block

    def fn(impl):
        return jax.shard_map(body(impl, 1), mesh=mesh, in_specs=specs, out_specs=out, axis_names={"tp"})

    xs, ws = jax.device_put(x, NamedSharding(mesh, x_sh)), jax.device_put(w, NamedSharding(mesh, w_sh))
    fused = jax.jit(fn("fused"))
    text = _compiled_text(fused, xs, ws)
    assert "flux_jax_" in text
    assert "all-gather" not in text  # the batch stays split over dp
    got = fused(xs, ws)
    assert got.sharding.spec[0] == "dp"
    np.testing.assert_allclose(np.asarray(got), np.einsum("bsd,dn->bsn", to64(x), to64(w)), rtol=2e-5, atol=2e-5)
    twin = jax.jit(fn("xla"))(xs, ws)  # with Explicit dp too (its collectives run per dp block)
    assert twin.sharding.spec[0] == "dp"
    np.testing.assert_allclose(np.asarray(got), np.asarray(twin), rtol=2e-5, atol=2e-5)

    ct64 = np.asarray(ct, np.float64)
    for impl in ("fused", "xla"):
        loss = lambda a, b, impl=impl: jnp.sum(fn(impl)(a, b) * ct)  # noqa: E731
        dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, ws)
        np.testing.assert_allclose(np.asarray(dx), np.einsum("bsn,dn->bsd", ct64, to64(w)), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(dw), np.einsum("bsd,bsn->dn", to64(x), ct64), rtol=1e-4, atol=1e-4)


def test_twin_under_vmap_over_a_dimension_split_over_explicit_dp():
    """jax.vmap inside shard_map(axis_names={"tp"}), the mapped dimension split over an Explicit
    dp: the twin's all-gather stays lax's own (a nested region per dp block, which JAX 0.11's
    reduce-scatter takes, cannot be built under that vmap), and matches the fused op and
    float64."""
    mesh = cpu_mesh((2, 4), ("dp", "tp"), AxisType.Explicit)
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 2, 8, 16)).astype(np.float32)  # [experts, batch, seq, hidden]
    w = rng.standard_normal((16, 16)).astype(np.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P("dp", None, "tp")))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "tp")))

    def fn(impl):
        body = lambda a, b: jax.vmap(_ag_block(impl, 1), in_axes=(0, None))(a, b)  # noqa: E731
        in_specs = (P(None, None, "tp"), P(None, "tp"))
        return jax.jit(jax.shard_map(body, in_specs=in_specs, out_specs=P(None, None, None, "tp"), axis_names={"tp"}))

    with jax.set_mesh(mesh):
        twin, fused = fn("xla")(xs, ws), fn("fused")(xs, ws)
    np.testing.assert_allclose(np.asarray(twin), np.einsum("ebsd,dn->ebsn", to64(x), to64(w)), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(twin), rtol=2e-5, atol=2e-5)


def test_partially_manual_region_on_a_dp_fsdp_tp_mesh_auto_may_fuse():
    mesh = cpu_mesh((2, 1, 4), ("dp", "fsdp", "tp"), AxisType.Auto)
    x, w, _ = _data()
    f = jax.jit(
        jax.shard_map(
            _ag_block("fused", 1),
            mesh=mesh,
            in_specs=(P(None, "tp"), P(None, "tp")),
            out_specs=P(None, None, "tp"),
            axis_names={"tp"},
        )
    )
    xs = jax.device_put(x, NamedSharding(mesh, P(("dp", "fsdp"), "tp")))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "tp")))
    np.testing.assert_allclose(np.asarray(f(xs, ws)), np.einsum("bsd,dn->bsn", x, w), rtol=2e-5, atol=2e-5)


def _nested(impl):
    inner = jax.shard_map(
        _ag_block(impl, 1), in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P(None, None, "tp"), axis_names={"tp"}
    )
    return inner


def test_nested_shard_maps_under_set_mesh():
    """Outer shard_map over dp, inner over tp: with the mesh set (jax.set_mesh) the fused op runs."""
    mesh = cpu_mesh((2, 4), ("dp", "tp"), AxisType.Explicit)
    x, w, _ = _data()
    xs, ws = (
        jax.device_put(x, NamedSharding(mesh, P("dp", "tp"))),
        jax.device_put(w, NamedSharding(mesh, P(None, "tp"))),
    )

    def outer(impl):
        return jax.jit(
            jax.shard_map(_nested(impl), mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"), axis_names={"dp"})
        )

    with jax.set_mesh(mesh):
        fused = outer("fused")
        assert "flux_jax_ag_matmul" in _compiled_text(fused, xs, ws)
        np.testing.assert_allclose(np.asarray(fused(xs, ws)), np.einsum("bsd,dn->bsn", x, w), rtol=2e-5, atol=2e-5)


def test_nested_shard_maps_without_a_concrete_mesh_are_clear():
    """Without the concrete mesh the lowering cannot know the TP groups' devices: impl="fused"
    says how to provide it; the backward of an auto-fused op falls back to the twin."""
    mesh = cpu_mesh((2, 4), ("dp", "tp"), AxisType.Explicit)
    x, w, _ = _data()
    xs, ws = (
        jax.device_put(x, NamedSharding(mesh, P("dp", "tp"))),
        jax.device_put(w, NamedSharding(mesh, P(None, "tp"))),
    )
    fused = jax.jit(
        jax.shard_map(_nested("fused"), mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"), axis_names={"dp"})
    )
    with pytest.raises(flux_jax.FusedUnavailableError, match=r"jax.set_mesh"):
        fused.lower(xs, ws)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_one_jitted_function_under_meshes_of_other_devices_lowers_for_each(op):
    """A shard_map without mesh= takes its devices from jax.set_mesh at lowering: one jitted
    function called under meshes of the same shape on other devices, or the same devices in
    another order, lowers again for each (flux_jax's primitives require devices during lowering),
    and each call is right against float32 with its outputs poisoned first."""
    from jax._src import dispatch

    from flux_jax.ops import _spec

    assert all(spec.primitive in dispatch.prim_requires_devices_during_lowering for spec in _spec.REGISTRY.values())
    in_specs = (P("tp"), P(None, "tp")) if op == "ag_matmul" else (P(None, "tp"), P("tp"))
    out_spec = P(None, "tp") if op == "ag_matmul" else P("tp")
    fn = getattr(flux_jax, op)
    body = lambda x, w: fn(x, w, axis_name="tp", impl="fused")  # noqa: E731
    f = jax.jit(jax.shard_map(body, in_specs=in_specs, out_specs=out_spec))
    rng = np.random.default_rng()
    x, w = random_array(rng, (64, 32), "float32"), random_array(rng, (32, 48), "float32", scale=1 / np.sqrt(32))
    with flux_jax.config(debug_poison_outputs=True):
        for order in ((0, 1, 2, 3), (3, 1, 0, 2), (4, 5, 6, 7), (1, 0, 3, 2)):
            devices = np.array(jax.devices("cpu"))[list(order)]
            mesh = jax.sharding.Mesh(devices, ("tp",), axis_types=(AxisType.Explicit,))
            with jax.set_mesh(mesh):
                xs, ws = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), in_specs))
                text = f.lower(xs, ws).as_text()
                ids = ", ".join(str(d.id) for d in mesh.devices.ravel())
                assert f"tp_devices = dense<[{ids}]>" in text, (order, text[:2000])
                out = np.asarray(f(xs, ws))
            assert rel_max_err(out, to64(x) @ to64(w)) < 1e-5, order


def test_config_takes_effect_on_an_already_compiled_function():
    """Config is part of the jit cache key: a `with flux_jax.config(...)` around a call of a compiled
    function retraces it with the new settings."""
    mesh = cpu_mesh((4,), ("tp",))
    x, w, _ = _data()
    specs = (P(None, "tp"), P(None, "tp"))
    f = jax.jit(jax.shard_map(_ag_block("fused", 1), mesh=mesh, in_specs=specs, out_specs=P(None, None, "tp")))
    xs, ws = jax.device_put(x, NamedSharding(mesh, specs[0])), jax.device_put(w, NamedSharding(mesh, specs[1]))
    assert "flux_jax_ag_matmul" in f.lower(xs, ws).as_text()
    f(xs, ws)
    with flux_jax.config(fused_path="latency"):
        text = f.lower(xs, ws).as_text()
        out = f(xs, ws)
    assert "flux_jax_all_gather" in text and "flux_jax_ag_matmul" not in text
    np.testing.assert_allclose(np.asarray(out), np.einsum("bsd,dn->bsn", x, w), rtol=2e-5, atol=2e-5)
    with flux_jax.config(timeout_s=7.0):
        assert "timeout_us = 7000000" in f.lower(xs, ws).as_text()
    assert "timeout_us = 7000000" not in f.lower(xs, ws).as_text()


def test_gspmd_model_with_a_flux_jax_mlp():
    """The README's recipe: a flux_jax MLP inside an otherwise GSPMD model on a (dp, tp) mesh."""
    mesh = cpu_mesh((2, 4), ("dp", "tp"), AxisType.Auto)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((B, S, D)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((D, 64)) / np.sqrt(D), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((64, D)) / 8, jnp.float32)

    def mlp(x, w1, w2, impl):
        h = flux_jax.ag_matmul(x, w1, axis_name="tp", axis=1, impl=impl)  # [B, S, 64/tp]
        return flux_jax.matmul_rs(jax.nn.gelu(h), w2, axis_name="tp", scatter_dimension=1, impl=impl)

    def model(x, w1, w2, impl):
        x = x * 2.0  # GSPMD code around the TP region
        y = jax.shard_map(
            functools.partial(mlp, impl=impl),
            in_specs=(P(None, "tp"), P(None, "tp"), P("tp")),
            out_specs=P(None, "tp"),
            axis_names={"tp"},
        )(x, w1, w2)
        return jnp.mean(y**2)

    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("dp", "tp")))
        w1s, w2s = (
            jax.device_put(w1, NamedSharding(mesh, P(None, "tp"))),
            jax.device_put(w2, NamedSharding(mesh, P("tp"))),
        )
        step = lambda impl: jax.jit(jax.value_and_grad(functools.partial(model, impl=impl), argnums=(1, 2)))  # noqa: E731
        (loss_f, g_f), (loss_x, g_x) = step("fused")(xs, w1s, w2s), step("xla")(xs, w1s, w2s)
        assert "flux_jax_" in step("fused").lower(xs, w1s, w2s).as_text()
    np.testing.assert_allclose(float(loss_f), float(loss_x), rtol=1e-5)
    for a, b in zip(g_f, g_x):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["sequence_parallel", "all_reduce"])
def test_gspmd_model_in_bfloat16_under_every_impl(layout, fp8):
    """The README's recipe in bfloat16, every impl, forward and gradients. XLA:CPU aborted the
    process compiling a bfloat16 psum / psum_scatter in a shard_map that leaves dp automatic,
    which the twins (impl="xla", and "auto" here) and their gradients are made of
    (flux_jax/_lax_collectives.py). Each result is checked against float32: within 4x XLA's own
    bfloat16 error (one device, no collective), or with fp8 within FP8 rounding and 4x the
    twin's error."""
    mesh = cpu_mesh((2, 4), ("dp", "tp"), AxisType.Auto)
    rng = np.random.default_rng(11)
    shapes = ((B, S, D), (D, 64), (64, D))
    args32 = [random_array(rng, s, "float32", scale=1 / np.sqrt(s[0]) if i else 1.0) for i, s in enumerate(shapes)]
    ct = jnp.asarray(rng.standard_normal((B, S, D)), jnp.float32)
    args = [a.astype(jnp.bfloat16) for a in args32]
    sp = layout == "sequence_parallel"

    def block(x, w1, w2, impl):
        if sp:
            h = flux_jax.ag_matmul(x, w1, axis_name="tp", axis=1, impl=impl, fp8=fp8)
            return flux_jax.matmul_rs(jax.nn.gelu(h), w2, axis_name="tp", scatter_dimension=1, impl=impl, fp8=fp8)
        h = flux_jax.column_matmul(x, w1, axis_name="tp", impl=impl, fp8=fp8)
        return flux_jax.matmul_ar(jax.nn.gelu(h), w2, axis_name="tp", impl=impl, fp8=fp8)

    x_spec = P(None, "tp") if sp else P()
    specs = (x_spec, P(None, "tp"), P("tp"))

    def model(impl):
        if impl is None:  # XLA alone on one device: the reference's own error
            return lambda x, w1, w2: jnp.dot(jax.nn.gelu(jnp.dot(x, w1)), w2)
        return jax.shard_map(
            functools.partial(block, impl=impl), mesh=mesh, in_specs=specs, out_specs=x_spec, axis_names={"tp"}
        )

    def results(impl, xs):
        fn = model(impl)
        loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * ct)  # noqa: E731
        return [jax.jit(fn)(*xs), *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*xs)]

    names = ("y", "dx", "dw1", "dw2")
    ref = [to64(r) for r in results(None, args32)]
    xla_alone = results(None, args)
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, (P("dp", *x_spec), *specs[1:]))]
    got = {impl: results(impl, placed) for impl in ("xla", "auto", "fused")}
    for impl, outs in got.items():
        for out, r, alone, name in zip(outs, ref, xla_alone, names):
            what = f"{layout} {impl} fp8={fp8} {name}"
            assert out.dtype == jnp.bfloat16, what
            if not fp8:
                assert_matches(out, r, alone, "bfloat16", what)
            elif impl == "xla":  # quantized: e4m3 forward, e5m2 gradients
                assert rel_max_err(out, r) < 0.15, what
            else:
                assert_matches(out, r, got["xla"][names.index(name)], "bfloat16", what)


HELPERS = [
    flux_jax.ag_matmul_sharded,
    flux_jax.matmul_rs_sharded,
    flux_jax.matmul_ar_sharded,
    flux_jax.column_matmul_sharded,
]


@pytest.mark.parametrize("op", HELPERS, ids=lambda f: f.__name__)
def test_sharded_helpers_on_a_mesh_of_explicit_dp_and_auto_tp(op):
    """The global-view helpers reshard only over the mesh's Explicit axes (reshard refuses to name
    an Auto one; shard_map moves x over those)."""
    mesh = jax.sharding.Mesh(
        np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"), axis_types=(AxisType.Explicit, AxisType.Auto)
    )
    rng = np.random.default_rng()
    x, w = random_array(rng, (64, 128), jnp.float32), random_array(rng, (128, 64), jnp.float32)
    with jax.set_mesh(mesh):
        out = to64(jax.jit(lambda a, b: op(a, b, mesh=mesh, axis_name="tp", impl="fused"))(x, w))
    np.testing.assert_allclose(out, to64(x) @ to64(w), rtol=1e-4, atol=1e-4 * np.max(np.abs(out)))


def test_explain_reports_the_twin_the_lowering_falls_back_to():
    """A plan the lowering cannot run (here x's gathered dimension also sharded over the dp axis
    the partial shard_map leaves automatic) runs the twin under impl="auto"; explain says so, with
    the reason, instead of the traced plan."""
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    x, w = jnp.ones((4, 16, 64)), jnp.ones((64, 32))
    body = functools.partial(flux_jax.ag_matmul, axis_name="tp", axis=1, impl="auto")
    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P(None, None, "tp"), axis_names={"tp"}
        )
    )
    xs = jax.device_put(x, NamedSharding(mesh, P(None, ("tp", "dp"))))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "tp")))
    with flux_jax.config(fused_path="overlap"), jax.set_mesh(mesh):
        sites = flux_jax.explain(f, xs, ws)
        text = f.lower(xs, ws).as_text()
    assert "flux_jax_ag_matmul" not in text
    assert [site.plan.path for site in sites] == ["twin"], str(sites)
    assert "automatic mesh axes" in sites[0].plan.reason


def test_sharded_helpers_check_the_global_operands_first():
    """Errors name the caller's global shapes and the mesh, not the per-shard ones."""
    mesh = cpu_mesh((4,), ("tp",))
    x, w = jnp.ones((64, 128)), jnp.ones((64, 256))
    with pytest.raises(ValueError, match=r"x float32\[64, 128\] has K=128 but w float32\[64, 256\]"):
        flux_jax.ag_matmul_sharded(x, w, mesh=mesh, axis_name="tp")
    with pytest.raises(ValueError, match=r"rank >= 2.*float32\[128\]"):
        flux_jax.matmul_ar_sharded(jnp.ones(128), jnp.ones((128, 8)), mesh=mesh, axis_name="tp")
    with pytest.raises(ValueError, match=r"N = 30 \(w float32\[128, 30\]\) must be divisible by .* \(4\)"):
        flux_jax.column_matmul_sharded(jnp.ones((8, 128)), jnp.ones((128, 30)), mesh=mesh, axis_name="tp")
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        flux_jax.matmul_rs_sharded(jnp.ones((8, 128)), jnp.ones((128, 8)), mesh=mesh, axis_name="model")
    with pytest.raises(TypeError, match="must be a jax.sharding.Mesh"):
        flux_jax.matmul_ar_sharded(jnp.ones((8, 128)), jnp.ones((128, 8)), mesh=None, axis_name="tp")
