"""Measure what impl="auto" should run on this host: `python -m flux_jax.tune` (docs/tuning.md).

For each requested GEMM (a model preset, explicit shapes, or the flux_jax calls of a function),
TP size and dtype, the tool times every fused path against the XLA twin on this host's GPUs with
the dispatch-free method (flux_jax/tune/_timing.py), checks every fused output against the
twin's, and writes a tuning table entry keyed by (device kind, GPU count, TP, dtype, op, shape
class): the path that beat the twin by `min_speedup` (recorded in the table), else the twin. The
table is written after every entry, so an interrupted or budget-limited run keeps what it
measured and a re-run skips it. impl="auto" reads the table (flux_jax/_plan.py): by default it is
written to this GPU kind's file in the user cache, which auto reads in every new process.

  python -m flux_jax.tune --model llama3-8b --tp 2
  python -m flux_jax.tune --shapes ag_matmul:4096x8192x28672,matmul_rs:4096x28672x8192
  python -m flux_jax.tune --from mypkg.bench:make_step --budget-minutes 20

or `flux_jax.tune.run(model="llama3-8b", tp=[2])`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from flux_jax import _plan, _tuning
from flux_jax._tuning import TuningTableError, cache_path, load
from flux_jax.tune import _models, _table, _timing
from flux_jax.tune._models import MODELS
from flux_jax.tune._table import MIN_SPEEDUP

__all__ = ["MIN_SPEEDUP", "MODELS", "Result", "TuneError", "TuningTableError", "cache_path", "load", "main", "run"]

OPS = ("ag_matmul", "matmul_rs", "matmul_ar")
_OP_ALIASES = {"ag": "ag_matmul", "rs": "matmul_rs", "ar": "matmul_ar", **{op: op for op in OPS}}
# "fp8": bfloat16 x and w with fp8=True (the default recipe: e4m3 operands, current scaling),
# against the FP8 twin; its table entries have dtype "float8_e4m3fn" (flux_jax/_tuning).
DTYPES = ("bfloat16", "float16", "float32", "fp8")
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
_CPU_WARNING = (
    "WARNING: tuning on CPU (--allow-cpu). The CPU backend is a reference of the protocol: its "
    'timings do not predict GPU speed. The run exercises the tool\'s mechanics only; impl="auto" '
    "follows a CPU table only through flux_jax.Config(tuning=<path>)."
)


class TuneError(Exception):
    """A request the tool cannot run (the message says why and what to do)."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """One global GEMM of one op at one TP size and dtype."""

    op: str
    M: int
    K: int
    N: int
    tp: int
    dtype: str
    label: str = ""

    @property
    def text(self) -> str:
        return f"{self.op}:{self.M}x{self.K}x{self.N}"

    @property
    def fp8(self) -> bool:
        return self.dtype == "fp8"

    @property
    def x_dtype(self) -> str:
        return "bfloat16" if self.fp8 else self.dtype

    @property
    def table_dtype(self) -> str:
        """The dtype of the shape's table entry (flux_jax/_tuning.table_dtype)."""
        return _tuning.FP8 if self.fp8 else self.dtype

    def per_rank(self) -> tuple[int, int, int]:
        """(rows, k, n) of the per-rank GEMM, as flux_jax/_plan.Problem counts them."""
        if self.op == "ag_matmul":
            return self.M, self.K, self.N // self.tp
        return self.M, self.K // self.tp, self.N

    def invalid(self) -> str | None:
        if self.op != "matmul_ar" and self.M % self.tp:  # matmul_ar's rows stay whole on every rank
            return f"M={self.M} is not divisible by tp={self.tp} (rows are sharded)"
        name, value = ("N", self.N) if self.op == "ag_matmul" else ("K", self.K)
        if value % self.tp:
            return f"{name}={value} is not divisible by tp={self.tp}"
        return None


@dataclasses.dataclass
class Row:
    """What happened to one shape: its status, times, speedups, errors and the table's choice."""

    shape: Shape
    status: str  # "measured", "measured before", "same shape class as ...", "unavailable: ...", ...
    path: str | None = None
    ms: dict = dataclasses.field(default_factory=dict)
    speedup: dict = dataclasses.field(default_factory=dict)
    max_rel_err: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Result:
    """What `run` did: the table file, one Row per shape, and whether the budget stopped it."""

    path: Path
    rows: list
    stopped_by_budget: bool
    table: _tuning.Table

    def summary(self) -> str:
        return _summary(self.rows)


# ---------------------------------------------------------------------------------------------
# What to measure


def _op(text: str) -> str:
    if text not in _OP_ALIASES:
        raise TuneError(f"unknown op {text!r}: use ag_matmul, matmul_rs or matmul_ar (or ag, rs, ar)")
    return _OP_ALIASES[text]


def _ints(text, what: str) -> list[int]:
    if isinstance(text, (list, tuple)):
        values = list(text)
    else:
        try:
            values = [int(v) for v in str(text).split(",") if v.strip()]
        except ValueError:
            raise TuneError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or any(type(v) is not int or v < 1 for v in values):
        raise TuneError(f"{what} must be positive integers, got {text!r}")
    return values


def _names(text, what: str, allowed) -> list[str]:
    values = list(text) if isinstance(text, (list, tuple)) else [v.strip() for v in str(text).split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise TuneError(f"{what} must be among {', '.join(allowed)}, got {text!r}")
    return values


def parse_shapes(text, tps, dtypes) -> list[Shape]:
    """Shapes from "op:MxKxN,op:MxKxN" (global shapes; op ag_matmul / matmul_rs / matmul_ar, or
    ag / rs / ar)."""
    items = list(text) if isinstance(text, (list, tuple)) else [s for s in str(text).split(",") if s.strip()]
    out = []
    for item in items:
        op, sep, dims = str(item).strip().partition(":")
        try:
            m, k, n = (int(v) for v in dims.lower().split("x"))
        except ValueError:
            raise TuneError(f"a shape is op:MxKxN (e.g. ag_matmul:4096x8192x28672), got {item!r}") from None
        if not sep or min(m, k, n) < 1:
            raise TuneError(f"a shape is op:MxKxN with positive sizes, got {item!r}")
        out += [Shape(_op(op), m, k, n, tp, dtype, "--shapes") for tp in tps for dtype in dtypes]
    return out


def model_shapes(model: str, ms, tps, dtypes, sequence_parallel: bool = True) -> list[Shape]:
    """A model preset's layer GEMMs at every M, TP size and dtype (`sequence_parallel`: the ops of
    the two layouts, _models.layers)."""
    try:
        layers = _models.layers(model, sequence_parallel)
    except ValueError as err:
        raise TuneError(str(err)) from None
    return [
        Shape(op, m, k, n, tp, dtype, label) for tp in tps for dtype in dtypes for op, k, n, label in layers for m in ms
    ]


def function_shapes(target) -> list[Shape]:
    """The flux_jax calls of `target` (a "module:function" or a callable) that returns (fn, args),
    found with flux_jax.explain: every call site's GEMM at its TP size and dtype."""
    from flux_jax import _explain

    if isinstance(target, str):
        module, sep, name = target.partition(":")
        if not sep or not module or not name:
            raise TuneError(f"--from takes module:function, got {target!r}")
        try:
            target = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as err:
            raise TuneError(f"--from {module}:{name}: {err}") from None
    made = target()
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])):
        raise TuneError("--from: the function must return (fn, args), a callable and its arguments")
    fn, args = made
    shapes = []
    for site in _explain.explain(fn, *tuple(args)):
        p = site.problem
        dtype = _tuning.table_dtype(p)
        if p.op not in OPS or dtype is None:  # (FP8 calls no table describes: a backward's e5m2 rows)
            continue
        m, k, n = (p.rows, p.k, p.n * p.tp) if p.op == "ag_matmul" else (p.rows, p.k * p.tp, p.n)
        dtype = "fp8" if dtype == _tuning.FP8 else dtype
        shape = Shape(p.op, m, k, n, p.tp, dtype, "backward" if site.backward else "forward")
        if all(dataclasses.replace(s, label="") != dataclasses.replace(shape, label="") for s in shapes):
            shapes.append(shape)
    if not shapes:
        raise TuneError(
            "--from: the function has no ag_matmul / matmul_rs / matmul_ar call (flux_jax.explain found none)"
        )
    return shapes


# ---------------------------------------------------------------------------------------------
# Measuring


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


def _measure(shape: Shape, platform: str, params: _timing.Params, seed: int, log) -> Row:
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


def _measure_link(tp: int, params: _timing.Params, small: bool) -> tuple[float, float]:
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


# ---------------------------------------------------------------------------------------------
# The run


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return f"[{'#' * filled}{'-' * (width - filled)}] {done}/{total}"


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _fmt_speedups(row: Row) -> str:
    return ", ".join(f"{p} {s:.2f}x" for p, s in sorted(row.speedup.items(), key=lambda kv: -kv[1])) or "-"


def _summary(rows: list) -> str:
    header = ("op", "M x K x N", "tp", "dtype", "twin ms", "overlap", "latency", "decode", "auto runs", "status")
    lines = [header]
    for r in rows:
        s = r.shape
        lines.append(
            (
                s.op,
                f"{s.M}x{s.K}x{s.N}",
                str(s.tp),
                s.dtype,
                f"{r.ms['twin']:.4f}" if "twin" in r.ms else "-",
                *(
                    f"{r.speedup[p]:.2f}x"
                    if p in r.speedup
                    else ("WRONG" if not r.max_rel_err.get(p, 0.0) <= TOLERANCE[s.dtype] else "-")
                    for p in ("overlap", "latency", "decode")
                ),
                r.path or "-",
                r.status,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line[:-1], widths)) + "  " + line[-1] for line in lines)


def _platform(allow_cpu: bool, log) -> str:
    platform = jax.devices()[0].platform
    if platform in ("gpu", "cuda"):
        return "cuda"
    if platform != "cpu":
        raise TuneError(f"the fused kernels run on CUDA GPUs (and a CPU reference backend), not on {platform!r}")
    if not allow_cpu:
        raise TuneError(
            'no GPU here (JAX\'s devices are CPUs). Tuning measures the GPUs impl="auto" will run on: '
            "run it on the GPU host. --allow-cpu runs the mechanics on CPU anyway (its timings do not "
            "predict GPU speed)."
        )
    log(_CPU_WARNING)
    return "cpu"


def _tp_sizes(tp, count: int) -> list[int]:
    sizes = _ints(tp, "--tp") if tp is not None else [count]
    if 1 in sizes or count == 1:
        raise TuneError(
            "TP=1 has nothing to overlap: a fused op moves no data between GPUs at TP=1, so there is "
            f"nothing to tune. Run with --tp 2 or more (this host has {count} device(s))."
        )
    too_big = [t for t in sizes if t > count]
    if too_big:
        raise TuneError(f"--tp {too_big[0]} needs {too_big[0]} devices; this host has {count}")
    return sorted(set(sizes))


def run(
    *,
    model: str | None = None,
    shapes=None,
    from_function=None,
    ms=None,
    tp=None,
    dtypes=("bfloat16",),
    out=None,
    budget_minutes: float | None = None,
    allow_cpu: bool = False,
    repeats: int | None = None,
    target_ms: float | None = None,
    min_speedup: float | None = None,
    seed: int = 0,
    log=print,
    dtype=None,
    sequence_parallel: bool = True,
) -> Result:
    """Measures the fused paths against the twin and writes the tuning table; see `main --help`.

    Exactly one of `model` (a preset name: MODELS), `shapes` ("op:MxKxN,..." global shapes) and
    `from_function` ("module:function" or a callable returning (fn, args)) says what to measure;
    `ms` the M values of a model preset, `sequence_parallel` which ops its layers use (False: the
    row-parallel GEMMs and the column-parallel ones' backward as matmul_ar), `tp` the TP sizes
    (default: every local device), `dtypes` (or `dtype`) the dtypes. `out`: the table file
    (default: this device kind's in the user cache; entries there are kept and skipped).
    `min_speedup`: the margin a fused path must beat the twin by to be chosen, recorded in the
    table (None: the existing table's, else MIN_SPEEDUP; another one than an existing table's is
    refused). Raises TuneError for a request it cannot run.
    """
    start = time.monotonic()
    if sum(v is not None for v in (model, shapes, from_function)) != 1:
        raise TuneError("say what to measure: exactly one of --model, --shapes and --from")
    if budget_minutes is not None and not (isinstance(budget_minutes, (int, float)) and budget_minutes > 0):
        raise TuneError(f"--budget-minutes must be a positive number, got {budget_minutes!r}")
    problem = _tuning.min_speedup_problem(min_speedup) if min_speedup is not None else None
    if problem:
        raise TuneError(f"--min-speedup must be {problem}")
    platform = _platform(allow_cpu, log)
    devices = jax.local_devices()
    kind, count = devices[0].device_kind, len(devices)
    dtypes = _names(dtype if dtype is not None else dtypes, "--dtype", DTYPES)
    if from_function is not None:
        requested = function_shapes(from_function)
        _tp_sizes([s.tp for s in requested], count)
    else:
        tps = _tp_sizes(tp, count)
        if model is not None:
            ms = _ints(ms, "--m") if ms is not None else _models.DEFAULT_MS
            requested = model_shapes(model, ms, tps, dtypes, sequence_parallel)
        else:
            requested = parse_shapes(shapes, tps, dtypes)
    if not requested:
        raise TuneError("no shapes to measure: --shapes, --model or --from-function named none")
    params = _timing.GPU if platform == "cuda" else _timing.CPU
    params = dataclasses.replace(
        params, **{k: v for k, v in (("repeats", repeats), ("target_ms", target_ms)) if v is not None}
    )
    if params.repeats < 1 or params.target_ms <= 0:
        raise TuneError("--repeats must be >= 1 and --target-ms > 0")

    path = Path(out) if out is not None else cache_path(kind)
    table = _table.read_or_none(path)  # an invalid file stops the run: it is never overwritten
    min_speedup = _min_speedup(min_speedup, table, path)
    device = table.devices.get(kind) if table is not None else None
    log(f"flux_jax.tune: {len(requested)} shape(s) on {count} x {kind}; table {path}")
    if device is None:
        log("measuring the link (XLA's all-gather) ...")
        gbps, latency_us = _measure_link(max(s.tp for s in requested), params, platform == "cpu")
        sms = getattr(devices[0], "core_count", None) if platform == "cuda" else os.cpu_count()
        device = _tuning.Device(kind, "gpu" if platform == "cuda" else "cpu", int(sms or 1), gbps, latency_us)
        log(f"  {gbps:.1f} GB/s per device, {latency_us:.1f} us for the smallest all-gather, {device.sms} SMs")
    table = dataclasses.replace(_table.merged(table, device, []), min_speedup=min_speedup)
    _table.write(path, table)

    done_keys = {e.key for e in table.entries}
    results, seen, stopped = [], {}, False
    entry_seconds = []
    deadline = start + budget_minutes * 60 if budget_minutes is not None else math.inf
    for index, shape in enumerate(requested):
        progress = _bar(index, len(requested))
        invalid = shape.invalid()
        rows, k, n = shape.per_rank()
        key = _table.make_entry(device, count, shape.tp, shape.table_dtype, shape.op, rows, k, n, {}).key
        skipped = None
        if invalid:
            skipped = Row(shape, f"invalid: {invalid}")
        elif key in seen:
            skipped = Row(shape, f"same shape class as {seen[key].text}", _entry_path(table, key))
        elif key in done_keys:
            skipped = Row(shape, "measured before", _entry_path(table, key))
        if skipped is not None:
            log(f"{progress} {shape.text} tp={shape.tp} {shape.dtype}: {skipped.status}, skipped")
            results.append(skipped)
        else:
            estimate = statistics.mean(entry_seconds) if entry_seconds else 0.0
            if entry_seconds and time.monotonic() + estimate > deadline:
                stopped = True
                log(f"{progress} budget of {budget_minutes:g} min reached: stopping before {shape.text}")
                results += [Row(s, "not measured (budget)") for s in requested[index:]]
                break
            left = f", ~{_clock(estimate * (len(requested) - index))} left" if entry_seconds else ""
            log(
                f"{progress} {shape.text} tp={shape.tp} {shape.dtype} "
                f"(elapsed {_clock(time.monotonic() - start)}{left})"
            )
            began = time.monotonic()
            row = _measure(shape, platform, params, seed, log)
            if row.status == "measured":
                entry = _table.make_entry(
                    device,
                    count,
                    shape.tp,
                    shape.table_dtype,
                    shape.op,
                    rows,
                    k,
                    n,
                    row.speedup,
                    min_speedup=min_speedup,
                )
                row.path = entry.path
                extra = {
                    entry.key: {
                        "global_shape": f"{shape.M}x{shape.K}x{shape.N}",
                        "label": shape.label,
                        "ms": {p: round(v, 6) for p, v in row.ms.items()},
                        "max_rel_err": {p: float(f"{v:.3g}") for p, v in row.max_rel_err.items()},
                        "measured_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    }
                }
                table = _table.merged(table, device, [entry], extra)
                _table.write(path, table)  # after every entry: nothing measured is lost
                done_keys.add(entry.key)
            entry_seconds.append(time.monotonic() - began)
            log(f"    -> {row.path or '-'} ({row.status}; {_fmt_speedups(row)} over the twin)")
            results.append(row)
        if not invalid:
            seen.setdefault(key, shape)
    log(
        _bar(len(requested) if not stopped else index, len(requested))
        + (" stopped by the budget: re-run the same command to measure the rest" if stopped else " done")
    )
    log(_summary(results))
    if platform == "cuda" and path == cache_path(kind):
        log(f'impl="auto" reads {path} in every new process on {kind} GPUs.')
    else:
        log(f'impl="auto" follows this table with flux_jax.Config(tuning={str(path)!r}).')
    return Result(path, results, stopped, table)


def _min_speedup(requested: float | None, table: _tuning.Table | None, path: Path) -> float:
    """The --min-speedup of a run: `requested`, else the table's, else the default. The table's
    entries chose their paths by its own, so another one is refused where it has entries."""
    if requested is None:
        return table.min_speedup if table is not None else MIN_SPEEDUP
    if table is not None and table.entries and float(requested) != table.min_speedup:
        raise TuneError(
            f"--min-speedup {requested:g} differs from the {table.min_speedup:g} that the table {path} was made "
            f"with (its entries chose their paths by it): run with --min-speedup {table.min_speedup:g}, or "
            "write another table with --out"
        )
    return float(requested)


def _entry_path(table: _tuning.Table, key) -> str | None:
    return next((e.path for e in table.entries if e.key == key), None)


# ---------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    models = ", ".join(MODELS)
    p = argparse.ArgumentParser(
        prog="python -m flux_jax.tune",
        description=(
            "Measure, on this host's GPUs, every fused path of flux_jax's ops against the XLA twin "
            "(dispatch-free device time, outputs checked against the twin) and write the tuning "
            'table impl="auto" follows. Run it once per GPU kind and TP size; re-running skips '
            "what the table already has. See docs/tuning.md."
        ),
        epilog=(
            "examples:\n"
            "  python -m flux_jax.tune --model llama3-8b --tp 2\n"
            "  python -m flux_jax.tune --shapes ag_matmul:4096x8192x28672,matmul_rs:4096x28672x8192 --tp 2,4\n"
            "  python -m flux_jax.tune --model llama3-8b --no-sequence-parallel  # matmul_ar\n"
            "  python -m flux_jax.tune --from mypkg.train:make_step --budget-minutes 30\n"
            "  python -m flux_jax.tune --model llama3-70b --out /shared/flux_jax/h100_tp4.json  "
            "# then Config(tuning=...)\n"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = p.add_argument_group("what to measure (exactly one)")
    group = what.add_mutually_exclusive_group()
    group.add_argument("--model", metavar="NAME", help=f"a model preset's layer GEMMs: {models}")
    group.add_argument(
        "--shapes",
        metavar="OP:MxKxN,...",
        help="global GEMM shapes; OP is ag_matmul (x [M,K] row-sharded, w [K,N] column-sharded), "
        "matmul_rs or matmul_ar (x and w sharded on K; matmul_ar's rows stay whole); "
        "e.g. ag_matmul:4096x4096x28672",
    )
    group.add_argument(
        "--from",
        dest="from_function",
        metavar="MODULE:FUNCTION",
        help="a function returning (fn, args): the shapes, TP sizes and dtypes of fn's flux_jax "
        "calls (found with flux_jax.explain)",
    )
    p.add_argument(
        "--m",
        metavar="M,...",
        help="with --model: the M values (rows, i.e. tokens) to sweep "
        f"(default {','.join(map(str, _models.DEFAULT_MS))})",
    )
    p.add_argument(
        "--no-sequence-parallel",
        dest="sequence_parallel",
        action="store_false",
        help="with --model: the layer without sequence parallelism (Megatron's first layout): the "
        "row-parallel GEMMs are matmul_ar, and so is the column-parallel ones' backward "
        "(column_matmul's dx); by default the layer has ag_matmul and matmul_rs",
    )
    p.add_argument(
        "--tp", metavar="TP,...", help="TP sizes (mesh axis sizes) to measure, each >= 2 (default: every local device)"
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        metavar="DTYPE,...",
        help=f"dtypes among {', '.join(DTYPES)} (default bfloat16); fp8: bfloat16 x and w with fp8=True "
        "(the default recipe's e4m3 operands), against the FP8 twin",
    )
    p.add_argument(
        "--out",
        metavar="PATH",
        help="the table file (default: this GPU kind's table in the user cache, "
        '$XDG_CACHE_HOME/flux_jax/tuning/<device-kind>.json, which impl="auto" reads)',
    )
    p.add_argument(
        "--budget-minutes",
        type=float,
        metavar="MIN",
        help="stop before a shape that would not finish within this many minutes (at least one "
        "shape is measured per run); the table keeps what was measured; re-run to continue",
    )
    p.add_argument("--repeats", type=int, metavar="N", help="timing rounds per shape (default 5 on GPU)")
    p.add_argument(
        "--target-ms",
        type=float,
        metavar="MS",
        help="length of the timed loop difference per sample (default 20 on GPU)",
    )
    p.add_argument(
        "--min-speedup",
        type=float,
        metavar="X",
        help="a fused path must beat the twin by this factor to be chosen; recorded in the table, and "
        f"a table's entries all use one (default: the table's, else {MIN_SPEEDUP})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs and of the round order")
    p.add_argument(
        "--allow-cpu",
        action="store_true",
        help="run on CPU devices when there is no GPU: the mechanics only, timings do not predict "
        "GPU speed (for testing the tool)",
    )
    p.add_argument("--list-models", action="store_true", help="list the model presets and exit")
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list_models:
        for name, (hidden, ffn, q, kv, hd) in MODELS.items():
            print(f"{name}: hidden {hidden}, ffn {ffn}, {q} query / {kv} KV heads of {hd}")
        return 0
    if not (args.model or args.shapes or args.from_function):
        parser.error("say what to measure: one of --model, --shapes, --from")
    try:
        run(
            model=args.model,
            shapes=args.shapes,
            from_function=args.from_function,
            ms=args.m,
            tp=args.tp,
            dtypes=args.dtype,
            out=args.out,
            budget_minutes=args.budget_minutes,
            allow_cpu=args.allow_cpu,
            repeats=args.repeats,
            target_ms=args.target_ms,
            min_speedup=args.min_speedup,
            seed=args.seed,
            sequence_parallel=args.sequence_parallel,
        )
    except (TuneError, TuningTableError) as err:
        print(f"flux_jax.tune: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "flux_jax.tune: interrupted; the table keeps every shape measured so far (re-run to continue)",
            file=sys.stderr,
        )
        return 130
    return 0
