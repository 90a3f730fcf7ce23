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

// FP8 operands (Fp8Operands): op(w) from w [n, k] in float8_e4m3fn times col_scale[n], as a
// row-major float32 [k, n] matrix; c[m, n] = row_scale[i] * (a[m, k] @ b[k, n]), a in e4m3 (e5m2
// with a_e5m2).
std::vector<float> Fp8WeightAsFloat(const void* w, int64_t k, int64_t n, const float* col_scale);
void GemmRowsFp8(const void* a, bool a_e5m2, int64_t m, int64_t k, const float* b, int64_t n, const float* row_scale,
                 float* c);

// Element conversions.
void ToFloat(const void* src, DType dtype, int64_t count, float* dst);
void FromFloat(const float* src, int64_t count, DType dtype, void* dst);

}  // namespace flux_jax::cpu
