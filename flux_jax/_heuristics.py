"""When the fused GPU kernels beat the XLA twin (impl="auto").

Filled from on-device measurements (benchmarks/RESULTS.md). Until a kernel has
been measured faster than the twin on a shape class, auto keeps the twin.
"""

from __future__ import annotations

import numpy as np

# (op, tp) -> smallest global row count M (rows * tp for ag, rows for rs) from
# which the fused kernel was measured faster than the twin. Absent: never.
_MIN_ROWS: dict[tuple[str, int], int] = {}


def fused_is_faster(op: str, tp: int, rows: int, k: int, n: int, dtype: np.dtype) -> bool:
    if np.dtype(dtype) == np.float32:
        return False  # kernels are tuned for 16-bit inputs
    global_rows = rows * tp if op == "ag_matmul" else rows
    threshold = _MIN_ROWS.get((op, tp))
    return threshold is not None and global_rows >= threshold
