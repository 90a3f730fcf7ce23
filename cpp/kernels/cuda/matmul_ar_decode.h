// matmul_ar's decode path (matmul_ar_decode.cu): for calls of at most
// kDecodeArMaxRows rows, chosen by flux_jax/_plan.py (the "decode" path).
#pragma once

#include <cuda_runtime.h>

#include "flux_jax/matmul_ar.h"
#include "flux_jax/status.h"
#include "flux_jax/tp_group.h"

namespace flux_jax::cuda {

// Whether the decode path serves this call (else the caller must not ask for it).
bool MatmulArDecodeSupported(const MatmulArParams& p, const TpGroup& group);

Status RunMatmulArDecode(const MatmulArParams& p, const TpGroup& group, const CommConfig& cfg, cudaStream_t stream);

}  // namespace flux_jax::cuda
