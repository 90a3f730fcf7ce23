"""The command line of `python -m flux_jax.tune` (docs/tuning.md)."""

from __future__ import annotations

import argparse
import sys

from flux_jax._tuning import TuningTableError
from flux_jax.tune import _models
from flux_jax.tune._models import MODELS
from flux_jax.tune._request import DTYPES, TuneError
from flux_jax.tune._run import run
from flux_jax.tune._table import MIN_SPEEDUP


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
        "--tp",
        metavar="TP,...",
        help="with --model or --shapes: TP sizes (mesh axis sizes) to measure, each >= 2 (default: every local device)",
    )
    p.add_argument(
        "--dtype",
        metavar="DTYPE,...",
        help=f"with --model or --shapes: dtypes among {', '.join(DTYPES)} (default bfloat16); fp8: bfloat16 "
        "x and w with fp8=True (the default recipe's e4m3 operands), against the FP8 twin",
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
