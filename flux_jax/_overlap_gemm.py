"""Which GEMM instance a call's overlap path runs on a Hopper GPU, for `explain` and
`explain_auto`: cpp/kernels/cuda/op_common.h's rule, asked through the extension (a CUDA build),
for the GEMM each op's handler launches."""

from __future__ import annotations

import numpy as np

from flux_jax import _native, _plan
from flux_jax._config import GEMM_KERNELS, get_gpu_tuning

# H100 / H200 SXM: what explain_auto and a plan made without a local GPU assume.
HOPPER_SMS = 132

_INSTANCES = {
    "128x256": "cooperative 128x256 tiles",
    "128x192": "cooperative 128x192 tiles",
    "128x224": "cooperative 128x224 tiles",
    "128x160_c2x1": "cooperative 128x160 tiles in 2x1 clusters",
    "128x128_pp_c2x1": "ping-pong 128x128 tiles in 2x1 clusters",
    "128x320_c2x1": "cooperative 128x320 tiles in 2x1 clusters",
    "128x160_pp_c2x1": "ping-pong 128x160 tiles in 2x1 clusters",
}


def gemm_rows(p: _plan.Problem) -> tuple[int, int]:
    """(rows of the overlap GEMM the handler plans, rows of one chunk it reads in order), as
    ag_matmul_cuda.cc, matmul_rs_cuda.cc and matmul_ar_cuda.cc pass them to the rule."""
    if p.op == "ag_matmul":  # every rank's rows, gathered chunk by chunk
        return p.rows, p.rows // p.tp
    composed = p.op == "matmul_ar" and not p.fp8 and _plan.composed_overlap(p.op, p.rows, p.tp, p.platform)
    if p.op == "matmul_rs" or composed:  # one stage per destination rank (matmul_ar: two-shot)
        return p.rows // p.tp, p.rows // p.tp
    return p.rows, p.rows  # matmul_ar: one GEMM over the local rows


def local_sms() -> int | None:
    """SMs of this process's first GPU, or None without one."""
    gpus = _plan.local_gpus()
    count = getattr(gpus[0], "core_count", None) if gpus else None
    return int(count) if count else None


def describe(p: _plan.Problem, sms: int | None = None) -> str | None:
    """'overlap GEMM: <instance>, row tiles in groups of G (S SMs)' for a call whose plan is the
    overlap path on a GPU; None where the build has no CUDA kernels or the call's rows are not
    one of the rule's (float32)."""
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
    if tuning.gemm_kernel != "auto" or tuning.tile_n:
        return f"overlap GEMM: as GpuTuning forces it (gemm_kernel={tuning.gemm_kernel!r}, tile_n={tuning.tile_n})"
    assumed = "" if sms else ", assumed"
    sms = sms or HOPPER_SMS
    m, chunk = gemm_rows(p)
    kernel, group = auto_plan(rows_dtype, p.transpose_w, m, p.k, p.n, chunk, sms)
    group = tuning.tile_group_m or group
    return f"overlap GEMM: {_INSTANCES[kernel]}, row tiles in groups of {group} ({sms} SMs{assumed})"


def auto_plan(
    rows_dtype: str, w_transposed: bool, m: int, k: int, n: int, chunk_rows: int, sms: int
) -> tuple[str, int]:
    """(GpuTuning.gemm_kernel name, tile group) that gemm_kernel="auto" and tile_group_m=0 run for
    an m x k x n overlap GEMM read in chunks of chunk_rows (op_common.h: ChooseGemmInstance or
    ChooseFp8GemmInstance, TileGroupM); a CUDA build only."""
    kernel, group = _native.extension().cuda_auto_gemm_plan(rows_dtype, w_transposed, m, k, n, chunk_rows, sms)
    return GEMM_KERNELS[kernel], group
