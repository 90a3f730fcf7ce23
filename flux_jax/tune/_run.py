"""The tool's run: what to measure, the device's link, each shape measured once per shape class,
the table written after every entry, and the summary."""

from __future__ import annotations

import dataclasses
import datetime
import math
import numbers
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax

from flux_jax import _tuning
from flux_jax._tuning import cache_path
from flux_jax.tune import _models, _table, _timing
from flux_jax.tune._measure import TOLERANCE, Row, measure, measure_link
from flux_jax.tune._request import (
    DTYPES,
    TuneError,
    function_shapes,
    model_shapes,
    parse_ints,
    parse_names,
    parse_shapes,
)
from flux_jax.tune._table import MIN_SPEEDUP

_CPU_WARNING = (
    "WARNING: tuning on CPU (--allow-cpu). The CPU backend is a reference of the protocol: its "
    'timings do not predict GPU speed. The run exercises the tool\'s mechanics only; impl="auto" '
    "follows a CPU table only through flux_jax.Config(tuning=<path>)."
)


@dataclasses.dataclass
class Result:
    """What `run` did: the table file, one Row per shape, and whether the budget stopped it."""

    path: Path
    rows: list
    stopped_by_budget: bool
    table: _tuning.Table

    def summary(self) -> str:
        return _summary(self.rows)


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


def _check_unused(from_function, shapes, tp, dtypes, ms, sequence_parallel: bool) -> None:
    """A TuneError for options the request would ignore: --from measures the function's own
    calls (their TP sizes and dtypes), --shapes its shapes at --tp and --dtype."""
    given = {"--tp": tp is not None, "--dtype": dtypes is not None, "--m": ms is not None}
    given["--no-sequence-parallel"] = not sequence_parallel
    if from_function is not None:
        ignored = [name for name, on in given.items() if on]
        why = "--from measures the TP sizes, dtypes and shapes of the function's own calls"
    elif shapes is not None:
        ignored = [name for name in ("--m", "--no-sequence-parallel") if given[name]]
        why = "--shapes names each op and global shape itself (--m and --no-sequence-parallel go with --model)"
    else:
        return
    if ignored:
        mode = "--from" if from_function is not None else "--shapes"
        raise TuneError(f"{', '.join(ignored)} cannot be used with {mode}: {why}")


def _tp_sizes(tp, count: int, *, from_function: bool = False) -> list[int]:
    sizes = parse_ints(tp, "--tp") if tp is not None else [count]
    if from_function and 1 in sizes:
        raise TuneError(
            "TP=1 has nothing to overlap: the function's flux_jax calls run over a mesh axis of size 1, "
            "where a fused op moves no data between GPUs. Build its mesh with a TP axis of 2 or more "
            f"devices (this host has {count})."
        )
    if 1 in sizes or (tp is None and count == 1):
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
    dtypes=None,
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
    if dtype is not None:
        dtypes = dtype
    _check_unused(from_function, shapes, tp, dtypes, ms, sequence_parallel)
    dtypes = parse_names(dtypes if dtypes is not None else "bfloat16", "--dtype", DTYPES)
    if from_function is not None:
        requested = function_shapes(from_function)
        _tp_sizes([s.tp for s in requested], count, from_function=True)
    else:
        tps = _tp_sizes(tp, count)
        if model is not None:
            ms = parse_ints(ms, "--m") if ms is not None else _models.DEFAULT_MS
            requested = model_shapes(model, ms, tps, dtypes, sequence_parallel)
        else:
            requested = parse_shapes(shapes, tps, dtypes)
    if not requested:
        raise TuneError("no shapes to measure: --shapes, --model or --from named none")
    params = _timing.GPU if platform == "cuda" else _timing.CPU
    params = dataclasses.replace(
        params, **{k: v for k, v in (("repeats", repeats), ("target_ms", target_ms)) if v is not None}
    )
    if isinstance(params.repeats, bool) or not isinstance(params.repeats, numbers.Integral) or params.repeats < 1:
        raise TuneError(f"--repeats must be an integer >= 1, got {params.repeats!r}")
    target = params.target_ms
    if isinstance(target, bool) or not isinstance(target, numbers.Real) or not 0 < target < math.inf:
        raise TuneError(f"--target-ms must be a positive finite number, got {target!r}")

    path = Path(out) if out is not None else cache_path(kind)
    _check_writable(path)
    table = _table.read_or_none(path)  # an invalid file stops the run: it is never overwritten
    min_speedup = _min_speedup(min_speedup, table, path)
    device = table.devices.get(kind) if table is not None else None
    log(f"flux_jax.tune: {len(requested)} shape(s) on {count} x {kind}; table {path}")
    if device is None:
        log("measuring the link (XLA's all-gather) ...")
        gbps, latency_us = measure_link(max(s.tp for s in requested), params, platform == "cpu")
        sms = getattr(devices[0], "core_count", None) if platform == "cuda" else os.cpu_count()
        device = _tuning.Device(kind, "gpu" if platform == "cuda" else "cpu", int(sms or 1), gbps, latency_us)
        log(f"  {gbps:.1f} GB/s per device, {latency_us:.1f} us for the smallest all-gather, {device.sms} SMs")
    table = dataclasses.replace(_table.merged(table, device, []), min_speedup=min_speedup)
    _write(path, table)

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
            row = measure(shape, platform, params, seed, log)
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
                _write(path, table)  # after every entry: nothing measured is lost
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


def _check_writable(path: Path) -> None:
    """TuneError unless the table can be written at `path` (its folder made and a file created
    there), so that a bad --out stops the run before it measures anything."""
    if path.is_dir():
        raise TuneError(f"--out {path} is a directory: name the table file, e.g. {path / 'table.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"):
            pass
    except OSError as err:
        raise TuneError(
            f"cannot write the table {path}: no file can be created in {path.parent} ({err.strerror or err}); "
            "name a writable file with --out"
        ) from None


def _write(path: Path, table: _tuning.Table) -> None:
    try:
        _table.write(path, table)
    except OSError as err:
        raise TuneError(f"cannot write the table {path}: {err.strerror or err}") from None


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
