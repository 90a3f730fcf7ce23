"""Which implementation runs on GPU: the overlap kernel, the latency path, the decode path, or the twin.

Measured with the harness (dispatch-free device time, 2x H200, TP=2, bf16, 2026-11-29; data in
benchmarks/data/harness_*_2026-11-29.json); rows marked (11-30) with tools/perf_probe.py after the
overlap GEMM got its grouped tile order (benchmarks/data/probe_2026-11-30*.json; the RS rows at
M <= 2048 with the gated launch's smaller groups, probe_2026-11-30_rs_groups.json); the row marked
(s6) with the harness, 5 shuffled samples per variant (harness_llama8b-tp2_ag_2026-11-30_s6.json; its s9
note from harness_llama8b-tp2_ag_m2048-4096_2026-11-30_s9.json). Speedup over the
twin (xla_shard_map), global shapes, AG: n = N/2 per rank; RS: k = K/2 per rank:

  op  M      K      N      twin us  overlap  latency
  ag  16     8192   57344    128.0   0.69     1.00
  ag  64     8192   10240     49.2   0.44     1.09
  ag  64     8192   57344    130.7   0.78     1.03
  ag  256    4096   6144      47.3   0.64     0.86   (rank operand; rank-free 1.11, s13)
  ag  256    8192   10240     73.4   0.62     1.21
  ag  256    8192   57344    236.8   0.88     1.14
  ag  1024   4096   6144      76.8   0.85     1.20
  ag  1024   8192   57344    749.1   0.84     1.09
  ag  2048   4096   6144     133.2   1.26     1.18 (s6; 192 tiles; 1.11 / 1.16 before the one-kernel handshake;
                                    s9 with 128x192 tiles: 133.1 us, overlap 1.45)
  ag  2048   14336  4096     316.2   0.97     1.10 (11-30; 128 tiles: one wave)
  ag  2048   4096   28672    400.8   1.10     1.03 (11-30)
  ag  2048   28672  8192     894.9   1.22     1.05 (11-30; 256 tiles)
  ag  2048   8192   57344   1510.3   1.03     1.02 (11-30)
  ag  4096   8192   8192     546.7   1.40     0.93 (probe)
  ag  16384  8192   8192    2054.4   1.36
  ag  8192   4096   28672   1593.3   1.05     1.02 (11-30)
  ag  8192   8192   16384   1819.9   1.07          (11-30)
  ag  8192   8192   28672   3077.6   1.03     1.01 (11-30; 0.90 before the tile order)
  Held-out shapes (s11, harness_holdout-tp2_*_2026-11-30_s11.json, 3 samples; auto / twin):
  ag  320    3072   9216      41.0   0.64     0.91   (rank operand; rank-free 1.17, s13)
  ag  12288  5120   27648   2568.0   1.01     1.00   (auto 0.99x; 0.97x in a second run)
  ag  16384  4096   28672   2889.0   1.03          (8B gate+up: auto 1.15 / 1.03 / 0.98 / 1.01x in s5-s8)
  rs  16     4096   4096      38.4   0.54     1.86
  rs  16     28672  8192      73.1   0.25     0.97   (rank operand; rank-free 1.06, s13)
  rs  64     4096   4096      37.6   0.55     1.67
  rs  64     8192   8192      40.9   0.37     0.98
  rs  256    8192   8192      62.4   0.55     1.27
  rs  256    28672  8192     129.8   0.42     1.21
  rs  1024   4096   4096      64.4   0.77     1.23
  rs  1024   8192   8192     153.2   1.24     1.10
  rs  1024   28672  8192     394.3   1.15     1.03
  rs  1024   8192   8192     172.6   1.15     1.07 (11-30)
  rs  2048   4096   6144     171.5   1.10     1.08 (11-30)
  rs  2048   14336  4096     245.9   1.19     1.09 (11-30)
  rs  2048   4096   28672    605.8   1.15     1.03 (11-30; 0.80 with one tile group per launch)
  rs  2048   8192   57344   1815.4   0.98     1.01 (11-30)
  rs  2048   28672  8192     819.3   1.13     1.05 (11-30)
  rs  4096   8192   8192     594.3   1.42     0.97 (probe)
  rs  16384  8192   8192    2068.6   1.23
  rs  8192   28672  8192    2914.7   1.03     1.00 (probe)
  rs  8192   8192   16384   2063.4   1.13     1.02 (11-30)
  rs  8192   4096   28672   2217.0   1.15     1.02 (11-30)
  rs  8192   8192   28672   3605.8   1.09     1.00 (11-30)
  Decode preset, all M (s12, harness_decode-tp2_rs_2026-11-30_s12.json, 3 samples), latency / twin:
  rs  8-64   4096   4096      31-37           1.64-1.86  (8B out-proj, weight k*N = 8.4M)
  rs  128    4096   4096      28.8            1.08       (twin sample low: 37-39 us at M = 64, 256)
  rs  8-128  14336  4096      31-40           0.94-1.07  (8B down, 29M; 1.13 / 0.96 on 11-29)
  rs  8-128  8192   8192      32-48           0.92-1.02  (70B out-proj, 34M; 1.04 / 0.98 on 11-29)
  rs  96     8192   3072      38.7            1.34       (held out, s11: Phi-3-mini down, 12.6M)
  rs  96     5120   5120      40.5            1.32       (held out, s11: Qwen out-proj, 13.1M)
  Then the CUDA lowering stopped computing the rank operand (s12, one run, 5 samples,
  harness_decode-tp2_m8-64-256_{rank,no_rank}_operand_2026-11-30_s12.json): the latency path
  took 0.61-0.96x its time at 16 of 21 decode shapes (2.5-6 us less per call at most), 0.98-1.00x
  at 70B gate+up (120-215 us calls) and 1.18 / 1.52x at 8B out-proj M = 64 / 8 (its twin read
  1.06 / 1.52x slower than in the first run too), latency / twin:
  rs  8-256  14336  4096      33-54           1.12-1.26  (8B down, 29M)
  rs  8-256  8192   8192      35-64           1.15-1.43  (70B out-proj, 34M)
  ag  8-256  all four decode layers            1.01-1.31  (1.01-1.02 at M = 8 with K = 8192 or N = 28672)
  Rank-free decode preset over the whole M list (s13, harness_decode-tp2_2026-11-30_s13.json,
  5 samples), latency / twin where the s12 rule still took the twin:
  ag  8-256  4096   6144      31-39           1.08-1.56  (8B qkv; M = 256 is 3.2e9 MACs, 0.86 in s3)
  ag  8-64   4096   28672     42-51           1.02-1.12  (8B gate+up)
  ag  8-64   8192   10240     35-52           1.02-1.19  (70B qkv)
  ag  8-32   8192   57344    124-135          1.01-1.05  (70B gate+up)
  rs  8-32   28672  8192      72-80           1.04-1.07  (70B down, 117M elements)
  and at every other decode shape 1.04-1.56 (RS) / 1.05-1.37 (AG below M = 1024); the only
  readings under 1.00 were 70B gate+up M = 1024 (0.99) and twins that read 0.98-1.00 against auto.
  With the latency path at every M below the overlap region (s13, 5 samples), auto / twin:
  held-out M = 96 / 320 (Qwen2.5-14B, Phi-3-mini; harness_holdout-tp2_m96-320_newrule_*_s13)
  1.06-1.42 at 16 of 16; the decode preset (harness_decode-tp2_{rs,ag}_auto_newrule_*_s13) RS
  1.01-1.32 at 31 of 31, AG 1.01-1.26 at 25 of 26 and 0.99 at 8B qkv M = 256 (samples overlap;
  1.11 in the run before).
  ag_matmul's decode path (s14, harness_decode-tp2_ag_decode_path_2026-11-30_s14.json, 5 samples,
  commit 91f24d7; bf16, at most 128 rows), decode / twin and latency / twin:
  ag  8-128  4096   6144      35-44   1.28-1.55  1.02-1.21  (8B qkv, n = 3072)
  ag  8-128  8192   10240     37-54   1.13-1.37  1.03-1.17  (70B qkv, n = 5120)
  ag  8-128  4096   28672     43-50   0.98-1.18  1.00-1.06  (8B gate+up, n = 14336)
  ag  8-32   8192   57344    123-130  0.93-0.98  1.01-1.03  (70B gate+up, n = 28672)
  Its GEMM streams a weight up to ~8192 columns per rank at or above cuBLAS's speed and trails it
  by ~10% on the widest (gemm_decode*_s14.txt), so the decode path for AG at <= 128 rows with a
  per-rank n <= 8192, the latency path elsewhere below the overlap region.
  ag_matmul's decode path at 256 rows (s16, harness_decode-tp2_ag_decode256_m256_2026-11-30_s16.json
  and harness_decode-8192-tp2_2026-11-30_s16.json, 5 samples; two 128-row tiles per 64 weight
  columns, each waiting only for its own rows' sender), decode / twin and latency / twin:
  ag  256    4096   6144      1.54       1.10  (8B qkv, n = 3072: 96 tiles; decode 26.9 us, XLA's GEMM 26.6)
  ag  256    8192   8192      1.18       1.32  (n = 4096: 128 tiles)
  ag  256    8192   10240     0.98       1.29  (70B qkv, n = 5120: 160 tiles)
  ag  256    4096   28672     0.88       1.16  (8B gate+up, 448 tiles)
  ag  256    8192   57344     0.77       1.07  (70B gate+up)
  The push kernel's 32 blocks hold their SMs while they run (the GEMM's CTAs take a whole SM's
  registers), so 128 tiles + 32 blocks overflow the 132 SMs and 28 tiles start late; an L2
  prefetch of the weight ahead of the loads made it no better (1.04-1.22x slower at 7 of 8
  decode shapes, ab_decode_l2_prefetch_2026-11-30_s16.json). So above 128 rows the decode path
  only where it has at most 100 tiles (per-rank n <= 3200).
  matmul_rs's decode path (s15, harness_decode-tp2_rs_decode_path_2026-11-30_s15.json with the
  low-latency exchange at M = 8-128, and _batched_m64-128_ with its loads batched, the final code;
  5 samples, bf16, at most 128 rows), decode / twin and latency / twin:
  rs  8-32   4096   4096      1.30-1.40  1.21-1.28  (8B out-proj, k = 2048)
  rs  64-128 4096   4096      1.45-1.71  1.22-1.35
  rs  8-32   14336  4096      1.16-1.28  1.15-1.26  (8B down, k = 7168)
  rs  64     14336  4096      1.18-1.34  1.09-1.15
  rs  128    14336  4096      1.03-1.13  1.14-1.16
  rs  8-32   8192   8192      1.14-1.17  1.11-1.15  (70B out-proj, k = 4096)
  rs  64     8192   8192      1.27-1.36  1.13-1.16
  rs  128    8192   8192      1.18-1.20  1.21-1.23
  rs  8-32   28672  8192      1.05-1.12  1.04-1.06  (70B down, k = 14336)
  rs  64     28672  8192      1.15-1.18  1.08-1.09
  rs  128    28672  8192      1.08-1.12  1.12-1.14
  Its GEMM and the exchange in its epilogue run in one wave, so the exchange adds its whole chain
  after the GEMM; at 128 rows (the 128-row tile, twice the data per thread) that chain cost
  ~12 us in the kernel against ~4.5 at 64, and only the shortest GEMM (8B out-proj) still came out
  ahead. So the decode path for RS at <= 64 rows, and at <= 128 rows for a per-rank weight of at
  most 16M elements; the latency path elsewhere below the overlap region.

Reading: the overlap kernel wins once there are enough row tiles to hide the transfer (M >=
2048; RS already at M = 1024 with N = 8192), at every per-rank N measured (up to 28672) since its
GEMM sweeps groups of 8 row tiles across N (alone it runs at 96-100% of XLA's GEMM there; with
plain raster it was 15-27% slower at N >= 14336 and the overlap lost) -- for AG provided the
GEMM has >= 192 output tiles of 128x256 (about 1.5 waves on 132 SMs): with one wave every remote
tile starts at once and waits for its rows, so nothing overlaps. Below that the latency path wins wherever the collective's
latency is a visible share of the call, i.e. for mid M, and for small M only when the GEMM is
short (RS); when a small-M GEMM is long anyway, the three are within noise and the twin stays.
The rule below is fitted to these points (shapes in between are interpolated, not measured).
Where the per-rank n is >= 12288 the gather is <= ~1/8 of the GEMM, and at K <= 6144 our GEMM
trails XLA's by 1-6% (s11), so at M >= 12288 the overlap gained 0-3% and lost 1-3% in three of
six runs: the twin there. On 24 held-out RS shapes (Qwen2.5-14B- and Phi-3-mini-like layers,
M = 96-12288) auto was 1.01-1.65x the twin.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# Thresholds from the table above (where the overlap kernel pays, and where it loses to XLA's GEMM).
_AG_OVERLAP_MIN_TILES = 192  # AG overlap needs > 1 wave of 128x256 tiles (128 tiles: 0.97x; 192: 1.26x)
# AG at M >= 12288 with a wide per-rank n and K <= 6144: the twin (see the table's s11 rows).
_AG_WIDE_MIN_ROWS, _AG_WIDE_MIN_N, _AG_WIDE_MAX_K = 12288, 12288, 6144
# ag_matmul's decode path: at most this many rows in all and this per-rank n (s14 rows above).
_AG_DECODE_MAX_ROWS, _AG_DECODE_MAX_N = 128, 8192
# ... and at 129-256 rows (two 128-row tiles per 64 weight columns) only where those tiles and the
# push kernel's 32 blocks run at once on an H200's 132 SMs (s16 rows above).
_AG_DECODE_TWO_TILE_MAX_ROWS, _AG_DECODE_TWO_TILE_MAX_TILES = 256, 100
# matmul_rs's decode path: at most 64 rows, or 128 with a per-rank weight (k * n) this small (s15).
_RS_DECODE_MAX_ROWS, _RS_DECODE_SMALL_WEIGHT_MAX_ROWS, _RS_DECODE_SMALL_WEIGHT = 64, 128, 1 << 24
# Below the overlap region both ops take the latency path at every M and weight size. The
# thresholds that kept the twin there (AG below M = 64 or 5e9 multiply-adds; RS below M = 256 with
# a per-rank weight over 64M elements) were fitted while the CUDA lowering still computed the rank
# operand before each call; without it (s12, s13) the latency path read 1.01-1.56x the twin at
# every decode shape they covered, the 1.01-1.07 of the longest GEMMs being ties at worst.


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
        return "xla"  # no float32 kernels; TP > 2 not measured yet (issue 7)
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


def explain(op: str, M: int, K: int, N: int, tp: int, dtype="bfloat16") -> str:
    """What impl="auto" runs on Hopper GPUs for a global GEMM shape, and why (one sentence).

    `op` is "ag_matmul" (x [M, K] row-sharded, w [K, N] column-sharded) or "matmul_rs"
    (x [M, K] and w [K, N] sharded on K). Shapes are global, as in the benchmarks.
    """
    if op not in ("ag_matmul", "matmul_rs"):
        raise ValueError(f'op must be "ag_matmul" or "matmul_rs", got {op!r}')
    if min(M, K, N, tp) < 1:
        raise ValueError(f"M, K, N and tp must be >= 1, got M={M} K={K} N={N} tp={tp}")
    sharded = N if op == "ag_matmul" else K
    if sharded % tp or M % tp:
        raise ValueError(f"{op} cannot shard M={M}, {'N' if op == 'ag_matmul' else 'K'}={sharded} over tp={tp}")
    k, n = (K, N // tp) if op == "ag_matmul" else (K // tp, N)
    where = f"{op} M={M} K={K} N={N} tp={tp} {np.dtype(dtype).name} on GPU"
    if k % 8 or n % 8:
        return f"{where}: the XLA twin (the kernels need per-rank K and N multiples of 8; got {k}, {n})"
    choice = choose(op, tp, M, k, n, dtype)
    if choice == "overlap":
        return (f"{where}: fused, overlap path (enough row tiles to hide the transfer: measured "
                "1.03-1.42x over the twin in that region)")
    if choice == "decode" and op == "ag_matmul":
        return (f"{where}: fused, decode path (the rows pushed over NVLink while a GEMM in the weight's "
                "orientation already streams the weight; measured 1.13-1.55x over the twin at <= 128 rows "
                f"with a per-rank n <= {_AG_DECODE_MAX_N}, 1.54x at 256 rows with n = 3072, where its "
                "tiles and the push fit on the GPU at once; a transposed weight takes the latency path)")
    if choice == "decode":
        return (f"{where}: fused, decode path (one GEMM in the weight's orientation whose epilogue "
                "reduce-scatters each output tile over NVLink; measured 0.97-1.71x over the twin at <= 64 "
                "rows, the least at 8 rows of the longest GEMMs (ties), and 1.45-1.53x at 128 rows with a "
                "per-rank weight <= 16M elements; a transposed weight takes the latency path)")
    if choice == "latency":
        if op == "ag_matmul" and M >= 2048:
            return (f"{where}: fused, latency path (the per-rank GEMM has {_tiles(M, n)} output tiles, "
                    f"fewer than {_AG_OVERLAP_MIN_TILES}: about one wave, so the overlap kernel cannot "
                    "hide the transfer; measured overlap 0.97x, latency 1.10x at 2048x14336x4096)")
        return (f"{where}: fused, latency path (our NVLink collective + XLA's GEMM; measured 1.1-1.9x "
                "over the twin for small and mid M)")
    if np.dtype(dtype) == np.float32:
        why = "no float32 kernels"
    elif tp != 2:
        why = f"tp={tp} has not been measured on GPUs yet"
    elif op == "ag_matmul" and _ag_wide_gemm(M, k, n):
        why = ("the gather is a small share of this wide GEMM and XLA's GEMM is 1-6% faster than ours "
               "here: the overlap measured 0.97-1.03x")
    else:
        why = "no fused path was measured faster for this shape"
    return f"{where}: the XLA twin ({why})"
