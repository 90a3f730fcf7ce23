"""Where a training step's device time goes, from a jax.profiler trace of a few steps.

`--profile-steps N` traces N steps (after the compile step and one warm step) and this
module reads the Perfetto trace: per GPU, the span and busy time per step and the kernel time
per step by category (our fused kernels, other GEMMs, NCCL, attention, copies, the rest), plus
the costliest kernels. Comparing the fused and the XLA run of `--compare` shows which kernels
the fused ops replaced and what they cost.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os

# First match wins (lower-case substrings of the kernel name). Our GEMM's mangled name carries
# flux_jax in its template arguments; XLA's GEMMs are nvjet / cuBLAS (xmma) / Triton (gemm_fusion).
CATEGORIES = (
    ("flux_jax", "flux"),
    ("nccl", "nccl"),
    ("sdpa", "attention"),
    ("cudnn", "attention"),
    ("fmha", "attention"),
    ("flash", "attention"),
    ("nvjet", "gemm"),
    ("xmma", "gemm"),
    ("gemm", "gemm"),
    ("cutlass", "gemm"),
    ("memcpy", "copy"),
    ("memset", "copy"),
)


def category(name: str) -> str:
    lower = name.lower()
    return next((cat for key, cat in CATEGORIES if key in lower), "other")


def union_length(intervals) -> float:
    """Total length covered by (start, stop) intervals, overlaps counted once."""
    busy, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            busy, end = busy + stop - start, stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    return busy


def load_trace(trace_dir: str, patterns=("perfetto_trace.json.gz",)) -> tuple[list, dict] | None:
    """The events of the first trace file under `trace_dir` matching `patterns` (in that order)
    and {pid: process name}; None when there is none. Also used by
    benchmarks/diagnostics/loop_anatomy.py."""
    paths = [p for pattern in patterns for p in glob.glob(os.path.join(trace_dir, "**", pattern), recursive=True)]
    if not paths:
        return None
    with gzip.open(paths[0], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {
        ev["pid"]: ev.get("args", {}).get("name", str(ev["pid"]))
        for ev in events
        if ev.get("ph") == "M" and ev.get("name") == "process_name"
    }
    return events, names


def summarize(trace_dir: str, steps: int, top: int = 12) -> dict:
    """{"devices": {name: {...}}} in ms per step, or {"error": ...} when there is no GPU activity."""
    trace = load_trace(trace_dir)
    if trace is None:
        return {"error": f"no perfetto trace under {trace_dir}"}
    events, names = trace
    by_pid = collections.defaultdict(list)
    for ev in events:
        if ev.get("ph") == "X" and "dur" in ev and "gpu" in names.get(ev["pid"], "").lower():
            by_pid[ev["pid"]].append(ev)
    if not by_pid:
        return {"error": "no GPU activity in the trace (profiles are for GPU runs)"}
    devices = {}
    for pid, evs in sorted(by_pid.items()):
        kernels = [e for e in evs if category(e["name"]) != "copy"]
        per_cat, per_kernel = collections.Counter(), collections.defaultdict(list)
        for e in evs:
            per_cat[category(e["name"])] += e["dur"]
            per_kernel[e["name"][:90]].append(e["dur"])
        spans = kernels or evs
        span = max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)
        ms = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731 - trace times are in us
        devices[names[pid]] = {
            "span_ms_per_step": ms(span),
            "busy_ms_per_step": ms(union_length([(e["ts"], e["ts"] + e["dur"]) for e in kernels])),
            "ms_per_step": {cat: ms(t) for cat, t in per_cat.most_common()},
            "top_kernels": [
                {"name": n, "calls_per_step": round(len(d) / steps, 2), "ms_per_step": ms(sum(d))}
                for n, d in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
            ],
        }
    return {"steps": steps, "devices": devices}


def describe(summary: dict) -> str:
    """A few lines for the console: per GPU, span, busy and the categories."""
    if "error" in summary:
        return f"  profile: {summary['error']}"
    lines = []
    for name, d in summary["devices"].items():
        cats = ", ".join(f"{cat} {t:.2f}" for cat, t in d["ms_per_step"].items())
        lines.append(
            f"  profile {name}: span {d['span_ms_per_step']:.2f} ms/step, busy "
            f"{d['busy_ms_per_step']:.2f}; kernels by category (ms/step): {cats}"
        )
    return "\n".join(lines)


class StepTracer:
    """Traces steps [first, first + steps) of a training loop with jax.profiler (steps = 0: off).

    The trace goes to a temporary directory, is summarized when the last traced step ends
    (`summary`), and is deleted: a few steps of a large model make tens of MB of trace.
    """

    def __init__(self, steps: int, first: int):
        self.steps, self.first = steps, first
        self.summary: dict | None = None
        self._dir: str | None = None

    def active(self, step: int) -> bool:
        return self.steps > 0 and self.first <= step < self.first + self.steps

    def before(self, step: int) -> None:
        if self.steps > 0 and step == self.first:
            import tempfile

            import jax

            self._dir = tempfile.mkdtemp(prefix="flux_jax_profile_")
            jax.profiler.start_trace(self._dir, create_perfetto_trace=True)

    def after(self, step: int) -> None:
        if self._dir is not None and step == self.first + self.steps - 1:
            import shutil

            import jax

            jax.profiler.stop_trace()
            self.summary = summarize(self._dir, self.steps)
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
