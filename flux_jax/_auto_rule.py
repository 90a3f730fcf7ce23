"""The built-in impl="auto" rule for Hopper GPUs at TP=2, fitted to measurements on 2x H200.

Only flux_jax/_plan.py calls it. Inputs are the per-rank GEMM (`rows` of the whole GEMM,
contraction `k`, output columns `n` per rank), the TP size and the dtype; the output is the
fused path measured fastest there, or "xla" (the twin). The measurements behind every threshold
are in docs/decisions/ (2026-11-30-auto-overlap-region.md, -latency-path-rank-free.md,
-ag-decode-path.md, -rs-decode-path.md); shapes between measured points are interpolated by the
thresholds, not measured.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# AG: the overlap kernel needs more than one wave of 128x256 output tiles (128 tiles: 0.97x the
# twin; 192: 1.26x).
_AG_OVERLAP_MIN_TILES = 192
# AG at M >= 12288 with a wide per-rank n and K <= 6144: the gather is a small share of a GEMM
# XLA runs 1-6% faster than ours, so the twin.
_AG_WIDE_MIN_ROWS, _AG_WIDE_MIN_N, _AG_WIDE_MAX_K = 12288, 12288, 6144
# ag_matmul's decode path: at most this many rows in all and this per-rank n ...
_AG_DECODE_MAX_ROWS, _AG_DECODE_MAX_N = 128, 8192
# ... and at 129-256 rows (two 128-row tiles per 64 weight columns) only where those tiles and the
# push kernel's 32 blocks run at once on an H200's 132 SMs.
_AG_DECODE_TWO_TILE_MAX_ROWS, _AG_DECODE_TWO_TILE_MAX_TILES = 256, 100
# matmul_rs's decode path: at most 64 rows, or 128 with a per-rank weight (k * n) this small.
_RS_DECODE_MAX_ROWS, _RS_DECODE_SMALL_WEIGHT_MAX_ROWS, _RS_DECODE_SMALL_WEIGHT = 64, 128, 1 << 24
# Below the overlap region both ops take the latency path at every M and weight size measured
# (1.01-1.56x the twin; the longest GEMMs tie).

_BF16 = np.dtype(ml_dtypes.bfloat16)


def _tiles(rows: int, n: int) -> int:
    """Output tiles of the overlap GEMM (128 x 256)."""
    return -(-rows // 128) * -(-n // 256)


def _ag_wide_gemm(rows: int, k: int, n: int) -> bool:
    """AG where the gather is a small share of a wide GEMM that XLA runs faster than ours."""
    return rows >= _AG_WIDE_MIN_ROWS and n >= _AG_WIDE_MIN_N and k <= _AG_WIDE_MAX_K


def _ag_overlap_fits(rows: int, n: int) -> bool:
    """AG: enough rows and enough output tiles (~1.5 waves) for the overlap kernel."""
    return rows >= 2048 and _tiles(rows, n) >= _AG_OVERLAP_MIN_TILES


def _ag_decode_pays(rows: int, n: int, dtype) -> bool:
    """AG at decode sizes where the decode path measured faster than the latency path."""
    if np.dtype(dtype) != _BF16:
        return False
    if rows <= _AG_DECODE_MAX_ROWS:
        return n <= _AG_DECODE_MAX_N
    return rows <= _AG_DECODE_TWO_TILE_MAX_ROWS and 2 * -(-n // 64) <= _AG_DECODE_TWO_TILE_MAX_TILES


def _rs_decode_pays(rows: int, k: int, n: int, dtype) -> bool:
    """RS at decode sizes where the decode path measured faster than the latency path."""
    if np.dtype(dtype) != _BF16:
        return False
    return rows <= _RS_DECODE_MAX_ROWS or (rows <= _RS_DECODE_SMALL_WEIGHT_MAX_ROWS
                                          and k * n <= _RS_DECODE_SMALL_WEIGHT)


def choose(op: str, tp: int, rows: int, k: int, n: int, dtype) -> str:
    """"overlap", "latency", "decode" or "xla" for a global GEMM of `rows` rows.

    "decode" is the decode path where its kernels exist (bfloat16, the untransposed weight); the
    lowering takes the latency path for calls it cannot serve (e.g. a backward's transposed
    weight).

    `k`, `n`: the per-rank GEMM's contraction size and output columns (AG: K and N/tp;
    RS: K/tp and N).
    """
    if np.dtype(dtype) == np.float32 or tp != 2:
        return "xla"  # no float32 kernels; TP > 2 not measured
    if op == "ag_matmul":
        if _ag_wide_gemm(rows, k, n):
            return "xla"
        if _ag_overlap_fits(rows, n):
            return "overlap"
        return "decode" if _ag_decode_pays(rows, n, dtype) else "latency"
    if rows >= 2048 or (rows >= 1024 and n >= 8192):
        return "overlap"
    return "decode" if _rs_decode_pays(rows, k, n, dtype) else "latency"


def best_fused_path(op: str, tp: int, rows: int, k: int, n: int, dtype) -> str:
    """The fused path for a call that must be fused (impl="fused", fused_path="auto")."""
    choice = choose(op, tp, rows, k, n, dtype)
    if choice != "xla":
        return choice
    if op == "ag_matmul":
        return "overlap" if _ag_overlap_fits(rows, n) else "latency"
    return "overlap" if rows >= 1024 else "latency"


def fused_is_faster(op: str, tp: int, rows: int, k: int, n: int, dtype) -> bool:
    """impl="auto": take a fused path only where one was measured faster than the twin."""
    return choose(op, tp, rows, k, n, dtype) != "xla"


def reason(op: str, tp: int, rows: int, k: int, n: int, dtype, choice: str) -> str:
    """Why `choice(...)` picked `choice`, with the measurements behind it (one clause)."""
    if choice == "overlap":
        return "enough row tiles to hide the transfer: measured 1.03-1.42x over the twin in that region"
    if choice == "decode" and op == "ag_matmul":
        return ("the rows pushed over NVLink while a GEMM in the weight's orientation already streams the "
                "weight; measured 1.13-1.55x over the twin at <= 128 rows with a per-rank n <= "
                f"{_AG_DECODE_MAX_N}, 1.54x at 256 rows with n = 3072")
    if choice == "decode":
        return ("one GEMM in the weight's orientation whose epilogue reduce-scatters each output tile over "
                "NVLink; measured 0.97-1.71x over the twin at <= 64 rows and 1.45-1.53x at 128 rows with a "
                "per-rank weight <= 16M elements")
    if choice == "latency":
        if op == "ag_matmul" and rows >= 2048:
            return (f"the per-rank GEMM has {_tiles(rows, n)} output tiles, fewer than "
                    f"{_AG_OVERLAP_MIN_TILES}: about one wave, so the overlap kernel cannot hide the "
                    "transfer; measured overlap 0.97x, latency 1.10x at 2048x14336x4096")
        return "our NVLink collective + XLA's GEMM; measured 1.1-1.9x over the twin for small and mid M"
    if np.dtype(dtype) == np.float32:
        return "no float32 kernels"
    if tp != 2:
        return f"tp={tp} has not been measured on GPUs (the built-in rule covers 2x H200 at TP=2)"
    if op == "ag_matmul" and _ag_wide_gemm(rows, k, n):
        return ("the gather is a small share of this wide GEMM and XLA's GEMM is 1-6% faster than ours "
                "here: the overlap measured 0.97-1.03x")
    return "no fused path was measured faster for this shape"
