"""Gradients of the fused ops under jit(grad) through shard_map match the float64 oracle
and the twin's gradients; the backward of each op runs the other fused op."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import flux_jax

from helpers import assert_matches, cpu_mesh, place, random_array, to64


def _grads(op, mesh, x, w, ct, impl, remat=False):
    tp_axis = "tp"
    if op == "ag":
        in_specs = (P("tp", None), P(None, "tp"))
        out_spec = P(None, "tp")
        body = functools.partial(flux_jax.ag_matmul, axis_name=tp_axis, impl=impl)
    else:
        in_specs = (P(None, "tp"), P("tp", None))
        out_spec = P("tp", None)
        body = functools.partial(flux_jax.matmul_rs, axis_name=tp_axis, impl=impl)
    if remat:
        body = jax.checkpoint(body)
    f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec)
    loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * ct)
    g = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return g(place(mesh, x, in_specs[0]), place(mesh, w, in_specs[1]))


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mesh_shape,names", [((8,), ("tp",)), ((2, 4), ("dp", "tp"))])
def test_grads_match_oracle_and_twin(op, dtype, mesh_shape, names):
    rng = np.random.default_rng()
    mesh = cpu_mesh(mesh_shape, names)
    tp = mesh.shape["tp"]
    M, K, N = 4 * tp, 8 * tp, 4 * tp
    x, w = random_array(rng, (M, K), dtype), random_array(rng, (K, N), dtype)
    ct = rng.standard_normal((M, N)).astype(np.float32)
    dx_ref, dw_ref = ct @ to64(w).T, to64(x).T @ ct
    dx, dw = _grads(op, mesh, x, w, ct, "fused")
    tdx, tdw = _grads(op, mesh, x, w, ct, "xla")
    assert_matches(dx, dx_ref, tdx, dtype, f"{op} dx")
    assert_matches(dw, dw_ref, tdw, dtype, f"{op} dw")


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_grads_under_checkpoint(op):
    rng = np.random.default_rng()
    mesh = cpu_mesh((8,), ("tp",))
    x, w = random_array(rng, (16, 64), "float32"), random_array(rng, (64, 32), "float32")
    ct = rng.standard_normal((16, 32)).astype(np.float32)
    dx, dw = _grads(op, mesh, x, w, ct, "fused", remat=True)
    tdx, tdw = _grads(op, mesh, x, w, ct, "xla")
    assert_matches(dx, ct @ to64(w).T, tdx, "float32", "remat dx")
    assert_matches(dw, to64(x).T @ ct, tdw, "float32", "remat dw")


def test_grads_with_return_gathered_and_middle_dims():
    """Loss uses both outputs: d x gets the matmul_rs term and the gathered copy's term."""
    rng = np.random.default_rng()
    mesh = cpu_mesh((2, 4), ("dp", "tp"), AxisType.Auto)
    x, w = random_array(rng, (8, 2, 16), "float32"), random_array(rng, (16, 12), "float32")
    c1 = rng.standard_normal((8, 2, 12)).astype(np.float32)
    c2 = rng.standard_normal((8, 2, 16)).astype(np.float32)

    def grads(impl):
        body = functools.partial(flux_jax.ag_matmul, axis_name="tp", impl=impl, return_gathered=True)

        def per_shard(x, w, c1, c2):
            out, x_full = body(x, w)
            return jax.lax.psum(jnp.sum(out * c1) + jnp.sum(x_full * c2) / 4.0, ("tp", "dp"))

        f = jax.shard_map(
            per_shard,
            mesh=mesh,
            in_specs=(P("tp", "dp"), P(None, "tp"), P(None, "dp", "tp"), P(None, "dp")),
            out_specs=P(),
        )
        return jax.jit(jax.grad(f, argnums=(0, 1)))(x, w, c1, c2)

    dx, dw = grads("fused")
    tdx, tdw = grads("xla")
    # d/dx of sum(AG(x) w * c1) + sum(AG(x) * c2) (x_full summed once per tp rank, / tp)
    dx_ref = np.einsum("mbn,kn->mbk", c1, to64(w)) + c2
    dw_ref = np.einsum("mbk,mbn->kn", to64(x), c1)
    assert_matches(dx, dx_ref, tdx, "float32", "dx")
    assert_matches(dw, dw_ref, tdw, "float32", "dw")


def _block(kind, impl, fp8=None):
    """A tensor-parallel MLP per shard: ag -> tanh -> rs (sequence parallel) or column -> tanh -> ar."""
    if kind == "sp":
        first, second = flux_jax.ag_matmul, flux_jax.matmul_rs
        specs, out_spec = (P("tp"), P(None, "tp"), P("tp")), P("tp")
    else:
        first, second = flux_jax.column_matmul, flux_jax.matmul_ar
        specs, out_spec = (P(), P(None, "tp"), P("tp")), P()

    def body(x, w1, w2):
        h = first(x, w1, axis_name="tp", impl=impl, fp8=fp8)
        return second(jnp.tanh(h), w2, axis_name="tp", impl=impl, fp8=fp8)

    return jax.shard_map(body, in_specs=specs, out_specs=out_spec)


def _mlp_operands(S, D, F, dtype):
    """x [S, D], w1 [D, F], w2 [F, D] and a direction v [S, D]: fresh random data."""
    rng = np.random.default_rng()
    x, v = random_array(rng, (S, D), dtype), random_array(rng, (S, D), dtype)
    w1, w2 = random_array(rng, (D, F), dtype, 0.25), random_array(rng, (F, D), dtype, 0.25)
    return x, w1, w2, v


def _second_order(block, x, w1, w2, v):
    """d/d(w1, w2) of <d loss/dx, v> with loss = <block(x, w1, w2), v>: reverse over reverse."""

    def input_grad_along_v(w1, w2):
        gx = jax.grad(lambda x: jnp.sum(block(x, w1, w2) * v))(x)
        return jnp.sum(gx * v)

    return jax.jit(jax.grad(input_grad_along_v, argnums=(0, 1)))(w1, w2)


@pytest.mark.parametrize("kind", ["sp", "ar"])
def test_grad_of_grad_matches_the_twin_and_the_global_reference(kind):
    """The fused ops' forward rules run through their custom_vjp cores, so a second reverse pass
    differentiates their backward rules (the paired fused ops) instead of failing."""
    mesh = cpu_mesh((4,), ("tp",), AxisType.Auto)
    x, w1, w2, v = _mlp_operands(32, 16, 32, "float32")

    def reference(x, w1, w2):  # the same block on global arrays, no collectives
        return jnp.dot(jnp.tanh(jnp.dot(x, w1)), w2)

    want = [to64(g) for g in _second_order(reference, x, w1, w2, v)]
    with jax.set_mesh(mesh):
        got = _second_order(_block(kind, "fused"), x, w1, w2, v)
        twin = _second_order(_block(kind, "xla"), x, w1, w2, v)
    for name, g, t, r in zip(("d w1", "d w2"), got, twin, want):
        assert_matches(g, r, t, "float32", f"{kind} {name}")


@pytest.mark.parametrize("kind", ["sp", "ar"])
def test_grad_of_grad_through_fp8_matches_the_twin_and_nears_the_unquantized_one(kind):
    """With fp8 every quantization is straight-through at second order too, in the fused ops and
    in the twins alike (their rules pair the same way): the two agree, and both stay within FP8's
    error of the unquantized second derivative."""
    mesh = cpu_mesh((4,), ("tp",), AxisType.Auto)
    x, w1, w2, v = _mlp_operands(64, 32, 64, "bfloat16")
    with jax.set_mesh(mesh):
        got = _second_order(_block(kind, "fused", fp8=True), x, w1, w2, v)
        twin = _second_order(_block(kind, "xla", fp8=True), x, w1, w2, v)
        want = _second_order(_block(kind, "xla"), x, w1, w2, v)
    for name, g, t, w in zip(("d w1", "d w2"), got, twin, want):
        g, t, w = to64(g), to64(t), to64(w)
        assert np.all(np.isfinite(g)), f"{kind} {name}: not finite"
        twin_rel = np.linalg.norm(g - t) / np.linalg.norm(t)
        assert twin_rel < 1e-2, f"{kind} {name}: {twin_rel:.3e} from the FP8 twin's second derivative"
        rel = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert rel < 0.2, f"{kind} {name}: {rel:.3f} from the unquantized second derivative"


@pytest.mark.parametrize("impl", ["fused", "xla"])
@pytest.mark.parametrize("op", ["matmul_ar", "column_matmul"])
def test_grad_of_grad_through_fp8_local_input_gradient_is_straight_through(op, impl):
    """matmul_ar's dx (and column_matmul's with check_vma=False) is a local FP8 GEMM of dy and w;
    a second reverse pass must not differentiate its quantization: d/dw <dx(v), u> is u^T v up to
    float32 rounding, not a tangent rounded to FP8 (fused and twin alike)."""
    mesh = cpu_mesh((2,), ("tp",), AxisType.Auto)
    rng = np.random.default_rng()
    x, u, w, v = (random_array(rng, s, "float32") for s in ((8, 32), (8, 32), (32, 16), (8, 16)))
    if op == "matmul_ar":  # row-parallel: x and w split over K, the output replicated
        specs, out_spec, check = (P(None, "tp"), P("tp", None)), P(), True
    else:  # column-parallel: x replicated, w and the output split over N
        specs, out_spec, check = (P(), P(None, "tp")), P(None, "tp"), False
    fn = getattr(flux_jax, op)
    f = jax.shard_map(
        lambda a, b: fn(a, b, axis_name="tp", impl=impl, fp8=True),
        mesh=mesh,
        in_specs=specs,
        out_specs=out_spec,
        check_vma=check,
    )

    def along_u(w):
        gx = jax.grad(lambda a: jnp.sum(f(a, w) * v))(x)
        return jnp.sum(gx * u)

    got = jax.jit(jax.grad(along_u))(w)
    want = to64(u).T @ to64(v)
    rel = np.linalg.norm(to64(got) - want) / np.linalg.norm(want)
    assert rel < 1e-5, f"{op} {impl}: {rel:.3e} from u^T v"
