"""Which GEMM instance a call's overlap path runs on a Hopper GPU, for `explain` and
`explain_auto`: cpp/kernels/cuda/op_common.h's rule, asked through the extension (a CUDA build),
for the GEMM each op's handler launches."""

from __future__ import annotations

import numpy as np

from flux_jax import _native, _plan
from flux_jax._config import GEMM_KERNELS, get_gpu_tuning

# What explain_auto and a plan made without a local GPU assume: an H200 (132 SMs, 4.8 TB/s of
# DRAM), the GPU the rule was tuned on.
HOPPER_SMS = 132
H200_DRAM_GBPS = 4800

_INSTANCES = {
    "128x256": "cooperative 128x256 tiles",
    "128x192": "cooperative 128x192 tiles",
    "128x224": "cooperative 128x224 tiles",
    "128x160_c2x1": "cooperative 128x160 tiles in 2x1 clusters",
    "128x128_pp_c2x1": "ping-pong 128x128 tiles in 2x1 clusters",
    "128x320_c2x1": "cooperative 128x320 tiles in 2x1 clusters",
    "128x160_pp_c2x1": "ping-pong 128x160 tiles in 2x1 clusters",
    "128x192_pp_c2x1": "ping-pong 128x192 tiles in 2x1 clusters",
}


def gemm_rows(p: _plan.Problem) -> tuple[int, int]:
    """(rows of the overlap GEMM the handler plans, rows of one chunk it reads in order), as
    ag_matmul_cuda.cc, matmul_rs_cuda.cc and matmul_ar_cuda.cc pass them to the rule."""
    if p.op == "ag_matmul":  # every rank's rows, gathered chunk by chunk
        return p.rows, p.rows // p.tp
    # matmul_ar's two-shot overlap runs matmul_rs's call: always with FP8 operands (ops/matmul_ar.py,
    # _fp8_overlap), else where composed_overlap says
    two_shot = p.op == "matmul_ar" and (p.fp8 or _plan.composed_overlap(p.op, p.rows, p.tp, p.platform))
    if p.op == "matmul_rs" or two_shot:  # one stage per destination rank
        return p.rows // p.tp, p.rows // p.tp
    return p.rows, p.rows  # matmul_ar: one GEMM over the local rows


def local_gpu() -> tuple[int, int] | None:
    """(SMs, peak DRAM bandwidth in GB/s) of this process's first GPU, as the rule reads them
    (workspace.cc); None without a GPU or a CUDA build."""
    gpus = _plan.local_gpus()
    ext = _native.extension()
    if not gpus or not hasattr(ext, "cuda_gemm_rule_inputs"):
        return None
    sms, dram_gbps = ext.cuda_gemm_rule_inputs(int(gpus[0].local_hardware_id))
    return int(sms), int(dram_gbps)


def describe(p: _plan.Problem, gpu: tuple[int, int] | None = None) -> str | None:
    """'overlap GEMM: <instance>, row tiles in groups of G (S SMs, B TB/s DRAM)' for a call whose
    plan is the overlap path on a GPU (`gpu`: its SMs and peak DRAM GB/s, local_gpu; None: an
    H200, assumed); None where the build has no CUDA kernels or the call's rows are not one of
    the rule's (float32)."""
    ext = _native.extension()
    rows_dtype = p.fp8 or np.dtype(p.dtype).name
    if not hasattr(ext, "cuda_auto_gemm_plan") or rows_dtype not in (
        "bfloat16",
        "float16",
        "float8_e4m3fn",
        "float8_e5m2",
    ):
        return None
    tuning = get_gpu_tuning()
    forced = _forced(tuning, rows_dtype)
    if forced:
        return f"overlap GEMM: as GpuTuning forces it ({forced})"
    assumed = "" if gpu else ", assumed"
    sms, dram_gbps = gpu or (HOPPER_SMS, H200_DRAM_GBPS)
    m, chunk = gemm_rows(p)
    kernel, group = auto_plan(rows_dtype, p.transpose_w, m, p.k, p.n, chunk, sms, dram_gbps)
    group = tuning.tile_group_m or group
    gpu_text = f"{sms} SMs, {dram_gbps / 1000:.1f} TB/s DRAM{assumed}"
    return f"overlap GEMM: {_INSTANCES[kernel]}, row tiles in groups of {group} ({gpu_text})"


def _forced(tuning, rows_dtype: str) -> str | None:
    """The GpuTuning fields that override the rule for rows of `rows_dtype` (op_common.h):
    gemm_kernel, and tile_n for bfloat16 / float16 rows only."""
    fields = []
    if tuning.gemm_kernel != "auto":
        fields.append(f"gemm_kernel={tuning.gemm_kernel!r}")
    if tuning.tile_n and not rows_dtype.startswith("float8"):
        fields.append(f"tile_n={tuning.tile_n}")
    return ", ".join(fields) or None


def auto_plan(
    rows_dtype: str, w_transposed: bool, m: int, k: int, n: int, chunk_rows: int, sms: int, dram_gbps: int = 0
) -> tuple[str, int]:
    """(GpuTuning.gemm_kernel name, tile group) that gemm_kernel="auto" and tile_group_m=0 run for
    an m x k x n overlap GEMM read in chunks of chunk_rows on a GPU with `sms` SMs and `dram_gbps`
    GB/s of peak DRAM bandwidth (0: unknown, an H200's rule) (op_common.h: ChooseGemmInstance or
    ChooseFp8GemmInstance, TileGroupM); a CUDA build only."""
    kernel, group = _native.extension().cuda_auto_gemm_plan(
        rows_dtype, w_transposed, m, k, n, chunk_rows, sms, dram_gbps
    )
    return GEMM_KERNELS[kernel], group
