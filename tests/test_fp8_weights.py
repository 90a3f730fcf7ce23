"""Pre-quantized FP8 weights (flux_jax.Fp8Weight): quantized once, passed as any op's `w`.

For every op and path, with per-tensor and per-column scales: the compiled program holds no
reduction over the weight (nothing quantizes it again; the same check finds the amax in the
fp8=True program), the output matches a float64 reference computed in numpy from the weight's q
and scale and x's rows quantized per row, and it equals fp8=True's output when the weight is
quantized as fp8=True quantizes it (per shard, inside the shard_map). The weight is frozen (a
zero cotangent) while dx flows straight-through. Also: the spec helper under jit + shard_map,
the global-view helpers, the Flax layers' quantize_kernel, and the errors.

Bounds. With the same FP8 operands the fused and XLA paths differ only by float32 accumulation
order and the output's roundings in bfloat16: once (2^-9 |y|), or for the reduce-scattered and
all-reduced outputs the partials rounded before they are summed, so outputs are compared against
the reference within 2 2^-8 |x| @ |w| (ag_matmul, column_matmul) or 2 tp 2^-8 |x| @ |w|.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import flux_jax
from flux_jax import Fp8, Fp8Weight
from flux_jax import fp8 as fp8_lib
from flux_jax.flax import ColumnParallelLinear, Fp8Kernel, RowParallelLinear, quantize_kernels, sharded_call

from helpers import cpu_mesh, place, random_array, to64

TP = 4
M, K, N = 8, 64, 128  # global x [M, K], w [K, N]
EPS = 2.0**-8  # bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
U4, U5 = 2.0**-4, 2.0**-3  # the e4m3 and e5m2 unit roundoffs (round to nearest)

# op: (function, x's spec, the logical weight's spec, the output's spec)
OPS = {
    "ag": (flux_jax.ag_matmul, P("tp", None), P(None, "tp"), P(None, "tp")),
    "rs": (flux_jax.matmul_rs, P(None, "tp"), P("tp", None), P("tp", None)),
    "ar": (flux_jax.matmul_ar, P(None, "tp"), P("tp", None), P()),
    "col": (flux_jax.column_matmul, P(), P(None, "tp"), P(None, "tp")),
}
# What a weight shard looks like: [K, N/tp] column-parallel, [K/tp, N] row-parallel.
SHARD = {"ag": (K, N // TP), "col": (K, N // TP), "rs": (K // TP, N), "ar": (K // TP, N)}
PATHS = {  # id: (impl, Config.fused_path)
    "overlap": ("fused", "overlap"),
    "latency": ("fused", "latency"),
    "decode": ("fused", "decode"),
    "xla": ("xla", None),
    "auto": ("auto", None),
}
# The flux_jax custom calls of a fused forward (column_matmul's forward is XLA's GEMM: its
# fused op is the backward's matmul_ar, checked with the gradients).
CALLS = {
    ("ag", "overlap"): {"flux_jax_ag_matmul", "flux_jax_all_gather"},
    ("ag", "latency"): {"flux_jax_all_gather"},
    ("ag", "decode"): {"flux_jax_ag_matmul"},
    ("rs", "overlap"): {"flux_jax_matmul_rs"},
    ("rs", "latency"): {"flux_jax_reduce_scatter"},
    ("rs", "decode"): {"flux_jax_matmul_rs"},
    ("ar", "overlap"): {"flux_jax_matmul_rs", "flux_jax_all_gather"},
    ("ar", "latency"): {"flux_jax_all_reduce"},
    ("ar", "decode"): {"flux_jax_matmul_ar"},
}


def _mesh():
    return cpu_mesh((TP,), ("tp",))


def _operands(seed=0):
    rng = np.random.default_rng(seed)
    return random_array(rng, (M, K), jnp.bfloat16), random_array(rng, (K, N), jnp.bfloat16, scale=K**-0.5)


def _fn(op, mesh, impl, w_spec, **kw):
    fn, x_spec, _, out_spec = OPS[op]
    body = functools.partial(fn, axis_name="tp", impl=impl, **kw)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec))


def _place_weight(mesh, w, spec):
    """A high-precision weight placed by its spec, or an Fp8Weight leaf by leaf (partition_spec)."""
    if isinstance(w, Fp8Weight):
        return jax.tree.map(lambda a, s: place(mesh, a, s), w, w.partition_spec(spec))
    return place(mesh, w, spec)


def _config(path):
    return flux_jax.config(fused_path=path) if path else flux_jax.config()


# ---- the float64 reference and the compiled program's reductions -------------------------------


def _rows(x):
    """x's rows through e4m3, dequantized, float64: fp8=True's row quantization (checked against
    its rounding bounds in test_fp8.py), compiled as in the ops. Neither a numpy copy nor an eager
    run matches it: compiled, XLA divides by a constant as a multiply by its reciprocal, and jax
    0.12 divides exactly when eager (either moves a scale by an ulp and rounds values the other
    way)."""
    q, scale = jax.jit(lambda a: fp8_lib.quantize_rows(a, Fp8()))(x)
    return np.asarray(q).astype(np.float64) * np.asarray(scale, dtype=np.float64)


def _np_weight(fw):
    """The logical weight [k, n] from q [n, k] and the scales, float64."""
    q = np.asarray(fw.q).astype(np.float64)
    scale = np.asarray(fw.scale, dtype=np.float64)
    return (q * (scale if scale.ndim == 0 else scale[:, None])).T


def _reference(op, x, fw):
    """(x_q @ w_q, |x_q| @ |w_q|) in float64, w_q from the Fp8Weight's q and scale in numpy: x's
    rows quantized per row, per rank's K-slice for the row-parallel ops (each rank quantizes its
    own slice)."""
    if op in ("rs", "ar"):
        xd = np.concatenate([_rows(s) for s in jnp.split(x, TP, axis=-1)], axis=-1)
    else:
        xd = _rows(x)
    wd = _np_weight(fw)
    return xd @ wd, np.abs(xd) @ np.abs(wd)


def _weight_reductions(hlo: str, shape) -> int:
    """How many reductions (`reduce`, or `reduce-window`, XLA:CPU's first stage of a large one)
    of a compiled HLO module read an array of `shape` or its transpose (the weight shard: its
    amax), found by the operand's definition."""
    defs = dict(re.findall(r"%([\w.\-]+) = \w+\[([\d,]*)\]", hlo))
    shapes = {tuple(shape), tuple(reversed(shape))}
    count = 0
    for operand in re.findall(r"\breduce(?:-window)?\(%([\w.\-]+)", hlo):
        dims = tuple(int(d) for d in defs.get(operand, "").split(",") if d)
        count += dims in shapes
    return count


def _custom_calls(hlo: str) -> set:
    return set(re.findall(r'custom_call_target="(flux_jax_\w+)"', hlo))


# ---- forward ---------------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", ["tensor", "column"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("op", list(OPS))
def test_prequantized_weight_is_not_quantized_again_and_matches_the_reference(op, path, scaling):
    """A global Fp8Weight sharded by partition_spec: no reduction over the weight in the compiled
    program (fp8=True's has its amax there), the op's custom calls, and the output within the
    output's rounding of the float64 product of the FP8 operands."""
    impl, fused_path = PATHS[path]
    mesh = _mesh()
    recipe = Fp8(weight_scaling=scaling)
    x, w = _operands()
    fw = Fp8Weight.quantize(w, recipe)
    _, x_spec, w_spec, _ = OPS[op]
    xs = place(mesh, x, x_spec)
    with _config(fused_path):
        fn = _fn(op, mesh, impl, fw.partition_spec(w_spec))
        args = (xs, _place_weight(mesh, fw, w_spec))
        out = to64(fn(*args))
        hlo = fn.lower(*args).compile().as_text()
        per_call = _fn(op, mesh, impl, w_spec, fp8=recipe)
        per_call_hlo = per_call.lower(xs, place(mesh, w, w_spec)).compile().as_text()
    assert _weight_reductions(per_call_hlo, SHARD[op]) >= 1, "the check must see fp8=True's amax of the weight"
    assert _weight_reductions(hlo, SHARD[op]) == 0, f"{op} {path}: the weight is reduced (quantized) again"
    calls = _custom_calls(hlo)
    if impl == "fused" and op != "col":
        assert calls == CALLS[op, path], calls
    if impl != "fused":
        assert not calls, calls  # CPU: auto takes the twin for FP8
    ref, ab = _reference(op, x, fw)
    assert out.shape == ref.shape and np.all(np.isfinite(out))
    err = np.abs(out - ref)
    bound = (2 * TP if op in ("rs", "ar") else 2) * EPS * ab + 1e-30
    assert np.all(err <= bound), f"{op} {path} {scaling}: error up to {np.max(err / bound):.2f}x the bound"


@pytest.mark.parametrize("scaling", ["tensor", "column"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("op", list(OPS))
def test_equals_fp8_true_on_the_weight_quantized_the_same_way(op, path, scaling):
    """Each rank quantizes its shard into an Fp8Weight, as fp8=True does on every call: the
    outputs are the same bits (the same FP8 operands, the same GEMM), within float32 accumulation
    order where XLA's GEMM reads the [n, k] weight instead of [k, n]."""
    impl, fused_path = PATHS[path]
    mesh = _mesh()
    recipe = Fp8(weight_scaling=scaling)
    x, w = _operands(1)
    fn, x_spec, w_spec, out_spec = OPS[op]

    def prequantized(x, w):
        return fn(x, Fp8Weight.quantize(w, recipe), axis_name="tp", impl=impl)

    with _config(fused_path):
        pre = jax.jit(jax.shard_map(prequantized, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec))
        args = (place(mesh, x, x_spec), place(mesh, w, w_spec))
        got = to64(pre(*args))
        want = to64(_fn(op, mesh, impl, w_spec, fp8=recipe)(*args))
    if impl == "fused" and fused_path != "latency":  # our kernels read the same K-major operands
        np.testing.assert_array_equal(got, want)
    else:
        ab = np.abs(to64(x)) @ np.abs(to64(w))
        assert np.all(np.abs(got - want) <= 2 * EPS * ab + 1e-30)
    assert np.max(np.abs(got)) > 0


# ---- gradients -------------------------------------------------------------------------------


def _loss(op, mesh, impl, w_spec, **kw):
    fn = _fn(op, mesh, impl, w_spec, **kw)
    return lambda x, w, ct: jnp.sum(fn(x, w).astype(jnp.float32) * ct)


@pytest.mark.parametrize("scaling", ["tensor", "column"])
@pytest.mark.parametrize("impl", ["fused", "xla"])
@pytest.mark.parametrize("op", list(OPS))
def test_dx_flows_straight_through_and_the_weight_is_frozen(op, impl, scaling):
    """jax.grad through a global Fp8Weight: its cotangent is an Fp8Weight of zeros; dx is close
    to ct @ w^T (float64, the FP8 weight) within dy's e5m2 and the e4m3 roundings, and to
    fp8=True's dx on the weight quantized the same way: the same bits per-tensor (dx's FP8 GEMM
    reads q transposed with the same scale), within one more e4m3 rounding per-column (w is
    dequantized and quantized per row for dx). The fused backward runs our custom calls (but
    matmul_ar's, a local GEMM), and with a per-tensor scale the whole gradient program reduces
    nothing over the weight."""
    mesh = _mesh()
    recipe = Fp8(weight_scaling=scaling)
    x, w = _operands(2)
    ct = random_array(np.random.default_rng(3), (M, N), jnp.float32)
    fn, x_spec, w_spec, out_spec = OPS[op]
    fw = Fp8Weight.quantize(w, recipe)
    xs, cts = place(mesh, x, x_spec), place(mesh, ct, out_spec)
    loss = _loss(op, mesh, impl, fw.partition_spec(w_spec))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    fws = _place_weight(mesh, fw, w_spec)
    dx, dw = grad(xs, fws, cts)
    assert isinstance(dw, Fp8Weight) and dw.scaling == scaling
    assert dw.q.dtype == jnp.float8_e4m3fn and dw.q.shape == fw.q.shape and dw.scale.shape == fw.scale.shape
    assert not np.any(to64(dw.q)) and not np.any(to64(dw.scale))
    dx = to64(dx)
    want = to64(ct) @ _np_weight(fw).T
    rel = np.linalg.norm(dx - want) / np.linalg.norm(want)
    assert rel <= np.sqrt(U5**2 + 2 * U4**2) + 4 * EPS, f"dx relative error {rel:.3f}"
    assert rel > EPS / 4, "dy is quantized to e5m2 in the backward"

    # fp8=True on the weight each rank quantizes the same way
    def prequantized(x, w):
        return fn(x, Fp8Weight.quantize(w, recipe), axis_name="tp", impl=impl)

    pre = jax.shard_map(prequantized, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
    per_call = _loss(op, mesh, impl, w_spec, fp8=recipe)
    ws = place(mesh, w, w_spec)
    got = to64(jax.jit(jax.grad(lambda x, w, ct: jnp.sum(pre(x, w).astype(jnp.float32) * ct)))(xs, ws, cts))
    ref = to64(jax.jit(jax.grad(per_call))(xs, ws, cts))
    if scaling == "tensor":
        np.testing.assert_array_equal(got, ref)
    else:
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= U4 + 4 * EPS
    hlo = grad.lower(xs, fws, cts).compile().as_text()
    if impl == "fused" and op != "ar":  # matmul_ar's dx is a local GEMM (and the loss is linear in y)
        assert _custom_calls(hlo), "the fused backward runs our custom calls"
    if scaling == "tensor":
        assert _weight_reductions(hlo, SHARD[op]) == 0, "the backward quantizes the weight again"


def test_vmap_over_x_with_a_prequantized_weight():
    mesh = _mesh()
    rng = np.random.default_rng(4)
    x = random_array(rng, (3, M, K), jnp.bfloat16)
    _, w = _operands(4)
    fw = Fp8Weight.quantize(w)
    spec = fw.partition_spec(P(None, "tp"))
    body = jax.vmap(functools.partial(flux_jax.ag_matmul, axis_name="tp", impl="fused"), in_axes=(0, None))
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), spec), out_specs=P(None, None, "tp")))
    out = to64(fn(place(mesh, x, P(None, "tp")), _place_weight(mesh, fw, P(None, "tp"))))
    for b in range(3):
        ref, ab = _reference("ag", x[b], fw)
        assert np.all(np.abs(out[b] - ref) <= 2 * EPS * ab + 1e-30)


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_shard_map_manual_over_tp_only(op):
    """A dp x tp mesh, shard_map manual over tp only, x's batch over dp: the fused op runs in its
    own manual region over dp, where the Fp8Weight's leaves go in replicated."""
    mesh = cpu_mesh((2, TP), ("dp", "tp"), AxisType.Auto)
    rng = np.random.default_rng(9)
    x = random_array(rng, (2, M, K), jnp.bfloat16)
    _, w = _operands(9)
    fn, _, w_spec, _ = OPS[op]
    if op == "ag":
        kw, x_spec, out_spec = {"axis": 1}, P(None, "tp"), P(None, None, "tp")
    else:
        kw, x_spec = ({"scatter_dimension": 1} if op == "rs" else {}), P(None, None, "tp")
        out_spec = P(None, "tp") if op == "rs" else P()
    for scaling in ("tensor", "column"):
        fw = Fp8Weight.quantize(w, Fp8(weight_scaling=scaling))
        body = functools.partial(fn, axis_name="tp", impl="fused", **kw)
        f = jax.shard_map(
            body, mesh=mesh, in_specs=(x_spec, fw.partition_spec(w_spec)), out_specs=out_spec, axis_names={"tp"}
        )
        with jax.set_mesh(mesh):
            out = to64(jax.jit(f)(x, fw))
            hlo = jax.jit(f).lower(x, fw).compile().as_text()
        assert _custom_calls(hlo) and _weight_reductions(hlo, SHARD[op]) == 0
        for b in range(2):
            ref, ab = _reference(op, x[b], fw)
            assert np.all(np.abs(out[b] - ref) <= 2 * TP * EPS * ab + 1e-30), (op, scaling, b)


@pytest.mark.parametrize("op", list(OPS))
def test_global_view_helpers_take_a_prequantized_weight(op):
    """flux_jax.<op>_sharded places the Fp8Weight's leaves by partition_spec and runs the op."""
    helper = {
        "ag": flux_jax.ag_matmul_sharded,
        "rs": flux_jax.matmul_rs_sharded,
        "ar": flux_jax.matmul_ar_sharded,
        "col": flux_jax.column_matmul_sharded,
    }[op]
    mesh = _mesh()
    x, w = _operands(5)
    for scaling in ("tensor", "column"):
        fw = Fp8Weight.quantize(w, Fp8(weight_scaling=scaling))
        out = to64(jax.jit(functools.partial(helper, mesh=mesh, axis_name="tp", impl="fused"))(x, fw))
        ref, ab = _reference(op, x, fw)
        assert np.all(np.abs(out - ref) <= 2 * TP * EPS * ab + 1e-30), (op, scaling)
    with pytest.raises(TypeError, match=f"flux_jax.{helper.__name__}: w is a pre-quantized"):
        helper(x, fw, mesh=mesh, axis_name="tp", fp8=False)


# ---- the type itself -------------------------------------------------------------------------


@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("scaling", ["tensor", "column"])
def test_quantize_is_the_recipe_in_numpy_and_dequantize_inverts_it(scaling, margin):
    rng = np.random.default_rng(6)
    w = random_array(rng, (48, 24), jnp.float32) * jnp.asarray(10.0 ** np.linspace(-3, 3, 24), jnp.float32)
    recipe = Fp8(weight_scaling=scaling, margin=margin)
    fw = Fp8Weight.quantize(w, recipe)
    assert fw.shape == (48, 24) and fw.ndim == 2 and fw.dtype == jnp.float8_e4m3fn and fw.scaling == scaling
    assert fw.q.shape == (24, 48) and fw.scale.dtype == jnp.float32
    assert fw.scale.shape == (() if scaling == "tensor" else (24,))
    w32 = np.asarray(w)
    amax = np.max(np.abs(w32), axis=None if scaling == "tensor" else 0)
    scale = np.asarray(fw.scale)
    # XLA divides by the constant as a multiply by its reciprocal: within one float32 ulp
    np.testing.assert_allclose(scale, amax / np.float32(448.0 / 2**margin), rtol=2.0**-23, atol=0)
    q = np.clip(w32 / scale, -448.0, 448.0).astype(E4M3)
    np.testing.assert_array_equal(np.asarray(fw.q).view(np.uint8), q.T.view(np.uint8))
    back = to64(fw.dequantize(jnp.float32))
    assert back.shape == (48, 24)
    floor = 2.0**-10 * np.broadcast_to(scale, w32.shape)  # e4m3's subnormal spacing / 2, scaled
    assert np.all(np.abs(back - w32) <= U4 * np.abs(w32) + floor)
    assert fw.dequantize(jnp.bfloat16).dtype == jnp.bfloat16
    # a [n, k] weight read transposed gives the same Fp8Weight
    ft = Fp8Weight.quantize(w.T, recipe, transpose_w=True)
    np.testing.assert_array_equal(np.asarray(ft.q).view(np.uint8), np.asarray(fw.q).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(ft.scale), np.asarray(fw.scale))


def test_it_is_a_pytree_with_static_scaling():
    fw = Fp8Weight.quantize(_operands()[1], Fp8(weight_scaling="column"))
    leaves, tree = jax.tree.flatten(fw)
    assert [a.dtype for a in leaves] == [jnp.float8_e4m3fn, jnp.float32]
    assert jax.tree.unflatten(tree, leaves) == fw
    assert jax.tree.structure(Fp8Weight.quantize(_operands()[1])) != tree  # the scaling is static
    doubled = jax.jit(lambda f: Fp8Weight(f.q, f.scale * 2, f.scaling))(fw)
    np.testing.assert_array_equal(np.asarray(doubled.scale), 2 * np.asarray(fw.scale))
    shapes = jax.eval_shape(Fp8Weight.quantize, jax.ShapeDtypeStruct((K, N), jnp.bfloat16))
    assert shapes.shape == (K, N) and shapes.q.shape == (N, K) and shapes.scale.shape == ()
    assert fw.recipe == Fp8(weight_scaling="column")


def test_partition_specs_of_the_leaves():
    tensor = Fp8Weight.quantize(_operands()[1])
    column = Fp8Weight.quantize(_operands()[1], Fp8(weight_scaling="column"))
    assert tensor.partition_spec(P(None, "tp")) == Fp8Weight(P("tp", None), P(), "tensor")
    assert column.partition_spec(P(None, "tp")) == Fp8Weight(P("tp", None), P("tp"), "column")
    assert column.partition_spec(P("tp", None)) == Fp8Weight(P(None, "tp"), P(None), "column")
    assert column.partition_spec(P("fsdp", "tp")) == Fp8Weight(P("tp", "fsdp"), P("tp"), "column")
    assert tensor.partition_spec(P()) == Fp8Weight(P(None, None), P(), "tensor")
    assert fp8_lib.weight_spec(P(None, "tp"), "column") == column.partition_spec(P(None, "tp"))
    with pytest.raises(ValueError, match="rank 2"):
        tensor.partition_spec(P(None, None, "tp"))
    with pytest.raises(TypeError, match="must be a PartitionSpec"):
        tensor.partition_spec(("tp", None))
    with pytest.raises(ValueError, match="scaling must be one of"):
        fp8_lib.weight_spec(P(), "row")


def test_recipe_resolution():
    fw = Fp8Weight.quantize(_operands()[1], Fp8(weight_scaling="column", margin=3))
    assert fp8_lib.resolve("op", None, fw) == Fp8(weight_scaling="column")
    assert fp8_lib.resolve("op", True, fw) == Fp8(weight_scaling="column")
    explicit = Fp8(weight_scaling="column", backward_format="e4m3", margin=1)
    assert fp8_lib.resolve("op", explicit, fw) is explicit
    assert fp8_lib.resolve("op", None) is None  # a high-precision weight: unchanged


# ---- errors ----------------------------------------------------------------------------------


def _call(op, x, w, **kw):
    """The op inside jit + shard_map, every operand replicated (errors raise at trace, naming
    the shapes the op sees)."""
    body = functools.partial(OPS[op][0], axis_name="tp", impl="fused", **kw)
    w_spec = jax.tree.map(lambda _: P(), w)
    return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(P(), w_spec), out_specs=P(), check_vma=False))(x, w)


@pytest.mark.parametrize("op", list(OPS))
def test_errors_name_the_op_and_the_leaf(op):
    name = {"ag": "ag_matmul", "rs": "matmul_rs", "ar": "matmul_ar", "col": "column_matmul"}[op]
    x, w = _operands()
    fw = Fp8Weight.quantize(w)
    col = Fp8Weight.quantize(w, Fp8(weight_scaling="column"))
    with pytest.raises(TypeError, match=rf"flux_jax.{name}: w is a pre-quantized flux_jax.Fp8Weight but fp8=False"):
        _call(op, x, fw, fp8=False)
    with pytest.raises(ValueError, match=rf"flux_jax.{name}: the recipe's weight_scaling='tensor' conflicts"):
        _call(op, x, col, fp8=Fp8())
    with pytest.raises(TypeError, match=rf"flux_jax.{name}: w.q must be float8_e4m3fn.*bfloat16\[128, 64\]"):
        _call(op, x, Fp8Weight(w.T, fw.scale))
    with pytest.raises(TypeError, match=r"w.q must be float8_e4m3fn.*float8_e5m2"):
        _call(op, x, Fp8Weight(fw.q.astype(jnp.float8_e5m2), fw.scale))
    with pytest.raises(ValueError, match=r"w.scale must be float32\[\] for scaling 'tensor'.*got float32\[128\]"):
        _call(op, x, Fp8Weight(fw.q, col.scale))
    with pytest.raises(ValueError, match=r"w.scale must be float32\[128\] for scaling 'column'.*got float32\[\]"):
        _call(op, x, Fp8Weight(fw.q, fw.scale, "column"))
    with pytest.raises(ValueError, match=r"w.scale must be float32\[\].*got bfloat16\[\]"):
        _call(op, x, Fp8Weight(fw.q, fw.scale.astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match=r"w.scaling must be one of"):
        _call(op, x, Fp8Weight(fw.q, fw.scale, "row"))
    with pytest.raises(ValueError, match=rf"flux_jax.{name}: contraction mismatch.*K=64.*\[K, N\] = \[32, 128\]"):
        _call(op, x, Fp8Weight.quantize(w[: K // 2]))
    with pytest.raises(TypeError, match=rf"flux_jax.{name}: with a pre-quantized w, x must be"):
        _call(op, x.astype(jnp.float8_e4m3fn), fw)


def test_quantize_errors():
    w = _operands()[1]
    with pytest.raises(TypeError, match="recipe must be a flux_jax.Fp8"):
        Fp8Weight.quantize(w, True)
    with pytest.raises(TypeError, match="high-precision float array.*int32"):
        Fp8Weight.quantize(jnp.ones((4, 4), jnp.int32))
    with pytest.raises(TypeError, match="high-precision float array.*float8_e4m3fn"):
        Fp8Weight.quantize(w.astype(jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"rank 2 \(\[k, n\]\), got \[2, 64, 128\]"):
        Fp8Weight.quantize(jnp.stack([w, w]))
    with pytest.raises(TypeError, match="already an Fp8Weight"):
        Fp8Weight.quantize(Fp8Weight.quantize(w))
    with pytest.raises(TypeError, match="w must be an array, got list"):
        Fp8Weight.quantize([[1.0]])
    with pytest.raises(TypeError, match="transpose_w must be a bool"):
        Fp8Weight.quantize(w, transpose_w=1)


# ---- Flax ------------------------------------------------------------------------------------


def _layers(mesh, fp8, sequence_parallel):
    rngs = nnx.Rngs(0)
    column = ColumnParallelLinear(
        K, (N // 8, 8), mesh=mesh, fp8=fp8, sequence_parallel=sequence_parallel, dtype=jnp.bfloat16, rngs=rngs
    )
    row = RowParallelLinear(
        N, K, mesh=mesh, fp8=fp8, sequence_parallel=sequence_parallel, dtype=jnp.bfloat16, rngs=rngs
    )
    return column, row


def _run(model, x, mesh, sequence_parallel):
    """The column then the row layer (nnx.List([column, row])) on global x [M, K]."""
    x_spec = P("tp", None) if sequence_parallel else P()

    def block(layers, x):
        column, row = layers
        h = column(x)
        return row(h.reshape(*h.shape[:-2], -1))

    return sharded_call(model, block, x, mesh=mesh, in_specs=(x_spec,), out_specs=x_spec)


def _functional(model, fn):
    """fn(model, *args) as a function of the model's state, for jax.jit / jax.grad."""
    graphdef, state = nnx.split(model)
    return state, lambda state, *args: fn(nnx.merge(graphdef, state), *args)


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no_sp"])
def test_flax_layers_run_their_kernels_quantized_once(sequence_parallel):
    """quantize_kernels: the layers hold Fp8Kernel leaves (q sharded like the kernel transposed),
    their forward equals the ops called directly with the same Fp8Weight, the compiled forward
    reduces over no kernel, and every parameter's gradient is zero while x's flows."""
    mesh = _mesh()
    x = random_array(np.random.default_rng(7), (M, K), jnp.bfloat16)
    column, row = _layers(mesh, False, sequence_parallel)
    model = nnx.List([column, row])
    kernels = (column.kernel[...].reshape(K, N), row.kernel[...])
    assert quantize_kernels(model, Fp8(weight_scaling="column")) == 2
    assert isinstance(column.kernel_q, Fp8Kernel) and column.kernel_q[...].shape == (N, K)
    assert column.kernel_q[...].sharding.spec == P("tp", None) and column.kernel_scale[...].sharding.spec == P("tp")
    assert row.kernel_q[...].sharding.spec == P(None, "tp") and row.kernel_scale[...].shape == (K,)
    assert len(jax.tree.leaves(nnx.state(model, Fp8Kernel))) == 4
    fws = [Fp8Weight.quantize(k, Fp8(weight_scaling="column")) for k in kernels]
    for layer, fw in zip((column, row), fws):
        np.testing.assert_array_equal(to64(layer.kernel_q[...]), to64(fw.q))

    state, forward = _functional(model, lambda m, x: _run(m, x, mesh, sequence_parallel))
    out = to64(jax.jit(forward)(state, x))
    if sequence_parallel:
        first, second, x_spec = flux_jax.ag_matmul, flux_jax.matmul_rs, P("tp", None)
    else:
        first, second, x_spec = flux_jax.column_matmul, flux_jax.matmul_ar, P()

    def direct(x, w1, w2):
        return second(first(x, w1, axis_name="tp"), w2, axis_name="tp")

    specs = (x_spec, fws[0].partition_spec(P(None, "tp")), fws[1].partition_spec(P("tp", None)))
    want = jax.jit(jax.shard_map(direct, mesh=mesh, in_specs=specs, out_specs=x_spec))
    placed = [_place_weight(mesh, fw, spec) for fw, spec in zip(fws, (P(None, "tp"), P("tp", None)))]
    np.testing.assert_array_equal(out, to64(want(place(mesh, x, x_spec), *placed)))
    hlo = jax.jit(forward).lower(state, x).compile().as_text()
    for shard in ((K, N // TP), (N // TP, K)):
        assert _weight_reductions(hlo, shard) == 0

    grads = jax.jit(jax.grad(lambda s, x: jnp.sum(forward(s, x).astype(jnp.float32)), argnums=(0, 1)))(state, x)
    assert all(not np.any(to64(g)) for g in jax.tree.leaves(grads[0]))  # the kernels are frozen
    assert np.linalg.norm(to64(grads[1])) > 0


def test_flax_quantize_kernel_options_and_errors():
    mesh = _mesh()
    column, row = _layers(mesh, Fp8(weight_scaling="column"), True)
    with pytest.raises(ValueError, match="quantize_kernel: recipe.weight_scaling='tensor' conflicts"):
        column.quantize_kernel(Fp8())
    with pytest.raises(TypeError, match="recipe must be a flux_jax.Fp8"):
        row.quantize_kernel("e4m3")
    with pytest.raises(TypeError, match="keep_kernel must be a bool"):
        row.quantize_kernel(keep_kernel="no")
    row.quantize_kernel()  # the layer's own recipe
    assert row.kernel_scaling == "column"
    column.quantize_kernel(keep_kernel=False)
    assert column.kernel is None and "kernel" not in nnx.to_pure_dict(nnx.state(column))
    with pytest.raises(ValueError, match="the kernel was dropped"):
        column.quantize_kernel()
    x = random_array(np.random.default_rng(8), (M, K), jnp.bfloat16)
    state, forward = _functional(nnx.List([column, row]), lambda m, x: _run(m, x, mesh, True))
    out = to64(jax.jit(forward)(state, x))
    assert out.shape == (M, K) and np.all(np.isfinite(out))
