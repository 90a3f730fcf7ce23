"""Tuning tables: the measurements impl="auto" follows (docs/tuning.md).

A table lists measured entries keyed by (device kind, GPU count, TP, dtype, op, shape class);
each says which path won there (a fused path, or "twin" when none beat XLA's) and by how much.
`python -m flux_jax.tune` writes them; the built-in table (h200_tp2.json: 2x H200 at TP=2,
flux_jax/_auto_rule.py's points) is one too. flux_jax/_plan.py is the only caller of `lookup`:
it asks, in this order, the table of `Config(tuning=path)`, this GPU kind's table in the user
cache (`cache_path`), and the built-in table; the first one with measurements near the call
decides, and without one auto takes the twin.

The shape class of a call is what transfers between shapes, not the shape itself. Its
coordinates, for the per-rank GEMM (rows x k x n) on a GPU with S SMs whose links were measured
at B GB/s and L us (XLA's all-gather: the bandwidth of a large one, the time of a tiny one):

  log2_flop         log2 of the GEMM's work, 2 rows k n, with rows rounded up to whole 64-row
                    MMA tiles (fewer rows cost as much)
  log2_transfer_us  log2 of L + the bytes each GPU moves over its links / B (ag_matmul: the
                    other ranks' rows of x; matmul_rs: the other ranks' rows of the partial
                    product)
  log2_waves        log2 of the overlap GEMM's 128 x 256 output tiles per SM
  decode_waves      the decode path's CTAs per SM (128 x 64 output tiles, plus ag_matmul's
                    32 row-push blocks), rounded up to 1/8 wave, at most 4

The log2 coordinates are rounded to 1/8. Calls with the same class share one measurement.
Between measured classes the lookup takes the two entries nearest the call (Euclidean distance
over the four coordinates: an octave of work or transfer time counts as much as a wave of
tiles) if both lie within RADIUS: the path both chose; where they chose differently, a fused
path both measured faster than the twin (the one with the better worst speedup); else the
twin. Where fewer than two entries lie that near, the table does not cover the call and the next
table is asked.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from pathlib import Path

import numpy as np

FORMAT = "flux_jax.tuning"
SCHEMA_VERSION = 1
PATHS = ("twin", "overlap", "latency", "decode")
FUSED_PATHS = PATHS[1:]
# x's dtype; "float8_e4m3fn": the op's FP8 call (fp8=True: bfloat16 x and w quantized to e4m3 with
# the default recipe's current scaling), measured against the FP8 twin
FP8 = "float8_e4m3fn"
DTYPES = ("bfloat16", "float16", "float32", FP8)

BUILTIN_PATH = Path(__file__).with_name("h200_tp2.json")
BUILTIN_SOURCE = "built-in table (H200, TP=2)"

_OVERLAP_TILE = (128, 256)  # output tile of the overlap GEMM
_DECODE_TILE = (128, 64)  # output tile of the decode GEMMs
_MMA_ROWS = 64  # the GEMMs run whole 64-row MMA tiles: fewer rows cost as much
_AG_PUSH_BLOCKS = 32  # blocks of ag_matmul's decode-path row push, resident next to the GEMM
_STEP_LOG2 = 8  # coordinates in log2 are rounded to 1/8
_STEP_WAVES = 8  # waves are rounded up to 1/8
_MAX_WAVES = 4.0  # decode_waves beyond 4: the decode path is long out of its region
RADIUS = 2.0  # the farthest an entry may lie from a call and still count as its neighbour
# The timing method's run-to-run spread (about 1-2%, benchmarks/README.md): a speedup within this
# factor of 1 is a tie with the twin.
SPREAD = 1.02
# The tool's --min-speedup by default (flux_jax/tune/_table.py): the margin by which a fused path
# must beat the twin to be chosen, recorded in the table as "min_speedup". A table without the
# field was made with this default.
DEFAULT_MIN_SPEEDUP = SPREAD
OPS = ("ag_matmul", "matmul_rs", "matmul_ar")  # the ops a table's entries may describe


class TuningTableError(ValueError):
    """A tuning table that cannot be read or does not follow the format (docs/tuning.md)."""


@dataclasses.dataclass(frozen=True)
class Device:
    """What a table records about the GPU kind its entries were measured on."""

    kind: str
    platform: str  # "gpu" or "cpu"
    sms: int  # streaming multiprocessors (CPU: cores), for the waves coordinates
    link_gbps: float  # per-GPU all-gather bandwidth the tool measured, GB/s
    link_latency_us: float  # the time of the smallest all-gather the tool measured, us

    def __post_init__(self):
        # Kept as the table writes them (3 decimals), so that shape classes computed from a
        # measured device equal those a reader recomputes from the file.
        object.__setattr__(self, "link_gbps", round(float(self.link_gbps), 3))
        object.__setattr__(self, "link_latency_us", round(float(self.link_latency_us), 3))

    def to_json(self) -> dict:
        return {
            "platform": self.platform,
            "sms": self.sms,
            "link_gbps": round(self.link_gbps, 3),
            "link_latency_us": round(self.link_latency_us, 3),
        }


@dataclasses.dataclass(frozen=True, order=True)
class ShapeClass:
    """The four coordinates of a call's shape class (module docstring)."""

    log2_flop: float
    log2_transfer_us: float
    log2_waves: float
    decode_waves: float

    def distance(self, other: ShapeClass) -> float:
        return math.dist(dataclasses.astuple(self), dataclasses.astuple(other))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        return (
            f"2^{self.log2_flop:g} flop, 2^{self.log2_transfer_us:g} us of transfer, "
            f"2^{self.log2_waves:g} waves, {self.decode_waves:g} decode waves"
        )


def _round_log2(value: float) -> float:
    return round(math.log2(max(value, 1e-30)) * _STEP_LOG2) / _STEP_LOG2


def _waves(ctas: int, sms: int) -> float:
    return min(math.ceil(ctas * _STEP_WAVES / max(sms, 1) - 1e-9) / _STEP_WAVES, _MAX_WAVES)


def moved_bytes(op: str, rows: int, k: int, n: int, dtype, tp: int) -> float:
    """Bytes each GPU moves over its links: the other ranks' rows of x (ag_matmul), the other
    ranks' rows of the partial product (matmul_rs), twice that for an all-reduce. FP8 calls move
    the e4m3 rows and their float32 scales, or the partial in x's dtype (bfloat16)."""
    share = (tp - 1) / tp * rows
    if op == "ag_matmul":
        return share * (k + 4 if np.dtype(dtype).name == FP8 else k * np.dtype(dtype).itemsize)
    itemsize = 2 if np.dtype(dtype).name == FP8 else np.dtype(dtype).itemsize
    return share * itemsize * n * (2 if op == "matmul_ar" else 1)


def shape_class(
    op: str, rows: int, k: int, n: int, dtype, tp: int, device: Device, sms: int | None = None
) -> ShapeClass:
    """The shape class of a per-rank GEMM (`rows` x `k` x `n`, as flux_jax/_plan.Problem counts
    them) on `device` (with `sms` SMs where given: this GPU's count, not the table's)."""
    sms = sms or device.sms
    tm, tn = _OVERLAP_TILE
    dm, dn = _DECODE_TILE
    decode_ctas = -(-rows // dm) * -(-n // dn) + (_AG_PUSH_BLOCKS if op == "ag_matmul" else 0)
    transfer_us = device.link_latency_us + moved_bytes(op, rows, k, n, dtype, tp) / (device.link_gbps * 1e3)
    return ShapeClass(
        log2_flop=_round_log2(2.0 * -(-rows // _MMA_ROWS) * _MMA_ROWS * k * n),
        log2_transfer_us=_round_log2(transfer_us),
        log2_waves=_round_log2(-(-rows // tm) * -(-n // tn) / max(sms, 1)),
        decode_waves=_waves(decode_ctas, sms),
    )


@dataclasses.dataclass(frozen=True)
class Entry:
    """One measured shape class: the path that won and each path's speedup over the twin."""

    device_kind: str
    gpu_count: int
    tp: int
    dtype: str
    op: str
    shape_class: ShapeClass
    shape: tuple  # (rows, k, n) of the per-rank GEMM that was measured
    path: str  # "twin" or the fused path that won (consistent with speedup: path_contradiction)
    speedup: dict  # fused path -> twin time / its time (the paths measured)
    note: str = ""

    @property
    def key(self) -> tuple:
        return (self.device_kind, self.gpu_count, self.tp, self.dtype, self.op, self.shape_class)

    def best_fused(self) -> str | None:
        if self.path != "twin":
            return self.path
        return max(self.speedup, key=self.speedup.get) if self.speedup else None

    def describe(self) -> str:
        rows, k, n = self.shape
        return f"{self.op} rows={rows} k={k} n={n} ({self.path})"

    def to_json(self) -> dict:
        rows, k, n = self.shape
        out = {
            "device_kind": self.device_kind,
            "gpu_count": self.gpu_count,
            "tp": self.tp,
            "dtype": self.dtype,
            "op": self.op,
            "shape_class": self.shape_class.to_json(),
            "shape": {"rows": rows, "k": k, "n": n},
            "path": self.path,
            "speedup": {p: round(s, 4) for p, s in sorted(self.speedup.items())},
        }
        if self.note:
            out["note"] = self.note
        return out


@dataclasses.dataclass(frozen=True)
class Table:
    """A loaded tuning table. `source` names it in Plan.decided_by."""

    source: str
    devices: dict  # device kind -> Device
    entries: tuple
    builtin: bool = False
    extra: dict = dataclasses.field(default_factory=dict)  # entries' other fields, by key (kept on rewrite)
    min_speedup: float = DEFAULT_MIN_SPEEDUP  # the tool's --min-speedup the entries' paths were chosen by

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "schema_version": SCHEMA_VERSION,
            "min_speedup": self.min_speedup,
            "devices": {kind: d.to_json() for kind, d in sorted(self.devices.items())},
            "entries": [dict(e.to_json(), **self.extra.get(e.key, {})) for e in sorted(self.entries, key=_entry_order)],
        }


def _entry_order(e: Entry):
    return (e.device_kind, e.gpu_count, e.tp, e.dtype, e.op, e.shape_class)


def min_speedup_problem(value) -> str | None:
    """What is wrong with `value` as a --min-speedup (the tool's and a table's), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value < math.inf:
        return f"a number >= 1 (auto never runs a slower path) and finite, got {value!r}"
    return None


def path_contradiction(path: str, speedup: dict) -> str | None:
    """Why an entry's `path` contradicts its `speedup`, or None.

    A fused path whose own speedup is below 1 / SPREAD measured slower than the twin by more
    than the timing's spread: auto would run it where XLA is faster. The bound is the timing's,
    not the table's min_speedup: a raised margin makes the tool choose fewer fused paths, it does
    not make a slower one acceptable. The other combinations are consistent with what the numbers
    mean: "twin" next to fused speedups above 1 (below the table's min_speedup, or a choice made
    elsewhere above it; the twin is never slower than XLA); a fused path that is not the fastest
    measured, or within the spread of the twin (a tie settled by other runs, as in the built-in
    table); a fused path without a speedup (a choice made elsewhere, e.g. a decision record the
    entry's note names).
    """
    measured = speedup.get(path)
    if path == "twin" or measured is None or measured >= 1 / SPREAD:
        return None
    return (
        f"path {path!r} contradicts its speedup {measured:g} (the twin was faster: a fused path must "
        f'measure at least {1 / SPREAD:.3f}x, the timing\'s spread of the twin; use path "twin" or '
        "correct the speedup)"
    )


# ---------------------------------------------------------------------------------------------
# Reading and writing


def _fail(where: str, why: str):
    raise TuningTableError(
        f"flux_jax tuning table {where}: {why} (format: docs/tuning.md; python -m flux_jax.tune writes a valid one)"
    )


def _field(where: str, obj: dict, name: str, kind, check=None, what: str = ""):
    if not isinstance(obj, dict) or name not in obj:
        _fail(where, f"missing field {name!r}")
    value = obj[name]
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if not ok or (check is not None and not check(value)):
        _fail(where, f"field {name!r} must be {what or getattr(kind, '__name__', kind)}, got {value!r}")
    return value


_NUMBER = (int, float)


def parse(data, where: str, *, builtin: bool = False) -> Table:
    """A Table from the decoded JSON of a table file (TuningTableError when it is not one)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        _fail(where, f'not a flux_jax tuning table (expected a JSON object with "format": "{FORMAT}")')
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        _fail(
            where,
            f"schema version {version!r}; this flux_jax reads version {SCHEMA_VERSION} "
            "(re-run python -m flux_jax.tune to measure again)",
        )
    min_speedup = data.get("min_speedup", DEFAULT_MIN_SPEEDUP)  # absent in tables made before it was recorded
    problem = min_speedup_problem(min_speedup)
    if problem:
        _fail(where, f"field 'min_speedup' (the --min-speedup the table was made with) must be {problem}")
    raw_devices = _field(where, data, "devices", dict, what="an object of device kinds")
    devices = {}
    for kind, d in raw_devices.items():
        at = f"{where}, device {kind!r}"
        devices[kind] = Device(
            kind,
            _field(at, d, "platform", str, lambda v: v in ("gpu", "cpu"), '"gpu" or "cpu"'),
            _field(at, d, "sms", int, lambda v: v >= 1, "a positive int"),
            float(_field(at, d, "link_gbps", _NUMBER, lambda v: 0 < v < math.inf, "a positive number")),
            float(_field(at, d, "link_latency_us", _NUMBER, lambda v: 0 <= v < math.inf, "a number >= 0")),
        )
    entries, extra, seen = [], {}, set()
    for i, e in enumerate(_field(where, data, "entries", list, what="a list")):
        at = f"{where}, entry {i}"
        kind = _field(at, e, "device_kind", str)
        if kind not in devices:
            _fail(at, f"device kind {kind!r} is not in the table's devices")
        raw_shape = _field(at, e, "shape", dict, what="an object")
        shape = tuple(_field(at, raw_shape, d, int, lambda v: v >= 1, "a positive int") for d in ("rows", "k", "n"))
        speedup = e.get("speedup", {})
        if not isinstance(speedup, dict):
            _fail(at, f"field 'speedup' must be an object of fused path -> speedup, got {speedup!r}")
        for p, s in speedup.items():
            if p not in FUSED_PATHS or isinstance(s, bool) or not isinstance(s, _NUMBER) or not 0 < s < math.inf:
                _fail(at, f"speedup {p!r}: {s!r} (fused paths {FUSED_PATHS}, positive numbers)")
        note = e.get("note", "")
        if not isinstance(note, str):
            _fail(at, f"field 'note' must be a string, got {note!r}")
        tp = _field(at, e, "tp", int, lambda v: v >= 2, "an int >= 2")
        dtype = _field(at, e, "dtype", str, lambda v: v in DTYPES, f"one of {DTYPES}")
        op = _field(at, e, "op", str, lambda v: v in OPS, f"one of {OPS}")
        # The class follows from the shape and the device; a stored one must agree (hand edits).
        computed = shape_class(op, *shape, dtype, tp, devices[kind])
        if "shape_class" in e:
            raw_class = _field(at, e, "shape_class", dict, what="an object")
            stored = {f.name: _field(at, raw_class, f.name, _NUMBER) for f in dataclasses.fields(ShapeClass)}
            if ShapeClass(**stored) != computed:
                _fail(
                    at,
                    f"shape_class {raw_class} does not match its shape on {kind!r}: "
                    f"{computed.to_json()} (leave the field out to have it computed)",
                )
        entry = Entry(
            kind,
            _field(at, e, "gpu_count", int, lambda v: v >= 1, "a positive int"),
            tp,
            dtype,
            op,
            computed,
            shape,
            _field(at, e, "path", str, lambda v: v in PATHS, f"one of {PATHS}"),
            {p: float(s) for p, s in speedup.items()},
            note,
        )
        contradiction = path_contradiction(entry.path, entry.speedup)
        if contradiction:
            _fail(at, contradiction)
        if entry.key in seen:
            _fail(at, f"a second entry for {entry.describe()}'s key (one entry per shape class)")
        seen.add(entry.key)
        entries.append(entry)
        known = {"device_kind", "gpu_count", "tp", "dtype", "op", "shape_class", "shape", "path", "speedup", "note"}
        rest = {name: value for name, value in e.items() if name not in known}
        if rest:
            extra[entry.key] = rest
    source = BUILTIN_SOURCE if builtin else f"tuning table {where}"
    return Table(source, devices, tuple(entries), builtin, extra, float(min_speedup))


def _read(path: str, *, builtin: bool = False) -> Table:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        _fail(path, f"cannot be read ({err.strerror or err})")
    except UnicodeDecodeError as err:
        _fail(path, f"is not UTF-8 text ({err.reason} at byte {err.start})")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        _fail(path, f"is not JSON ({err})")
    return parse(data, path, builtin=builtin)


@functools.lru_cache(maxsize=64)
def _load_cached(path: str, stamp: tuple, builtin: bool) -> Table:
    del stamp  # part of the cache key only: a rewritten file is read again
    return _read(path, builtin=builtin)


def load(path, *, builtin: bool = False) -> Table:
    """The table in file `path` (read again when the file changes); TuningTableError if it is
    missing or invalid."""
    path = os.path.abspath(os.fspath(path))
    try:
        st = os.stat(path)
    except OSError as err:
        _fail(path, f"cannot be read ({err.strerror or err})")
    return _load_cached(path, (st.st_mtime_ns, st.st_size), builtin or path == str(BUILTIN_PATH))


def builtin() -> Table:
    return load(BUILTIN_PATH, builtin=True)


def checked_path(value) -> str | None:
    """Config.tuning: None, or the path (a str or os.PathLike) of a readable, valid table, as a
    str (the Config stays hashable: it is part of the jit cache key); else ValueError."""
    if value is None:
        return None
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path:
        raise ValueError(
            "Config.tuning must be None or the path of a tuning table (a str or os.PathLike such as "
            f"pathlib.Path), got {value!r}"
        )
    load(path)
    return path


def _check_writable(path, table: Table) -> None:
    """TuningTableError where `table` has a field or an entry a reader would refuse."""
    problem = min_speedup_problem(table.min_speedup)
    if problem:
        raise TuningTableError(f"flux_jax tuning table {path}: not written: min_speedup must be {problem}")
    for e in table.entries:
        contradiction = path_contradiction(e.path, e.speedup)
        if contradiction:
            raise TuningTableError(f"flux_jax tuning table {path}: not written: entry {e.describe()}: {contradiction}")


def write(path, table: Table) -> None:
    """Writes `table` to `path` atomically (a reader never sees half a file); a table with an
    entry a reader would refuse is a TuningTableError and leaves the file as it was."""
    _check_writable(path, table)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(dumps(table))
    os.replace(tmp, path)


def dumps(table: Table) -> str:
    """The file text of `table`: one line per entry, so that tables diff well."""
    data = table.to_json()
    entries = ",\n".join("  " + json.dumps(e) for e in data.pop("entries"))
    head = json.dumps(data, indent=1)[:-2]
    return f'{head},\n "entries": [\n{entries}\n ]\n}}\n'


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/flux_jax/tuning (default ~/.cache/flux_jax/tuning)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "flux_jax" / "tuning"


def cache_path(device_kind: str) -> Path:
    """Where the table of one device kind lives in the user cache (non-alphanumerics become _)."""
    return cache_dir() / (re.sub(r"[^A-Za-z0-9.-]+", "_", device_kind).strip("_") + ".json")


# ---------------------------------------------------------------------------------------------
# Lookup


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


def _candidates(table: Table, kind: str | None, count: int | None, tp: int, dtype: str, op: str) -> list:
    """The entries of `table` that may answer a call: same TP, dtype and op; the same device kind
    (any kind for the built-in table; any of the platform's kinds when `kind` is None); the same
    GPU count where the table has it."""
    same = [
        e
        for e in table.entries
        if e.tp == tp and e.dtype == dtype and e.op == op and (table.builtin or kind is None or e.device_kind == kind)
    ]
    if kind is None and not table.builtin and same:
        first = min(e.device_kind for e in same)
        same = [e for e in same if e.device_kind == first]
    counted = [e for e in same if e.gpu_count == count]
    return counted or same


def _agreement(near: list) -> tuple[str, str]:
    """The path two neighbouring entries agree on, and why."""
    a, b = near
    where = f"{a.describe()}, {b.describe()}"
    if a.path == b.path:
        return a.path, f"between measured points that agree ({where})"
    safe = [(min(a.speedup.get(p, 0.0), b.speedup.get(p, 0.0)), p) for p in FUSED_PATHS]
    worst, best = max(safe)
    if worst > 1.0:
        return best, (
            f"between measured points where {best} beat the twin at both "
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
    near = sorted(entries, key=lambda e: (e.shape_class.distance(query), _entry_order(e)))[:2]
    if len(near) < 2 or near[1].shape_class.distance(query) > RADIUS:
        return None
    path, why = _agreement(near)
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


def lookup(problem, explicit: str | None, *, on_hopper: bool = False) -> Decision | None:
    """What the tuning tables say about `problem` (a flux_jax/_plan.Problem), or None when no
    table covers it. Only flux_jax/_plan.py calls this.

    `explicit`: Config.tuning. CPU calls consult only an explicit table (its "cpu" entries);
    GPU calls the explicit table, this GPU kind's table in the user cache, then the built-in
    one. `on_hopper` (explain_auto): a GPU call even in a process without GPUs.
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
        entries = _candidates(table, kind, local.count if local else None, problem.tp, dtype, problem.op)
        entries = [e for e in entries if table.devices[e.device_kind].platform == platform]
        if not entries:
            continue
        device = table.devices[entries[0].device_kind]
        sms = local.sms if local is not None and platform == "gpu" else None
        query = shape_class(problem.op, problem.rows, problem.k, problem.n, dtype, problem.tp, device, sms)
        decision = _decide(table, entries, query)
        if decision is not None:
            return decision
    return None
