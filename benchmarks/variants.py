"""One builder per benchmarked variant: global shape + mesh + inputs -> a runnable `Built`.

Every builder takes a CaseContext (the case, its meshes, the host inputs and the twin's output)
and returns a Built (or a list of candidate Builts, of which the fastest correct one is
reported), or raises Unavailable(reason). Variants on the Explicit mesh share the same placed
x and w. xla_windowed_einsum has no builder here: it runs in a subprocess (benchmarks/windowed.py).

With `ctx.grad` (harness `--grad`) a step is a training step of the op: forward and backward
with a random cotangent ct of the output, returning dx, with y and dw kept live (see
`with_grad`). The limits become the three GEMMs alone (gemm_only) and the op's two collectives,
forward and transposed (comm_only). Variants without a backward here are Unavailable.

With dtype "fp8" (Case.fp8) the ops run with fp8=True on bf16 operands: the reference is the FP8
twin, gemm_only its FP8 GEMM (quantize, then XLA's GEMM on the FP8 operands), comm_only moves
the FP8 rows (1-byte elements) where the op does; variants without an FP8 form are Unavailable.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flux_jax
from benchmarks import rings
from benchmarks.data import case_rng, make_xw, random_normal, rel_max_err
from benchmarks.presets import Case
from benchmarks.timing import Built

AXIS = "tp"
# (x, w, out) shardings of the op in the global view.
SPECS = {
    "ag": (P(AXIS, None), P(None, AXIS), P(None, AXIS)),
    "rs": (P(None, AXIS), P(AXIS, None), P(AXIS, None)),
    "ar": (P(None, AXIS), P(AXIS, None), P()),
}
# Variants that give the limit max(T_gemm, T_comm), not the op itself.
LIMIT_VARIANTS = ("gemm_only", "comm_only")


class Unavailable(Exception):
    """The variant cannot run on this platform / shape (the message says why)."""


def error_summary(err: BaseException, limit: int = 300) -> str:
    """A one-line reason from an exception, for a status string."""
    text = str(err) if isinstance(err, Unavailable) else f"{type(err).__name__}: {err}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    text = " | ".join(lines)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclasses.dataclass
class CaseContext:
    """What every builder of one case shares."""

    case: Case
    platform: str  # "cpu" or "gpu"
    mesh: jax.sharding.Mesh  # Explicit axis type
    auto_mesh: jax.sharding.Mesh  # Auto axis type (for the auto-partitioned jit)
    x: np.ndarray  # global host operands
    w: np.ndarray
    seed: int
    twin_out: np.ndarray | None = None  # host output of xla_shard_map (the reference)
    grad: bool = False  # time forward + backward (see with_grad)
    ct: np.ndarray | None = None  # --grad: the cotangent of the op's output [M, N]
    _placed: dict = dataclasses.field(default_factory=dict)

    def place(self, name: str, host: np.ndarray, spec: P, mesh=None) -> jax.Array:
        """device_put once per (array, spec, mesh)."""
        mesh = mesh or self.mesh
        key = (name, spec, mesh.axis_types)
        if key not in self._placed:
            self._placed[key] = jax.device_put(host, NamedSharding(mesh, spec))
        return self._placed[key]

    def op_args(self, mesh=None) -> tuple[jax.Array, jax.Array]:
        x_spec, w_spec, _ = SPECS[self.case.op]
        return self.place("x", self.x, x_spec, mesh), self.place("w", self.w, w_spec, mesh)

    def against_twin(self, out: np.ndarray) -> float:
        return rel_max_err(out, self.twin_out)

    def require_gpu(self, what: str):
        if self.platform != "gpu":
            raise Unavailable(f"GPU only ({what}); platform is {self.platform}")

    def require_forward(self, what: str):
        if self.grad:
            raise Unavailable(f"forward only ({what})")

    def require_unquantized(self, what: str):
        if self.case.fp8:
            raise Unavailable(f"no FP8 form ({what})")


def case_context(case: Case, seed: int, grad: bool = False) -> CaseContext:
    """What every builder of `case` shares: the meshes, the seeded host operands and, for
    grad, the seeded random cotangent (never ones: XLA would fold the twin's backward GEMMs)."""
    platform = jax.devices()[0].platform
    ctx = CaseContext(
        case,
        "gpu" if platform in ("gpu", "cuda") else platform,
        *make_meshes(case.tp),
        *make_xw(case, seed),
        seed,
        grad=grad,
    )
    if grad:
        ctx.ct = random_normal(case_rng(case, seed, "cotangent"), (case.M, case.N), case.operand_dtype)
    return ctx


def with_grad(fn):
    """fn(x, *rest) -> y becomes step(x, *rest, ct) -> dx of the vjp at ct, with y and the other
    gradients (dw) added at weight 0 so that none of them is dead code.

    Without y XLA could drop the twin's forward GEMM (dx and dw of a linear op do not need y)
    while the fused forward, one call that also returns the gathered x, always runs.
    """

    def step(*args):
        *inputs, ct = args
        y, vjp = jax.vjp(fn, *inputs)
        dx, *others = vjp(ct.astype(y.dtype))
        live = y[0, 0].astype(jnp.float32) * 0
        for g in others:
            live = live + g[0, 0].astype(jnp.float32) * 0
        return dx + live.astype(dx.dtype)

    return step


def make_meshes(tp: int) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh]:
    """The Explicit and Auto 1-D meshes ("tp",) over the first tp devices."""
    devices = jax.devices()[:tp]
    explicit = jax.make_mesh((tp,), (AXIS,), axis_types=(AxisType.Explicit,), devices=devices)
    auto = jax.make_mesh((tp,), (AXIS,), axis_types=(AxisType.Auto,), devices=devices)
    return explicit, auto


def _op_shard_map(ctx: CaseContext, per_shard, check_vma: bool = True, note: str = "") -> Built:
    """The op's per-shard function in a shard_map over the shared x, w."""
    x_spec, w_spec, out_spec = SPECS[ctx.case.op]
    if ctx.grad:
        step = jax.shard_map(
            with_grad(per_shard),
            mesh=ctx.mesh,
            in_specs=(x_spec, w_spec, out_spec),
            out_specs=x_spec,
            check_vma=check_vma,
        )
        args = (*ctx.op_args(), ctx.place("ct", ctx.ct, out_spec))
        return Built(step, args, ctx.mesh, x_spec, x_spec, ctx.against_twin, note)
    step = jax.shard_map(per_shard, mesh=ctx.mesh, in_specs=(x_spec, w_spec), out_specs=out_spec, check_vma=check_vma)
    return Built(step, ctx.op_args(), ctx.mesh, x_spec, out_spec, ctx.against_twin, note)


def xla_shard_map(ctx: CaseContext) -> Built:
    """The XLA twin: all_gather + dot / dot + psum_scatter / dot + psum inside shard_map (the reference).
    fp8: the FP8 twin (flux_jax.ag_matmul_xla / matmul_rs_xla / matmul_ar_xla with fp8=True)."""
    if ctx.case.fp8:
        twin = {"ag": flux_jax.ag_matmul_xla, "rs": flux_jax.matmul_rs_xla, "ar": flux_jax.matmul_ar_xla}[ctx.case.op]
        return _op_shard_map(ctx, functools.partial(twin, axis_name=AXIS, fp8=True))
    if ctx.case.op == "ag":
        per_shard = lambda x, w: jnp.dot(lax.all_gather(x, AXIS, axis=0, tiled=True), w)  # noqa: E731
    elif ctx.case.op == "ar":
        per_shard = lambda x, w: lax.psum(jnp.dot(x, w), AXIS)  # noqa: E731
    else:
        per_shard = lambda x, w: lax.psum_scatter(jnp.dot(x, w), AXIS, scatter_dimension=0, tiled=True)  # noqa: E731
    return _op_shard_map(ctx, per_shard)


# The FP8 overlap path's own custom call (matmul_ar's two-shot runs matmul_rs's).
_FP8_OVERLAP_CALL = re.compile(r"custom_call @flux_jax_(ag_matmul|matmul_rs)\(")
# A latency composition's collective (no decode kernel served the case).
_COLLECTIVE_CALL = re.compile(r"custom_call @flux_jax_(all_gather|all_reduce|reduce_scatter)\(")


def _flux(ctx: CaseContext, impl: str, path: str = "auto") -> Built:
    op = {"ag": flux_jax.ag_matmul, "rs": flux_jax.matmul_rs, "ar": flux_jax.matmul_ar}[ctx.case.op]
    kw = {"fp8": ctx.case.fp8} if ctx.case.fp8 else {}
    body = functools.partial(op, axis_name=AXIS, impl=impl, **kw)

    def traced_with_path(*args):  # the configuration is read while tracing
        with flux_jax.config(fused_path=path):
            return body(*args)

    built = _op_shard_map(ctx, traced_with_path)
    try:
        hlo = jax.jit(built.step).lower(*built.args).as_text()
    except flux_jax.FusedUnavailableError as err:
        raise Unavailable(str(err)) from err
    if ctx.case.fp8 and path == "overlap" and not _FP8_OVERLAP_CALL.search(hlo):
        raise Unavailable(
            "the FP8 overlap kernel does not serve this case (bfloat16, per-rank K % 16 == 0, N % 8 == 0, "
            "rows divisible by tp): the latency composition would run"
        )
    if ctx.case.fp8 and path == "decode" and _COLLECTIVE_CALL.search(hlo):
        raise Unavailable(
            "the FP8 decode kernel does not serve this case (e4m3 rows, bfloat16, per-rank K % 16 == 0, "
            "N % 8 == 0, the decode row limits): the latency composition would run"
        )
    if impl == "auto":
        fused = "custom_call @flux_jax_" in hlo
        built.note = "auto chose the fused kernel" if fused else "auto chose the XLA twin"
    return built


def flux_fused(ctx: CaseContext) -> Built:
    return _flux(ctx, "fused")


def flux_auto(ctx: CaseContext) -> Built:
    return _flux(ctx, "auto")


def flux_overlap(ctx: CaseContext) -> Built:
    """The overlap kernel (GEMM consumes rows as they arrive), whatever the shape."""
    return _flux(ctx, "fused", "overlap")


def flux_latency(ctx: CaseContext) -> Built:
    """The latency path (our NVLink collective + XLA's GEMM), whatever the shape."""
    return _flux(ctx, "fused", "latency")


def flux_decode(ctx: CaseContext) -> Built:
    """The decode path (ag_matmul: rows pushed under the weight stream; else the latency path)."""
    return _flux(ctx, "fused", "decode")


def xla_jit(ctx: CaseContext) -> Built:
    """Plain jit on the Auto mesh: XLA's partitioner inserts the collective itself."""
    ctx.require_forward("not built for --grad")
    ctx.require_unquantized("XLA's partitioner on the unquantized dot")
    x_spec, _, out_spec = SPECS[ctx.case.op]
    out_sharding = NamedSharding(ctx.auto_mesh, out_spec)
    step = lambda x, w: lax.with_sharding_constraint(jnp.dot(x, w), out_sharding)  # noqa: E731
    args = ctx.op_args(ctx.auto_mesh)
    return Built(step, args, ctx.auto_mesh, x_spec, out_spec, ctx.against_twin)


def _ring(ctx: CaseContext, bidi: bool) -> Built:
    ctx.require_unquantized("the rings move and multiply unquantized blocks")
    case = ctx.case
    if case.op == "ar":
        raise Unavailable("no ring variant of GEMM -> AllReduce")
    rows = case.M // case.tp  # rows per block: x rows per shard (ag) or output rows per shard (rs)
    if bidi and rows % 2:
        raise Unavailable(f"the bidirectional ring splits blocks in halves: M/tp={rows} is odd")
    if case.op == "ag":
        fn = rings.ag_ring_bidi if bidi else rings.ag_ring
    else:
        fn = rings.rs_ring_bidi if bidi else rings.rs_ring
    return _op_shard_map(ctx, functools.partial(fn, axis_name=AXIS, tp=case.tp))


def jax_ring(ctx: CaseContext) -> Built:
    return _ring(ctx, bidi=False)


def jax_ring_bidi(ctx: CaseContext) -> Built:
    return _ring(ctx, bidi=True)


def _pallas_configs():
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension, TuningConfig

    def cfg(tm, tn, steps, wg, minor, width):
        return TuningConfig(
            tile_m=tm,
            tile_n=tn,
            tile_k=64,
            max_concurrent_steps=steps,
            wg_dimension=wg,
            grid_minor_dim=minor,
            grid_tile_width=width,
        )

    return [
        cfg(128, 128, 4, MatmulDimension.N, MatmulDimension.N, 1),  # CTA 128 x 256
        cfg(128, 128, 4, MatmulDimension.M, MatmulDimension.M, 4),  # CTA 256 x 128
        cfg(64, 128, 6, MatmulDimension.N, MatmulDimension.N, 1),  # CTA 64 x 256: small M
        cfg(128, 64, 6, MatmulDimension.N, MatmulDimension.M, 8),  # CTA 128 x 128
    ]


def _cta_tile(config) -> tuple[int, int]:
    from jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu import MatmulDimension

    m = config.tile_m * (2 if config.wg_dimension == MatmulDimension.M else 1)
    n = config.tile_n * (2 if config.wg_dimension == MatmulDimension.N else 1)
    return m, n


def pallas_mgpu(ctx: CaseContext) -> list[Built]:
    """Mosaic GPU all_gather_lhs_matmul, one candidate per tile config that fits the shape."""
    case = ctx.case
    if case.op != "ag":
        raise Unavailable("AG only (collective_matmul_mgpu has no GEMM -> reduce-scatter kernel)")
    ctx.require_gpu("Mosaic GPU kernel")
    ctx.require_forward("the Pallas kernel has no VJP")
    ctx.require_unquantized("the Mosaic GPU kernel")
    if case.tp != jax.device_count():
        raise Unavailable(f"the kernel needs axis size == all devices ({jax.device_count()}), tp={case.tp}")
    from jax.experimental.pallas.ops.gpu.collective_matmul_mgpu import all_gather_lhs_matmul

    m_shard, n_shard = case.M // case.tp, case.N // case.tp
    candidates = []
    for config in _pallas_configs():
        cta_m, cta_n = _cta_tile(config)
        if m_shard % cta_m or n_shard % cta_n or case.K % config.tile_k:
            continue
        per_shard = functools.partial(all_gather_lhs_matmul, axis_name=AXIS, config=config, dtype=jnp.dtype(case.dtype))
        note = (
            f"tile_m={config.tile_m} tile_n={config.tile_n} tile_k={config.tile_k} "
            f"steps={config.max_concurrent_steps} wg={config.wg_dimension.name} "
            f"minor={config.grid_minor_dim.name} width={config.grid_tile_width}"
        )
        candidates.append(_op_shard_map(ctx, per_shard, check_vma=False, note=note))
    if not candidates:
        raise Unavailable(f"no tile config fits M/tp={m_shard}, N/tp={n_shard}")
    return candidates


def gemm_only(ctx: CaseContext) -> Built:
    """The per-GPU GEMM of the op without communication (ag: [M,K]x[K,N/tp]; rs: [M,K/tp]x[K/tp,N]).

    With --grad: its forward and both backward GEMMs (y, dx, dw) on the same per-GPU shapes.
    fp8: the FP8 twin's GEMM (flux_jax.fp8.matmul: quantize, XLA's GEMM on the FP8 operands);
    with --grad y and dx in FP8 (dy e5m2), dw in bf16, as the FP8 ops run them.
    """
    case = ctx.case
    if case.transpose_w:
        return _gemm_only_transposed(ctx)
    gemm = _fp8_gemm if case.fp8 else jnp.dot
    x_spec, w_spec, out_spec = SPECS[case.op]
    w = ctx.place("w", ctx.w, w_spec)
    if case.op == "ag":  # every shard holds all of x: the gathered operand
        x = ctx.place("x_tiled", np.tile(ctx.x, (case.tp, 1)), P(AXIS, None))
        x_spec = P(AXIS, None)
        check = ctx.against_twin
        if ctx.grad:  # each shard's dx is a partial of the full dx; their sum is the twin's
            check = lambda out: ctx.against_twin(  # noqa: E731
                out.reshape(case.tp, case.M, case.K).astype(np.float32).sum(0)
            )
    else:  # every shard's partial [M, N], stacked; their sum is the twin's output
        x = ctx.place("x", ctx.x, x_spec)
        out_spec = P(AXIS, None)
        check = lambda out: ctx.against_twin(  # noqa: E731
            out.reshape(case.tp, case.M, case.N).astype(np.float32).sum(0)
        )
        if ctx.grad:  # every partial sees the whole cotangent: each shard's dx is the twin's
            check = ctx.against_twin
    if not ctx.grad:
        step = jax.shard_map(gemm, mesh=ctx.mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
        return Built(step, (x, w), ctx.mesh, x_spec, out_spec, check)
    ct_host = ctx.ct if case.op == "ag" else np.tile(ctx.ct, (case.tp, 1))
    ct = ctx.place(f"ct_gemm_{case.op}", ct_host, out_spec)
    step = jax.shard_map(
        _fp8_gemm_grad_step if case.fp8 else with_grad(jnp.dot),
        mesh=ctx.mesh,
        in_specs=(x_spec, w_spec, out_spec),
        out_specs=x_spec,
    )
    return Built(step, (x, w, ct), ctx.mesh, x_spec, x_spec, check)


def _fp8_gemm(x, w):
    return flux_jax.fp8.matmul(x, w, flux_jax.Fp8())


def _fp8_gemm_grad_step(x, w, ct):
    """The FP8 ops' three GEMMs: y and dx = ct @ w^T in FP8 (ct e5m2), dw = x^T ct in x's dtype;
    returns dx with y and dw live (see with_grad)."""
    recipe = flux_jax.Fp8()
    y = flux_jax.fp8.matmul(x, w, recipe)
    dx = flux_jax.fp8.matmul(ct, w, recipe, transpose_w=True, grad=True)
    dw = jnp.dot(x.T, ct)
    live = (y[0, 0].astype(jnp.float32) + dw[0, 0].astype(jnp.float32)) * 0
    return dx + live.astype(dx.dtype)


def flux_gemm_only(ctx: CaseContext, tuning: dict | None = None) -> Built:
    """flux_jax's own overlap GEMM kernel on gemm_only's per-GPU shape, without communication.

    ag_matmul(impl="fused", fused_path="overlap") over a mesh axis of size 1 runs the fused
    kernel's GEMM alone, so `flux_gemm_only` vs `gemm_only` separates "our GEMM is slower than
    XLA's" from "overlap costs". `tuning`: GPU tuning fields to trace it under (A/B runs).
    """
    ctx.require_gpu("the CPU backend is a reference, not a fast GEMM")
    ctx.require_forward("not built for --grad")
    ctx.require_unquantized("our GEMM kernel takes bf16 / f16")
    case = ctx.case
    if case.transpose_w:
        return _flux_gemm_only_transposed(ctx, tuning or {})
    devices = np.asarray(ctx.mesh.devices).reshape(case.tp, 1)
    mesh = jax.sharding.Mesh(devices, (AXIS, "one"), axis_types=(AxisType.Explicit,) * 2)
    w_spec = P(None, AXIS) if case.op == "ag" else P(AXIS, None)
    w = ctx.place("w", ctx.w, w_spec, mesh)
    if case.op == "ag":  # every shard holds all of x; shard r computes columns r
        # Specs name "one" (size 1): the output (and so the loop's carry) varies over it.
        x_spec, out_spec, check = P((AXIS, "one"), None), P("one", AXIS), ctx.against_twin
        x = ctx.place("x_tiled", np.tile(ctx.x, (case.tp, 1)), x_spec, mesh)
    else:
        x_spec, out_spec = P("one", AXIS), P((AXIS, "one"), None)
        x = ctx.place("x", ctx.x, x_spec, mesh)
        check = lambda out: ctx.against_twin(  # noqa: E731
            out.reshape(case.tp, case.M, case.N).astype(np.float32).sum(0)
        )
    body = flux_gemm_fn("one", tuning=tuning)
    step = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
    try:
        jax.jit(step).lower(x, w)
    except flux_jax.FusedUnavailableError as err:
        raise Unavailable(str(err)) from err
    return Built(step, (x, w), mesh, x_spec, out_spec, check)


def comm_only(ctx: CaseContext) -> Built:
    """The collective alone: all_gather of x (ag) / psum_scatter (rs) / psum (ar) of an [M, N] array.

    With --grad: the collective and its transpose (ag: all_gather of x, then reduce-scatter of
    an [M, K] cotangent per shard, as dx's; rs: reduce-scatter, then all_gather of the cotangent;
    ar: the psum alone, since its transpose moves nothing: the replicated cotangent stays local).
    fp8: the rows that travel as FP8 (x forward, the cotangent of rs backward) travel as 1-byte
    elements; partials stay bf16.
    """
    case = ctx.case
    if case.fp8:
        return _fp8_comm_only(ctx)
    spec = P(AXIS, None)
    if case.op == "ar":  # each shard its own [M, N] partial; every shard gets the sum
        host = random_normal(case_rng(case, ctx.seed, "partials"), (case.tp * case.M, case.N), case.dtype)
        expected = np.tile(host.reshape(case.tp, case.M, case.N).astype(np.float32).sum(0), (case.tp, 1))
        sharded = jax.shard_map(lambda y: lax.psum(y, AXIS), mesh=ctx.mesh, in_specs=(spec,), out_specs=spec)
        note = "the all-reduce alone (its transpose moves nothing)" if ctx.grad else ""
        return Built(
            sharded,
            (ctx.place("comm_ar", host, spec),),
            ctx.mesh,
            spec,
            spec,
            lambda out: rel_max_err(out, expected),
            note,
        )
    if case.op == "ag":
        host = ctx.x
        step = lambda x: lax.all_gather(x, AXIS, axis=0, tiled=True)  # noqa: E731
        expected = np.tile(ctx.x, (case.tp, 1))
    else:  # each shard its own [M, N] partial
        host = random_normal(case_rng(case, ctx.seed, "partials"), (case.tp * case.M, case.N), case.dtype)
        step = lambda y: lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True)  # noqa: E731
        expected = host.reshape(case.tp, case.M, case.N).astype(np.float32).sum(0)
    arg = ctx.place(f"comm_{case.op}", host, spec)
    if not ctx.grad:
        sharded = jax.shard_map(step, mesh=ctx.mesh, in_specs=(spec,), out_specs=spec)
        return Built(sharded, (arg,), ctx.mesh, spec, spec, lambda out: rel_max_err(out, expected))
    if case.op == "ag":  # a cotangent [M, K] per shard; its transpose sums them
        ct_host = random_normal(case_rng(case, ctx.seed, "comm_cotangent"), (case.tp * case.M, case.K), case.dtype)
        expected = ct_host.reshape(case.tp, case.M, case.K).astype(np.float32).sum(0)
    else:  # the output's cotangent [M, N]; its transpose hands every shard all of it
        ct_host = ctx.ct
        expected = np.tile(ct_host, (case.tp, 1))

    ct = ctx.place(f"comm_ct_{case.op}", ct_host, spec)
    sharded = jax.shard_map(with_grad(step), mesh=ctx.mesh, in_specs=(spec, spec), out_specs=spec)
    return Built(sharded, (arg, ct), ctx.mesh, spec, spec, lambda out: rel_max_err(out, expected))


def _as_fp8_bytes(host: np.ndarray, fmt) -> np.ndarray:
    """The 1-byte pattern of `host` in an FP8 format (N(0, 1) data fits unscaled), as uint8: it
    moves like the FP8 rows and keeps the timing loop's carry arithmetic on integers."""
    return host.astype(np.float32).astype(fmt).view(np.uint8)


def _fp8_comm_only(ctx: CaseContext) -> Built:
    case = ctx.case
    spec = P(AXIS, None)
    gather = lambda a: lax.all_gather(a, AXIS, axis=0, tiled=True)  # noqa: E731
    scatter = lambda a: lax.psum_scatter(a, AXIS, scatter_dimension=0, tiled=True)  # noqa: E731
    if case.op == "ag":  # the e4m3 rows of x; backward: dx's bf16 partials reduce-scattered
        host = _as_fp8_bytes(ctx.x, ml_dtypes.float8_e4m3fn)
        expected = np.tile(host, (case.tp, 1))
        if ctx.grad:
            ct_host = random_normal(
                case_rng(case, ctx.seed, "comm_cotangent"), (case.tp * case.M, case.K), case.operand_dtype
            )
            expected = ct_host.reshape(case.tp, case.M, case.K).astype(np.float32).sum(0)
            step = lambda x, ct: scatter(ct) + (gather(x)[0, 0] * 0).astype(ct.dtype)  # noqa: E731
    else:  # the bf16 partials; backward: the e5m2 rows of the cotangent gathered
        host = random_normal(case_rng(case, ctx.seed, "partials"), (case.tp * case.M, case.N), case.operand_dtype)
        expected = host.reshape(case.tp, case.M, case.N).astype(np.float32).sum(0)
        if ctx.grad:
            ct_host = _as_fp8_bytes(ctx.ct, ml_dtypes.float8_e5m2)
            expected = np.tile(ct_host, (case.tp, 1))
            step = lambda y, ct: gather(ct) + (scatter(y)[0, 0] * 0).astype(ct.dtype)  # noqa: E731
    arg = ctx.place(f"comm_fp8_{case.op}", host, spec)
    if not ctx.grad:
        sharded = jax.shard_map(gather if case.op == "ag" else scatter, mesh=ctx.mesh, in_specs=(spec,), out_specs=spec)
        return Built(sharded, (arg,), ctx.mesh, spec, spec, lambda out: rel_max_err(out, expected))
    ct = ctx.place(f"comm_fp8_ct_{case.op}", ct_host, spec)
    sharded = jax.shard_map(step, mesh=ctx.mesh, in_specs=(spec, spec), out_specs=spec)
    return Built(sharded, (arg, ct), ctx.mesh, spec, spec, lambda out: rel_max_err(out, expected))


# ---- one-GPU GEMM parity (preset gemm-parity-1gpu, benchmarks/gemm_parity.py) ----------------


def _ag_matmul_transposed_weight(x, w_nk, *, axis_name: str):
    """ag_matmul reading its weight transposed (w_nk [n, k]): the kernel a fused op's backward runs
    for dx = dy w^T. The public op has no such argument; this binds the op's primitive with
    `transpose_w` as its backward does (flux_jax/ops/_common.py backward_call)."""
    from flux_jax import _plan, _validation
    from flux_jax._config import get_config, get_gpu_tuning
    from flux_jax.ops import _common
    from flux_jax.ops._spec import REGISTRY, Call

    spec = REGISTRY["ag_matmul"]
    info = _validation.check_axis(spec.name, axis_name)
    problem = spec.problem(x.shape, w_nk.shape, x.dtype, info.tp_size, info.platform, True)
    plan = _plan.plan(problem, "fused", get_config())
    call = Call(
        info.axis_name, info.tp_size, True, "fused", False, plan, get_config(), get_gpu_tuning(), platform=info.platform
    )
    return _common.run(spec, x, w_nk, call)[0]


def flux_gemm_fn(axis_name: str, *, transpose_w: bool = False, tuning: dict | None = None, poison: bool = False):
    """Per-shard fn(x, w) -> our GEMM alone: ag_matmul(impl="fused") on the overlap path over
    `axis_name` (size 1 where it measures the GEMM), traced under the GPU tuning fields `tuning`
    (e.g. {"gemm_kernel": "128x256_c2x1"}; `flux_jax._config.GpuTuning`) and, with `poison`,
    Config(debug_poison_outputs=True) (the kernel fills its output with NaN first)."""
    from flux_jax import _config

    public = {"fused_path": "overlap", **({"debug_poison_outputs": True} if poison else {})}

    def fn(x, w):  # the configuration is read while tracing
        with flux_jax.config(**public), _config.gpu_tuning(**(tuning or {})):
            if transpose_w:
                return _ag_matmul_transposed_weight(x, w, axis_name=axis_name)
            return flux_jax.ag_matmul(x, w, axis_name=axis_name, impl="fused")

    return fn


def flux_ar_decode_fn(axis_name: str, *, poison: bool = False):
    """Per-shard fn(x, w) -> matmul_ar(impl="fused") pinned to its decode path over `axis_name`
    (size 1 where it measures the cost: the decode GEMM, its all-reducing epilogue with no peer,
    the row staging, the workspace's epoch)."""
    public = {"fused_path": "decode", **({"debug_poison_outputs": True} if poison else {})}

    def fn(x, w):
        with flux_jax.config(**public):
            return flux_jax.matmul_ar(x, w, axis_name=axis_name, impl="fused")

    return fn


def xla_gemm_fn(transpose_w: bool = False):
    """fn(x, w) -> XLA's GEMM x @ w, or x @ w^T for a weight stored [n, k] (one dot_general: cuBLAS
    reads it transposed, as XLA's backward does for dx = dy w^T)."""
    if not transpose_w:
        return jnp.dot
    return lambda x, w_nk: lax.dot_general(x, w_nk, (((1,), (1,)), ((), ())))


def _one_gpu_transposed(ctx: CaseContext, what: str):
    if ctx.case.tp != 1 or ctx.case.op != "ag":
        raise Unavailable(f"{what}: a transposed-weight case runs at tp=1 as op ag")
    return np.ascontiguousarray(ctx.w.T)  # the layer's weight as stored for dx: [N, K] here


def _gemm_only_transposed(ctx: CaseContext) -> Built:
    """gemm_only for a transposed-weight (dx) case: XLA's x [M, K] @ (w stored [N, K])^T."""
    w_nk = ctx.place("w_nk", _one_gpu_transposed(ctx, "gemm_only"), P(AXIS, None))
    x = ctx.place("x", ctx.x, P(AXIS, None))
    step = jax.shard_map(
        xla_gemm_fn(True), mesh=ctx.mesh, in_specs=(P(AXIS, None), P(AXIS, None)), out_specs=P(AXIS, None)
    )
    return Built(step, (x, w_nk), ctx.mesh, P(AXIS, None), P(AXIS, None), ctx.against_twin)


def _flux_gemm_only_transposed(ctx: CaseContext, tuning: dict) -> Built:
    """flux_gemm_only for a transposed-weight (dx) case: our overlap GEMM reading w [N, K]."""
    w_nk = ctx.place("w_nk", _one_gpu_transposed(ctx, "flux_gemm_only"), P(AXIS, None))
    x = ctx.place("x", ctx.x, P(AXIS, None))
    step = jax.shard_map(
        flux_gemm_fn(AXIS, transpose_w=True, tuning=tuning),
        mesh=ctx.mesh,
        in_specs=(P(AXIS, None), P(AXIS, None)),
        out_specs=P(AXIS, None),
    )
    try:
        jax.jit(step).lower(x, w_nk)
    except flux_jax.FusedUnavailableError as err:
        raise Unavailable(str(err)) from err
    return Built(step, (x, w_nk), ctx.mesh, P(AXIS, None), P(AXIS, None), ctx.against_twin)


def flux_gemm_only_decode(ctx: CaseContext) -> Built:
    """The decode path's GEMM alone (GpuTuning.gemm_kernel="decode": ag_matmul at tp=1 runs it
    without pushes): bfloat16, a [K, N] weight, at most 256 rows; tp=1 only."""
    ctx.require_gpu("the decode GEMM is a CUDA kernel")
    if ctx.case.tp != 1 or ctx.case.transpose_w or ctx.case.dtype != "bfloat16" or ctx.case.M > 256:
        raise Unavailable("the decode GEMM alone runs at tp=1, bfloat16, a [K, N] weight, M <= 256")
    return flux_gemm_only(ctx, {"gemm_kernel": "decode"})


# Variants that build a transposed-weight (dx) case of the gemm-parity preset.
TRANSPOSED_WEIGHT_VARIANTS = ("xla_shard_map", "gemm_only", "flux_gemm_only")


BUILDERS = {
    "flux_fused": flux_fused,
    "flux_auto": flux_auto,
    "xla_shard_map": xla_shard_map,
    "xla_jit": xla_jit,
    "jax_ring": jax_ring,
    "jax_ring_bidi": jax_ring_bidi,
    "pallas_mgpu": pallas_mgpu,
    "gemm_only": gemm_only,
    "flux_gemm_only": flux_gemm_only,
    "flux_gemm_only_decode": flux_gemm_only_decode,
    "flux_overlap": flux_overlap,
    "flux_latency": flux_latency,
    "flux_decode": flux_decode,
    "comm_only": comm_only,
}
# All variants in report order; xla_windowed_einsum runs in a subprocess (benchmarks/windowed.py).
VARIANTS = (
    "flux_fused",
    "flux_auto",
    "flux_overlap",
    "flux_latency",
    "flux_decode",
    "xla_shard_map",
    "xla_jit",
    "xla_windowed_einsum",
    "jax_ring",
    "jax_ring_bidi",
    "pallas_mgpu",
    "gemm_only",
    "flux_gemm_only",
    "comm_only",
    "flux_gemm_only_decode",
)
