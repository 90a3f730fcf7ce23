"""Which implementation runs on GPU: the overlap kernel, the latency path, or the XLA twin.

From on-device measurements (benchmarks/RESULTS.md, 2x H200, TP=2, bf16, 2026-11-29, harness,
dispatch-free ms per call):

  op  M      K     N      twin    overlap  latency
  ag  4096   8192  8192   0.547   0.389    (pending)
  ag  16384  8192  8192   2.054   1.512
  ag  8192   8192  28672  2.963   3.287    <- per-rank N 14336: the shipped GEMM config is slow there
  ag  64     8192  8192   0.037   0.110
  rs  4096   8192  8192   0.594   0.419
  rs  16384  8192  8192   2.069   1.683
  rs  8192   28672 8192   2.915   2.823
  rs  64     8192  8192   0.043   0.111

The rule: the overlap kernel where it was measured faster (TP=2, global M >= 2048, per-rank
N <= 8192); below that the latency path. Everything else keeps the twin, so impl="auto" is
never slower than the twin where we have not measured.
"""

from __future__ import annotations

import numpy as np

# (op, tp) -> (smallest global M, largest per-rank GEMM N) where the overlap kernel is faster.
_OVERLAP_REGION: dict[tuple[str, int], tuple[int, int]] = {
    ("ag_matmul", 2): (2048, 8192),
    ("matmul_rs", 2): (2048, 8192),
}
# (op, tp) -> (largest global M, largest per-rank GEMM N) where the latency path is faster.
_LATENCY_REGION: dict[tuple[str, int], tuple[int, int]] = {}


def best_fused_path(op: str, tp: int, rows: int, k: int, n: int, dtype: np.dtype) -> str:
    """"overlap" or "latency": the faster fused path for a global GEMM of `rows` rows."""
    del k, dtype
    min_rows, _ = _OVERLAP_REGION.get((op, tp), (2048, 0))
    return "overlap" if rows >= min_rows else "latency"


def fused_is_faster(op: str, tp: int, rows: int, k: int, n: int, dtype: np.dtype) -> bool:
    """`rows`: global GEMM rows M; `n`: the per-rank GEMM's N (its output columns)."""
    if np.dtype(dtype) == np.float32:
        return False  # no float32 kernels
    region = (_OVERLAP_REGION if best_fused_path(op, tp, rows, k, n, dtype) == "overlap"
              else _LATENCY_REGION).get((op, tp))
    if region is None:
        return False
    limit_rows, max_n = region
    if best_fused_path(op, tp, rows, k, n, dtype) == "overlap":
        return rows >= limit_rows and n <= max_n
    return rows <= limit_rows and n <= max_n
