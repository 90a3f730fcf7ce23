"""When the fused GPU kernels beat the XLA twin (impl="auto").

From on-device measurements (benchmarks/RESULTS.md, 2x H200, TP=2, bf16, 2026-11-29):

  op  M      K     N      fused/twin
  ag  512    8192  8192   0.70   <- slower: no latency path yet (issue #8)
  ag  2048   8192  8192   1.21
  ag  4096   8192  8192   1.20
  ag  16384  8192  8192   1.17
  ag  8192   8192  28672  0.91   <- per-rank N 14336: the shipped GEMM config is slow there
  rs  512    8192  8192   0.77
  rs  2048   8192  8192   1.18
  rs  4096   8192  8192   1.16
  rs  16384  8192  8192   1.09
  rs  8192   8192  28672  0.91

So auto takes the fused kernel only inside the measured-faster region: TP=2, global M >= 2048,
and a per-rank GEMM N <= 8192. Everything else keeps the twin (auto must never be slower).
"""

from __future__ import annotations

import numpy as np

# (op, tp) -> (smallest global M, largest per-rank GEMM N) measured faster than the twin.
_FASTER_REGION: dict[tuple[str, int], tuple[int, int]] = {
    ("ag_matmul", 2): (2048, 8192),
    ("matmul_rs", 2): (2048, 8192),
}


def fused_is_faster(op: str, tp: int, rows: int, k: int, n: int, dtype: np.dtype) -> bool:
    """`rows`: global GEMM rows M; `n`: the per-rank GEMM's N (its output columns)."""
    if np.dtype(dtype) == np.float32:
        return False  # no float32 kernels
    region = _FASTER_REGION.get((op, tp))
    if region is None:
        return False
    min_rows, max_n = region
    return rows >= min_rows and n <= max_n
