// The one GEMM configuration every fused op instantiates (per dtype, B layout,
// tile width, cluster and schedule): CUTLASS sm90 TMA warp-specialized persistent
// kernel, cooperative 128x256x64 tiles (128x192x64 and 128x224x64 for the narrower
// instances), cluster 1x1 (the 2x1-cluster instances share B by TMA multicast: 128x160,
// ping-pong 128x128 and 128x192, cooperative 128x320), f32 accumulation, with the gated mainloop,
// gated epilogue and rotated scheduler of gated_gemm.cuh. Included only by the
// instantiation units (each costs ~1 minute of nvcc on 2 cores).
#pragma once

#include <cstring>
#include <string>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "gated_gemm.cuh"
#include "gemm_plan.h"
#include "launch_params_cache.h"
#include "wide_tile_mainloop.cuh"

namespace flux_jax::cuda {

// The kernel schedules: cooperative (both consumer warpgroups on one tile, its epilogue while the
// tensor cores idle) or ping-pong (each warpgroup owns a tile; one's epilogue runs under the
// other's MMAs).
template <bool kPingpong>
struct GemmSchedule {
  using Mainloop = std::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                      cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using MainloopFp8FastAccum =
      std::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum>;
  using Epilogue = std::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                                      cutlass::epilogue::TmaWarpSpecializedCooperative>;
};

// The arguments every instance shares: the problem, A (and its local rows), B, C, D, their gates
// and tile signal, the persistent grid and the tile order. The caller fills the epilogue's
// fusion arguments (`epilogue.thread`).
template <class Kernel>
typename Kernel::Arguments GemmArguments(const GemmPlan& p, int device, int sm_count) {
  using ElementA = typename Kernel::ElementA;
  using ElementB = typename Kernel::ElementB;
  using ElementC = typename Kernel::ElementC;
  using ElementD = typename Kernel::ElementD;
  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);

  typename Kernel::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {m, n, k, 1};

  auto& ml = args.mainloop;
  ml.ptr_A = static_cast<ElementA const*>(p.a);
  ml.dA = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, cute::make_shape(m, k, 1));
  ml.ptr_B = static_cast<ElementB const*>(p.b);
  ml.dB = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, cute::make_shape(n, k, 1));
  ml.ptr_A_local = static_cast<ElementA const*>(p.a_local);
  ml.local_rows = p.local_rows;
  ml.local_first_tile = p.local_first_tile;
  ml.gate = p.gate_a;

  auto& ep = args.epilogue;
  ep.ptr_C = static_cast<ElementC const*>(p.c != nullptr ? p.c : p.d);
  ep.dC = cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, cute::make_shape(m, n, 1));
  ep.ptr_D = static_cast<ElementD*>(p.d);
  ep.dD = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, cute::make_shape(m, n, 1));
  ep.gate = p.gate_c;
  ep.signal = p.signal_d;

  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  args.scheduler.group_m_tiles = p.group_m_tiles;
  args.scheduler.rotate_m_tiles = p.rotate_m_tiles;
  args.scheduler.serpentine = p.serpentine;
  return args;
}

// The overlap GEMM's mainloop (A row-major): CUTLASS's builder up to 256 columns, the wide-tile
// collective (wide_tile_mainloop.cuh: two m64n160 MMAs per warpgroup) for 320.
template <class ElementA, class ElementB, bool kBKMajor, class TileShape, class ClusterShape, class Schedule,
          int kEpilogueSmemBytes, bool kWide = (cute::size<1>(TileShape{}) > 256)>
struct OverlapMainloop {
  static constexpr int kAlignA = 128 / cutlass::sizeof_bits<ElementA>::value;  // 16 bytes
  static constexpr int kAlignB = 128 / cutlass::sizeof_bits<ElementB>::value;
  using type = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cutlass::layout::RowMajor, kAlignA, ElementB,
      std::conditional_t<kBKMajor, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>, kAlignB, float, TileShape,
      ClusterShape, cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmemBytes>, Schedule>::CollectiveOp;
};
template <class ElementA, class ElementB, bool kBKMajor, class TileShape, class ClusterShape, class Schedule,
          int kEpilogueSmemBytes>
struct OverlapMainloop<ElementA, ElementB, kBKMajor, TileShape, ClusterShape, Schedule, kEpilogueSmemBytes, true> {
  using type = typename WideTileMainloop<ElementA, ElementB, kBKMajor, TileShape, ClusterShape, 160, Schedule,
                                         kEpilogueSmemBytes>::CollectiveOp;
};

template <class Element, bool kBKMajor, int kBlockN = kGemmBlockN, int kClusterM = 1, bool kPingpong = false>
struct GemmInstance {
  using LayoutC = cutlass::layout::RowMajor;
  static constexpr int kAlignment = 8;  // 16 bytes: K and N multiples of 8
  using TileShape = cute::Shape<cute::Int<kGemmBlockM>, cute::Int<kBlockN>, cute::_64>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::_1, cute::_1>;

  using BaseEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, LayoutC, kAlignment, Element, LayoutC,
      kAlignment, typename GemmSchedule<kPingpong>::Epilogue>::CollectiveOp;

  using BaseMainloop = typename OverlapMainloop<Element, Element, kBKMajor, TileShape, ClusterShape,
                                                typename GemmSchedule<kPingpong>::Mainloop,
                                                static_cast<int>(sizeof(typename BaseEpilogue::SharedStorage))>::type;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, GatedMainloop<BaseMainloop>,
                                                      GatedEpilogue<BaseEpilogue>, RotatedSchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // For RunGemmInstance: the name in errors, what CUTLASS requires, the launch's arguments.
  static constexpr const char* kWhat = "GEMM";
  static constexpr const char* kRequirement = "K and N must be multiples of 8";
  static typename Kernel::Arguments Arguments(const GemmPlan& p, int device, int sm_count) {
    auto args = GemmArguments<Kernel>(p, device, sm_count);
    auto& ep = args.epilogue;
    ep.thread.alpha = 1.0f;
    ep.thread.alpha_ptr = p.alpha_ptr;
    // As in the decode GEMM: a nonzero batch stride makes the epilogue read alpha per tile (batch 0
    // only), not once at kernel start, so a tile whose rows never came (its wait gave up and
    // poisoned alpha before its loads) comes out NaN instead of finite and wrong (found by
    // cpp/tests/loopback). A partial-sum (C) wait may give up after the tile's epilogue read alpha;
    // it makes the tile's C NaN instead (GatedEpilogue::load).
    ep.thread.dAlpha = {cute::_0{}, cute::_0{}, 1};
    ep.thread.beta = p.beta;
    return args;
  }
};

// What a launch's kernel parameters are built from: the plan less its waits and tile signal
// (their epochs and timeouts change every call) and less what picks the instance (each instance
// caches its own). No padding: keys compare as bytes (launch_params_cache.h).
struct GemmLaunchKey {
  int64_t m, n, k;
  const void* a;
  const void* a_local;
  const void* b;
  const void* c;
  void* d;
  const float* alpha_ptr;
  const float* row_scale;
  const float* col_scale;
  uint32_t beta_bits;
  int32_t local_rows, local_first_tile, rotate_m_tiles, group_m_tiles, device, sm_count;
  int16_t b_kmajor, serpentine;  // int16: no padding (SameLaunchKey)
};

inline GemmLaunchKey MakeGemmLaunchKey(const GemmPlan& p, int device, int sm_count) {
  GemmLaunchKey key{};
  key.m = p.m;
  key.n = p.n;
  key.k = p.k;
  key.a = p.a;
  key.a_local = p.a_local;
  key.b = p.b;
  key.c = p.c;
  key.d = p.d;
  key.alpha_ptr = p.alpha_ptr;
  key.row_scale = p.row_scale;
  key.col_scale = p.col_scale;
  std::memcpy(&key.beta_bits, &p.beta, sizeof(key.beta_bits));
  key.local_rows = p.local_rows;
  key.local_first_tile = p.local_first_tile;
  key.rotate_m_tiles = p.rotate_m_tiles;
  key.group_m_tiles = p.group_m_tiles;
  key.device = device;
  key.sm_count = sm_count;
  key.b_kmajor = p.b_kmajor;
  key.serpentine = p.serpentine;
  return key;
}

// Checks and launches one GEMM of `Instance` (GemmInstance, GemmInstanceFp8). The kernel parameters
// come from Instance::Arguments on the first launch of this signature, from the cache after
// (launch_params_cache.h); this call's waits and tile signal are patched in. The kernel's shared
// memory size was set once per device (PreloadGemmInstance).
template <class Instance>
Status RunGemmInstance(const GemmPlan& p, cudaStream_t stream, int device, int sm_count) {
  using Gemm = typename Instance::Gemm;
  using Params = typename Instance::Kernel::Params;
  static LaunchParamsCache<GemmLaunchKey, Params> cache;
  Params params;
  cutlass::Status st = cache.Get(
      MakeGemmLaunchKey(p, device, sm_count), cutlass::Status::kSuccess,
      [&](Params* out) {
        const auto args = Instance::Arguments(p, device, sm_count);
        if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return cutlass::Status::kErrorInvalidProblem;
        *out = Instance::Kernel::to_underlying_arguments(args, nullptr);  // the persistent scheduler takes no workspace
        return cutlass::Status::kSuccess;
      },
      &params);
  if (st == cutlass::Status::kErrorInvalidProblem) {
    return Status::InvalidArgument(std::string("flux_jax: CUTLASS cannot implement ") + Instance::kWhat +
                                   " m=" + std::to_string(p.m) + " n=" + std::to_string(p.n) +
                                   " k=" + std::to_string(p.k) + " (" + Instance::kRequirement + ")");
  }
  params.mainloop.gate = p.gate_a;
  params.epilogue.gate = p.gate_c;
  params.epilogue.signal = p.signal_d;
  if (st == cutlass::Status::kSuccess) st = Gemm::run(params, stream);
  if (st != cutlass::Status::kSuccess) {
    return Status::Internal(std::string("flux_jax: CUTLASS ") + Instance::kWhat + " launch failed: " +
                            cutlass::cutlassGetStatusString(st) + " / " + cudaGetErrorString(cudaGetLastError()));
  }
  return Status::Ok();
}

// Loads the kernel into the current device's context now. With CUDA's lazy
// module loading the first launch of a kernel waits for the device to go idle;
// if that first launch happens while one of our flag-waiting kernels spins
// (waiting for a peer whose host thread is blocked on the same loader lock),
// both sides stall until the timeout. So every kernel is loaded up front.
template <class Instance>
Status PreloadGemmInstance() {
  using Kernel = typename Instance::Kernel;
  cudaError_t err = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(Kernel::SharedStorageSize));
  if (err != cudaSuccess) {
    return Status::Internal(std::string("flux_jax: loading a GEMM kernel failed: ") + cudaGetErrorString(err));
  }
  return Status::Ok();
}

}  // namespace flux_jax::cuda

// Defines the entry points of one instance type (GemmInstance<...> or GemmInstanceFp8<...>, the
// arguments after `name`): Status <name>(plan, stream, device, sms) and Status Preload_<name>().
#define FLUX_JAX_DEFINE_GEMM_INSTANCE(name, ...)                                     \
  namespace flux_jax::cuda {                                                         \
  using name##_Instance = __VA_ARGS__;                                               \
  Status name(const GemmPlan& plan, cudaStream_t stream, int device, int sm_count) { \
    return RunGemmInstance<name##_Instance>(plan, stream, device, sm_count);         \
  }                                                                                  \
  Status Preload_##name() { return PreloadGemmInstance<name##_Instance>(); }         \
  }
