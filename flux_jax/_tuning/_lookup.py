"""What the tuning tables say about one call: the tables asked in order, the entries that may
answer, the measured class or the two nearest neighbours (flux_jax/_tuning/__init__.py)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from flux_jax._tuning._files import builtin, cache_path, load
from flux_jax._tuning._model import FP8, FUSED_PATHS, RADIUS, Entry, ShapeClass, Table, entry_order, shape_class


@dataclasses.dataclass(frozen=True)
class Decision:
    """What a table says about one call: `path` ("twin" or a fused path), `fused` (the fused
    path to run where one must run, or None when the table does not say), why, and the table."""

    path: str
    fused: str | None
    reason: str
    source: str


@dataclasses.dataclass(frozen=True)
class LocalDevice:
    kind: str
    count: int
    sms: int | None


@functools.cache
def local_device(platform: str) -> LocalDevice | None:
    """This process's devices of `platform` ("cpu" or "gpu"), or None when it has none."""
    import jax

    try:
        devices = jax.local_devices(backend=platform)
    except RuntimeError:
        return None
    if not devices:
        return None
    d = devices[0]
    sms = getattr(d, "core_count", None)
    return LocalDevice(d.device_kind, len(devices), sms if isinstance(sms, int) and sms > 0 else None)


def _candidates(table: Table, kind: str | None, count: int | None, tp: int, dtype: str, op: str) -> list[list]:
    """The entries of `table` that may answer a call, in the order to ask them: same TP, dtype and
    op; the same device kind (any kind for the built-in table; any of the platform's kinds when
    `kind` is None). Those measured with this host's GPU count are asked first, then all."""
    same = [
        e
        for e in table.entries
        if e.tp == tp and e.dtype == dtype and e.op == op and (table.builtin or kind is None or e.device_kind == kind)
    ]
    if kind is None and not table.builtin and same:
        first = min(e.device_kind for e in same)
        same = [e for e in same if e.device_kind == first]
    counted = [e for e in same if e.gpu_count == count]
    return [counted, same] if counted and len(counted) < len(same) else [same]


def _agreement(near: list, min_speedup: float) -> tuple[str, str]:
    """The path two neighbouring entries agree on, and why: their common path, else the fused
    path whose worse speedup of the two is the best, where it beat the twin by the table's
    `min_speedup` at both (the margin each entry was chosen by)."""
    a, b = near
    where = f"{a.describe()}, {b.describe()}"
    if a.path == b.path:
        return a.path, f"between measured points that agree ({where})"
    safe = [(min(a.speedup.get(p, 0.0), b.speedup.get(p, 0.0)), p) for p in FUSED_PATHS]
    worst, best = max(safe)
    if worst >= min_speedup:
        return best, (
            f"between measured points where {best} beat the twin by the table's --min-speedup "
            f"{min_speedup:g} at both "
            f"({a.describe()}: {a.speedup[best]:.2f}x, {b.describe()}: {b.speedup[best]:.2f}x)"
        )
    return "twin", f"the measured points nearest this shape disagree ({where})"


def _twin_result(e: Entry, min_speedup: float) -> str:
    """Why an entry with fused speedups chose the twin: none was faster, none by the table's
    min_speedup (the tool's --min-speedup), or the choice was made elsewhere (a fused path beat
    the twin by the margin)."""
    best = e.best_fused()
    measured = e.speedup[best]
    if measured >= min_speedup:
        return (
            f"the twin, although {best} measured {measured:.2f}x, not below the table's --min-speedup "
            f"{min_speedup:g} (a choice made elsewhere)"
        )
    margin = f" by the table's --min-speedup {min_speedup:g}" if measured >= 1 else ""
    return f"no fused path beat the twin{margin} (the best, {best}, measured {measured:.2f}x)"


def _decide(table: Table, entries: list, query: ShapeClass) -> Decision | None:
    exact = [e for e in entries if e.shape_class == query]
    if exact:
        e = exact[0]
        rows, k, n = e.shape
        if e.path in e.speedup:
            result = f"{e.path} {e.speedup[e.path]:.2f}x over the twin"
        elif e.path == "twin" and e.speedup:
            result = _twin_result(e, table.min_speedup)
        else:
            result = e.path
        what = f"measured at this shape class: {e.op} rows={rows} k={k} n={n}, {result}"
        return Decision(e.path, e.best_fused(), f"{what} ({e.note})" if e.note else what, table.source)
    near = sorted(entries, key=lambda e: (e.shape_class.distance(query), entry_order(e)))[:2]
    if len(near) < 2 or near[1].shape_class.distance(query) > RADIUS:
        return None
    path, why = _agreement(near, table.min_speedup)
    fused = path if path != "twin" else near[0].best_fused()
    return Decision(path, fused, why, table.source)


def table_dtype(problem) -> str | None:
    """The `dtype` of a call's entries: x's dtype, or FP8 for an FP8 call's forward (e4m3 rows,
    bfloat16 x); None for FP8 calls no table describes (e5m2 rows of a backward, other x dtypes)."""
    if getattr(problem, "fp8", None) is None:
        return np.dtype(problem.dtype).name
    return FP8 if problem.fp8 == FP8 and np.dtype(problem.dtype).name == "bfloat16" else None


def _tables(explicit: str | None, platform: str, local: LocalDevice | None) -> list:
    tables = []
    if explicit is not None:
        tables.append(load(explicit))
    if platform == "gpu":
        if local is not None:
            cached = cache_path(local.kind)
            if cached.is_file():
                tables.append(load(cached))
        tables.append(builtin())
    return tables


def lookup(problem, explicit: str | None, *, on_hopper: bool = False, sms: int | None = None) -> Decision | None:
    """What the tuning tables say about `problem` (a flux_jax/_plan.Problem), or None when no
    table covers it. Only flux_jax/_plan.py calls this.

    `explicit`: Config.tuning. CPU calls consult only an explicit table (its "cpu" entries);
    GPU calls the explicit table, this GPU kind's table in the user cache, then the built-in
    one. `on_hopper` (explain_auto): a GPU call even in a process without GPUs; `sms`
    (explain_auto's gpu=): the SM count the shape classes are scaled to, instead of this GPU's.
    """
    platform = "gpu" if on_hopper or problem.platform in ("cuda", "gpu") else problem.platform
    if platform not in ("gpu", "cpu"):
        return None
    local = local_device(platform)
    dtype = table_dtype(problem)
    if dtype is None:
        return None
    for table in _tables(explicit, platform, local):
        kind = None if local is None or table.builtin else local.kind
        for entries in _candidates(table, kind, local.count if local else None, problem.tp, dtype, problem.op):
            entries = [e for e in entries if table.devices[e.device_kind].platform == platform]
            if not entries:
                continue
            device = table.devices[entries[0].device_kind]
            gpu_sms = sms if sms is not None else local.sms if local is not None and platform == "gpu" else None
            query = shape_class(problem.op, problem.rows, problem.k, problem.n, dtype, problem.tp, device, gpu_sms)
            decision = _decide(table, entries, query)
            if decision is not None:
                return decision
    return None
