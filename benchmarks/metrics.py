"""Derived metrics of one case's rows: TFLOP/s, speedup over the twin, overlap, ratio to the limit.

With T the variant's time, T_gemm (gemm_only) and T_comm (comm_only) of the same shape:
  tflops                   = 2 * M * K * N / tp / T            (per GPU)
  speedup_vs_xla_shard_map = T_twin / T
  overlap_efficiency       = (T_gemm + T_comm - T) / T_comm   (1 = communication fully hidden)
  ratio_to_limit           = T / max(T_gemm, T_comm)          (1 = at the limit)
Only "ok" rows get metrics: a WRONG variant keeps its time but makes no claim.
"""

from __future__ import annotations

from benchmarks.presets import Case
from benchmarks.variants import LIMIT_VARIANTS

REFERENCE = "xla_shard_map"


def _ok_ms(rows: list[dict], variant: str) -> float | None:
    for row in rows:
        if row["variant"] == variant and row["status"] == "ok" and row["ms"] > 0:
            return row["ms"]
    return None


def add_metrics(case: Case, rows: list[dict], gemms: int = 1) -> None:
    """Fill tflops, speedup_vs_xla_shard_map, overlap_efficiency and ratio_to_limit in place.

    gemms: GEMMs of the op's size per step (3 for forward + backward: y, dx, dw).
    """
    t_twin, t_gemm, t_comm = (_ok_ms(rows, v) for v in (REFERENCE, "gemm_only", "comm_only"))
    for row in rows:
        row.update(tflops=None, speedup_vs_xla_shard_map=None, overlap_efficiency=None, ratio_to_limit=None)
        t = row["ms"]
        if row["status"] != "ok" or t is None or t <= 0:
            continue
        if row["variant"] != "comm_only":
            row["tflops"] = gemms * case.flops_per_gpu / (t * 1e-3) / 1e12
        if row["variant"] in LIMIT_VARIANTS:
            continue
        if t_twin:
            row["speedup_vs_xla_shard_map"] = t_twin / t
        if t_gemm and t_comm:
            row["overlap_efficiency"] = (t_gemm + t_comm - t) / t_comm
            row["ratio_to_limit"] = t / max(t_gemm, t_comm)
