"""Measuring one shape: the twin and every fused path that serves it, timed with the dispatch-free
method (flux_jax/tune/_timing.py), each fused output checked against the twin's first."""

from __future__ import annotations

import dataclasses
import random
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from flux_jax import _plan, _tuning
from flux_jax.tune import _timing
from flux_jax.tune._request import Shape

# Max |fused - twin| / max |twin| above which a fused output is wrong (as the benchmarks). An FP8
# path and the FP8 twin quantize alike: they differ by the GEMM's accumulation and rounding only.
TOLERANCE = {"bfloat16": 2e-2, "float16": 2e-2, "float32": 1e-3, "fp8": 2e-2}
_AXIS = "tp"
_SPECS = {  # (x, w, out) in the global view
    "ag_matmul": (P(_AXIS, None), P(None, _AXIS), P(None, _AXIS)),
    "matmul_rs": (P(None, _AXIS), P(_AXIS, None), P(_AXIS, None)),
    "matmul_ar": (P(None, _AXIS), P(_AXIS, None), P(None, None)),
}
# The custom call that shows a path ran (the lowered program must hold it).
_LATENCY_CALLS = {
    "ag_matmul": "flux_jax_all_gather",
    "matmul_rs": "flux_jax_reduce_scatter",
    "matmul_ar": "flux_jax_all_reduce",
}


@dataclasses.dataclass
class Row:
    """What happened to one shape: its status, times, speedups, errors and the table's choice."""

    shape: Shape
    status: str  # "measured", "measured before", "same shape class as ...", "unavailable: ...", ...
    path: str | None = None
    ms: dict = dataclasses.field(default_factory=dict)
    speedup: dict = dataclasses.field(default_factory=dict)
    max_rel_err: dict = dataclasses.field(default_factory=dict)


def _mesh(tp: int):
    devices = jax.local_devices()[:tp]
    return jax.make_mesh((tp,), (_AXIS,), axis_types=(AxisType.Explicit,), devices=devices)


def _random(key, shape, dtype, mesh, spec):
    make = jax.jit(
        lambda k: jax.random.normal(k, shape, jnp.float32).astype(dtype), out_shardings=NamedSharding(mesh, spec)
    )
    return make(key)


def _step(op: str, path: str, mesh, poison: bool = False, fp8: bool = False):
    import flux_jax

    fn = {"ag_matmul": flux_jax.ag_matmul, "matmul_rs": flux_jax.matmul_rs, "matmul_ar": flux_jax.matmul_ar}[op]
    impl = "xla" if path == "twin" else "fused"
    overrides = ({} if path == "twin" else {"fused_path": path}) | ({"debug_poison_outputs": True} if poison else {})

    def body(x, w):  # the configuration is read while tracing
        with flux_jax.config(**overrides):
            return fn(x, w, axis_name=_AXIS, impl=impl, fp8=fp8 or None)

    x_spec, w_spec, out_spec = _SPECS[op]
    return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)


@jax.jit
def _rel_err(out, ref):
    o, r = out.astype(jnp.float32), ref.astype(jnp.float32)
    err = jnp.max(jnp.abs(o - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-30)
    return jnp.where(jnp.all(jnp.isfinite(o)), err, jnp.inf)


def _custom_call(problem: _plan.Problem, path: str) -> str:
    if path == "latency":
        return _LATENCY_CALLS[problem.op]
    two_shot = problem.fp8 is not None or _plan.composed_overlap(problem.op, problem.rows, problem.tp, problem.platform)
    if path == "overlap" and problem.op == "matmul_ar" and two_shot:
        return "flux_jax_matmul_rs"  # matmul_ar's two-shot: matmul_rs's overlap call, then our all_gather
    return f"flux_jax_{problem.op}"


def _paths(problem: _plan.Problem) -> list[str]:
    if problem.fp8 is not None:  # the latency composition serves every FP8 call
        overlap = ["overlap"] if _plan.fp8_overlap_supported(problem) else []
        return overlap + ["latency"] + (["decode"] if _plan.fp8_decode_supported(problem) else [])
    paths = ["overlap"]
    if problem.platform == "cpu" or problem.tp <= _plan.limits()["latency_max_tp"]:
        paths.append("latency")
    if _plan.decode_supported(problem):
        paths.append("decode")
    return paths


def _error_text(err: BaseException) -> str:
    text = " | ".join(line.strip() for line in str(err).splitlines() if line.strip())
    text = f"{type(err).__name__}: {text}"
    return text if len(text) <= 200 else text[:197] + "..."


def measure(shape: Shape, platform: str, params: _timing.Params, seed: int, log) -> Row:
    """Times the twin and every fused path of `shape`, checks the fused outputs; a Row."""
    rows, k, n = shape.per_rank()
    fp8 = _tuning.FP8 if shape.fp8 else None
    problem = _plan.Problem(shape.op, rows, k, n, np.dtype(shape.x_dtype), shape.tp, platform, fp8=fp8)
    reason = _plan.unavailable(problem)
    if reason is not None:
        return Row(shape, f"unavailable: {reason}")
    mesh = _mesh(shape.tp)
    x_spec, w_spec, out_spec = _SPECS[shape.op]
    kx, kw = jax.random.split(jax.random.key(seed))
    x = _random(kx, (shape.M, shape.K), shape.x_dtype, mesh, x_spec)
    w = _random(kw, (shape.K, shape.N), shape.x_dtype, mesh, w_spec)
    twin = _step(shape.op, "twin", mesh, fp8=shape.fp8)
    reference = jax.jit(twin)(x, w)
    timers = {"twin": _timing.LoopTimer(twin, (x, w), mesh, x_spec, out_spec, params)}
    row = Row(shape, "measured")
    for path in _paths(problem):
        try:
            step = _step(shape.op, path, mesh, fp8=shape.fp8)
            text = jax.jit(step).lower(x, w).as_text()
            call = _custom_call(problem, path)
            if f"custom_call @{call}" not in text:
                raise RuntimeError(f"the program has no {call} call")
            err = float(_rel_err(jax.jit(_step(shape.op, path, mesh, poison=True, fp8=shape.fp8))(x, w), reference))
            row.max_rel_err[path] = err
            if not err <= TOLERANCE[shape.dtype]:
                log(f"    {path}: WRONG output (max relative error {err:.3g} against the twin); not a candidate")
                continue
            timers[path] = _timing.LoopTimer(step, (x, w), mesh, x_spec, out_spec, params)
        except Exception as err:  # noqa: BLE001  a path that cannot run here is reported, the others go on
            log(f"    {path}: unavailable: {_error_text(err)}")
    samples = {name: [] for name in timers}
    names = sorted(timers)
    for round_index in range(params.repeats):
        order = names[:]
        random.Random(7919 * (round_index + 1) + seed).shuffle(order)  # neighbours change each round
        for name in order:
            samples[name].append(timers[name].sample())
    row.ms = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
    twin_ms = row.ms["twin"]
    if not twin_ms > 0:
        return dataclasses.replace(row, status="unresolved: the twin's median time is <= 0 (noise); raise --target-ms")
    row.speedup = {p: twin_ms / ms for p, ms in row.ms.items() if p != "twin" and ms > 0}
    for p in sorted(set(row.ms) - set(row.speedup) - {"twin"}):
        log(f"    {p}: not resolved (median time <= 0: noise); not a candidate (raise --target-ms)")
    return row


def measure_link(tp: int, params: _timing.Params, small: bool) -> tuple[float, float]:
    """(GB/s, us): XLA's all-gather over `tp` devices: per-GPU bandwidth of a large one (32 MiB
    per rank on GPU, 256 KiB on CPU) and the time of a tiny one."""
    mesh = _mesh(tp)
    spec = P(_AXIS, None)
    step = jax.shard_map(
        lambda v: jax.lax.all_gather(v, _AXIS, axis=0, tiled=True), mesh=mesh, in_specs=spec, out_specs=spec
    )
    times = {}
    for rows in (8, 128 if small else 8192):
        v = _random(jax.random.key(rows), (tp * rows, 2048), jnp.bfloat16, mesh, spec)
        timer = _timing.LoopTimer(step, (v,), mesh, spec, spec, params)
        times[rows] = statistics.median(timer.sample() for _ in range(params.repeats))
    big = max(times)
    received = (tp - 1) * big * 2048 * 2
    return received / max(times[big], 1e-9) / 1e9, max(times[8], 0.0) * 1e6
