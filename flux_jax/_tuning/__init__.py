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

_model.py holds the format and the coordinates, _files.py reads and writes tables, _lookup.py
answers a call.
"""

from flux_jax._tuning._files import (
    builtin,
    cache_dir,
    cache_path,
    checked_path,
    dumps,
    load,
    parse,
    write,
)
from flux_jax._tuning._lookup import Decision, LocalDevice, local_device, lookup, table_dtype
from flux_jax._tuning._model import (
    BUILTIN_PATH,
    BUILTIN_SOURCE,
    DEFAULT_MIN_SPEEDUP,
    DTYPES,
    FORMAT,
    FP8,
    FUSED_PATHS,
    OPS,
    PATHS,
    RADIUS,
    SCHEMA_VERSION,
    SPREAD,
    Device,
    Entry,
    ShapeClass,
    Table,
    TuningTableError,
    min_speedup_problem,
    moved_bytes,
    path_contradiction,
    shape_class,
    stored_speedup,
)

__all__ = [
    "BUILTIN_PATH",
    "BUILTIN_SOURCE",
    "DEFAULT_MIN_SPEEDUP",
    "DTYPES",
    "Decision",
    "Device",
    "Entry",
    "FORMAT",
    "FP8",
    "FUSED_PATHS",
    "LocalDevice",
    "OPS",
    "PATHS",
    "RADIUS",
    "SCHEMA_VERSION",
    "SPREAD",
    "ShapeClass",
    "Table",
    "TuningTableError",
    "builtin",
    "cache_dir",
    "cache_path",
    "checked_path",
    "dumps",
    "load",
    "local_device",
    "lookup",
    "min_speedup_problem",
    "moved_bytes",
    "parse",
    "path_contradiction",
    "shape_class",
    "stored_speedup",
    "table_dtype",
    "write",
]
