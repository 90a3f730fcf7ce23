"""Fused ops: one process driving both GPUs vs one process per GPU (the two should be within 3%).

    python benchmarks/diagnostics/multiprocess_bench.py   # on a 2-GPU host; a table, JSON to --out

Each worker (tests/gpu_multiprocess_worker.py) times the fused op (auto path) with the harness's
serialized loop (benchmarks/timing.py: each call's input depends on the previous output through a
shard-local update, so the program holds no collective besides the op's own), n2 - n1 = 1000
calls at M = 256 and 200 at M = 4096, 9 samples, median. Not perf_probe.py's loop: its global
`x.at[0, 0]` update needs a cross-device collective, which XLA lowers to an in-process Triton
collective in one process and to NCCL across processes (~10 us per call more at M = 256 in the
two-process figure). With the harness's loop both layouts compile the same GEMM picks.

`--rounds N` alternates single / two-process runs N times and compares medians. `--autotune-cache
auto` shares XLA's per-fusion autotune cache (`--xla_gpu_per_fusion_autotune_cache_dir`) between
all workers, so the first run's GEMM pick is every run's pick; each run also reports the picks of
its timed program. `--xla-flags` passes XLA_FLAGS to every worker.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).resolve().parents[2] / "tests" / "gpu_multiprocess_worker.py"


def run(pids):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(pid), port, "timing"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in pids
    ]
    out = {}
    for pid, p in zip(pids, procs):
        log = p.communicate(timeout=500)[0]
        lines = [line for line in log.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise SystemExit(f"process {pid} failed:\n{log[-3000:]}")
        out[pid] = json.loads(lines[-1][len("RESULT ") :])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--rounds", type=int, default=1, help="alternating single / two-process runs")
    ap.add_argument("--xla-flags", default=None, help="XLA_FLAGS for every worker")
    ap.add_argument(
        "--autotune-cache",
        default=None,
        help="DIR (or 'auto': a fresh temp dir) for XLA's per-fusion autotune cache, "
        "shared by every worker so all runs use the same GEMM picks",
    )
    ap.add_argument("--m", default="4096,256", help="the M values to time (4096, 256 or both)")
    ap.add_argument(
        "--budget-s", type=float, default=0, help="start no round that would end past this many seconds (0: no limit)"
    )
    args = ap.parse_args()
    os.environ["FLUX_JAX_MP_BENCH_M"] = args.m
    if args.xla_flags is not None:
        os.environ["XLA_FLAGS"] = args.xla_flags
    if args.autotune_cache:
        cache = tempfile.mkdtemp(prefix="xla_autotune_") if args.autotune_cache == "auto" else args.autotune_cache
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_per_fusion_autotune_cache_dir={cache}".strip()
        print(f"autotune cache shared by every worker: {cache}", flush=True)
    singles, multis = [], []
    start = time.monotonic()
    for i in range(args.rounds):
        round_start = time.monotonic()
        singles.append(run([-1])[-1])
        multis.append(run([0, 1]))
        report(singles, multis, args.out)  # after every round: a timeout keeps what was measured
        spent = time.monotonic() - start
        if args.budget_s and spent + (time.monotonic() - round_start) > args.budget_s and i + 1 < args.rounds:
            print(
                f"stopping after {i + 1} of {args.rounds} rounds: another would pass --budget-s "
                f"{args.budget_s:.0f} ({spent:.0f} s spent)",
                flush=True,
            )
            break


def report(singles: list, multis: list, out: str | None) -> None:
    print(f"-- after {len(singles)} round(s)", flush=True)
    rows = []
    for key in sorted(k for k in singles[0] if k.endswith("_ms")):
        single_runs = [s[key] for s in singles]
        two_runs = [max(m[0][key], m[1][key]) for m in multis]  # the slower process paces the pair
        single, worst = statistics.median(single_runs), statistics.median(two_runs)
        rows.append(
            dict(
                case=key,
                single_ms=single,
                two_process_ms=worst,
                ratio=worst / single,
                single_runs=single_runs,
                two_process_runs=two_runs,
            )
        )
        print(
            f"{key:12} single {single:.4f} ms   2 processes {worst:.4f} ms   ratio {worst / single:.3f}   "
            f"(runs: single {[round(v, 4) for v in single_runs]}, 2p {[round(v, 4) for v in two_runs]})",
            flush=True,
        )
        picks = key[:-3] + "_gemm"
        if picks in singles[-1]:  # XLA's GEMM pick in the newest round, per process
            print(
                f"{'':12} GEMM pick: single {singles[-1][picks]}, 2p {[m[picks] for m in multis[-1].values()]}",
                flush=True,
            )
    if out:
        Path(out).write_text(
            json.dumps(
                dict(rows=rows, xla_flags=os.environ.get("XLA_FLAGS", ""), singles=singles, multis=multis), indent=1
            )
        )


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
