"""Reading, validating and writing tuning table files, and where they live in the user cache."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from pathlib import Path

from flux_jax._tuning._model import (
    BUILTIN_PATH,
    BUILTIN_SOURCE,
    DEFAULT_MIN_SPEEDUP,
    DTYPES,
    FORMAT,
    FUSED_PATHS,
    OPS,
    PATHS,
    SCHEMA_VERSION,
    Device,
    Entry,
    ShapeClass,
    Table,
    TuningTableError,
    as_float,
    min_speedup_problem,
    path_contradiction,
    shape_class,
)


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
        _fail(where, f"field {name!r} must be {what or _kind_name(kind)}, got {value!r}")
    return value


def _kind_name(kind) -> str:
    return "a number" if kind == _NUMBER else getattr(kind, "__name__", str(kind))


_NUMBER = (int, float)
_MAX_SIZE = 2**63  # a GEMM dimension beyond any array's


def _stored(value) -> float:
    """A device's link figure as the table keeps it (Device: 3 decimals); inf beyond a float."""
    return round(as_float(value), 3)


def parse(data, where: str, *, builtin: bool = False) -> Table:
    """A Table from the decoded JSON of a table file (TuningTableError when it is not one)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        _fail(where, f'not a flux_jax tuning table (expected a JSON object with "format": "{FORMAT}")')
    version = data.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
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
            float(
                _field(
                    at,
                    d,
                    "link_gbps",
                    _NUMBER,
                    lambda v: 0 < _stored(v) < math.inf,
                    "a finite number >= 0.001 (GB/s, kept to 3 decimals)",
                )
            ),
            float(
                _field(at, d, "link_latency_us", _NUMBER, lambda v: 0 <= _stored(v) < math.inf, "a finite number >= 0")
            ),
        )
    entries, extra, seen = [], {}, set()
    for i, e in enumerate(_field(where, data, "entries", list, what="a list")):
        at = f"{where}, entry {i}"
        kind = _field(at, e, "device_kind", str)
        if kind not in devices:
            _fail(at, f"device kind {kind!r} is not in the table's devices")
        raw_shape = _field(at, e, "shape", dict, what="an object")
        shape = tuple(
            _field(at, raw_shape, d, int, lambda v: 1 <= v < _MAX_SIZE, "a positive int below 2**63")
            for d in ("rows", "k", "n")
        )
        speedup = e.get("speedup", {})
        if not isinstance(speedup, dict):
            _fail(at, f"field 'speedup' must be an object of fused path -> speedup, got {speedup!r}")
        for p, s in speedup.items():
            if (
                p not in FUSED_PATHS
                or isinstance(s, bool)
                or not isinstance(s, _NUMBER)
                or not 0 < as_float(s) < math.inf
            ):
                _fail(at, f"speedup {p!r}: {s!r} (fused paths {FUSED_PATHS}, positive finite numbers)")
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
    except RecursionError:
        _fail(path, "is nested too deeply to be a tuning table")
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
    """Config.tuning: None, or the path (a str or os.PathLike) of a readable, valid table, as an
    absolute str (the Config stays hashable: it is part of the jit cache key; a relative path is
    resolved once, so that a later chdir does not change which file it names); else ValueError."""
    if value is None:
        return None
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path:
        raise ValueError(
            "Config.tuning must be None or the path of a tuning table (a str or os.PathLike such as "
            f"pathlib.Path), got {value!r}"
        )
    path = os.path.abspath(path)
    load(path)
    return path


def _check_writable(path, table: Table) -> None:
    """TuningTableError where a reader would refuse `table`'s file: the text is parsed as `load`
    parses it, so that the tool never writes a table it cannot read back."""
    try:
        parse(json.loads(dumps(table)), str(path))
    except TuningTableError as err:
        raise TuningTableError(f"not written: {err}") from None


def write(path, table: Table) -> None:
    """Writes `table` to `path` atomically (a reader never sees half a file); a table with an
    entry a reader would refuse is a TuningTableError and leaves the file as it was."""
    _check_writable(path, table)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(dumps(table))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


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
