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

_request.py says what to measure (the shapes), _measure.py measures one shape, _run.py runs a
request and writes the table (_table.py), _cli.py is the command line; _timing.py is the timing
method, _models.py the model presets.
"""

from flux_jax._tuning import TuningTableError, cache_path, load
from flux_jax.tune._cli import main
from flux_jax.tune._models import MODELS
from flux_jax.tune._request import DTYPES, OPS, Shape, TuneError, function_shapes, model_shapes, parse_shapes
from flux_jax.tune._run import Result, run
from flux_jax.tune._table import MIN_SPEEDUP

__all__ = [
    "DTYPES",
    "MIN_SPEEDUP",
    "MODELS",
    "OPS",
    "Result",
    "Shape",
    "TuneError",
    "TuningTableError",
    "cache_path",
    "function_shapes",
    "load",
    "main",
    "model_shapes",
    "parse_shapes",
    "run",
]
