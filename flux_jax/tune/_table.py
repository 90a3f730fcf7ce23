"""The tool's table writing: measured speedups -> entries -> a merged table file.

The built-in table (flux_jax/_auto_rule.py's points) is written by this code too.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flux_jax import _tuning
from flux_jax._tuning import Device, Entry, Table

# A fused path must beat the twin by this factor to be chosen: the timing method's run-to-run
# spread (benchmarks/README.md), and auto must never be slower than XLA. A table records the one
# its entries were chosen by (Table.min_speedup).
MIN_SPEEDUP = _tuning.DEFAULT_MIN_SPEEDUP


def choose(speedup: dict, min_speedup: float = MIN_SPEEDUP) -> str:
    """The fastest fused path where it beat the twin by `min_speedup` (>= 1), else "twin"."""
    problem = _tuning.min_speedup_problem(min_speedup)
    if problem:
        raise ValueError(f"min_speedup must be {problem}")
    if not speedup:
        return "twin"
    best = max(sorted(speedup), key=speedup.get)
    return best if speedup[best] >= min_speedup else "twin"


def make_entry(
    device: Device,
    gpu_count: int,
    tp: int,
    dtype,
    op: str,
    rows: int,
    k: int,
    n: int,
    speedup: dict,
    *,
    path: str | None = None,
    note: str = "",
    min_speedup: float = MIN_SPEEDUP,
) -> Entry:
    """The entry of one measured per-rank GEMM (rows x k x n). `path` defaults to `choose`'s; a
    `path` its speedup contradicts (_tuning.path_contradiction) is a ValueError. The speedups are
    rounded as the file stores them, so that a reader sees the numbers the path was chosen by."""
    dtype = np.dtype(dtype).name
    speedup = {p: _tuning.stored_speedup(s) for p, s in speedup.items()}
    path = path or choose(speedup, min_speedup)
    contradiction = _tuning.path_contradiction(path, speedup)
    if contradiction:
        raise ValueError(f"tuning table entry {op} rows={rows} k={k} n={n} ({dtype}, tp={tp}): {contradiction}")
    shape_class = _tuning.shape_class(op, rows, k, n, dtype, tp, device)
    return Entry(
        device.kind,
        gpu_count,
        tp,
        dtype,
        op,
        shape_class,
        (rows, k, n),
        path,
        speedup,
        note,
    )


def merged(table: Table | None, device: Device, entries, extra: dict | None = None) -> Table:
    """`table` (or an empty one) with `device` and `entries` added; an entry replaces one with
    the same key. `extra`: per-key fields kept next to an entry (the measured times, errors)."""
    if table is None:
        table = Table("", {}, ())
    by_key = {e.key: e for e in table.entries}
    kept = dict(table.extra)
    for e in entries:
        by_key[e.key] = e
        kept.pop(e.key, None)
    kept.update(extra or {})
    devices = dict(table.devices)
    devices[device.kind] = device
    return dataclasses.replace(table, devices=devices, entries=tuple(by_key.values()), extra=kept)


def read_or_none(path) -> Table | None:
    """The table at `path`, None when there is no file (TuningTableError when it is invalid)."""
    import os

    return _tuning.load(path) if os.path.exists(path) else None


write = _tuning.write
