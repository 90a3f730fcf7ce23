"""FP8 operands (fp8=True / flux_jax.Fp8): quantization, the fused latency composition, the twin,
the straight-through backward, the recipe's errors and the planner's choices.

Error bounds. e4m3 keeps 3 mantissa bits, so rounding to nearest moves a normal value by at most
u = 2^-4 of itself; values below the smallest normal (2^-6, in scaled units) move by at most half
the subnormal spacing, 2^-10 scaled units = 2^-10 * amax / 448 in the operand's units. With
a_i ~= x_i (1 + d_i) + e_i (|d_i| <= u, |e_i| <= that absolute floor) for both operands, every
output element obeys

  |y_fp8 - y| <= (u|x| + e_x) @ ((1 + u)|w| + e_w) + |x| @ (u|w| + e_w) + r (|x| @ |w|)

with r covering the output's rounding to x's dtype (twice for matmul_rs: the partial, then the
sum), i.e. about 2u = 2^-3 of |x| @ |w|. e5m2 (the backward's dy) keeps 2 bits: u = 2^-3.
Gradients are compared in norm: independent roundings add in quadrature, so the relative
Frobenius error of a gradient is about sqrt(sum of u_i^2 / 3) over the quantizations along its
path; the tests allow sqrt(sum of u_i^2) (a factor sqrt(3) of headroom).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import flux_jax
from flux_jax import _plan, fp8

from helpers import DTYPES, ag_specs, cpu_mesh, place, random_array, rs_specs, to64

U = {"float8_e4m3fn": 2.0**-4, "float8_e5m2": 2.0**-3}
FLOOR = {"float8_e4m3fn": 2.0**-10 / 448, "float8_e5m2": 2.0**-17 / 57344}  # x amax
EPS = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}


OPS = {"ag": flux_jax.ag_matmul, "rs": flux_jax.matmul_rs, "ar": flux_jax.matmul_ar}


def ar_specs(mesh, tp_axis, ndim):
    """matmul_ar: x sharded on K, w on its rows, the output replicated."""
    del mesh
    return P(*([None] * (ndim - 1)), tp_axis), P(tp_axis, None), P(*([None] * ndim))


def _fn(op, mesh, ndim, impl, recipe, tp_axis="tp", **kw):
    specs = {"ag": ag_specs, "rs": rs_specs, "ar": ar_specs}[op]
    x_spec, w_spec, out_spec = specs(mesh, tp_axis, ndim)
    body = functools.partial(OPS[op], axis_name=tp_axis, impl=impl, fp8=recipe, **kw)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)), (x_spec, w_spec)


def _operands(rng, op, tp, m_local, k, n, dtype, mid=()):
    if op == "ag":
        return random_array(rng, (tp * m_local, *mid, k), dtype), random_array(rng, (k, tp * n), dtype)
    return random_array(rng, (tp * m_local, *mid, tp * k), dtype), random_array(rng, (tp * k, n), dtype)


def _fp8_bound(x64, w64, dtype_name, op, tp, recipe=None):
    """The elementwise bound of the module docstring for x [..., K] @ w [K, N] (global operands).

    matmul_rs and matmul_ar quantize each rank's K-slice of a row separately, with the slice's
    own amax; the row's full amax bounds every slice's, so the floor below holds for them too."""
    recipe = recipe or fp8.Fp8()
    u = U[recipe.forward_format]
    floor = FLOOR[recipe.forward_format]
    ax = np.abs(x64)
    aw = np.abs(w64)
    e_x = floor * np.max(ax, axis=-1, keepdims=True) * np.ones_like(ax)
    e_w = floor * (np.max(aw, axis=0, keepdims=True) if recipe.weight_scaling == "column" else np.max(aw))
    e_w = e_w * np.ones_like(aw)
    mm = lambda a, b: np.tensordot(a, b, axes=1)  # noqa: E731
    rounding = (1 if op == "ag" else 2) * EPS[dtype_name] * (1 + 1.0 / tp)
    return mm(u * ax + e_x, (1 + u) * aw + e_w) + mm(ax, u * aw + e_w) + rounding * mm(ax, aw)


def _placed(mesh, specs, *arrays):
    return tuple(place(mesh, a, s) for a, s in zip(arrays, specs))


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_output_is_fp8_accurate_quantized_and_matches_the_twin(op, dtype_name):
    rng = np.random.default_rng()
    tp = 4
    mesh = cpu_mesh((tp,), ("tp",))
    dtype = DTYPES[dtype_name]
    x, w = _operands(rng, op, tp, 3, 32, 16, dtype)
    fused, specs = _fn(op, mesh, 2, "fused", True)
    twin, _ = _fn(op, mesh, 2, "xla", True)
    plain, _ = _fn(op, mesh, 2, "xla", None)
    xs, ws = _placed(mesh, specs, x, w)
    out = fused(xs, ws)
    assert out.dtype == x.dtype
    x64, w64 = to64(x), to64(w)
    ref = np.tensordot(x64, w64, axes=1)
    got = to64(out)
    assert np.all(np.isfinite(got)), "an output element was not written (poisoned) or overflowed"
    err = np.abs(got - ref)
    bound = _fp8_bound(x64, w64, dtype_name, op, tp)
    assert np.all(err <= bound), f"{op} {dtype_name}: error exceeds the e4m3 bound by up to {np.max(err / bound):.2f}x"
    # visibly quantized: further from the exact product than the unquantized op (bf16 rounding)
    plain_err = np.max(np.abs(to64(plain(xs, ws)) - ref))
    assert np.max(err) > max(2 * plain_err, 2.0**-8 * np.max(np.abs(ref))), (np.max(err), plain_err)
    # the twin quantizes the same way: they differ by the output's rounding at most
    twin_out = to64(twin(xs, ws))
    ab = np.tensordot(np.abs(x64), np.abs(w64), axes=1)
    assert np.all(np.abs(got - twin_out) <= 2 * tp * EPS[dtype_name] * ab + 1e-30)


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_rows_near_float32s_limit_stay_finite_in_the_fused_op_and_the_twin(op):
    """|x| ~ 1e36: the float32 accumulator times x's row scale (~1e34) would overflow before the
    weight's scale brings it back; the scales apply weight first (as the CUDA epilogue does)."""
    rng = np.random.default_rng()
    tp = 2
    mesh = cpu_mesh((tp,), ("tp",))
    x, w = _operands(rng, op, tp, 3, 32, 16, jnp.float32)
    x = x * np.float32(1e36)
    fused, specs = _fn(op, mesh, 2, "fused", True)
    twin, _ = _fn(op, mesh, 2, "xla", True)
    xs, ws = _placed(mesh, specs, x, w)
    x64, w64 = to64(x), to64(w)
    ref = np.tensordot(x64, w64, axes=1)
    assert np.all(np.isfinite(ref)) and np.max(np.abs(ref)) > 1e36
    bound = _fp8_bound(x64, w64, "float32", op, tp)
    for name, f in (("fused", fused), ("twin", twin)):
        got = to64(f(xs, ws))
        assert np.all(np.isfinite(got)), f"{op} {name}: overflowed"
        assert np.all(np.abs(got - ref) <= bound), f"{op} {name}: {np.max(np.abs(got - ref) / bound):.2f}x the bound"


def _ssa_results(text: str, what: str) -> list[str]:
    """The SSA names of the StableHLO ops in `text` whose line holds `what`, in program order."""
    return [line.split("=")[0].strip().split(":")[0] for line in text.splitlines() if what in line and " = " in line]


def _ssa_ancestors(text: str, name: str) -> set[str]:
    """Every SSA value of `text` (one function's names) that `name` depends on."""
    uses = {}
    for line in text.splitlines():
        head, sep, rest = line.partition(" = ")
        if sep and head.strip().startswith("%"):
            uses[head.strip().split(":")[0]] = {u.split("#")[0] for u in re.findall(r"%[\w#]+", rest)}
    seen, todo = set(), [name]
    while todo:
        for used in uses.get(todo.pop(), ()):
            if used not in seen:
                seen.add(used)
                todo.append(used)
    return seen


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_fused_latency_program_holds_our_collective_and_an_fp8_gemm(op):
    rng = np.random.default_rng()
    mesh = cpu_mesh((4,), ("tp",))
    x, w = _operands(rng, op, 4, 2, 32, 16, jnp.bfloat16)
    with flux_jax.config(fused_path="latency"):
        fused, specs = _fn(op, mesh, 2, "fused", True)
        args = _placed(mesh, specs, x, w)
        hlo = fused.lower(*args).as_text()
        compiled = fused.lower(*args).compile().as_text()
    if op == "ag":  # the FP8 rows and, alongside, their float32 scales
        assert hlo.count("custom_call @flux_jax_all_gather") == 2, hlo
        assert "f8E4M3FN" in hlo and "flux_jax_reduce_scatter" not in hlo
        # ... in one order on every device: two independent blocking calls can wait on each
        # other across devices on XLA:CPU (fp8.gathered_matmul)
        rows, scales = _ssa_results(hlo, "custom_call @flux_jax_all_gather")
        assert rows in _ssa_ancestors(hlo, scales), hlo
    else:  # the FP8 GEMM's partial, in x's dtype
        assert hlo.count("custom_call @flux_jax_reduce_scatter") == 1
        assert "flux_jax_all_gather" not in hlo
    assert "flux_jax_ag_matmul" not in hlo and "flux_jax_matmul_rs" not in hlo
    assert "f8e4m3fn" in compiled  # the GEMM's operands are FP8 in the compiled program
    twin, _ = _fn(op, mesh, 2, "xla", True)
    twin_hlo = twin.lower(*args).as_text()
    assert "flux_jax" not in twin_hlo and "f8E4M3FN" in twin_hlo


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_fused_overlap_program_runs_our_gemm_on_fp8_operands(op):
    """bfloat16 with e4m3 rows: the op's own custom call takes the FP8 operands (w transposed,
    K-major) and their float32 scales; ag_matmul gathers the row scales first."""
    import re

    rng = np.random.default_rng()
    mesh = cpu_mesh((4,), ("tp",))
    x, w = _operands(rng, op, 4, 2, 32, 16, jnp.bfloat16)
    fused, specs = _fn(op, mesh, 2, "fused", True)
    args = _placed(mesh, specs, x, w)
    hlo = fused.lower(*args).as_text()
    target = "flux_jax_ag_matmul" if op == "ag" else "flux_jax_matmul_rs"
    calls = re.findall(rf"custom_call @{target}\((.*?)\).*?: \((.*?)\) ->", hlo)
    assert len(calls) == 1, hlo
    operand_types = calls[0][1]
    assert operand_types.count("f8E4M3FN") == 2 and operand_types.count("xf32>") == 2, operand_types
    assert hlo.count("custom_call @flux_jax_all_gather") == (1 if op == "ag" else 0)  # the row scales
    assert "flux_jax_reduce_scatter" not in hlo
    # and it is right: same numbers as the latency composition (XLA's FP8 GEMM), up to the rounding
    with flux_jax.config(fused_path="latency"):
        latency, _ = _fn(op, mesh, 2, "fused", True)
        want = to64(latency(*args))
    got = to64(fused(*args))
    ab = np.tensordot(np.abs(to64(x)), np.abs(to64(w)), axes=1)
    assert np.all(np.abs(got - want) <= 2 * 4 * EPS["bfloat16"] * ab + 1e-30)


def _block_loss(impl, recipe, mesh):
    def body(x, w1, w2, ct):
        h = flux_jax.ag_matmul(x, w1, axis_name="tp", impl=impl, fp8=recipe)
        y = flux_jax.matmul_rs(jnp.tanh(h), w2, axis_name="tp", impl=impl, fp8=recipe)
        return jax.lax.psum(jnp.sum(y.astype(jnp.float32) * ct), "tp")

    specs = (P("tp", None), P(None, "tp"), P("tp", None), P("tp", None))
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P()), specs


def _block_grads(make_loss, dtype, mesh):
    """Gradients of a two-op block's loss w.r.t. x, w1, w2 for the fused FP8 op, the FP8 twin and
    the unquantized twin (float64), and the fused program's HLO."""
    rng = np.random.default_rng()
    s, d, f = 16, 64, 128
    x = random_array(rng, (s, d), dtype)
    w1 = random_array(rng, (d, f), dtype, scale=d**-0.5)
    w2 = random_array(rng, (f, d), dtype, scale=f**-0.5)
    ct = random_array(rng, (s, d), jnp.float32)
    grads, hlo = {}, ""
    for impl, recipe in (("fused", True), ("xla", True), ("xla", None)):
        loss, specs = make_loss(impl, recipe, mesh)
        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        args = _placed(mesh, specs, x, w1, w2, ct)
        grads[impl, recipe] = [to64(g) for g in fn(*args)]
        if impl == "fused":
            hlo = fn.lower(*args).as_text()
    return grads, hlo


def _check_block_grads(grads, dtype_name):
    """Each gradient within the FP8 roundings on its path of the unquantized one (module
    docstring), visibly quantized, and within the output's rounding of the FP8 twin's."""
    e4, e5 = U["float8_e4m3fn"], U["float8_e5m2"]
    # roundings on each gradient's path: dx: ct and dh (e5m2), w2, w1, and x, w1 through
    # tanh'(h); dw1: ct, dh, w2 and x; dw2: ct, x, w1 and tanh(h)
    paths = {"dx": [e5, e5, e4, e4, e4, e4], "dw1": [e5, e5, e4, e4, e4, e4], "dw2": [e5, e4, e4, e4]}
    out_rounding = 4 * EPS[dtype_name]
    for name, got, fp8_twin, want in zip(paths, grads["fused", True], grads["xla", True], grads["xla", None]):
        assert np.all(np.isfinite(got)), name
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        bound = np.sqrt(sum(u * u for u in paths[name])) + out_rounding
        assert rel <= bound, f"{name}: relative error {rel:.3f} > {bound:.3f}"
        assert rel > 4 * EPS[dtype_name], f"{name}: the backward is not quantized ({rel:.2e})"
        twin_rel = np.linalg.norm(got - fp8_twin) / np.linalg.norm(fp8_twin)
        assert twin_rel <= 8 * EPS[dtype_name] + 1e-6, f"{name}: fused vs FP8 twin {twin_rel:.2e}"


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_gradients_through_ag_tanh_rs_are_close_to_the_unquantized_ones(dtype_name):
    grads, hlo = _block_grads(_block_loss, DTYPES[dtype_name], cpu_mesh((4,), ("tp",)))
    # bfloat16 runs the FP8 overlap kernels both ways: forward ag_matmul (its row scales gathered
    # first); backward, dx of matmul_rs is the FP8 ag_matmul of dy's e5m2 rows (scales gathered
    # first) and dx of ag_matmul the FP8 matmul_rs of them (the e5m2 x e4m3 GEMM). float32 runs
    # the latency composition: our all_gather moves rows and scales, our reduce_scatter the
    # partial. The loss is linear in matmul_rs's output, so only its backward runs.
    overlap = dtype_name == "bfloat16"
    calls = [line for line in hlo.splitlines() if "custom_call @flux_jax_" in line]
    fused = [line for line in calls if "@flux_jax_ag_matmul" in line or "@flux_jax_matmul_rs" in line]
    if overlap:
        assert sum("@flux_jax_all_gather" in line for line in calls) >= 2
        assert any("@flux_jax_ag_matmul" in line and "f8E4M3FN" in line for line in fused)
        assert any("@flux_jax_ag_matmul" in line and "f8E5M2" in line for line in fused)
        assert any("@flux_jax_matmul_rs" in line and "f8E5M2" in line for line in fused)
    else:
        assert not fused
        assert sum("@flux_jax_all_gather" in line for line in calls) >= 4
        assert sum("@flux_jax_reduce_scatter" in line for line in calls) >= 1
        assert "f8E5M2" in hlo
    _check_block_grads(grads, dtype_name)


def _megatron_loss(impl, recipe, mesh):
    """The block without sequence parallelism: column_matmul -> tanh -> matmul_ar."""

    def body(x, w1, w2, ct):
        h = flux_jax.column_matmul(x, w1, axis_name="tp", impl=impl, fp8=recipe)
        y = flux_jax.matmul_ar(jnp.tanh(h), w2, axis_name="tp", impl=impl, fp8=recipe)
        return jnp.sum(y.astype(jnp.float32) * ct)

    specs = (P(), P(None, "tp"), P("tp", None), P())
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P()), specs


def test_gradients_through_column_tanh_ar_are_close_to_the_unquantized_ones():
    grads, hlo = _block_grads(_megatron_loss, jnp.bfloat16, cpu_mesh((4,), ("tp",)))
    # column_matmul's dx is matmul_ar's FP8 two-shot on dy's e5m2 rows: the e5m2 x e4m3 GEMM
    # reduce-scatters its partial in our matmul_rs kernel, then our all_gather (the loss is linear
    # in matmul_ar's output, so only its backward runs: a local FP8 GEMM)
    calls = [line for line in hlo.splitlines() if "custom_call @flux_jax_" in line]
    assert any("@flux_jax_matmul_rs" in line and "f8E5M2" in line for line in calls), calls
    assert not any("@flux_jax_all_reduce" in line for line in calls), calls
    _check_block_grads(grads, "bfloat16")


@pytest.mark.parametrize("rows", [8, 6])
def test_matmul_ar_fp8_is_the_two_shot_where_rows_divide(rows):
    """bfloat16 rows divisible by tp: matmul_rs's FP8 overlap call (the FP8 operands and their
    scales) and our all_gather of the summed chunks; otherwise XLA's FP8 GEMM and our
    all_reduce. Both agree with the latency composition up to the output's rounding."""
    import re

    rng = np.random.default_rng()
    tp = 4
    mesh = cpu_mesh((tp,), ("tp",))
    x = random_array(rng, (rows, tp * 32), jnp.bfloat16)
    w = random_array(rng, (tp * 32, 16), jnp.bfloat16)
    fused, specs = _fn("ar", mesh, 2, "fused", True)
    args = _placed(mesh, specs, x, w)
    hlo = fused.lower(*args).as_text()
    calls = re.findall(r"custom_call @flux_jax_matmul_rs\((.*?)\).*?: \((.*?)\) ->", hlo)
    if rows % tp == 0:
        assert len(calls) == 1, hlo
        assert calls[0][1].count("f8E4M3FN") == 2 and calls[0][1].count("xf32>") == 2, calls[0][1]
        assert hlo.count("custom_call @flux_jax_all_gather") == 1 and "flux_jax_all_reduce" not in hlo
    else:
        assert not calls and "custom_call @flux_jax_all_reduce" in hlo, hlo
    with flux_jax.config(fused_path="latency"):
        latency, _ = _fn("ar", mesh, 2, "fused", True)
        want = to64(latency(*args))
    got = to64(fused(*args))
    x64, w64 = to64(x), to64(w)
    ab = np.tensordot(np.abs(x64), np.abs(w64), axes=1)
    assert np.all(np.abs(got - want) <= 2 * tp * EPS["bfloat16"] * ab + 1e-30)
    assert np.all(np.abs(got - x64 @ w64) <= _fp8_bound(x64, w64, "bfloat16", "ar", tp))


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_middle_dimensions_axis_and_scatter_dimension(op):
    rng = np.random.default_rng()
    tp = 4
    mesh = cpu_mesh((tp,), ("tp",))
    b, s, k, n = 3, 8, 32, 16
    if op == "ag":  # x [B, S/tp, K] gathered on axis 1
        x = random_array(rng, (b, s, k), jnp.bfloat16)
        w = random_array(rng, (k, tp * n), jnp.bfloat16)
        specs, out_spec = (P(None, "tp", None), P(None, "tp")), P(None, None, "tp")
        body = functools.partial(flux_jax.ag_matmul, axis=1)
    else:  # x [B, S, K/tp] scattered on dimension 1
        x = random_array(rng, (b, s, tp * k), jnp.bfloat16)
        w = random_array(rng, (tp * k, n), jnp.bfloat16)
        specs, out_spec = (P(None, None, "tp"), P("tp", None)), P(None, "tp", None)
        body = functools.partial(flux_jax.matmul_rs, scatter_dimension=1)
    outs = {}
    for impl in ("fused", "xla"):
        fn = jax.jit(
            jax.shard_map(
                functools.partial(body, axis_name="tp", impl=impl, fp8=True),
                mesh=mesh,
                in_specs=specs,
                out_specs=out_spec,
            )
        )
        outs[impl] = to64(fn(*_placed(mesh, specs, x, w)))
    x64, w64 = to64(x), to64(w)
    ref = np.tensordot(x64, w64, axes=1)
    assert outs["fused"].shape == ref.shape
    assert np.all(np.abs(outs["fused"] - ref) <= _fp8_bound(x64, w64, "bfloat16", op, tp))
    ab = np.tensordot(np.abs(x64), np.abs(w64), axes=1)
    assert np.all(np.abs(outs["fused"] - outs["xla"]) <= 2 * tp * EPS["bfloat16"] * ab)


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_2d_mesh_with_middle_dims_and_gradients(op, axis_type):
    """dp x tp mesh, x [rows, batch, K] with the batch over dp: forward and x's gradient."""
    rng = np.random.default_rng()
    mesh = cpu_mesh((2, 4), ("dp", "tp"), axis_type)
    x, w = _operands(rng, op, 4, 2, 16, 8, jnp.float32, mid=(4,))
    ct = random_array(rng, (x.shape[0], 4, w.shape[1]), jnp.float32)
    results = {}
    for impl in ("fused", "xla"):
        fn, specs = _fn(op, mesh, 3, impl, True)
        xs, ws = _placed(mesh, specs, x, w)
        out = fn(xs, ws)
        grad = jax.jit(jax.grad(lambda x, w, fn=fn: jnp.sum(fn(x, w) * ct), argnums=(0, 1)))(xs, ws)
        results[impl] = [to64(out)] + [to64(g) for g in grad]
    ref = np.tensordot(to64(x), to64(w), axes=1)
    assert np.all(np.abs(results["fused"][0] - ref) <= _fp8_bound(to64(x), to64(w), "float32", op, 4))
    for got, want in zip(results["fused"], results["xla"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_shard_map_manual_over_tp_only(axis_type):
    """shard_map(axis_names={"tp"}) on a dp x tp mesh, x [batch over dp, seq over tp, K]: the FP8
    twin gathers the row scales without merging the dp-sharded batch into the rows, and the fused
    op (its own manual region over dp) matches it."""
    rng = np.random.default_rng()
    mesh = cpu_mesh((2, 4), ("dp", "tp"), axis_type)
    x, w = random_array(rng, (2, 8, 32), jnp.float32), random_array(rng, (32, 64), jnp.float32)
    xs, ws = place(mesh, x, P("dp", "tp")), place(mesh, w, P(None, "tp"))
    outs = {}
    for impl in ("fused", "xla"):
        body = functools.partial(flux_jax.ag_matmul, axis_name="tp", axis=1, impl=impl, fp8=True)
        f = jax.shard_map(
            body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P(None, None, "tp"), axis_names={"tp"}
        )
        outs[impl] = to64(jax.jit(f)(xs, ws))
    x64, w64 = to64(x), to64(w)
    assert np.all(
        np.abs(outs["fused"] - np.einsum("bsk,kn->bsn", x64, w64)) <= _fp8_bound(x64, w64, "float32", "ag", 4)
    )
    np.testing.assert_allclose(outs["fused"], outs["xla"], rtol=1e-5, atol=1e-5 * np.max(np.abs(outs["xla"])))


@pytest.mark.parametrize("rows", [6, 2])
def test_matmul_ar_two_shot_when_the_region_splits_rows(rows):
    """FP8 matmul_ar in a shard_map manual over tp only, with dp automatic: the fused op's own
    manual region splits x's rows over dp, so tp no longer divides them (6 -> 3 rows per dp
    shard): the planned two-shot cannot sum one chunk per rank, and the call takes the latency
    path there instead of failing at run time."""
    rng = np.random.default_rng()
    mesh = cpu_mesh((2, 2), ("dp", "tp"), AxisType.Auto)
    x = random_array(rng, (rows, 128), jnp.bfloat16)
    w = random_array(rng, (128, 32), jnp.bfloat16)
    body = functools.partial(flux_jax.matmul_ar, axis_name="tp", impl="fused", fp8=True)
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P(), axis_names={"tp"})
    with jax.set_mesh(mesh), flux_jax.config(fused_path="overlap"):
        sites = flux_jax.explain(f, x, w)
        assert [site.plan.path for site in sites] == ["latency"], str(sites)
        assert "rows divisible by tp=2" in sites[0].plan.reason and f"not {rows // 2} rows" in sites[0].plan.reason
        out = to64(jax.jit(f)(x, w))
    x64, w64 = to64(x), to64(w)
    assert np.all(np.abs(out - x64 @ w64) <= _fp8_bound(x64, w64, "bfloat16", "ar", 2))


def test_return_gathered_is_the_dequantized_fp8_rows():
    rng = np.random.default_rng()
    tp = 4
    mesh = cpu_mesh((tp,), ("tp",))
    x, w = _operands(rng, "ag", tp, 2, 32, 8, jnp.bfloat16)
    for impl in ("fused", "xla"):
        fn = jax.jit(
            jax.shard_map(
                functools.partial(flux_jax.ag_matmul, axis_name="tp", impl=impl, fp8=True, return_gathered=True),
                mesh=mesh,
                in_specs=(P("tp", None), P(None, "tp")),
                out_specs=(P(None, "tp"), P()),
                check_vma=False,
            )
        )
        out, gathered = fn(*_placed(mesh, (P("tp", None), P(None, "tp")), x, w))
        assert gathered.dtype == x.dtype and gathered.shape == x.shape
        x64, g64 = to64(x), to64(gathered)
        floor = FLOOR["float8_e4m3fn"] * np.max(np.abs(x64), axis=-1, keepdims=True)
        err = np.abs(g64 - x64)
        assert np.all(err <= (U["float8_e4m3fn"] + EPS["bfloat16"]) * np.abs(x64) + floor), impl
        assert np.max(err) > 0  # quantized, not the input
        # the output is the gathered rows times w's own e4m3 rounding (and the bf16 roundings)
        w64 = to64(w)
        ab = np.abs(g64) @ np.abs(w64)
        slack = (U["float8_e4m3fn"] + 3 * EPS["bfloat16"]) * ab + FLOOR["float8_e4m3fn"] * np.max(np.abs(w64)) * (
            np.sum(np.abs(g64), axis=1, keepdims=True)
        )
        assert np.all(np.abs(to64(out) - g64 @ w64) <= slack), impl


def test_rows_keep_their_own_scales_across_ranks():
    """Rank 0's rows are 1e-3 the size of rank 3's: per-row scales keep every row as accurate,
    relative to itself, as the bound says (a shared amax would flush the small rows)."""
    rng = np.random.default_rng()
    tp = 4
    mesh = cpu_mesh((tp,), ("tp",))
    x, w = _operands(rng, "ag", tp, 2, 32, 8, jnp.float32)
    x = x * jnp.repeat(jnp.asarray([1e-3, 1e-1, 1.0, 1e3], jnp.float32), 2)[:, None]
    x = x.at[1].set(0.0)  # an all-zero row: scale 1, output exactly zero
    fn, specs = _fn("ag", mesh, 2, "fused", True)
    out = to64(fn(*_placed(mesh, specs, x, w)))
    x64, w64 = to64(x), to64(w)
    ref = x64 @ w64
    assert np.all(np.abs(out - ref) <= _fp8_bound(x64, w64, "float32", "ag", tp))
    assert np.all(out[1] == 0)
    rel_row = np.max(np.abs(out - ref), axis=1) / np.max(np.abs(ref), axis=1).clip(1e-30)
    assert np.all(rel_row[[0, 2, 4, 6]] < 0.25), rel_row


def test_column_scaling_serves_columns_of_different_magnitudes():
    rng = np.random.default_rng()
    tp = 2
    mesh = cpu_mesh((tp,), ("tp",))
    x, w = _operands(rng, "ag", tp, 4, 32, 8, jnp.float32)
    w = w * (10.0 ** -np.arange(16) / 2)[None, :].astype(np.float32)  # columns 1 .. 1e-8
    recipe = flux_jax.Fp8(weight_scaling="column", margin=1)
    errs = {}
    for r in (recipe, flux_jax.Fp8()):
        fn, specs = _fn("ag", mesh, 2, "fused", r)
        out = to64(fn(*_placed(mesh, specs, x, w)))
        ref = to64(x) @ to64(w)
        assert np.all(np.abs(out - ref) <= _fp8_bound(to64(x), to64(w), "float32", "ag", tp, r))
        errs[r.weight_scaling] = np.max(np.abs(out - ref) / np.abs(ref).max(axis=0), axis=0)
    # per column: the small columns keep their precision only with their own scales
    assert np.all(errs["column"] < 0.2)
    assert np.max(errs["tensor"][-4:]) > 0.5


def test_recipe_fields_and_their_errors():
    r = flux_jax.Fp8(backward_format="e4m3", weight_scaling="column", margin=2)
    assert r.forward_format == "float8_e4m3fn" and r.backward_format == "float8_e4m3fn"
    assert flux_jax.Fp8(backward_format=jnp.float8_e5m2) == flux_jax.Fp8()
    assert hash(flux_jax.Fp8()) == hash(flux_jax.Fp8(forward_format="e4m3"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.margin = 3
    for bad in ("e5m2", jnp.bfloat16):  # the error names e4m3 alone, whatever else was given
        with pytest.raises(ValueError, match=r"forward_format must be float8_e4m3fn \(or 'e4m3'\).*e5m2 x e5m2"):
            flux_jax.Fp8(forward_format=bad)
    with pytest.raises(ValueError, match=r"backward_format must be one of \('float8_e4m3fn', 'float8_e5m2'\).*float16"):
        flux_jax.Fp8(backward_format="float16")
    with pytest.raises(ValueError, match="backward_format must be one of"):
        flux_jax.Fp8(backward_format=jnp.bfloat16)
    with pytest.raises(TypeError, match="backward_format must be an FP8 dtype or its name"):
        flux_jax.Fp8(backward_format=3.5)
    with pytest.raises(ValueError, match=r"weight_scaling must be one of \('tensor', 'column'\), got 'row'"):
        flux_jax.Fp8(weight_scaling="row")
    with pytest.raises(ValueError, match="margin must be in 0..8"):
        flux_jax.Fp8(margin=-1)
    with pytest.raises(TypeError, match="margin must be an int"):
        flux_jax.Fp8(margin=1.5)
    mesh = cpu_mesh((2,), ("tp",))
    for op in ("ag", "rs"):
        x, w = _operands(np.random.default_rng(), op, 2, 2, 16, 8, jnp.float32)
        with pytest.raises(
            TypeError,
            match=f"flux_jax.{'ag_matmul' if op == 'ag' else 'matmul_rs'}: fp8 must be "
            "True, False, None or a flux_jax.Fp8 recipe, got 'e4m3'",
        ):
            fn, specs = _fn(op, mesh, 2, "fused", "e4m3")
            fn(*_placed(mesh, specs, x, w))


def test_quantize_helpers():
    rng = np.random.default_rng()
    x = random_array(rng, (6, 40), jnp.float32).at[2].set(0.0)
    q, s = fp8.quantize(x, jnp.float8_e4m3fn, axis=-1)
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (6, 1) and s.dtype == jnp.float32
    assert float(s[2, 0]) == 1.0 and np.all(to64(q)[2] == 0)
    np.testing.assert_allclose(np.max(np.abs(to64(q)), axis=1)[[0, 1, 3, 4, 5]], 448.0)
    back = to64(fp8.dequantize(q, s, jnp.float32))
    x64 = to64(x)
    assert np.all(np.abs(back - x64) <= U["float8_e4m3fn"] * np.abs(x64) + FLOOR["float8_e4m3fn"] * 448 * to64(s))
    q2, s2 = fp8.quantize(x, "float8_e5m2", margin=3)
    assert s2.shape == (1, 1) and np.max(np.abs(to64(q2))) == 57344.0 / 8


@pytest.mark.parametrize("path", ["overlap", "latency", "decode"])
@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_tiny_rows_stay_finite_and_nonfinite_inputs_show(op, path):
    """A row of tiny but normal magnitudes (amax below e4m3's max times float32's smallest normal:
    its scale would be subnormal, and a device that flushes subnormals divides by 0) comes out
    finite and within FP8 rounding; a NaN in w (one scale per rank's shard) makes every output
    that scale touches NaN, never finite numbers from a made-up scale."""
    tp, m_local, k, n = 2, 4, 32, 16
    mesh = cpu_mesh((tp,), ("tp",))
    rng = np.random.default_rng()
    x, w = _operands(rng, op, tp, m_local, k, n, jnp.float32)
    x = x.at[1].multiply(1e-37).at[1, 0].set(0.0)
    recipe = fp8.Fp8()
    fn, specs = _fn(op, mesh, 2, "fused", recipe)
    with flux_jax.config(fused_path=path):
        out = to64(fn(*_placed(mesh, specs, x, w)))
        x64, w64 = to64(x), to64(w)
        ref = x64 @ w64
        assert np.isfinite(out).all(), f"{op} {path}: a tiny row gave non-finite output"
        assert np.all(np.abs(out - ref) <= _fp8_bound(x64, w64, "float32", op, tp, recipe))
        bad = to64(fn(*_placed(mesh, specs, x, w.at[3, 2].set(jnp.nan))))
    # The NaN is in rank 0's shard: ag_matmul's columns of that shard (each rank scales its own
    # shard), every output of the others (their sums take rank 0's part).
    touched = bad[:, :n] if op == "ag" else bad
    assert np.isnan(touched).all(), f"{op} {path}: a NaN in w must show in every output its scale touches"


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_decode_path_runs_the_ops_own_call_on_fp8_operands(op):
    """fused_path="decode" with FP8: the op's own custom call on the FP8 operands with the decode
    path's attribute and this rank's row scales (ag_matmul's travel with its rows: no collective
    besides the call); the same numbers as the latency composition (XLA's FP8 GEMM) up to the
    output's rounding."""
    import re

    rng = np.random.default_rng()
    tp = 4
    mesh = cpu_mesh((tp,), ("tp",))
    x, w = _operands(rng, op, tp, 2, 32, 16, jnp.bfloat16)
    with flux_jax.config(fused_path="decode"):
        fused, specs = _fn(op, mesh, 2, "fused", True)
        args = _placed(mesh, specs, x, w)
        sites = flux_jax.explain(fused, *args)
        hlo = fused.lower(*args).as_text()
        got = to64(fused(*args))
    assert [site.plan.path for site in sites] == ["decode"], sites
    target = {"ag": "flux_jax_ag_matmul", "rs": "flux_jax_matmul_rs", "ar": "flux_jax_matmul_ar"}[op]
    calls = re.findall(rf"custom_call @{target}\((.*?)\).*?: \((.*?)\) ->", hlo)
    assert len(calls) == 1, hlo
    assert calls[0][1].count("f8E4M3FN") == 2 and calls[0][1].count("xf32>") == 2, calls[0][1]
    assert f"tensor<{2 if op == 'ag' else 8}xf32>" in calls[0][1], calls[0][1]  # this rank's rows' scales
    assert re.search(r"path = 1 : i32", hlo), hlo  # FusedPath::kDecode
    assert not re.search(r"flux_jax_(all_gather|reduce_scatter|all_reduce)", hlo)
    with flux_jax.config(fused_path="latency"):
        latency, _ = _fn(op, mesh, 2, "fused", True)
        want = to64(latency(*args))
    x64, w64 = to64(x), to64(w)
    assert np.all(np.abs(got - np.tensordot(x64, w64, axes=1)) <= _fp8_bound(x64, w64, "bfloat16", op, tp))
    ab = np.tensordot(np.abs(x64), np.abs(w64), axes=1)
    assert np.all(np.abs(got - want) <= 2 * tp * EPS["bfloat16"] * ab + 1e-30)


def test_ag_decode_path_gathered_rows_and_gradients():
    """ag_matmul's FP8 decode path with return_gathered (and so under value_and_grad): the
    gathered rows are the e4m3 rows dequantized with every rank's scales, which are then gathered
    (the one collective), and the gradients equal the latency composition's."""
    rng = np.random.default_rng()
    tp = 4
    mesh = cpu_mesh((tp,), ("tp",))
    x, w = _operands(rng, "ag", tp, 2, 32, 16, jnp.bfloat16)
    runs = {}
    for path in ("decode", "latency"):
        with flux_jax.config(fused_path=path):
            fused, specs = _fn("ag", mesh, 2, "fused", True, return_gathered=True)
            args = _placed(mesh, specs, x, w)
            out, gathered = fused(*args)
            loss = lambda x, w, f=fused: jnp.sum(jnp.tanh(f(x, w)[0].astype(jnp.float32)))  # noqa: E731
            grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
            hlo = fused.lower(*args).as_text()
        runs[path] = (to64(out), to64(gathered), [to64(g) for g in grads], hlo)
    (out, gathered, grads, hlo), (want, want_gathered, want_grads, _) = runs["decode"], runs["latency"]
    assert hlo.count("custom_call @flux_jax_all_gather") == 1 and "flux_jax_ag_matmul" in hlo  # the scales
    np.testing.assert_array_equal(gathered, want_gathered)
    x64 = to64(x)
    gathered = gathered[:, : x64.shape[1]]  # every rank's copy, side by side (out_specs)
    floor = FLOOR["float8_e4m3fn"] * np.max(np.abs(x64), axis=-1, keepdims=True)
    assert np.all(np.abs(gathered - x64) <= (U["float8_e4m3fn"] + EPS["bfloat16"]) * np.abs(x64) + floor)
    assert np.max(np.abs(gathered - x64)) > 0  # visibly the e4m3 rows
    ab = np.tensordot(np.abs(x64), np.abs(to64(w)), axes=1)
    assert np.all(np.abs(out - want) <= 2 * tp * EPS["bfloat16"] * ab + 1e-30)
    for g, t in zip(grads, want_grads):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, t, rtol=0, atol=2**-6 * np.max(np.abs(t)))


def test_plans_and_explain():
    cfg = flux_jax.Config()
    cpu = _plan.Problem("ag_matmul", 64, 256, 256, np.dtype("bfloat16"), 2, "cpu", fp8="float8_e4m3fn")
    assert _plan.plan(cpu, "fused", cfg).path == "overlap"  # the CPU backend runs one protocol
    assert _plan.plan(cpu, "auto", cfg).path == "twin"
    e5m2 = dataclasses.replace(cpu, fp8="float8_e5m2")  # a backward GEMM's rows: the e5m2 x e4m3 kernel
    e5m2_plan = _plan.plan(e5m2, "auto", cfg, backward=True)
    assert e5m2_plan.path == "overlap" and "row operand in e5m2" in e5m2_plan.reason
    f32 = dataclasses.replace(cpu, dtype=np.dtype("float32"))  # the FP8 instance writes bfloat16
    assert _plan.plan(f32, "fused", cfg).path == "latency"
    gpu = dataclasses.replace(cpu, platform="cuda")
    auto = _plan.plan(gpu, "auto", cfg, on_hopper=True)
    assert auto.path == "twin" and "not measured" in auto.reason
    assert _plan.plan(gpu, "fused", cfg, on_hopper=True).path == "latency"  # 64 rows: nothing to pipeline
    big = dataclasses.replace(gpu, rows=8192, k=4096, n=8192)
    assert _plan.plan(big, "fused", cfg, on_hopper=True).path == "overlap"
    forced = _plan.plan(gpu, "fused", flux_jax.Config(fused_path="overlap"), on_hopper=True)
    assert forced.path == "overlap" and "FP8 overlap GEMM" in forced.reason
    pinned = flux_jax.Config(fused_path="overlap")
    unaligned = _plan.plan(dataclasses.replace(gpu, n=252), "fused", pinned, on_hopper=True)
    assert unaligned.path == "latency" and "do not serve" in unaligned.reason
    decode_cfg = flux_jax.Config(fused_path="decode")
    for op in ("ag_matmul", "matmul_rs", "matmul_ar"):
        small = dataclasses.replace(gpu, op=op, transpose_w=True)
        assert _plan.plan(small, "fused", decode_cfg, on_hopper=True).path == "decode"
        assert _plan.plan(small, "fused", cfg, on_hopper=True).path == "latency"  # only where asked for
        e5m2_rows = _plan.plan(dataclasses.replace(small, fp8="float8_e5m2"), "fused", decode_cfg, on_hopper=True)
        assert e5m2_rows.path == "latency" and "serve e4m3 rows" in e5m2_rows.reason  # no e5m2 decode kernel
        assert _plan.plan(dataclasses.replace(small, rows=512), "fused", decode_cfg, on_hopper=True).path == "latency"
        wide = _plan.plan(dataclasses.replace(small, n=40000), "fused", decode_cfg, on_hopper=True)
        assert wide.path == ("decode" if op == "ag_matmul" else "latency")  # RS, AR: the exchange's limits
    odd_k = dataclasses.replace(gpu, k=200)
    assert "multiple of 16" in _plan.unavailable_on_hopper(odd_k)
    rs32 = dataclasses.replace(gpu, op="matmul_rs", dtype=np.dtype("float32"))
    assert "bfloat16 or float16" in _plan.unavailable_on_hopper(rs32)
    assert _plan.unavailable_on_hopper(dataclasses.replace(gpu, op="matmul_rs")) is None
    assert "FP8: rows in float8_e4m3fn" in cpu.describe()
    ar = dataclasses.replace(gpu, op="matmul_ar", rows=4096, k=4096, n=8192)
    two_shot = _plan.plan(ar, "fused", cfg, on_hopper=True)
    assert two_shot.path == "overlap" and "FP8 two-shot" in two_shot.reason, two_shot
    assert _plan.plan(dataclasses.replace(ar, rows=64), "fused", cfg, on_hopper=True).path == "latency"
    assert _plan.plan(dataclasses.replace(ar, rows=4095), "fused", pinned, on_hopper=True).path == "latency"
    assert _plan.plan(ar, "auto", cfg, on_hopper=True).path == "twin"
    ar_cpu = dataclasses.replace(cpu, op="matmul_ar", rows=6)  # 6 rows over tp = 2
    assert _plan.plan(ar_cpu, "fused", cfg).path == "overlap"
    assert _plan.plan(dataclasses.replace(ar_cpu, rows=7), "fused", cfg).path == "latency"

    mesh = cpu_mesh((2,), ("tp",))
    x, w = _operands(np.random.default_rng(), "ag", 2, 2, 16, 8, jnp.float32)
    body = functools.partial(flux_jax.ag_matmul, axis_name="tp", impl="fused", fp8=True)
    fn = jax.shard_map(
        lambda x, w: jax.lax.psum(jnp.sum(body(x, w)), "tp"),
        mesh=mesh,
        in_specs=(P("tp", None), P(None, "tp")),
        out_specs=P(),
    )
    sites = flux_jax.explain(jax.grad(fn, argnums=(0, 1)), *_placed(mesh, (P("tp", None), P(None, "tp")), x, w))
    text = str(sites)
    assert len(sites) == 2 and all(site.plan.path == "latency" for site in sites), text
    assert "rows in float8_e4m3fn" in text and "rows in float8_e5m2" in text


def test_vmap_over_x_keeps_per_row_scales():
    rng = np.random.default_rng()
    mesh = cpu_mesh((2,), ("tp",))
    x = random_array(rng, (3, 4, 16), jnp.float32)  # vmapped over the leading 3
    w = random_array(rng, (16, 8), jnp.float32)
    outs = {}
    for impl in ("fused", "xla"):
        body = jax.vmap(functools.partial(flux_jax.ag_matmul, axis_name="tp", impl=impl, fp8=True), in_axes=(0, None))
        fn = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P(None, None, "tp"))
        )
        outs[impl] = to64(fn(*_placed(mesh, (P(None, "tp"), P(None, "tp")), x, w)))
    np.testing.assert_allclose(outs["fused"], outs["xla"], rtol=1e-6, atol=1e-6)
    ref = np.einsum("bsk,kn->bsn", to64(x), to64(w))
    assert np.max(np.abs(outs["fused"] - ref)) / np.max(np.abs(ref)) < 0.1


def test_global_view_helpers_and_explain_auto():
    rng = np.random.default_rng()
    mesh = cpu_mesh((4,), ("tp",))
    for op, helper in (("ag", flux_jax.ag_matmul_sharded), ("rs", flux_jax.matmul_rs_sharded)):
        x, w = _operands(rng, op, 4, 2, 16, 8, jnp.float32)
        specs = ag_specs(mesh, "tp", 2) if op == "ag" else rs_specs(mesh, "tp", 2)
        xs, ws = _placed(mesh, specs[:2], x, w)
        fused = to64(jax.jit(functools.partial(helper, mesh=mesh, axis_name="tp", impl="fused", fp8=True))(xs, ws))
        twin = to64(jax.jit(functools.partial(helper, mesh=mesh, axis_name="tp", impl="xla", fp8=True))(xs, ws))
        np.testing.assert_allclose(fused, twin, rtol=1e-6, atol=1e-6 * np.max(np.abs(twin)))
        assert np.all(np.abs(fused - to64(x) @ to64(w)) <= _fp8_bound(to64(x), to64(w), "float32", op, 4))
    text = flux_jax.explain_auto("ag_matmul", 256, 4096, 4096, 2, fp8=True)
    assert "with FP8 operands" in text and "the XLA twin" in text and "not measured" in text
