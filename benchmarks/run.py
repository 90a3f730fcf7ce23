"""Command line: run a preset of shapes through every variant and write json, md and plots.

  python -m benchmarks.run --op ag|rs|all --preset NAME [--out benchmarks/results]
      [--variants a,b,...] [--m 4096,8192] [--repeats R] [--n1 N] [--target-ms T]
      [--max-calls C] [--preheat-ms P] [--seed S] [--dtype D] [--profiler] [--git-commit SHA]

Writes <out>/<stem>.json, .md, _speedup.png and _time_split.png, where <stem> is the preset's
name (plus _<op> / _m<list> for a partial run). Results are rewritten after every case, so an
interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

from benchmarks import plots, report
from benchmarks.harness import run_case
from benchmarks.metrics import REFERENCE
from benchmarks.presets import OPS, PRESETS, preset_tp, select_cases
from benchmarks.timing import TimingParams, params_problem
from benchmarks.variants import VARIANTS
from benchmarks.windowed import WindowedEinsum

METHOD = (
    "per call = (T(n2) - T(n1)) / (n2 - n1), T(n) = wall time of one jit running n dependent "
    "calls in a lax.fori_loop (after warm-up, block_until_ready); median over repeats, "
    "variants sampled once per round in a new seeded shuffle each round, each sample after a "
    "pre-heat run of its own loop"
)


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def output_stem(preset: str, op: str, ms: tuple[int, ...] | None) -> str:
    """<preset>, with _<op> and _m<M-M-...> when only part of it runs (so parts don't overwrite)."""
    stem = preset if op == "all" else f"{preset}_{op}"
    return stem if ms is None else f"{stem}_m{'-'.join(map(str, ms))}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=(*OPS, "all"), default="all")
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--m", type=_int_list, default=None, help="subset of the preset's M values, e.g. 4096,8192")
    parser.add_argument(
        "--repeats", type=int, default=5, help="samples per variant (one per round, the order shuffled each round)"
    )
    parser.add_argument("--n1", type=int, default=2, help="calls in the short loop")
    parser.add_argument("--target-ms", type=float, default=20.0, help="the long loop runs at least this much longer")
    parser.add_argument("--max-calls", type=int, default=10000, help="cap on calls in the long loop")
    parser.add_argument(
        "--preheat-ms",
        type=float,
        default=50.0,
        help="untimed run of a variant's long loop before each of its samples (0: none)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32", "fp8"),
        default=None,
        help="override the preset's dtype (fp8: bf16 operands, the ops with fp8=True)",
    )
    parser.add_argument("--profiler", action="store_true", help="GPU: also record CUPTI kernel time (mosaic profiler)")
    parser.add_argument(
        "--grad",
        action="store_true",
        help="time forward + backward (dx with y and dw live) against a random cotangent; "
        "limits become the 3 GEMMs alone and the forward + transposed collective",
    )
    parser.add_argument("--git-commit", default=None, help="commit to record when the tree has no .git (a copy)")
    args = parser.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if REFERENCE not in names:
        print(f"note: {REFERENCE} is always measured (it is the reference of the check)", flush=True)
        names.append(REFERENCE)
    args.variant_names = [v for v in VARIANTS if v in names]
    problem = params_problem(args.n1, args.repeats, args.target_ms, args.max_calls, args.preheat_ms)
    if problem:
        parser.error(problem)
    return args


def run_notes(tp: int, platform: str) -> list[str]:
    """What the reader of this run's numbers must know before reading them."""
    notes = []
    if tp == 1:
        notes.append(
            "NOTE: tp=1: a TP group of one device moves no rows; the fused ops run their GEMM "
            "alone, so these times say nothing about communication overlap"
        )
    if platform == "cpu":
        notes.append(
            "NOTE: CPU timings: the CPU backend is the protocol's reference implementation; "
            "its times do not predict GPU speed"
        )
    return notes


def main(argv: list[str] | None = None) -> list[dict]:
    """Runs the benchmark; returns the rows (also written under --out)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    tp = preset_tp(preset, len(jax.devices()))
    for note in run_notes(tp, jax.default_backend()):
        print(note, flush=True)
    ops = OPS if args.op == "all" else (args.op,)
    cases, skipped = select_cases(preset, tp, ops, args.m, args.dtype)
    for shape in skipped:
        print(f"skipping {shape['op']} M={shape['M']} K={shape['K']} N={shape['N']}: {shape['reason']}", flush=True)
    params = TimingParams(
        n1=args.n1, target_ms=args.target_ms, max_calls=args.max_calls, repeats=args.repeats, preheat_ms=args.preheat_ms
    )
    meta = report.metadata(preset.name, tp, argv, {"method": METHOD, **vars(params)}, skipped, args.git_commit)
    meta["grad"] = args.grad
    meta["notes"] = run_notes(tp, jax.default_backend())
    stem = output_stem(preset.name, args.op, args.m) + ("_grad" if args.grad else "")
    json_path, md_path = args.out / f"{stem}.json", args.out / f"{stem}.md"

    rows: list[dict] = []
    windowed = WindowedEinsum()
    try:
        for i, case in enumerate(cases, 1):
            shape = f"{case.op} M={case.M} K={case.K} N={case.N} tp={case.tp}"
            print(f"[{i}/{len(cases)}] {shape} ({case.layer})", flush=True)
            case_rows = run_case(
                case,
                args.variant_names,
                seed=args.seed,
                params=params,
                windowed=windowed,
                profile=args.profiler,
                grad=args.grad,
            )
            for row in case_rows:
                ms = f"{row['ms']:.4f} ms" if row["ms"] is not None else ""
                print(f"    {row['variant']:<20} {ms:>12}  {row['status']}", flush=True)
            rows += case_rows
            report.write_json(json_path, meta, rows)
            report.write_markdown(md_path, meta, rows)
    finally:
        windowed.close()
    plot_paths = plots.write_plots(rows, args.out, stem)
    print(f"\nwrote {json_path}, {md_path}, " + ", ".join(map(str, plot_paths)) + "\n", flush=True)
    print(report.markdown_table(rows), flush=True)
    return rows


if __name__ == "__main__":
    main()
