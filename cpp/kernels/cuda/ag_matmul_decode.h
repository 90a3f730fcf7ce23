// ag_matmul's decode path (ag_matmul_decode.cu): for calls of at most
// kDecodeMaxRows rows in all, chosen by flux_jax/_plan.py (the "decode" path).
#pragma once

#include <cuda_runtime.h>

#include "flux_jax/params.h"
#include "flux_jax/status.h"
#include "flux_jax/tp_group.h"

namespace flux_jax::cuda {

// Whether the decode path serves this call (else the caller must not ask for it).
bool AgMatmulDecodeSupported(const AgMatmulParams& p, const TpGroup& group);

Status RunAgMatmulDecode(const AgMatmulParams& p, const TpGroup& group, const CommConfig& cfg, cudaStream_t stream);

// GpuTuning.gemm_kernel = decode at tp = 1: the decode GEMM on x alone, no pushes and no waits
// (an A/B measurement of the GEMM against XLA's). Bfloat16, the untransposed weight, at most
// kDecodeMaxRows rows; else an error.
Status RunDecodeGemmAlone(const AgMatmulParams& p, const TpGroup& group, const CommConfig& cfg, cudaStream_t stream);

// Loads the push kernel into the current device's context.
Status PreloadAgMatmulDecode();

}  // namespace flux_jax::cuda
