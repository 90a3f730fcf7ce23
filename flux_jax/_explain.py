"""What impl="auto" and the fused ops run, and why: `explain_auto` for a shape, `explain` for
a whole function."""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax
import numpy as np

from flux_jax import _overlap_gemm, _plan
from flux_jax._config import get_config

_local = threading.local()


@dataclasses.dataclass(frozen=True)
class CallSite:
    """One fused op call site of a traced function and its plan."""

    op: str
    problem: _plan.Problem
    plan: _plan.Plan
    backward: bool

    def __str__(self) -> str:
        role = " (backward)" if self.backward else ""
        return f"{self.op}{role}: {self.problem.describe()} -> {_with_gemm(self.problem, self.plan)}"


class Explanation(list):
    """The fused call sites of a function, in trace order (a list of CallSite)."""

    def __str__(self) -> str:
        if not self:
            return "no flux_jax op in this function"
        return "\n".join(f"{i}. {site}" for i, site in enumerate(self, 1))


def _with_gemm(problem: _plan.Problem, plan: _plan.Plan, gpu: tuple[int, int] | None = None) -> str:
    """The plan's description, and on a GPU's overlap path the GEMM instance it runs (on `gpu`,
    (SMs, peak DRAM GB/s), else on this process's first GPU)."""
    text = plan.describe()
    if plan.path != "overlap" or problem.platform not in ("cuda", "gpu"):
        return text
    gemm = _overlap_gemm.describe(problem, gpu or _overlap_gemm.local_gpu())
    return f"{text}; {gemm}" if gemm else text


def record(op: str, problem: _plan.Problem, plan: _plan.Plan, backward: bool) -> None:
    """Called by the ops at every plan: kept while `explain` traces."""
    sites = getattr(_local, "sites", None)
    if sites is not None:
        sites.append(CallSite(op, problem, plan, backward))


def amend(planned: _plan.Plan, lowered: _plan.Plan, problem: _plan.Problem | None = None) -> None:
    """Called by the lowering where it runs another plan than the one traced (the mesh rules the
    fused kernels out, a manual region's layout), or plans for other operands (`problem`: a
    vmapped batch, another platform)."""
    amendments = getattr(_local, "amendments", None)
    if amendments is not None and (lowered != planned or problem is not None):
        amendments.append((planned, lowered, problem))


def _amended(sites: Explanation, amendments: list) -> Explanation:
    """Each amendment replaces the plan of the first site not yet amended that was traced with
    it (the lowering meets the sites in program order; identical sites share a plan)."""
    out = Explanation(sites)
    done = set()
    for planned, lowered, problem in amendments:
        for i, site in enumerate(out):
            if i not in done and site.plan is planned:
                out[i] = dataclasses.replace(site, plan=lowered, problem=problem or site.problem)
                done.add(i)
                break
    return out


@contextlib.contextmanager
def _collecting():
    previous = getattr(_local, "sites", None), getattr(_local, "amendments", None)
    _local.sites, _local.amendments = Explanation(), []
    try:
        yield _local.sites, _local.amendments
    finally:
        _local.sites, _local.amendments = previous


def explain(fn, *args, **kwargs) -> Explanation:
    """Traces and lowers `fn(*args, **kwargs)` (as jax.jit would) and lists every flux_jax call
    site with its plan: the path that runs (or the twin) and why; on a GPU's overlap path, with
    a CUDA build, also the GEMM instance it runs.

    Every call site traced is listed, also one whose result XLA then drops as dead code (the
    forward of a loss whose gradient does not need it). The plans are taken while `fn` is
    traced and amended where the lowering runs another one (the twin where the mesh rules the
    fused kernels out) or plans again for the rows it lowers (a vmapped batch; the rows are then
    the batch's). A call site traced once and lowered at two shapes (a jitted helper called with
    and without vmap) is listed once, with the batch's rows. JAX does not trace again a function
    it traced before with the same argument types, so this clears JAX's caches first
    (`jax.clear_caches()`): functions that ran before compile again on their next call.

    Example:
      print(flux_jax.explain(train_step, state, batch))
    """
    jax.clear_caches()
    with _collecting() as (sites, amendments):
        jax.jit(fn).trace(*args, **kwargs).lower()
    return _amended(sites, amendments)


def explain_auto(
    op: str, M: int, K: int, N: int, tp: int, dtype="bfloat16", fp8: bool = False, gpu: tuple[int, int] | None = None
) -> str:
    """What impl="auto" runs on Hopper GPUs for a global GEMM shape, why, and which tuning table
    decided (one sentence; docs/tuning.md); on the overlap path, with a CUDA build, also the GEMM
    instance it runs. Both for `gpu`: (SMs, peak DRAM bandwidth in GB/s), e.g. (132, 3352) for an
    H100 SXM (the SM count scales the tables' shape classes, as on that GPU); by default this
    process's first GPU, else an H200 (132 SMs, 4.8 TB/s), assumed.

    `op` is "ag_matmul" (x [M, K] row-sharded, w [K, N] column-sharded), "matmul_rs" or
    "matmul_ar" (x [M, K] and w [K, N] sharded on K). Shapes are global, as in the benchmarks.
    `fp8`: the call with fp8=True (the default recipe's e4m3 operands). At tp=1 auto takes the
    twin: nothing moves between devices, so there is nothing to overlap or to tune.
    """
    if op not in ("ag_matmul", "matmul_rs", "matmul_ar"):
        raise ValueError(f'op must be "ag_matmul", "matmul_rs" or "matmul_ar", got {op!r}')
    for name, value in (("M", M), ("K", K), ("N", N), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"explain_auto: {name} must be an int, got {value!r}")
    if not isinstance(fp8, bool):
        raise TypeError(f"explain_auto: fp8 must be a bool, got {fp8!r}")
    if gpu is not None and not (
        isinstance(gpu, tuple)
        and len(gpu) == 2
        and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in gpu)
    ):
        raise TypeError(f"explain_auto: gpu must be (SMs, peak DRAM GB/s), two positive ints, got {gpu!r}")
    if min(M, K, N, tp) < 1:
        raise ValueError(f"M, K, N and tp must be >= 1, got M={M} K={K} N={N} tp={tp}")
    sharded = N if op == "ag_matmul" else K
    if sharded % tp or (M % tp and op != "matmul_ar"):  # matmul_ar shards no rows
        raise ValueError(f"{op} cannot shard M={M}, {'N' if op == 'ag_matmul' else 'K'}={sharded} over tp={tp}")
    k, n = (K, N // tp) if op == "ag_matmul" else (K // tp, N)
    dtype = np.dtype(dtype)
    problem = _plan.Problem(op, M, k, n, dtype, tp, "cuda", fp8="float8_e4m3fn" if fp8 else None)
    where = f"{op} M={M} K={K} N={N} tp={tp} {dtype.name}{' with FP8 operands' if fp8 else ''} on GPU"
    plan = _plan.plan(problem, "auto", get_config(), on_hopper=True, sms=gpu and int(gpu[0]))
    return f"{where}: {_with_gemm(problem, plan, gpu and (int(gpu[0]), int(gpu[1])))}"
