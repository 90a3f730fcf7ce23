// The typed attributes of flux_jax's custom calls (built by flux_jax/_lowering.py)
// and their decoding into TpGroup and CommConfig.
//
// XLA decodes each custom call's attribute dictionary into one of these
// structs before the handler runs: a missing, extra or mistyped attribute is an
// FFI error naming it, never a default.
#pragma once

#include <cstdint>
#include <optional>

#include "flux_jax/params.h"
#include "flux_jax/status.h"
#include "flux_jax/tp_group.h"
#include "xla/ffi/api/ffi.h"

namespace flux_jax::ffi_adapter {

namespace ffi = xla::ffi;

// Every custom call: the TP groups of the mesh and the runtime settings.
//   tp_devices[g * tp_size + r]: global id of rank r's device in group g;
//   tp_processes: the process of each of those devices.
struct CollectiveAttrs {
  int64_t tp_size;
  ffi::Span<const int64_t> tp_devices;
  ffi::Span<const int64_t> tp_processes;
  int64_t callsite;
  int64_t timeout_us;
  int64_t jitter_us;
  int64_t drop_rank;
  bool poison;
};

// The fused GEMM ops: the collective's attributes, the weight's layout, the
// path and the GPU tuning (GpuTuning's fields, same names).
struct GemmAttrs {
  int64_t tp_size;
  ffi::Span<const int64_t> tp_devices;
  ffi::Span<const int64_t> tp_processes;
  int64_t callsite;
  int64_t timeout_us;
  int64_t jitter_us;
  int64_t drop_rank;
  bool poison;
  bool w_transposed;
  FusedPath path;
  int64_t piece_bytes;
  int64_t tile_group_m;
  int64_t tile_serpentine;
  int64_t rs_stage_launches;
  int64_t rs_tile_signal;
  int64_t tile_n;
  bool decode_early_launch;
  int64_t gemm_kernel;
  bool gate_probe;
};

// Fills `group` (which rank this device is, its peers) and `cfg` from the
// attributes every custom call carries. `position_operand` is the device's
// place in the device table by lax.axis_index (group * tp + rank), where the
// host can read it (CPU), cross-checked against the table.
template <typename Attrs>
Status DecodeCommon(const Attrs& a, Platform platform, int32_t device_ordinal, std::optional<int32_t> position_operand,
                    TpGroup* group, CommConfig* cfg) {
  if (a.tp_processes.size() != a.tp_devices.size()) {
    return Status::InvalidArgument("tp_processes and tp_devices differ in length");
  }
  cfg->callsite = a.callsite;
  cfg->timeout_us = a.timeout_us;
  cfg->jitter_us = a.jitter_us;
  cfg->drop_rank = a.drop_rank;
  cfg->poison_outputs = a.poison;
  return ResolveTpGroup(a.tp_devices.begin(), a.tp_processes.begin(), a.tp_devices.size(), a.tp_size, platform,
                        device_ordinal, position_operand, group);
}

inline Status DecodeGemm(const GemmAttrs& a, Platform platform, int32_t device_ordinal,
                         std::optional<int32_t> position_operand, TpGroup* group, CommConfig* cfg) {
  if (a.path != FusedPath::kOverlap && a.path != FusedPath::kDecode) {
    return Status::InvalidArgument("unknown fused path " + std::to_string(static_cast<int32_t>(a.path)));
  }
  cfg->path = a.path;
  cfg->tuning.piece_bytes = a.piece_bytes;
  cfg->tuning.tile_group_m = a.tile_group_m;
  if (a.tile_serpentine < -1 || a.tile_serpentine > 1) {
    return Status::InvalidArgument("tile_serpentine must be -1, 0 or 1, got " + std::to_string(a.tile_serpentine));
  }
  cfg->tuning.tile_serpentine = a.tile_serpentine;
  cfg->tuning.rs_stage_launches = a.rs_stage_launches;
  cfg->tuning.rs_tile_signal = a.rs_tile_signal;
  cfg->tuning.tile_n = a.tile_n;
  cfg->tuning.decode_early_launch = a.decode_early_launch;
  if (a.gemm_kernel < static_cast<int64_t>(GemmKernel::kAuto) ||
      a.gemm_kernel > static_cast<int64_t>(kLastGemmKernel)) {
    return Status::InvalidArgument("unknown gemm_kernel " + std::to_string(a.gemm_kernel));
  }
  cfg->tuning.gemm_kernel = a.gemm_kernel;
  cfg->tuning.gate_probe = a.gate_probe;
  return DecodeCommon(a, platform, device_ordinal, position_operand, group, cfg);
}

}  // namespace flux_jax::ffi_adapter

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(flux_jax::FusedPath);

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(flux_jax::ffi_adapter::CollectiveAttrs, StructMember<int64_t>("tp_size"),
                                      StructMember<Span<const int64_t>>("tp_devices"),
                                      StructMember<Span<const int64_t>>("tp_processes"),
                                      StructMember<int64_t>("callsite"), StructMember<int64_t>("timeout_us"),
                                      StructMember<int64_t>("jitter_us"), StructMember<int64_t>("drop_rank"),
                                      StructMember<bool>("poison"));

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    flux_jax::ffi_adapter::GemmAttrs, StructMember<int64_t>("tp_size"), StructMember<Span<const int64_t>>("tp_devices"),
    StructMember<Span<const int64_t>>("tp_processes"), StructMember<int64_t>("callsite"),
    StructMember<int64_t>("timeout_us"), StructMember<int64_t>("jitter_us"), StructMember<int64_t>("drop_rank"),
    StructMember<bool>("poison"), StructMember<bool>("w_transposed"), StructMember<flux_jax::FusedPath>("path"),
    StructMember<int64_t>("piece_bytes"), StructMember<int64_t>("tile_group_m"),
    StructMember<int64_t>("tile_serpentine"), StructMember<int64_t>("rs_stage_launches"),
    StructMember<int64_t>("rs_tile_signal"), StructMember<int64_t>("tile_n"), StructMember<bool>("decode_early_launch"),
    StructMember<int64_t>("gemm_kernel"), StructMember<bool>("gate_probe"));
