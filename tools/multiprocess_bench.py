"""Fused ops: one process driving both GPUs vs one process per GPU (issue 9's 3% target).

    python tools/multiprocess_bench.py      # on a 2-GPU host; prints a table, JSON to --out
"""

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parent.parent / "tests" / "gpu_multiprocess_worker.py"


def run(pids):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(pid), port, "timing"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for pid in pids]
    out = {}
    for pid, p in zip(pids, procs):
        log = p.communicate(timeout=500)[0]
        lines = [line for line in log.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise SystemExit(f"process {pid} failed:\n{log[-3000:]}")
        out[pid] = json.loads(lines[-1][len("RESULT "):])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    single = run([-1])[-1]
    multi = run([0, 1])
    rows = []
    for key in sorted(k for k in single if k.endswith("_ms")):
        worst = max(multi[0][key], multi[1][key])
        rows.append(dict(case=key, single_ms=single[key], two_process_ms=worst, ratio=worst / single[key]))
        print(f"{key:12} single {single[key]:.4f} ms   2 processes {worst:.4f} ms   ratio {worst / single[key]:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(rows=rows, single=single, multi=multi), indent=1))


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
