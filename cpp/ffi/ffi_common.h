// Shared pieces of the FFI adapters: dtype mapping, result-size checks and
// Status -> ffi::Error (attributes: attrs.h).
#pragma once

#include <cstdint>
#include <string>

#include "flux_jax/params.h"
#include "flux_jax/status.h"
#include "xla/ffi/api/ffi.h"

namespace flux_jax::ffi_adapter {

namespace ffi = xla::ffi;

inline ffi::Error ToFfiError(const Status& s) {
  switch (s.code()) {
    case StatusCode::kOk: return ffi::Error::Success();
    case StatusCode::kInvalidArgument: return ffi::Error(ffi::ErrorCode::kInvalidArgument, s.message());
    case StatusCode::kDeadlineExceeded: return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, s.message());
    case StatusCode::kResourceExhausted: return ffi::Error(ffi::ErrorCode::kResourceExhausted, s.message());
    case StatusCode::kInternal: break;
  }
  return ffi::Error(ffi::ErrorCode::kInternal, s.message());
}

inline Status ToDType(ffi::DataType t, const char* what, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kF32; return Status::Ok();
    case ffi::DataType::BF16: *out = DType::kBF16; return Status::Ok();
    case ffi::DataType::F16: *out = DType::kF16; return Status::Ok();
    default: break;
  }
  return Status::InvalidArgument(std::string("unsupported dtype for ") + what +
                                 " (float32, bfloat16 and float16 are supported)");
}

// A payload that is only moved (the all_gather): ToDType's types plus 1-byte ones
// (FP8 operands), which travel as DType::kU8 whatever their format.
inline Status ToPayloadDType(ffi::DataType t, const char* what, DType* out) {
  switch (t) {
    case ffi::DataType::F8E4M3FN:
    case ffi::DataType::F8E5M2:
    case ffi::DataType::U8:
    case ffi::DataType::S8: *out = DType::kU8; return Status::Ok();
    default: break;
  }
  return ToDType(t, what, out);
}

// x [rows, ..., cols] as the kernels see it: [rows * ..., cols] (the same bytes). The
// gathered / scattered dimension comes first, so folding keeps every rank's block contiguous.
struct Folded {
  int64_t rows = 0, cols = 0;
};
inline Status Fold(ffi::AnyBuffer x, const char* what, Folded* out) {
  auto d = x.dimensions();
  if (d.size() < 2) return Status::InvalidArgument(std::string(what) + " must have rank >= 2");
  out->rows = 1;
  for (size_t i = 0; i + 1 < d.size(); ++i) out->rows *= d[i];
  out->cols = d[d.size() - 1];
  return Status::Ok();
}

// Checks that a result buffer has the element count the op will write.
inline Status CheckElements(const char* what, size_t have, int64_t want) {
  if (static_cast<int64_t>(have) == want) return Status::Ok();
  return Status::InvalidArgument(std::string(what) + " has " + std::to_string(have) + " elements, expected " +
                                 std::to_string(want));
}

// The element types of a fused GEMM op's x, w and out, and its FP8 scales. Either x, w and
// out share one of ToDType's types and `scales` is empty, or x and w are float8_e4m3fn (w
// transposed), out is bfloat16 and `scales` holds the row and column scales (float32, counts
// checked here: `rows` and `n`); see Fp8Operands.
inline Status DecodeOperandTypes(const char* op, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer out,
                                 ffi::RemainingArgs& scales, bool w_transposed, int64_t rows, int64_t n, DType* dtype,
                                 Fp8Operands* fp8) {
  const std::string name(op);
  const bool x_e5m2 = x.element_type() == ffi::DataType::F8E5M2;
  if (x.element_type() != ffi::DataType::F8E4M3FN && !x_e5m2) {
    if (scales.size() != 0) return Status::InvalidArgument(name + ": scales are passed only with FP8 operands");
    FLUX_JAX_RETURN_IF_ERROR(ToDType(x.element_type(), op, dtype));
    if (w.element_type() != x.element_type() || out.element_type() != x.element_type()) {
      return Status::InvalidArgument(name + ": x, w and out must share one dtype");
    }
    *fp8 = Fp8Operands{};
    return Status::Ok();
  }
  if (w.element_type() != ffi::DataType::F8E4M3FN || !w_transposed) {
    return Status::InvalidArgument(
        name + ": with float8_e4m3fn or float8_e5m2 x, w must be float8_e4m3fn and transposed ([n, k])");
  }
  if (out.element_type() != ffi::DataType::BF16) {
    return Status::InvalidArgument(name + ": FP8 operands give a bfloat16 output here");
  }
  *dtype = DType::kBF16;
  if (scales.size() != 2) return Status::InvalidArgument(name + ": FP8 operands need a row and a column scale");
  auto row = scales.get<ffi::AnyBuffer>(0);
  auto col = scales.get<ffi::AnyBuffer>(1);
  if (!row.has_value() || !col.has_value()) return Status::Internal(name + ": cannot decode the FP8 scales");
  if (row->element_type() != ffi::DataType::F32 || col->element_type() != ffi::DataType::F32) {
    return Status::InvalidArgument(name + ": FP8 scales must be float32");
  }
  FLUX_JAX_RETURN_IF_ERROR(CheckElements((name + " row scales").c_str(), row->element_count(), rows));
  FLUX_JAX_RETURN_IF_ERROR(CheckElements((name + " column scales").c_str(), col->element_count(), n));
  fp8->on = true;
  fp8->x_e5m2 = x_e5m2;
  fp8->row_scale = static_cast<const float*>(row->untyped_data());
  fp8->col_scale = static_cast<const float*>(col->untyped_data());
  return Status::Ok();
}

}  // namespace flux_jax::ffi_adapter
