"""Where the time of a serialized benchmark loop goes, per variant (GPU diagnostic).

For each case and variant this builds the harness's loop (benchmarks/timing.py), times it the
harness's way, then runs it once more under jax.profiler with a Perfetto trace and reads the
trace: per device, kernels per call, kernel time per call (busy), idle time between kernels
per call (gaps), and the host events that cost most per call. A loop whose gaps dominate is
bound by the host (thunk launches, loop control), not by its kernels.

  python benchmarks/diagnostics/loop_anatomy.py --cases ag:256x8192x8192,rs:64x8192x8192 \
      --variants gemm_only,flux_latency,xla_shard_map --calls 40 --out anatomy.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, "examples"))

import jax  # noqa: E402
from training.profile import load_trace, union_length  # noqa: E402  (the training example's trace reader)

import flux_jax  # noqa: E402
from benchmarks import timing, variants  # noqa: E402
from benchmarks.presets import Case, case_from_text  # noqa: E402
from flux_jax._config import parse_overrides  # noqa: E402


def read_trace(trace_dir: str, calls: int) -> dict:
    """Per-device busy / gap per call and the costliest host events per call, in us."""
    trace = load_trace(trace_dir, ("*.trace.json.gz", "perfetto_trace.json.gz"))
    if trace is None:
        return {"error": f"no trace under {trace_dir}"}
    events, names = trace
    by_pid = collections.defaultdict(list)
    for ev in events:
        if ev.get("ph") == "X" and "dur" in ev:
            by_pid[ev["pid"]].append(ev)
    result = {"devices": {}, "host_top": []}
    host_totals = collections.Counter()
    loop_by_thread = collections.Counter()
    for pid, evs in by_pid.items():
        pname = names.get(pid, str(pid))
        if "GPU" in pname or "gpu" in pname:
            kernels = [e for e in evs if not e["name"].startswith(("Memcpy", "Memset"))] or evs
            start = min(e["ts"] for e in kernels)
            stop = max(e["ts"] + e["dur"] for e in kernels)
            busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
            per_name = collections.defaultdict(list)
            for e in kernels:
                per_name[e["name"][:70]].append(e["dur"])
            top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:6]
            copies = collections.defaultdict(list)
            for e in evs:
                if e["name"].startswith("Memcpy"):
                    copies[e["name"][:40]].append(e["dur"])
            # One call in the middle of the loop, kernels and copies with their stream (tid):
            # when the copies start and end against the GEMMs, which kernel waits for what.
            # The anchor is the earliest-starting kernel that runs once per call.
            ordered = sorted(evs, key=lambda e: e["ts"])
            counts = collections.Counter(e["name"] for e in ordered)
            anchor = next((e["name"] for e in ordered if abs(counts[e["name"]] - calls) <= 1), None)
            starts = [i for i, e in enumerate(ordered) if e["name"] == anchor]
            k = len(starts) // 2
            window = ordered[starts[k] : starts[k + 1]] if len(starts) > k + 1 else []
            origin = window[0]["ts"] if window else 0
            timeline = [
                {
                    "name": e["name"][:48],
                    "stream": e.get("tid"),
                    "start_us": round(e["ts"] - origin, 2),
                    "dur_us": round(e["dur"], 2),
                }
                for e in window
            ]
            result["devices"][pname] = {
                "timeline": timeline,
                # Copy-engine operations (the overlap path's pushes): they overlap kernels, so
                # they are not in busy.
                "copies": [
                    {"name": n, "per_call": round(len(d) / calls, 2), "mean_us": round(sum(d) / len(d), 2)}
                    for n, d in copies.items()
                ],
                "events": len(kernels),
                "per_call_us": round((stop - start) / calls, 2),
                "busy_per_call_us": round(busy / calls, 2),
                "gap_per_call_us": round((stop - start - busy) / calls, 2),
                "kernels": [{"name": n, "count": len(d), "mean_us": round(sum(d) / len(d), 2)} for n, d in top],
            }
        else:
            for e in evs:
                if not e["name"].startswith("$"):  # Python frames: the tool's own calls
                    host_totals[e["name"][:70]] += e["dur"]
                if e["name"].startswith("while"):  # XLA's loop thunk, one per device thread
                    loop_by_thread[(pid, e.get("tid"))] += e["dur"]
    result["host_top"] = [{"name": n, "us_per_call": round(t / calls, 2)} for n, t in host_totals.most_common(12)]
    # The host time one device thread spends per call in the loop (enqueueing the body, then
    # waiting for the predicate). CUPTI makes every CUDA API call slower, so a variant with
    # many API calls per call (ours) can be host-bound under the profiler only: its timeline
    # then shows the profiler's host lag, not the loop's (loop_us is timed without it).
    if loop_by_thread:
        result["host_loop_per_call_us"] = round(max(loop_by_thread.values()) / calls, 2)
    return result


def summary_line(row: dict) -> str:
    dev = next(iter(row.get("devices", {}).values()), {})
    kernels = "; ".join(f"{k['name'][:40]} x{k['count']} {k['mean_us']}us" for k in dev.get("kernels", [])[:4])
    copies = "; ".join(f"{c['name']} x{c['per_call']}/call {c['mean_us']}us" for c in dev.get("copies", []))
    copies = f"| copies {copies}" if copies else ""
    host = row.get("host_loop_per_call_us")
    if host and dev.get("per_call_us") and host >= 0.9 * dev["per_call_us"]:
        copies += (
            f" | HOST-BOUND UNDER THE PROFILER (host {host} us per call per device thread): the trace's "
            "gaps and late starts are profiler overhead, compare with loop_us"
        )
    return (
        f"ANATOMY {row['case']:>18} {row['variant']:>14} {row.get('config', '')} "
        f"loop {row.get('loop_us', '-')} us | trace/call "
        f"{dev.get('per_call_us')} busy {dev.get('busy_per_call_us')} gap {dev.get('gap_per_call_us')} | "
        f"{kernels} {copies} {row.get('error', '')}"
    )


def anatomy(
    case: Case,
    names: list[str],
    calls: int,
    seed: int,
    trace: bool = True,
    label: str = "",
    grad: bool = False,
    timeline_lines: bool = False,
) -> list[dict]:
    ctx = variants.case_context(case, seed, grad)  # grad: forward + backward, as the harness's --grad
    if grad:
        label = f"{label} grad".strip()
    params = timing.TimingParams(n1=2, target_ms=10.0, max_calls=400, repeats=3)
    rows = []
    for name in names:
        row = {"case": f"{case.op}:{case.M}x{case.K}x{case.N}", "variant": name, "config": label}
        try:
            built = variants.BUILDERS[name](ctx)
            built = built[0] if isinstance(built, list) else built
            timer = timing.LoopTimer(built, params)
            row["loop_us"] = round(1e6 * min(timer.sample() for _ in range(3)), 2)
            if not trace:
                print(summary_line(row), flush=True)
                rows.append(row)
                continue
            loop = timing.serialized_loop(built, calls).lower(jax.numpy.float32(0.0), *built.args).compile()
            args = (jax.numpy.float32(0.0), *built.args)
            jax.block_until_ready(loop(*args))
            trace_dir = tempfile.mkdtemp(prefix="anatomy_")
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                jax.block_until_ready(loop(*args))
            row.update(read_trace(trace_dir, calls + 1))
        except Exception as err:  # a diagnostic: report and go on
            row["error"] = variants.error_summary(err)
        print(summary_line(row), flush=True)
        if timeline_lines:
            for dev_name, dev in row.get("devices", {}).items():
                print(
                    f"TIMELINE {row['case']} {row['variant']} {dev_name[-14:]}: "
                    + " | ".join(
                        f"{t['name'][:28]}@s{t['stream']} {t['start_us']}+{t['dur_us']}" for t in dev["timeline"]
                    ),
                    flush=True,
                )
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="ag:256x8192x8192,rs:256x8192x8192")
    ap.add_argument("--variants", default="gemm_only,flux_latency,xla_shard_map")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--config", default="", help="flux_jax.Config fields for every variant, e.g. 'gpu_tile_group_m=16'")
    ap.add_argument("--no-trace", action="store_true", help="time the loops only (no profiler run)")
    ap.add_argument("--grad", action="store_true", help="forward + backward steps (the harness's --grad)")
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="print one call's kernels and copies per device "
        "(start + duration in us from the call's first event, stream id)",
    )
    args = ap.parse_args()
    kw = parse_overrides(args.config)
    rows = []
    with flux_jax.config(**kw):
        for text in args.cases.split(","):
            rows += anatomy(
                case_from_text(text, 2, "anatomy"),
                args.variants.split(","),
                args.calls,
                args.seed,
                trace=not args.no_trace,
                label=args.config,
                grad=args.grad,
                timeline_lines=args.timeline,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
