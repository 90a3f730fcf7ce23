// Reference-quality GEMM for the CPU backend: float32 accumulation in a fixed
// order (deterministic), inputs in float32 / bfloat16 / float16.
#pragma once

#include <cstdint>
#include <vector>

#include "flux_jax/params.h"

namespace flux_jax::cpu {

// op(w) as a row-major float32 [k, n] matrix; w is [k, n], or [n, k] if transposed.
std::vector<float> WeightAsFloat(const void* w, DType dtype, int64_t k, int64_t n, bool transposed);

// c[m, n] = a[m, k] @ b[k, n]; a in `dtype`, b and c float32.
void GemmRows(const void* a, DType dtype, int64_t m, int64_t k, const float* b, int64_t n, float* c);

// Element conversions.
void ToFloat(const void* src, DType dtype, int64_t count, float* dst);
void FromFloat(const float* src, int64_t count, DType dtype, void* dst);

}  // namespace flux_jax::cpu
