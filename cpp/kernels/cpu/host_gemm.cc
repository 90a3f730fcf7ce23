#include "host_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace flux_jax::cpu {
namespace {

float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

float F16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t abs = bits & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {                                               // subnormal or zero in f16
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t exp = abs >> 23;
    uint32_t man = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp;  // 14 + (113 - exp) - 1
    uint32_t half = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t h = ((abs - 0x38000000u) >> 13);
  uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN.
float E4m3ToFloat(uint8_t v) {
  const float sign = (v & 0x80u) ? -1.0f : 1.0f;
  const int exp = (v >> 3) & 0xf, man = v & 0x7;
  if (exp == 0xf && man == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(static_cast<float>(man), -9);  // subnormal: man/8 * 2^-6
  return sign * std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
}

// float8_e5m2: 1 sign, 5 exponent (bias 15), 2 mantissa bits: the high byte of a float16.
float E5m2ToFloat(uint8_t v) { return F16ToFloat(static_cast<uint16_t>(v << 8)); }

}  // namespace

void ToFloat(const void* src, DType dtype, int64_t count, float* dst) {
  switch (dtype) {
    case DType::kF32: std::memcpy(dst, src, static_cast<size_t>(count) * 4); return;
    case DType::kBF16: {
      auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i) dst[i] = Bf16ToFloat(s[i]);
      return;
    }
    case DType::kF16: {
      auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < count; ++i) dst[i] = F16ToFloat(s[i]);
      return;
    }
    case DType::kU8:  // 1-byte payloads are only moved (all_gather), never converted: NaN shows misuse
      std::fill(dst, dst + count, std::numeric_limits<float>::quiet_NaN());
      return;
  }
}

void FromFloat(const float* src, int64_t count, DType dtype, void* dst) {
  switch (dtype) {
    case DType::kF32: std::memcpy(dst, src, static_cast<size_t>(count) * 4); return;
    case DType::kBF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < count; ++i) d[i] = FloatToBf16(src[i]);
      return;
    }
    case DType::kF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < count; ++i) d[i] = FloatToF16(src[i]);
      return;
    }
    case DType::kU8:  // never converted (see ToFloat): all bits set, NaN in every FP8 format
      std::memset(dst, 0xFF, static_cast<size_t>(count));
      return;
  }
}

std::vector<float> WeightAsFloat(const void* w, DType dtype, int64_t k, int64_t n, bool transposed) {
  std::vector<float> out(static_cast<size_t>(k * n));
  if (!transposed) {
    ToFloat(w, dtype, k * n, out.data());
    return out;
  }
  std::vector<float> row(static_cast<size_t>(k));
  const size_t elt = DTypeBytes(dtype);
  for (int64_t j = 0; j < n; ++j) {  // w is [n, k]: row j of w is column j of op(w)
    ToFloat(static_cast<const char*>(w) + j * k * elt, dtype, k, row.data());
    for (int64_t kk = 0; kk < k; ++kk) out[kk * n + j] = row[kk];
  }
  return out;
}

std::vector<float> Fp8WeightAsFloat(const void* w, int64_t k, int64_t n, const float* col_scale) {
  std::vector<float> out(static_cast<size_t>(k * n));
  auto* q = static_cast<const uint8_t*>(w);
  for (int64_t j = 0; j < n; ++j) {  // w is [n, k]: row j of w is column j of op(w)
    for (int64_t kk = 0; kk < k; ++kk) out[kk * n + j] = E4m3ToFloat(q[j * k + kk]) * col_scale[j];
  }
  return out;
}

void GemmRowsFp8(const void* a, bool a_e5m2, int64_t m, int64_t k, const float* b, int64_t n, const float* row_scale,
                 float* c) {
  std::vector<float> rows(static_cast<size_t>(m * k));
  auto* q = static_cast<const uint8_t*>(a);
  for (int64_t i = 0; i < m * k; ++i) rows[i] = a_e5m2 ? E5m2ToFloat(q[i]) : E4m3ToFloat(q[i]);
  GemmRows(rows.data(), DType::kF32, m, k, b, n, c);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) c[i * n + j] *= row_scale[i];
  }
}

void GemmRows(const void* a, DType dtype, int64_t m, int64_t k, const float* b, int64_t n, float* c) {
  constexpr int64_t kRows = 4;  // rows per pass: 4 FMAs per load of b
  const size_t elt = DTypeBytes(dtype);
  std::vector<float> a_rows(static_cast<size_t>(kRows * k));
  for (int64_t i0 = 0; i0 < m; i0 += kRows) {
    const int64_t rows = std::min(kRows, m - i0);
    ToFloat(static_cast<const char*>(a) + i0 * k * elt, dtype, rows * k, a_rows.data());
    float* c0 = c + i0 * n;
    std::fill(c0, c0 + rows * n, 0.0f);
    if (rows == kRows) {
      float *c1 = c0 + n, *c2 = c1 + n, *c3 = c2 + n;
      const float *a0 = a_rows.data(), *a1 = a0 + k, *a2 = a1 + k, *a3 = a2 + k;
      for (int64_t kk = 0; kk < k; ++kk) {
        const float* brow = b + kk * n;
        const float v0 = a0[kk], v1 = a1[kk], v2 = a2[kk], v3 = a3[kk];
        for (int64_t j = 0; j < n; ++j) {
          const float bj = brow[j];
          c0[j] += v0 * bj;
          c1[j] += v1 * bj;
          c2[j] += v2 * bj;
          c3[j] += v3 * bj;
        }
      }
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        float* cr = c0 + r * n;
        const float* ar = a_rows.data() + r * k;
        for (int64_t kk = 0; kk < k; ++kk) {
          const float* brow = b + kk * n;
          const float v = ar[kk];
          for (int64_t j = 0; j < n; ++j) cr[j] += v * brow[j];
        }
      }
    }
  }
}

}  // namespace flux_jax::cpu
