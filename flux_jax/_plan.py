"""What runs for one fused call: the XLA twin or one of the fused paths, and why.

This module is the only place that decides. The ops call `plan()` when they are traced (every
call, the backward's included); the lowering calls `for_topology()` once the concrete mesh is
known (a TP group that spans hosts or cannot map its peers' memory takes the twin). Inputs:

  op, per-rank GEMM shape, dtype, TP size, platform   (`Problem`)
  impl ("auto" | "fused" | "xla") and Config.fused_path
  the kernels this build has and their limits (cpp/include/flux_jax/limits.h, via the extension)
  the tuning tables (flux_jax/_tuning: Config.tuning's, this GPU kind's in the user cache, the
  built-in one measured on 2x H200 at TP=2); this module is the only caller of their lookup

Paths: "twin" (XLA's own collective and GEMM), "overlap" (one kernel: the GEMM consumes rows as
they arrive), "latency" (our one-kernel collective next to XLA's GEMM), "decode" (one
weight-streaming GEMM that moves the rows itself).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import ml_dtypes
import numpy as np

from flux_jax import _native, _tuning
from flux_jax._config import Config
from flux_jax._errors import FusedUnavailableError

PATHS = ("twin", "overlap", "latency", "decode")
# Ops whose CUDA paths end in the all_reduce kernel (latency_collectives.cu), TP <= latency_max_tp.
_ALL_REDUCE_OPS = ("matmul_ar",)
# Ops the built-in rule has no measurements of: impl="auto" takes the twin on GPUs and a call
# that must be fused the latency path (XLA's GEMM next to our collective).
_UNMEASURED_ON_GPUS = {
    "matmul_ar": 'matmul_ar has not been measured at tp > 1 on GPUs, so impl="auto" takes the twin there '
    "until this GPU kind is tuned (python -m flux_jax.tune --shapes matmul_ar:MxKxN or --model NAME "
    '--no-sequence-parallel); impl="fused" takes the decode kernel up to 128 rows (tp x rows x N <= 2^22), '
    "the two-shot overlap from 1024 rows divisible by tp, else XLA's GEMM + our all_reduce",
}
_GPU_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
_BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One fused call as the planner sees it.

    `rows`: rows of the whole GEMM (ag_matmul: every rank's rows, i.e. tp x the local ones;
    matmul_rs / matmul_ar: the local x's rows); `k`, `n`: the per-rank GEMM's contraction and
    output columns; `transpose_w`: the weight is read as [n, k] (a backward pass).
    """

    op: str
    rows: int
    k: int
    n: int
    dtype: np.dtype
    tp: int
    platform: str
    transpose_w: bool = False
    fp8: str | None = None  # FP8 operands: the row operand's format (flux_jax/fp8.py), else None

    def describe(self) -> str:
        w = " (transposed weight)" if self.transpose_w else ""
        fp8 = f" (FP8: rows in {self.fp8})" if self.fp8 else ""
        return (
            f"{self.op} rows={self.rows} k={self.k} n={self.n} per rank, "
            f"{np.dtype(self.dtype).name}{fp8}, tp={self.tp}, {self.platform}{w}"
        )


@dataclasses.dataclass(frozen=True)
class Plan:
    """The decision for one call: `path` in PATHS, why, and what decided it."""

    path: str
    reason: str
    decided_by: str

    @property
    def fused(self) -> bool:
        return self.path != "twin"

    def describe(self) -> str:
        what = "the XLA twin" if self.path == "twin" else f"fused, {self.path} path"
        return f"{what} ({self.reason}; decided by {self.decided_by})"


@functools.cache
def limits() -> dict:
    """The kernels' limits (cpp/include/flux_jax/limits.h), as the extension exports them."""
    return dict(_native.extension().limits())


def local_gpus() -> list:
    """This process's GPUs (none on a CPU-only host)."""
    return [d for d in jax.local_devices() if d.platform == "gpu"]


def _non_hopper_gpus() -> list[str]:
    bad = []
    for d in jax.local_devices():
        if d.platform == "gpu" and str(getattr(d, "compute_capability", "9.0")) != "9.0":
            bad.append(f"{d.device_kind} (sm {d.compute_capability})")
    return bad


def unavailable(p: Problem) -> str | None:
    """Why no fused kernel can run this call here, or None."""
    lim = limits()
    if p.platform == "cpu":
        if p.tp > lim["cpu_max_tp"]:
            return f"the CPU backend serves TP groups of at most {lim['cpu_max_tp']} ranks, not {p.tp}"
        return None
    if p.platform not in ("cuda", "gpu"):
        return f"no fused kernel for platform {p.platform!r} (cpu and cuda are supported)"
    if not _native.has_cuda_kernel(p.op):
        built = _native.build_info()
        what = "without CUDA" if not built["cuda"] else f"without a CUDA kernel for {p.op}"
        return f"this flux_jax build was compiled {what} (flux_jax.build_info(): {built})"
    reason = unavailable_on_hopper(p)
    if reason is not None:
        return reason
    bad = _non_hopper_gpus()
    if bad:
        return f"the CUDA kernels need Hopper (sm_90) GPUs; found {bad}"
    return None


def unavailable_on_hopper(p: Problem) -> str | None:
    """Why the CUDA kernels cannot serve this call on a Hopper GPU, or None."""
    if p.fp8:
        return _fp8_unavailable_on_hopper(p)
    lim = limits()
    if np.dtype(p.dtype) not in _GPU_DTYPES:
        return f"the CUDA kernels take bfloat16 or float16 inputs, not {np.dtype(p.dtype).name}"
    align = lim["gpu_align_elements"]
    if p.k % align or p.n % align:
        return f"the CUDA kernels need per-rank K and N multiples of {align} (got K={p.k}, N={p.n})"
    if p.tp > lim["gpu_max_tp"]:
        return f"the CUDA kernels serve TP groups of at most {lim['gpu_max_tp']} ranks, not {p.tp}"
    if p.op in _ALL_REDUCE_OPS and p.tp > lim["latency_max_tp"]:
        return (
            f"{p.op}'s CUDA paths all run the all_reduce kernel, which serves TP groups of at most "
            f"{lim['latency_max_tp']} ranks, not {p.tp}"
        )
    return None


def _fp8_unavailable_on_hopper(p: Problem) -> str | None:
    """FP8 calls run the latency composition: our collective moves the FP8 rows (1-byte
    elements, 16-byte vectors) or the partial in x's dtype (summed in bf16 / f16 pairs)."""
    lim = limits()
    if p.tp > lim["latency_max_tp"]:
        return f"the FP8 ops run the latency collectives, which serve at most {lim['latency_max_tp']} ranks, not {p.tp}"
    if p.op == "ag_matmul" and p.k % 16:
        return f"the FP8 rows move as 16-byte vectors: per-rank K must be a multiple of 16 (got K={p.k})"
    if p.op != "ag_matmul":
        if np.dtype(p.dtype) not in _GPU_DTYPES:
            return (
                f"the CUDA reduce-scatter sums the FP8 GEMM's partial in x's dtype: bfloat16 or "
                f"float16, not {np.dtype(p.dtype).name}"
            )
        if p.n % lim["gpu_align_elements"]:
            return f"the CUDA collectives need per-rank N multiples of {lim['gpu_align_elements']} (got N={p.n})"
    return None


def fp8_overlap_unavailable(p: Problem) -> str | None:
    """Why the FP8 overlap kernels do not serve this call, or None where they do: a GEMM of
    ag_matmul, matmul_rs or matmul_ar (matmul_rs's kernel, then an all_gather: the two-shot) with
    rows in e4m3 (the forward) or e5m2 (the backward's dy; the weight is e4m3 in both), a bfloat16
    output, per-rank K a multiple of 16 and N of 8 (the CUDA instances' alignment; the CPU backend
    follows it), rows divisible by tp for the GEMM-first ops (each rank sums one chunk of them)."""
    if p.op not in ("ag_matmul", "matmul_rs", "matmul_ar"):
        return f"{p.op} has no FP8 overlap kernel"
    if p.fp8 not in ("float8_e4m3fn", "float8_e5m2"):
        return f"they take e4m3 or e5m2 rows, not {p.fp8}"
    if np.dtype(p.dtype) != _BF16:
        return f"they write bfloat16, not {np.dtype(p.dtype).name}"
    if p.k % 16 or p.n % 8:
        return f"they need per-rank K a multiple of 16 and N of 8, not K={p.k}, N={p.n}"
    if p.op != "ag_matmul" and p.rows % p.tp:
        return f"{p.op} needs rows divisible by tp={p.tp} there (each rank sums one chunk), not {p.rows} rows"
    return None


def fp8_overlap_supported(p: Problem) -> bool:
    """Whether the FP8 overlap kernels serve this call (`fp8_overlap_unavailable`)."""
    return fp8_overlap_unavailable(p) is None


def _plan_fp8(p: Problem, config: Config, must_fuse: bool, on_hopper: bool = False, sms: int | None = None) -> Plan:
    """FP8 calls (available kernels): Config.fused_path where set; else a tuning table's measured
    choice (forward calls, e4m3 rows and bfloat16 x: the tables' dtype "float8_e4m3fn"); else the
    FP8 overlap kernel or the latency composition where they must fuse, and the twin where not."""
    latency = (
        "the latency composition: quantize, our collective moves the FP8 rows and their scales "
        "(or the partial), XLA's FP8 GEMM"
    )
    overlap_ok = fp8_overlap_supported(p)
    overlap = "the FP8 overlap GEMM"
    if p.op == "matmul_ar":
        overlap = "the FP8 two-shot: matmul_rs's FP8 overlap GEMM + reduce-scatter, then our all_gather"
    if config.fused_path == "decode":
        if fp8_decode_supported(p):
            return Plan(
                "decode", 'Config.fused_path="decode": the FP8 decode kernel (e4m3 rows, bfloat16 out)', "config"
            )
        return Plan(
            "latency",
            "the FP8 decode kernels serve e4m3 rows, a bfloat16 output and the decode path's limits "
            f'only (Config.fused_path="decode"): {latency}',
            "config",
        )
    if config.fused_path == "latency":
        return Plan("latency", f'Config.fused_path="latency": {latency}', "config")
    if config.fused_path == "overlap":
        if overlap_ok:
            return Plan("overlap", f'Config.fused_path="overlap": {overlap}', "config")
        why = fp8_overlap_unavailable(p)
        return Plan("latency", f"the FP8 overlap kernels do not serve this call ({why}): {latency}", "config")
    tuned = _tuning.lookup(p, config.tuning, on_hopper=on_hopper, sms=sms) if p.tp > 1 else None
    if tuned is not None and (tuned.path != "twin" or not must_fuse):
        return _fp8_tuned(p, tuned.path, tuned.reason, tuned.source, overlap, latency)
    if tuned is not None and tuned.fused is not None:  # must fuse where the table chose the twin
        return _fp8_tuned(p, tuned.fused, f'impl="fused" ({tuned.reason})', tuned.source, overlap, latency)
    if must_fuse:
        where = "platform" if p.platform == "cpu" else "kernels"
        if overlap_ok and (p.platform == "cpu" or _default_fused(p) == "overlap"):
            rows = "e4m3" if p.fp8 == "float8_e4m3fn" else "e5m2"
            return Plan("overlap", f"{overlap} (the row operand in {rows}, bfloat16 out)", where)
        return Plan("latency", latency, where)
    if p.tp == 1:
        return _single_device(p)
    if p.platform == "cpu":
        return Plan("twin", "the CPU backend is a protocol reference, slower than XLA:CPU's dot", "platform")
    if _tuning.table_dtype(p) is None:  # e5m2 rows, or x other than bfloat16: no table holds it
        return Plan(
            "twin",
            f"no tuning table holds FP8 calls with {p.fp8} rows of {np.dtype(p.dtype).name} x, only "
            'bfloat16 x with e4m3 rows; impl="fused" runs the fused paths',
            "FP8 rule (unmeasured: the twin)",
        )
    return Plan(
        "twin",
        "the fused FP8 paths are not measured at tp > 1 on GPUs yet (python -m flux_jax.tune --dtype fp8 "
        'measures them on this GPU kind); impl="fused" runs them',
        "FP8 rule (unmeasured: the twin)",
    )


def _fp8_tuned(p: Problem, path: str, why: str, source: str, overlap: str, latency: str) -> Plan:
    """A tuning table's choice for an FP8 call, where its kernels serve it (else the latency
    composition, which serves every FP8 call)."""
    if path == "twin":
        return Plan("twin", why, source)
    if path == "overlap" and not fp8_overlap_supported(p):
        return Plan(
            "latency",
            f"{why}; the FP8 overlap kernels do not serve this call ({fp8_overlap_unavailable(p)}): {latency}",
            source,
        )
    if path == "decode" and not fp8_decode_supported(p):
        return Plan("latency", f"{why}; the FP8 decode kernels do not serve this call: {latency}", source)
    what = {"overlap": overlap, "latency": latency, "decode": "the FP8 decode kernel (e4m3 rows, bfloat16 out)"}
    return Plan(path, f"{why}: {what[path]}", source)


def fp8_decode_supported(p: Problem) -> bool:
    """Whether the FP8 decode kernels serve this call: a GEMM with rows in e4m3 (the forward), a
    bfloat16 output, per-rank K a multiple of 16 and N of 8, within the bf16 decode path's limits
    (the same kernels with the FP8 GEMM; ag_matmul's push kernel moves the row scales too)."""
    return (
        p.fp8 == "float8_e4m3fn"
        and np.dtype(p.dtype) == _BF16
        and p.k % 16 == 0
        and p.n % 8 == 0
        and decode_supported(dataclasses.replace(p, fp8=None, transpose_w=False))
    )


def decode_supported(p: Problem) -> bool:
    """Whether the decode kernels exist for this call (bfloat16, the untransposed weight, ...)."""
    lim = limits()
    if not (1 <= p.tp <= lim["decode_max_tp"] and not p.transpose_w and np.dtype(p.dtype) == _BF16):
        return False
    if p.op == "matmul_ar":  # tp = 1 too: the GEMM and its epilogue with no peer (a cost measurement)
        return 1 <= p.rows <= lim["decode_ar_max_rows"] and p.tp * p.rows * p.n <= lim["decode_ar_max_elements"]
    if p.tp < 2:
        return False
    if p.op == "ag_matmul":
        return 1 <= p.rows <= lim["decode_ag_max_rows"]
    if p.op == "matmul_rs":
        return 1 <= p.rows <= lim["decode_rs_max_rows"] and p.rows % p.tp == 0 and p.n <= lim["decode_rs_max_n"]
    return False


def _feasible(p: Problem, path: str) -> tuple[str, str]:
    """`path` where its kernels serve the call, else the nearest path that does (and why)."""
    if p.platform == "cpu":
        return path, ""
    if path == "decode" and not decode_supported(p):
        path, why = "latency", "the decode kernels do not serve this call"
    else:
        why = ""
    if path == "latency" and p.tp > limits()["latency_max_tp"]:
        return "overlap", f"the latency collectives serve at most {limits()['latency_max_tp']} ranks"
    return path, why


def _default_fused(p: Problem) -> str:
    """The fused path for a call that must be fused where no tuning table names one: the overlap
    kernel once it has rows to pipeline (AG: 2048 rows and ~1.5 waves of 128 x 256 output tiles;
    RS: 1024 rows), else the latency path. matmul_ar, unmeasured at tp > 1 on GPUs: its decode
    kernel where it serves the call (one launch, no all_reduce after it); the two-shot overlap
    where it applies (matmul_rs's overlap path, measured faster than the twin from 1024 rows at
    TP = 2, carries the reduce-scatter half); else the latency path."""
    if p.op in _UNMEASURED_ON_GPUS:
        if decode_supported(p):
            return "decode"
        return "overlap" if composed_overlap(p.op, p.rows, p.tp, p.platform) else "latency"
    if p.op == "ag_matmul":
        device = _tuning.local_device("gpu")
        sms = device.sms if device is not None and device.sms else 132
        return "overlap" if p.rows >= 2048 and -(-p.rows // 128) * -(-p.n // 256) >= 1.45 * sms else "latency"
    return "overlap" if p.rows >= 1024 else "latency"


def _single_device(p: Problem) -> Plan:
    """impl="auto" on a mesh axis of one device: nothing moves between devices, so no fused path
    can hide a transfer and there is nothing to measure (the tuning tool refuses TP=1)."""
    return Plan(
        "twin",
        f"tp={p.tp}: the mesh axis has one device, so there is no communication to overlap; the twin is "
        'XLA\'s GEMM alone (impl="fused" still runs the fused kernels, e.g. to measure their cost)',
        "TP size",
    )


def _unmeasured(p: Problem) -> str:
    if p.op in _UNMEASURED_ON_GPUS:
        return _UNMEASURED_ON_GPUS[p.op]
    return (
        f"tp={p.tp} has not been measured for {p.op} in {np.dtype(p.dtype).name} near this shape on "
        "this GPU kind: no tuning table covers it (python -m flux_jax.tune measures it; docs/tuning.md)"
    )


# matmul_ar's overlap path at these many rows or more, divisible by tp, on these platforms:
# two-shot (below). The CPU backend keeps its one custom call, the protocol reference (the tests
# add "cpu" here to run the composition on CPU devices).
_TWO_SHOT_MIN_ROWS = 1024
_TWO_SHOT_PLATFORMS = ("cuda", "gpu")


def composed_overlap(op: str, rows: int, tp: int, platform: str) -> bool:
    """Whether the overlap path of `op` is a composition of other ops' custom calls (the lowering
    asks). matmul_ar on GPUs with tp >= 2 and rows % tp == 0, from 1024 rows: the "two-shot"
    overlap, matmul_rs's overlap call (each rank sums one chunk of rows, the reduce-scatter
    overlapped with the GEMM) and then our all_gather of the chunks. Every chunk is summed once,
    by its owner, so the output is the same bits on every rank; each rank moves 2 (tp - 1) / tp
    of the partial instead of tp - 1 times it. Elsewhere matmul_ar's overlap path is one custom
    call (our GEMM, then the all_reduce kernel). Not timed on GPUs (no two-GPU host)."""
    return (
        op == "matmul_ar"
        and platform in _TWO_SHOT_PLATFORMS
        and tp >= 2
        and rows >= _TWO_SHOT_MIN_ROWS
        and rows % tp == 0
    )


def plan(
    p: Problem, impl: str, config: Config, *, backward: bool = False, on_hopper: bool = False, sms: int | None = None
) -> Plan:
    """The plan for one call (`_decide`), naming matmul_ar's two-shot overlap where it applies."""
    decided = _decide(p, impl, config, backward=backward, on_hopper=on_hopper, sms=sms)
    if decided.path == "overlap" and not p.fp8 and composed_overlap(p.op, p.rows, p.tp, p.platform):
        two_shot = "two-shot: matmul_rs's overlapped GEMM + reduce-scatter, then our all_gather"
        return Plan(decided.path, f"{decided.reason}; {two_shot}", decided.decided_by)
    return decided


def _decide(
    p: Problem, impl: str, config: Config, *, backward: bool = False, on_hopper: bool = False, sms: int | None = None
) -> Plan:
    """The plan for one call.

    impl="xla" is the twin; impl="fused" is a fused path or FusedUnavailableError; impl="auto"
    is a fused path only where a tuning table measured one faster, else the twin (always at
    tp=1, where there is no communication to overlap).
    `backward=True` plans the paired op of a fused op's backward pass: a fused path wherever one
    can run. `on_hopper=True` plans as on a Hopper GPU with a CUDA build, whatever this process
    has (explain_auto); `sms`: that GPU's SM count (explain_auto's gpu=), else this process's GPU's.
    """
    if config.debug_drop_rank >= p.tp:
        raise ValueError(
            f"Config.debug_drop_rank={config.debug_drop_rank} names no rank of a TP group of {p.tp} ({p.op})"
        )
    if impl == "xla":
        return Plan("twin", 'impl="xla"', "impl")
    if 0 in (p.rows, p.k, p.n):  # any impl: the exact result needs no kernel (twins.py returns it)
        return Plan("twin", "a zero-size operand: the result is zeros or empty, nothing to compute or move", "shape")
    reason = unavailable_on_hopper(p) if on_hopper else unavailable(p)
    if reason is not None:
        if impl == "fused" and not backward:
            raise FusedUnavailableError(f'flux_jax.{p.op}(impl="fused") cannot run here: {reason}')
        return Plan("twin", reason, "kernels")
    must_fuse = impl == "fused" or backward
    if p.fp8:
        return _plan_fp8(p, config, must_fuse, on_hopper, sms)
    if config.fused_path != "auto":
        path, why = _feasible(p, config.fused_path)
        return Plan(path, why or f'Config.fused_path="{config.fused_path}"', "config")
    if p.tp == 1 and not must_fuse:
        return _single_device(p)
    tuned = _tuning.lookup(p, config.tuning, on_hopper=on_hopper, sms=sms)
    if tuned is None:
        if p.platform == "cpu" and not on_hopper:
            if must_fuse:
                return Plan("overlap", "the CPU backend runs one protocol", "platform")
            return Plan("twin", "the CPU backend is a protocol reference, slower than XLA:CPU's dot", "platform")
        if not must_fuse:
            return Plan("twin", _unmeasured(p), "no tuning table")
        path, adjusted = _feasible(p, _default_fused(p))
        return Plan(path, adjusted or f'impl="fused" ({_unmeasured(p)})', "default fused path")
    choice, why = tuned.path, tuned.reason
    if choice == "twin":
        if not must_fuse:
            return Plan("twin", why, tuned.source)
        choice, why = tuned.fused or _default_fused(p), f'impl="fused" ({why})'
    path, adjusted = _feasible(p, choice)
    return Plan(path, adjusted or why, tuned.source)


def for_topology(plan: Plan, op: str, reason: str | None, forced: bool) -> Plan:
    """The plan once the lowering knows the mesh: `reason` says why the TP group cannot run
    fused (spans hosts, no IPC between its processes, ...), or is None."""
    if reason is None or not plan.fused:
        return plan
    if forced:
        raise FusedUnavailableError(f'flux_jax.{op}(impl="fused") cannot run here: {reason}')
    return Plan("twin", reason, "topology")
