"""The tuning table's model: its format constants, the device and shape-class coordinates, entries
and tables, and the checks an entry must pass (flux_jax/_tuning/__init__.py says what a table is)."""

from __future__ import annotations

import dataclasses
import math
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
            "speedup": {p: stored_speedup(s) for p, s in sorted(self.speedup.items())},
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
            "entries": [dict(e.to_json(), **self.extra.get(e.key, {})) for e in sorted(self.entries, key=entry_order)],
        }


def entry_order(e: Entry):
    """The order of entries in a table file, and between equally near neighbours in a lookup."""
    return (e.device_kind, e.gpu_count, e.tp, e.dtype, e.op, e.shape_class)


def as_float(value) -> float:
    """An int or float `value` as a float: inf for an int beyond a float's range (JSON's integers
    have no bound)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def stored_speedup(value) -> float:
    """A speedup as a table file keeps it: five significant digits (four decimals from 1 to 10;
    a tiny one stays positive, as a reader demands)."""
    return float(f"{float(value):.5g}")


def min_speedup_problem(value) -> str | None:
    """What is wrong with `value` as a --min-speedup (the tool's and a table's), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= as_float(value) < math.inf:
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
