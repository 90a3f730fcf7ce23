"""matmul_ar (GEMM -> AllReduce) and column_matmul (its column-parallel partner) on CPU.

The contract against a float64 oracle (outputs poisoned by conftest), the same bits on every
rank, meshes and middle dimensions, autodiff against the twin (no communication in matmul_ar's
backward; column_matmul's backward is a fused matmul_ar), errors, vmap, partially manual
shard_maps, the latency path (XLA's GEMM + flux_jax_all_reduce) and the planner's GPU rules.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import flux_jax
from flux_jax import _plan

from helpers import DTYPES, assert_matches, cpu_mesh, place, random_array, to64

PATHS = ["overlap", "latency"]  # on CPU: the fused kernel, and XLA's GEMM + our all_reduce


def _specs(mesh, tp_axis, ndim):
    """x sharded on its contraction (a middle dim over the other axes), w rows over tp; the
    output replicated over tp."""
    others = tuple(a for a in mesh.axis_names if a != tp_axis)
    x_spec = P(*([None] * (ndim - 1)), tp_axis)
    out_spec = P(*([None] * ndim))
    if others and ndim >= 3:
        x_spec = P(None, others, *([None] * (ndim - 3)), tp_axis)
        out_spec = P(None, others, *([None] * (ndim - 2)))
    return x_spec, P(tp_axis, None), out_spec


def _fn(mesh, ndim, impl="fused", tp_axis="tp"):
    """A fresh jit(shard_map(matmul_ar)): the configuration is read when it is traced."""
    x_spec, w_spec, out_spec = _specs(mesh, tp_axis, ndim)
    body = functools.partial(flux_jax.matmul_ar, axis_name=tp_axis, impl=impl)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)), (x_spec, w_spec)


def _run(mesh, x, w, impl="fused", path="auto", tp_axis="tp"):
    with flux_jax.config(fused_path=path):
        fn, (x_spec, w_spec) = _fn(mesh, x.ndim, impl, tp_axis)
        xs, ws = place(mesh, x, x_spec), place(mesh, w, w_spec)
        return fn(xs, ws), fn.lower(xs, ws).as_text(), (xs, ws)


def _shards_bitwise_equal(out, what):
    """Every device's buffer of a result replicated over TP holds the same bits (with a 2-D mesh,
    the devices that hold the same block of the output)."""
    blocks = {}
    for shard in out.addressable_shards:
        key = tuple((s.start, s.stop) for s in shard.index)
        blocks.setdefault(key, []).append(np.asarray(shard.data))
    assert blocks and all(len(v) >= 2 for v in blocks.values()), f"{what}: not replicated: {list(blocks)}"
    for key, arrays in blocks.items():
        bits = [a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16) for a in arrays]
        for i, b in enumerate(bits[1:], 1):
            assert np.array_equal(b, bits[0]), f"{what}: block {key}: device {i} differs from device 0"


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("m", [1, 2, 7, 64, 129, 256])
def test_contract_against_float64_oracle_and_same_bits_on_every_rank(m, dtype_name):
    rng = np.random.default_rng()
    mesh = cpu_mesh((8,), ("tp",))
    dtype = DTYPES[dtype_name]
    x, w = random_array(rng, (m, 8 * 24), dtype), random_array(rng, (8 * 24, 40), dtype)
    ref = to64(x) @ to64(w)
    twin, _, _ = _run(mesh, x, w, "xla")
    for path in PATHS:
        out, hlo, _ = _run(mesh, x, w, "fused", path)
        target = "flux_jax_matmul_ar" if path == "overlap" else "flux_jax_all_reduce"
        assert f"custom_call @{target}" in hlo, path
        assert out.dtype == x.dtype and out.shape == (m, 40)
        assert_matches(out, ref, twin, dtype_name, f"matmul_ar {path} M={m}")
        _shards_bitwise_equal(out, f"matmul_ar {path} M={m} {dtype_name}")


@pytest.mark.parametrize("path", PATHS)
def test_float16_and_bits_repeat_under_jitter(path):
    """Arrival order varies (random delays before every signal); the bits do not."""
    rng = np.random.default_rng()
    mesh = cpu_mesh((4,), ("tp",))
    x, w = random_array(rng, (5, 3, 64), jnp.float16), random_array(rng, (64, 24), jnp.float16)
    with flux_jax.config(fused_path=path, debug_jitter_us=300):
        fn, (x_spec, w_spec) = _fn(mesh, 3)
        xs, ws = place(mesh, x, x_spec), place(mesh, w, w_spec)
        first = fn(xs, ws)
        _shards_bitwise_equal(first, f"float16 {path}")
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(fn(xs, ws)).view(np.uint16), np.asarray(first).view(np.uint16))
    twin, _, _ = _run(mesh, x, w, "xla")
    assert_matches(first, np.tensordot(to64(x), to64(w), axes=1), twin, "float16", f"float16 {path}")


@pytest.mark.parametrize("mesh_shape,names", [((2, 4), ("dp", "tp")), ((4, 2), ("tp", "dp"))])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("path", PATHS)
def test_2d_mesh_with_middle_dimensions(mesh_shape, names, axis_type, path):
    """dp x tp with TP on either axis; x [M, B, S, k_local] with B split over dp."""
    rng = np.random.default_rng()
    mesh = cpu_mesh(mesh_shape, names, axis_type)
    tp = mesh.shape["tp"]
    x = random_array(rng, (3, 4, 2, tp * 16), jnp.bfloat16)
    w = random_array(rng, (tp * 16, 24), jnp.bfloat16)
    out, _, _ = _run(mesh, x, w, "fused", path)
    twin, _, _ = _run(mesh, x, w, "xla")
    assert out.shape == (3, 4, 2, 24)
    assert_matches(out, np.tensordot(to64(x), to64(w), axes=1), twin, "bfloat16", f"{names} {path}")
    _shards_bitwise_equal(out, f"{names} {path}")


def test_global_view_helper():
    rng = np.random.default_rng()
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        mesh = cpu_mesh((2, 4), ("dp", "tp"), axis_type)
        x, w = random_array(rng, (6, 2, 32), jnp.float32), random_array(rng, (32, 16), jnp.float32)
        f = jax.jit(
            lambda x, w, impl: flux_jax.matmul_ar_sharded(x, w, mesh=mesh, axis_name="tp", impl=impl), static_argnums=2
        )
        out = f(x, w, "fused")
        assert_matches(out, np.tensordot(to64(x), to64(w), axes=1), f(x, w, "xla"), "float32", f"helper {axis_type}")
        assert "flux_jax_matmul_ar" in f.lower(x, w, "fused").as_text()
        col = jax.jit(lambda x, w: flux_jax.column_matmul_sharded(x, w, mesh=mesh, axis_name="tp", impl="fused"))
        np.testing.assert_allclose(np.asarray(col(x, w)), np.tensordot(to64(x), to64(w), axes=1), rtol=1e-5, atol=1e-5)


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_fused_program_has_the_custom_call_and_no_xla_all_reduce():
    """impl="fused": the compiled program holds flux_jax_matmul_ar, forward only; its backward is
    two local GEMMs (no communication at all); the twin's program all-reduces."""
    rng = np.random.default_rng()
    mesh = cpu_mesh((8,), ("tp",))
    x, w = random_array(rng, (16, 64), jnp.bfloat16), random_array(rng, (64, 32), jnp.bfloat16)
    xs, ws = place(mesh, x, P(None, "tp")), place(mesh, w, P("tp", None))

    def program(impl, grad):
        f = jax.shard_map(
            functools.partial(flux_jax.matmul_ar, axis_name="tp", impl=impl),
            mesh=mesh,
            in_specs=(P(None, "tp"), P("tp", None)),
            out_specs=P(),
        )
        if not grad:
            return _compiled(f, xs, ws)
        return _compiled(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2), argnums=(0, 1)), xs, ws)

    for grad in (False, True):
        text = program("fused", grad)
        assert text.count('custom_call_target="flux_jax_matmul_ar"') == 1, grad
        assert not re.search(r"all-reduce(-start)?\(", text), f"fused program (grad={grad}) has an XLA all-reduce"
    assert re.search(r"all-reduce(-start)?\(", program("xla", False))
    assert "flux_jax_" not in program("xla", True)


@pytest.mark.parametrize("path", PATHS)
def test_gradients_match_the_twin(path):
    rng = np.random.default_rng()
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    x = random_array(rng, (6, 4, 32), jnp.float32)
    w = random_array(rng, (32, 24), jnp.float32)
    ct = random_array(rng, (6, 4, 24), jnp.float32)

    def loss(impl, x, w, ct):
        def body(x, w, ct):
            y = flux_jax.matmul_ar(x, w, axis_name="tp", impl=impl)
            return jax.lax.psum(jnp.sum(y * ct), "dp")

        return jax.shard_map(
            body, mesh=mesh, in_specs=(P(None, "dp", "tp"), P("tp", None), P(None, "dp")), out_specs=P()
        )(x, w, ct)

    args = (place(mesh, x, P(None, "dp", "tp")), place(mesh, w, P("tp", None)), place(mesh, ct, P(None, "dp")))
    with flux_jax.config(fused_path=path):
        got = jax.jit(jax.value_and_grad(functools.partial(loss, "fused"), argnums=(0, 1)))(*args)
    want = jax.jit(jax.value_and_grad(functools.partial(loss, "xla"), argnums=(0, 1)))(*args)
    for g, t in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(t), rtol=2e-5, atol=2e-5)
    # against float64: dx = ct @ w^T, dw = x^T ct
    dx, dw = got[1]
    np.testing.assert_allclose(np.asarray(dx), np.einsum("mbn,kn->mbk", to64(ct), to64(w)), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dw), np.einsum("mbk,mbn->kn", to64(x), to64(ct)), rtol=1e-4, atol=1e-4)


def _megatron_loss(impl, mesh, x, w1, w2, ct):
    """column_matmul -> tanh -> matmul_ar: a Megatron MLP without sequence parallelism."""

    def body(x, w1, w2, ct):
        h = flux_jax.column_matmul(x, w1, axis_name="tp", impl=impl)
        y = flux_jax.matmul_ar(jnp.tanh(h), w2, axis_name="tp", impl=impl)
        return jax.lax.psum(jnp.sum(y * ct), "dp"), y

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P("dp"), P(None, "tp"), P("tp", None), P("dp")), out_specs=(P(), P("dp"))
    )(x, w1, w2, ct)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_column_matmul_forward_and_backward_match_the_twin(dtype_name):
    rng = np.random.default_rng()
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    dtype = DTYPES[dtype_name]
    x = random_array(rng, (4, 3, 32), dtype)
    w1, w2 = random_array(rng, (32, 64), dtype, 0.2), random_array(rng, (64, 32), dtype, 0.2)
    ct = random_array(rng, (4, 3, 32), dtype)
    args = (
        place(mesh, x, P("dp")),
        place(mesh, w1, P(None, "tp")),
        place(mesh, w2, P("tp", None)),
        place(mesh, ct, P("dp")),
    )
    grads = {}
    for impl in ("fused", "xla"):
        step = jax.jit(
            jax.value_and_grad(lambda *a, impl=impl: _megatron_loss(impl, mesh, *a), argnums=(0, 1, 2), has_aux=True)
        )
        grads[impl] = step(*args)
        text = step.lower(*args).compile().as_text()
        calls = text.count('custom_call_target="flux_jax_matmul_ar"')
        assert calls == (2 if impl == "fused" else 0), (impl, calls)  # forward + column's backward
    (_, y), (dx, dw1, dw2) = grads["fused"]
    (_, ty), (tdx, tdw1, tdw2) = grads["xla"]
    h64 = np.tanh(np.tensordot(to64(x), to64(w1), axes=1))
    assert_matches(y, np.tensordot(h64, to64(w2), axes=1), ty, dtype_name, "forward", factor=8)
    for got, want, what in ((dx, tdx, "dx"), (dw1, tdw1, "dw1"), (dw2, tdw2, "dw2")):
        ref = to64(want)  # the twin's gradient; the fused one within its error of it
        err = np.max(np.abs(to64(got) - ref)) / np.max(np.abs(ref))
        assert err <= (1e-5 if dtype_name == "float32" else 3e-2), (what, err)
    # float32: against float64 autodiff of the same math
    if dtype_name == "float32":

        def ref_loss(x, w1, w2):
            return jnp.sum(jnp.tanh(x @ w1) @ w2 * ct)

        with jax.default_device(jax.devices("cpu")[0]):
            rx, rw1, rw2 = jax.grad(ref_loss, argnums=(0, 1, 2))(*(jnp.asarray(a) for a in (x, w1, w2)))
        for got, want in ((dx, rx), (dw1, rw1), (dw2, rw2)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_column_matmul_backward_is_the_planned_fused_matmul_ar():
    rng = np.random.default_rng()
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    x, w = random_array(rng, (4, 32), jnp.float32), random_array(rng, (32, 16), jnp.float32)

    def f(impl):
        def body(x, w):
            y = flux_jax.column_matmul(x, w, axis_name="tp", impl=impl)
            return jax.lax.psum(jnp.sum(y**2), ("dp", "tp"))

        return jax.shard_map(body, mesh=mesh, in_specs=(P("dp"), P(None, "tp")), out_specs=P())

    xs, ws = place(mesh, x, P("dp")), place(mesh, w, P(None, "tp"))
    sites = flux_jax.explain(jax.grad(f("fused"), argnums=(0, 1)), xs, ws)
    assert [(s.op, s.backward, s.plan.path, s.problem.transpose_w) for s in sites] == [
        ("matmul_ar", True, "overlap", True)
    ]
    # the forward alone runs no collective
    assert "flux_jax_" not in _compiled(f("fused"), xs, ws)
    # impl="auto" on CPU: the twin, whose backward all-reduces with XLA
    text = _compiled(jax.grad(f("auto"), argnums=(0, 1)), xs, ws)
    assert "flux_jax_" not in text and re.search(r"all-reduce(-start)?\(", text)


@pytest.mark.parametrize(
    "x_shape, two_shot",
    [((1024, 64), True), ((256, 4, 64), True), ((1000, 64), False), ((1020, 64), False)],
    ids=["1024", "256x4", "1000: fewer rows", "1020: rows % 8"],
)
def test_overlap_from_1024_rows_is_two_shot(x_shape, two_shot, monkeypatch):
    """rows % tp == 0 from 1024 rows: matmul_rs's overlap call, then our all_gather (each chunk
    summed once, so every rank holds the same bits); elsewhere the one custom call. A GPU path,
    run here on CPU devices."""
    monkeypatch.setattr(_plan, "_TWO_SHOT_PLATFORMS", ("cuda", "gpu", "cpu"))
    rng = np.random.default_rng()
    mesh = cpu_mesh((8,), ("tp",))
    x, w = random_array(rng, x_shape, jnp.bfloat16), random_array(rng, (64, 48), jnp.bfloat16)
    out, hlo, (xs, ws) = _run(mesh, x, w, "fused", "overlap")
    calls = sorted(set(re.findall(r"custom_call @(flux_jax_\w+)", hlo)))
    assert calls == (["flux_jax_all_gather", "flux_jax_matmul_rs"] if two_shot else ["flux_jax_matmul_ar"]), calls
    twin, _, _ = _run(mesh, x, w, "xla")
    assert_matches(out, np.tensordot(to64(x), to64(w), axes=1), twin, "bfloat16", f"two-shot {x_shape}")
    _shards_bitwise_equal(out, f"two-shot {x_shape}")
    fn, _ = _fn(mesh, x.ndim)
    with flux_jax.config(fused_path="overlap"):
        (site,) = flux_jax.explain(fn, xs, ws)
    assert site.plan.path == "overlap" and ("two-shot" in site.plan.reason) == two_shot


def test_two_shot_gradients_and_the_column_backward(monkeypatch):
    """A Megatron block without sequence parallelism at 1024 rows: the forward matmul_ar and the
    column layer's backward all-reduce (transposed weight) both run two-shot (on CPU devices as
    on GPUs)."""
    monkeypatch.setattr(_plan, "_TWO_SHOT_PLATFORMS", ("cuda", "gpu", "cpu"))
    rng = np.random.default_rng()
    mesh = cpu_mesh((4,), ("tp",))
    x = random_array(rng, (1024, 32), jnp.float32)
    w1, w2 = random_array(rng, (32, 64), jnp.float32, 0.2), random_array(rng, (64, 32), jnp.float32, 0.2)

    def loss(impl, x, w1, w2):
        def body(x, w1, w2):
            h = jnp.tanh(flux_jax.column_matmul(x, w1, axis_name="tp", impl=impl))
            return jnp.sum(flux_jax.matmul_ar(h, w2, axis_name="tp", impl=impl) ** 2)

        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "tp"), P("tp", None)), out_specs=P())(x, w1, w2)

    args = (place(mesh, x, P()), place(mesh, w1, P(None, "tp")), place(mesh, w2, P("tp", None)))
    with flux_jax.config(fused_path="overlap"):
        step = jax.jit(jax.grad(functools.partial(loss, "fused"), argnums=(0, 1, 2)))
        got = step(*args)
        text = step.lower(*args).compile().as_text()
    assert text.count('custom_call_target="flux_jax_matmul_rs"') == 2 and "flux_jax_matmul_ar" not in text
    want = jax.jit(jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2)))(*args)
    for g, t, what in zip(got, want, ("dx", "dw1", "dw2")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(t), rtol=1e-4, atol=1e-4, err_msg=what)


@pytest.mark.parametrize("fn", [flux_jax.matmul_ar, flux_jax.column_matmul])
def test_contraction_mismatch_is_a_clear_error_before_tracing(fn):
    mesh = cpu_mesh((8,), ("tp",), AxisType.Auto)
    f = jax.shard_map(
        functools.partial(fn, axis_name="tp", impl="fused"), mesh=mesh, in_specs=(P(), P()), out_specs=P()
    )
    name = fn.__name__
    with pytest.raises(
        ValueError,
        match=rf"flux_jax.{name}: contraction mismatch: x float32\[4, 16\] has K=16 but "
        r"w float32\[12, 8\]",
    ):
        jax.jit(f)(jnp.ones((4, 16)), jnp.ones((12, 8)))


def test_vmap_over_x_and_its_gradient():
    rng = np.random.default_rng()
    mesh = cpu_mesh((8,), ("tp",), AxisType.Auto)
    x, w = random_array(rng, (3, 5, 32), jnp.float32), random_array(rng, (32, 24), jnp.float32)
    specs, out = (P(None, None, "tp"), P("tp")), P()

    def run(impl):
        per_example = functools.partial(flux_jax.matmul_ar, axis_name="tp", impl=impl)
        f = jax.shard_map(
            lambda x, w: jax.vmap(per_example, in_axes=(0, None))(x, w), mesh=mesh, in_specs=specs, out_specs=out
        )
        value = jax.jit(f)(x, w)
        grads = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1)))(x, w)
        return value, grads, jax.jit(f).lower(x, w).as_text()

    (v, (dx, dw), text), (tv, (tdx, tdw), _) = run("fused"), run("xla")
    assert "flux_jax_matmul_ar" in text
    assert_matches(v, np.einsum("bmk,kn->bmn", to64(x), to64(w)), tv, "float32", "vmap matmul_ar")
    np.testing.assert_allclose(np.asarray(dx), np.asarray(tdx), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(tdw), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", ["matmul_ar", "column_matmul"])
def test_partially_manual_shard_map(op):
    """shard_map manual over tp only, dp left to the partitioner: the fused op runs (in a manual
    region over dp that it opens itself) and equals the twin, forward and backward."""
    rng = np.random.default_rng()
    mesh = cpu_mesh((2, 4), ("dp", "tp"), AxisType.Auto)
    fn = getattr(flux_jax, op)
    if op == "matmul_ar":
        x, w = random_array(rng, (8, 4, 32), jnp.float32), random_array(rng, (32, 16), jnp.float32)
        specs, out = (P(None, None, "tp"), P("tp")), P()
    else:
        x, w = random_array(rng, (8, 4, 32), jnp.float32), random_array(rng, (32, 16), jnp.float32)
        specs, out = (P(), P(None, "tp")), P(None, None, "tp")

    def call(impl):
        f = jax.shard_map(
            functools.partial(fn, axis_name="tp", impl=impl),
            mesh=mesh,
            in_specs=specs,
            out_specs=out,
            axis_names={"tp"},
        )
        loss = lambda x, w: jnp.sum(jnp.sin(f(x, w)))
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
        return jax.jit(f)(x, w), value, grads, jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()

    (y, v, g, text), (ty, tv, tg, _) = call("fused"), call("xla")
    assert "flux_jax_matmul_ar" in text
    y64 = np.einsum("bsk,kn->bsn", to64(x), to64(w))
    assert_matches(y, y64, ty, "float32", f"partially manual {op}")
    # The loss sums 512 terms of either sign, so it can cancel to far below them: its tolerance is
    # relative to the terms' magnitude (a wrong shard moves it by O(1)), not to the sum.
    terms = np.abs(np.sin(y64)).sum()
    np.testing.assert_allclose(float(v), np.sin(y64).sum(), rtol=0, atol=1e-5 * terms)
    np.testing.assert_allclose(float(v), float(tv), rtol=0, atol=1e-5 * terms)
    for a, b in zip(g, tg):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", PATHS)
def test_missing_peer_times_out_naming_it(path):
    rng = np.random.default_rng()
    mesh = cpu_mesh((8,), ("tp",))
    x, w = random_array(rng, (4, 8 * 8), jnp.float32), random_array(rng, (8 * 8, 16), jnp.float32)
    name = "matmul_ar" if path == "overlap" else "all_reduce"
    with flux_jax.config(fused_path=path, timeout_s=0.3, debug_drop_rank=5):
        fn, (x_spec, w_spec) = _fn(mesh, 2)
        with pytest.raises(Exception, match=rf"{name} \(cpu backend\).* timed out after 0.3 s .*from rank 5 \(epoch 1"):
            np.asarray(fn(place(mesh, x, x_spec), place(mesh, w, w_spec)))
    flux_jax.reset()


def _gpu_problem(rows=16, k=2048, n=4096, tp=2, dtype=jnp.bfloat16, transpose_w=False):
    return _plan.Problem("matmul_ar", rows, k, n, np.dtype(dtype), tp, "cuda", transpose_w)


def test_planner_on_gpus():
    """Not measured at tp > 1 on GPUs: auto takes the twin and says so; fused takes the decode
    kernel where it serves the call, the two-shot overlap from 1024 rows divisible by tp, else
    the latency path; all paths serve TP <= 8."""
    cfg = flux_jax.Config()
    auto = _plan.plan(_gpu_problem(), "auto", cfg, on_hopper=True)
    assert auto.path == "twin" and "not been measured at tp > 1 on GPUs" in auto.reason
    assert _plan.plan(_gpu_problem(rows=8192, k=8192, n=8192), "auto", cfg, on_hopper=True).path == "twin"
    assert _plan.plan(_gpu_problem(), "fused", cfg, on_hopper=True).path == "decode"
    assert _plan.plan(_gpu_problem(rows=128), "fused", cfg, on_hopper=True).path == "decode"
    assert _plan.plan(_gpu_problem(rows=129), "fused", cfg, on_hopper=True).path == "latency"
    assert _plan.plan(_gpu_problem(dtype=jnp.float16), "fused", cfg, on_hopper=True).path == "latency"
    big = _plan.plan(_gpu_problem(rows=8192), "fused", cfg, on_hopper=True)
    assert big.path == "overlap" and "two-shot" in big.reason  # from 1024 rows divisible by tp
    assert _plan.plan(_gpu_problem(rows=8191), "fused", cfg, on_hopper=True).path == "latency"
    assert _plan.plan(_gpu_problem(rows=1000), "fused", cfg, on_hopper=True).path == "latency"
    assert _plan.plan(_gpu_problem(transpose_w=True), "auto", cfg, backward=True, on_hopper=True).path == "latency"
    assert _plan.plan(_gpu_problem(tp=8), "fused", cfg, on_hopper=True).path == "decode"
    # the receive area bounds tp x rows x N: 8 x 128 x 8192 is past it
    assert _plan.plan(_gpu_problem(tp=8, rows=128, n=8192), "fused", cfg, on_hopper=True).path == "latency"
    with pytest.raises(flux_jax.FusedUnavailableError, match="all_reduce kernel, which serves TP groups of at most 8"):
        _plan.plan(_gpu_problem(tp=16), "fused", cfg, on_hopper=True)
    assert _plan.plan(_gpu_problem(tp=16), "auto", cfg, on_hopper=True).path == "twin"
    decode = _plan.plan(_gpu_problem(), "fused", flux_jax.Config(fused_path="decode"), on_hopper=True)
    assert decode.path == "decode"
    odd = _plan.plan(_gpu_problem(rows=200), "fused", flux_jax.Config(fused_path="decode"), on_hopper=True)
    assert odd.path == "latency" and "decode kernels do not serve" in odd.reason
    assert _plan.plan(_gpu_problem(), "fused", flux_jax.Config(fused_path="overlap"), on_hopper=True).path == "overlap"
    with pytest.raises(flux_jax.FusedUnavailableError, match="bfloat16 or float16"):
        _plan.plan(_gpu_problem(dtype=jnp.float32), "fused", cfg, on_hopper=True)
    text = flux_jax.explain_auto("matmul_ar", 16, 4096, 4096, 2)
    assert "the XLA twin" in text and "not been measured at tp > 1 on GPUs" in text


def test_cpu_plans():
    cfg = flux_jax.Config()
    cpu = _plan.Problem("matmul_ar", 16, 64, 64, np.dtype(np.float32), 8, "cpu")
    assert _plan.plan(cpu, "auto", cfg).path == "twin"
    assert _plan.plan(cpu, "fused", cfg).path == "overlap"
    assert _plan.plan(cpu, "fused", flux_jax.Config(fused_path="latency")).path == "latency"
    # the two-shot overlap is a GPU path: the CPU backend keeps its one custom call
    assert not _plan.composed_overlap("matmul_ar", 1024, 8, "cpu")
    assert _plan.composed_overlap("matmul_ar", 1024, 8, "cuda")
    assert not _plan.composed_overlap("matmul_rs", 1024, 8, "cuda")


@pytest.mark.skipif(not flux_jax._native.has_cuda_kernel("matmul_ar"), reason="built without CUDA kernels")
@pytest.mark.parametrize("path", ["overlap", "latency", "two-shot"])
def test_gpu_lowering_drops_the_rank_operand(path):
    """Lowered for CUDA on CPU devices (only shapes matter): no rank operand on GPU."""
    rows = 1024 if path == "two-shot" else 64
    mesh = cpu_mesh((2,), ("tp",))
    rng = np.random.default_rng()
    f = jax.jit(
        jax.shard_map(
            functools.partial(flux_jax.matmul_ar, axis_name="tp", impl="fused"),
            mesh=mesh,
            in_specs=(P(None, "tp"), P("tp", None)),
            out_specs=P(),
        )
    )
    x = place(mesh, random_array(rng, (rows, 32), "bfloat16"), P(None, "tp"))
    w = place(mesh, random_array(rng, (32, 64), "bfloat16"), P("tp", None))
    with flux_jax.config(fused_path="overlap" if path == "two-shot" else path):
        text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"stablehlo\.custom_call @(flux_jax_\w+)\(([^)]*)\)", text)
    counts = {t: len([a for a in args.split(",") if a.strip()]) for t, args in calls}
    expected = {
        "overlap": {"flux_jax_matmul_ar": 2},
        "latency": {"flux_jax_all_reduce": 1},
        "two-shot": {"flux_jax_matmul_rs": 2, "flux_jax_all_gather": 1},
    }
    assert counts == expected[path]


@pytest.mark.parametrize("op", ["matmul_ar", "column_matmul"])
def test_gradients_without_type_checks_follow_the_twin(op):
    """shard_map(check_vma=False): JAX's convention for replicated values' cotangents differs
    (psum transposes to psum; the boundary sums replicated inputs); both ops follow their twins
    (column_matmul: and a plain jnp.dot)."""
    rng = np.random.default_rng()
    mesh = cpu_mesh((4,), ("tp",))
    if op == "matmul_ar":
        x, w = random_array(rng, (6, 32), jnp.float32), random_array(rng, (32, 8), jnp.float32)
        specs, out = (P(None, "tp"), P("tp", None)), P()
    else:
        x, w = random_array(rng, (6, 8), jnp.float32), random_array(rng, (8, 16), jnp.float32)
        specs, out = (P(), P(None, "tp")), P(None, "tp")
    args = (place(mesh, x, specs[0]), place(mesh, w, specs[1]))

    def grads(body):
        f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out, check_vma=False)
        return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1)))(*args)

    fn = getattr(flux_jax, op)
    got = grads(functools.partial(fn, axis_name="tp", impl="fused"))
    wants = [grads(functools.partial(fn, axis_name="tp", impl="xla"))]
    if op == "column_matmul":
        wants.append(grads(jnp.dot))
    for want in wants:
        for g, t in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(t), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_batch_first_rows_over_dp_in_a_shard_map_manual_over_tp(axis_type):
    """x [B, S, K] with B over dp (the usual GSPMD layout) in shard_map(axis_names={"tp"}):
    matmul_ar moves no rows across ranks, so its own manual region over dp keeps B split there
    (no resharding of B to S)."""
    rng = np.random.default_rng()
    mesh = cpu_mesh((2, 4), ("dp", "tp"), axis_type)
    x, w = random_array(rng, (4, 6, 16), jnp.float32), random_array(rng, (16, 8), jnp.float32)
    xs, ws = place(mesh, x, P("dp", None, "tp")), place(mesh, w, P("tp"))

    def fn(impl):
        body = functools.partial(flux_jax.matmul_ar, axis_name="tp", impl=impl)
        specs = (P(None, None, "tp"), P("tp"))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(), axis_names={"tp"}))

    fused = fn("fused")
    text = fused.lower(xs, ws).as_text()
    assert "flux_jax_matmul_ar" in text and "all_to_all" not in text
    ref = np.einsum("bsk,kn->bsn", to64(x), to64(w))
    assert_matches(fused(xs, ws), ref, fn("xla")(xs, ws), "float32", f"batch over dp ({axis_type})")
