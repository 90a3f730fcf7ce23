// Shared pieces of the FFI adapters: dtype mapping, attribute decoding into
// TpGroup / CommConfig, and Status -> ffi::Error.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "flux_jax/params.h"
#include "flux_jax/status.h"
#include "flux_jax/tp_group.h"
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

// Reads attribute `name` of the op, with a readable error when it is missing.
template <typename T>
Status GetAttr(const ffi::Dictionary& attrs, const char* name, T* out) {
  auto value = attrs.get<T>(name);
  if (!value.has_value()) {
    return Status::InvalidArgument(std::string("missing or mistyped FFI attribute '") + name + "'");
  }
  *out = *value;
  return Status::Ok();
}

// Decodes the attributes every fused op carries (see flux_jax/_lowering.py):
// tp_size, tp_devices, tp_processes, callsite, timeout_us, jitter_us, drop_rank, poison,
// piece_bytes, tile_group_m, rs_stage_launches, rs_tile_signal, tile_n, decode_path,
// decode_early_launch.
inline Status DecodeCommon(const ffi::Dictionary& attrs, Platform platform, int32_t device_ordinal,
                           std::optional<int32_t> rank_operand, TpGroup* group, CommConfig* cfg) {
  int64_t tp_size = 0;
  ffi::Span<const int64_t> table, processes;
  FLUX_JAX_RETURN_IF_ERROR(GetAttr(attrs, "tp_size", &tp_size));
  FLUX_JAX_RETURN_IF_ERROR(GetAttr(attrs, "tp_devices", &table));
  FLUX_JAX_RETURN_IF_ERROR(GetAttr(attrs, "tp_processes", &processes));
  if (processes.size() != table.size()) {
    return Status::InvalidArgument("tp_processes and tp_devices differ in length");
  }
  FLUX_JAX_RETURN_IF_ERROR(GetAttr(attrs, "callsite", &cfg->callsite));
  FLUX_JAX_RETURN_IF_ERROR(GetAttr(attrs, "timeout_us", &cfg->timeout_us));
  FLUX_JAX_RETURN_IF_ERROR(GetAttr(attrs, "jitter_us", &cfg->jitter_us));
  FLUX_JAX_RETURN_IF_ERROR(GetAttr(attrs, "drop_rank", &cfg->drop_rank));
  FLUX_JAX_RETURN_IF_ERROR(GetAttr(attrs, "poison", &cfg->poison_outputs));
  FLUX_JAX_RETURN_IF_ERROR(GetAttr(attrs, "piece_bytes", &cfg->piece_bytes));
  FLUX_JAX_RETURN_IF_ERROR(GetAttr(attrs, "tile_group_m", &cfg->tile_group_m));
  FLUX_JAX_RETURN_IF_ERROR(GetAttr(attrs, "rs_stage_launches", &cfg->rs_stage_launches));
  FLUX_JAX_RETURN_IF_ERROR(GetAttr(attrs, "rs_tile_signal", &cfg->rs_tile_signal));
  FLUX_JAX_RETURN_IF_ERROR(GetAttr(attrs, "tile_n", &cfg->tile_n));
  FLUX_JAX_RETURN_IF_ERROR(GetAttr(attrs, "decode_path", &cfg->decode_path));
  int64_t early_launch = 1;
  FLUX_JAX_RETURN_IF_ERROR(GetAttr(attrs, "decode_early_launch", &early_launch));
  cfg->decode_early_launch = early_launch != 0;
  return ResolveTpGroup(table.begin(), processes.begin(), table.size(), tp_size, platform,
                        device_ordinal, rank_operand, group);
}

// Checks that a result buffer has the element count the op will write.
inline Status CheckElements(const char* what, size_t have, int64_t want) {
  if (static_cast<int64_t>(have) == want) return Status::Ok();
  return Status::InvalidArgument(std::string(what) + " has " + std::to_string(have) +
                                 " elements, expected " + std::to_string(want));
}

}  // namespace flux_jax::ffi_adapter
