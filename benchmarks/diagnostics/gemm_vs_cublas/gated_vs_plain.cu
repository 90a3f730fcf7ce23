// What our hooks cost: the overlap GEMM the fused ops run (RunGemm: gated mainloop, gated epilogue, rotated
// scheduler, with nothing to wait for) against plain CUTLASS of the same configuration, in one process on one GPU
// with tile_sweep's driver (check first, outputs poisoned; best of 7 loops, two passes in opposite column order).
//
//   bf16   reference cuBLAS; ping-pong 128x128 in 2x1 clusters (B N-major), plain, unhooked and ours; cooperative
//          128x256 (the tile of every shape at M >= 8192), plain, unhooked, each hook alone, all three and ours;
//          the same tile in 2x1 clusters (cuBLAS's most frequent pick at M >= 8192), plain, unhooked, all hooks
//   fp8    reference plain CUTLASS ping-pong 128x128 2x1 with fast accumulation (raster AlongN, no swizzle), so the
//          ratio is ours / plain; unhooked and ours with their row and column scales (all 1) in the epilogue
//
// Unhooked: our instance's CUTLASS mainloop and epilogue (alpha read per tile; FP8: the scale tree) in a plain kernel
// with CUTLASS's persistent scheduler, none of our hooks: plain -> unhooked prices our epilogue, unhooked -> ours the
// hooks. FP8 and bf16 128x256 also put them back one at a time (mainloop_hook, epilogue_hook, scheduler_hook) and
// all three (all_hooks: the product's kernel built from this checkout's headers, next to `ours` from the linked
// library).
// SWEEP_PROFILE=<n> times by profiler instead of loops (tile_sweep.cuh): the way to read differences of a few percent.
// SWEEP_ENERGY=<seconds> times each column at the power cap instead, with its energy per call (tile_sweep.cuh).
//
// Plain configurations run tile_sweep's four scheduler variants. Ours reads them as:
//
//   sw1,N  tile groups of 1 (plain raster along N, as plain sw1,N)
//   sw8,N  tile groups of 8, serpentine (the product's order below 16 row tiles)
//   sw1,H  tile groups of 8, serpentine, alpha a scalar (the product reads it from memory per tile: the poison of a
//          failed wait)
//   sw8,H  tile groups of 16, serpentine (the product's order for 128x256 tiles at >= 16 row tiles)
//
//   gated_vs_plain                      # tile_sweep's built-in shapes
//   gated_vs_plain 2048x2560x5120 ...   # per-GPU MxKxN shapes instead
//
// Caveat (docs/decisions/2026-12-02-cluster-shape-and-tile-groups.md): the event-timed loops read our FP8 kernel
// 10-20% slower than CUPTI's kernel time in benchmarks/fp8_gemm.py, and the variants' differences there (groups of
// 16: 7-13%) did not show in the kernel times, so time by profiler (SWEEP_PROFILE) for anything under ~10%.
//
// cuBLAS: as tile_sweep (FLUX_PROBE_CUBLAS); `cublaslt_autotuned` is XLA's pick (cublaslt_loader.cuh). Build: build.sh
// <build-dir> <out-dir> (links the CUDA backend).
#include <deque>
#include <string>
#include <type_traits>
#include <vector>

#include "gemm_fp8_instance.cuh"
#include "gemm_instance.cuh"
#include "gemm_plan.h"
#include "cublaslt_loader.cuh"

namespace {

using F8 = cutlass::float_e4m3_t;
using PS = cutlass::gemm::PersistentScheduler;
using PlainBf16Pp = PlainGemmT<E, RM, RM, RM, 128, 128, 2, 1, PS, true>;
using PlainFp8Pp = PlainGemmT<F8, RM, CM, RM, 128, 128, 2, 1, PS, true, true>;
using PlainBf16Coop = PlainGemmT<E, RM, RM, RM, 128, 256, 1, 1, PS>;
using PlainBf16CoopC2 = PlainGemmT<E, RM, RM, RM, 128, 256, 2, 1, PS>;

// Our instance's own mainloop and epilogue (CUTLASS's, before our hooks wrap them) in a plain GemmUniversal with
// CUTLASS's persistent scheduler: the product's kernel less the gated mainloop, gated epilogue and rotated scheduler.
// Against the plain configuration it prices the epilogue (FP8: the scale tree); against ours, the hooks. kHooks puts
// some of them back, one at a time, to price each (nothing to wait for, no tile signal: as at TP = 1).
enum Hooks { kNoHooks = 0, kMainloopHook = 1, kEpilogueHook = 2, kSchedulerHook = 4 };
template <class Instance, int kHooks = kNoHooks>
struct Unhooked {
  using Mainloop =
      std::conditional_t<(kHooks & kMainloopHook) != 0, flux_jax::cuda::GatedMainloop<typename Instance::BaseMainloop>,
                         typename Instance::BaseMainloop>;
  using Epilogue =
      std::conditional_t<(kHooks & kEpilogueHook) != 0, flux_jax::cuda::GatedEpilogue<typename Instance::BaseEpilogue>,
                         typename Instance::BaseEpilogue>;
  using Scheduler = std::conditional_t<(kHooks & kSchedulerHook) != 0, flux_jax::cuda::RotatedSchedulerTag, PS>;
  static constexpr bool kRotated = (kHooks & kSchedulerHook) != 0;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};
using UnhookedBf16Pp = Unhooked<flux_jax::cuda::GemmInstance<E, false, 128, 2, true>>;
using Bf16CoopInstance = flux_jax::cuda::GemmInstance<E, false, 256, 1, false>;
using Bf16CoopC2Instance = flux_jax::cuda::GemmInstance<E, false, 256, 2, false>;  // cuBLAS's tile at large M
using Fp8PpInstance = flux_jax::cuda::GemmInstanceFp8<F8, E, 128, 2, true>;

// A runner of an Unhooked instance; the epilogue's arguments as the product sets them (alpha read per tile from
// `one`, beta 0, FP8: every row and column scale `one`).
template <class U, bool kFp8>
Runner MakeUnhooked(const SweepShape& s, const void* x, const void* w, E* d, const float* one, void* ws,
                    size_t ws_bytes, Variant v) {
  using K = typename U::Kernel;
  typename K::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {s.m, s.n, s.k, 1};
  args.mainloop.ptr_A = static_cast<typename K::ElementA const*>(x);
  args.mainloop.dA = cutlass::make_cute_packed_stride(typename K::StrideA{}, {s.m, s.k, 1});
  args.mainloop.ptr_B = static_cast<typename K::ElementB const*>(w);
  args.mainloop.dB = cutlass::make_cute_packed_stride(typename K::StrideB{}, {s.n, s.k, 1});
  args.epilogue.ptr_C = d;
  args.epilogue.dC = cutlass::make_cute_packed_stride(typename K::StrideC{}, {s.m, s.n, 1});
  args.epilogue.ptr_D = d;
  args.epilogue.dD = cutlass::make_cute_packed_stride(typename K::StrideD{}, {s.m, s.n, 1});
  auto& fusion = args.epilogue.thread;
  if constexpr (kFp8) {
    fusion.op_0.scalars[0] = 0.f;
    flux_jax::cuda::GemmInstanceFp8<F8, E, 128, 2, true>::Scale::Set(fusion.op_2, one, one, one);
  } else {
    fusion.alpha = 1.f;
    fusion.alpha_ptr = one;
    fusion.dAlpha = {cute::_0{}, cute::_0{}, 1};
    fusion.beta = 0.f;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  args.hw_info.sm_count = prop.multiProcessorCount;
  args.scheduler.max_swizzle_size = v.swizzle;
  using R = typename K::TileScheduler::RasterOrderOptions;
  args.scheduler.raster_order = v.heuristic ? R::Heuristic : R::AlongN;
  if constexpr (U::kRotated) args.scheduler.group_m_tiles = v.swizzle == 1 ? 1 : 8;  // sw1: plain raster along N
  auto g = std::make_shared<typename U::Gemm>();
  if (g->can_implement(args) != cutlass::Status::kSuccess || U::Gemm::get_workspace_size(args) > ws_bytes ||
      g->initialize(args, ws) != cutlass::Status::kSuccess)
    return {};
  return [g] { g->run(); };
}

// The columns `<what>_<tile>` of Instance on a and b: unhooked, each hook put back alone (kEachHook), all three.
template <class Instance, bool kFp8, bool kEachHook = true>
void AddHookColumns(std::vector<Config>* out, const char* tile, const void* a, const void* b, E* d, const float* one,
                    void* ws, size_t ws_bytes) {
  static std::deque<std::string> names;  // Config.name points into these
  auto add = [&](const char* what, auto hooks) {
    using U = Unhooked<Instance, decltype(hooks)::value>;
    names.push_back(std::string(what) + "_" + tile);
    out->push_back({names.back().c_str(), [=](const SweepShape& s, Variant v) {
                      return MakeUnhooked<U, kFp8>(s, a, b, d, one, ws, ws_bytes, v);
                    }});
  };
  add("unhooked", std::integral_constant<int, kNoHooks>{});
  if constexpr (kEachHook) {
    add("mainloop_hook", std::integral_constant<int, kMainloopHook>{});
    add("epilogue_hook", std::integral_constant<int, kEpilogueHook>{});
    add("scheduler_hook", std::integral_constant<int, kSchedulerHook>{});
  }
  add("all_hooks", std::integral_constant<int, kMainloopHook | kEpilogueHook | kSchedulerHook>{});
}

// Our instance of `base` (block_n, cluster, schedule; FP8 or not) on s, its variant read as the header says.
Runner MakeOurs(flux_jax::cuda::GemmPlan base, const SweepShape& s, const void* x, const void* w, E* d,
                const float* one, Variant v) {
  base.m = s.m;
  base.n = s.n;
  base.k = s.k;
  base.a = x;
  base.b = w;
  base.d = d;
  base.alpha_ptr = v.swizzle == 1 && v.heuristic ? nullptr : one;
  base.group_m_tiles = !v.heuristic && v.swizzle == 1 ? 1 : (v.heuristic && v.swizzle == 8 ? 16 : 8);
  base.serpentine = base.group_m_tiles > 1;  // the product's order
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  if (!flux_jax::cuda::RunGemm(base, flux_jax::DType::kBF16, nullptr, 0, sms).ok()) return {};
  return [base, sms] { flux_jax::cuda::RunGemm(base, flux_jax::DType::kBF16, nullptr, 0, sms); };
}

flux_jax::cuda::GemmPlan Instance(int block_n, int cluster_m, bool pingpong, bool fp8, const float* scales) {
  flux_jax::cuda::GemmPlan p;
  p.block_n = block_n;
  p.cluster_m = cluster_m;
  p.pingpong = pingpong;
  p.b_kmajor = fp8;
  p.fp8 = fp8;
  p.row_scale = scales;
  p.col_scale = scales;
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  // The GEMM instances set their shared-memory size when loaded (as the workspace does); a launch
  // before that fails and every configuration of ours would read as rejected.
  if (!flux_jax::cuda::PreloadGemmKernels().ok()) {
    std::printf("loading the GEMM instances failed\n");
    return 1;
  }
  std::vector<Shape> parsed = {
      {2048, 2560, 5120, ""}, {2048, 8192, 5120, ""}, {2048, 6912, 5120, ""}, {2048, 4096, 3072, ""},
      {4096, 3072, 4608, ""}, {8192, 2048, 4096, ""}, {8192, 8192, 8192, ""},
  };
  if (argc > 1) {
    parsed.clear();
    if (!ParseShapes(argc, argv, 1, &parsed)) return 2;
  }
  std::vector<SweepShape> shapes;
  size_t max_rows = 0;
  for (const Shape& s : parsed) {
    shapes.push_back({s.m, s.k, s.n});
    max_rows = std::max({max_rows, (size_t)s.m, (size_t)s.n});
  }
  constexpr size_t kWsBytes = size_t{64} << 20;
  const ProbeBuffers buf(parsed, kWsBytes);
  std::vector<float> ones(max_rows, 1.f);
  float* scales;  // alpha and the FP8 row / column scales: all 1
  cudaMalloc(&scales, max_rows * sizeof(float));
  cudaMemcpy(scales, ones.data(), max_rows * sizeof(float), cudaMemcpyHostToDevice);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  printf("%s, %d SMs; ours: sw1,N = groups of 1, sw8,N = groups of 8, sw1,H = 8 + scalar alpha, sw8,H = 16\n",
         prop.name, prop.multiProcessorCount);

  // bf16: X[M, K] W[K, N] (W N-major), against cuBLAS.
  const E *x = buf.x, *w = buf.w;
  Cublas cublas;
  const bool have_cublas = cublas.Load();
  auto cublas_ref = [&](const SweepShape& s, E* out) -> Runner {
    if (!have_cublas || cublas.Run(s.m, s.n, s.k, x, w, out) != 0) return {};
    return [&cublas, s, x, w, out] { cublas.Run(s.m, s.n, s.k, x, w, out); };
  };
  auto ours = [&](const char* name, flux_jax::cuda::GemmPlan base, const void* a, const void* b) {
    return Config{name, [=](const SweepShape& s, Variant v) { return MakeOurs(base, s, a, b, buf.d, scales, v); }};
  };
  std::vector<Config> bf16 = {
      {"plain_pp_128x128_c2x1",
       [&](const SweepShape& s, Variant v) {
         return MakePlain<PlainBf16Pp>(s.m, s.n, s.k, x, w, buf.d, buf.ws, kWsBytes, v);
       }},
      {"unhooked_pp_128x128_c2x1",
       [&](const SweepShape& s, Variant v) {
         return MakeUnhooked<UnhookedBf16Pp, false>(s, x, w, buf.d, scales, buf.ws, kWsBytes, v);
       }},
      ours("ours_pp_128x128_c2x1", Instance(128, 2, true, false, scales), x, w),
      {"plain_coop_128x256",
       [&](const SweepShape& s, Variant v) {
         return MakePlain<PlainBf16Coop>(s.m, s.n, s.k, x, w, buf.d, buf.ws, kWsBytes, v);
       }},
  };
  AddHookColumns<Bf16CoopInstance, false>(&bf16, "coop_128x256", x, w, buf.d, scales, buf.ws, kWsBytes);
  bf16.push_back(ours("ours_coop_128x256", Instance(256, 1, false, false, scales), x, w));
  bf16.push_back({"plain_coop_128x256_c2x1", [&](const SweepShape& s, Variant v) {
                    return MakePlain<PlainBf16CoopC2>(s.m, s.n, s.k, x, w, buf.d, buf.ws, kWsBytes, v);
                  }});
  AddHookColumns<Bf16CoopC2Instance, false, false>(&bf16, "coop_128x256_c2x1", x, w, buf.d, scales, buf.ws, kWsBytes);
  bf16.push_back(CublasLtAutotunedBf16(x, w, buf.d));
  printf("bf16: us per call (best of 7 loops, min of 2 passes); ratio = config / cuBLAS\n");
  RunSweep("bf16", "cuBLAS", shapes, 650.0, cublas_ref, bf16, buf.d, buf.d2, buf.acc);

  // FP8: X[M, K] W[N, K]^T, both e4m3, refilled into the bf16 buffers, against plain CUTLASS.
  size_t max_mk = 0, max_nk = 0;
  for (const SweepShape& s : shapes) {
    max_mk = std::max(max_mk, (size_t)s.m * s.k);
    max_nk = std::max(max_nk, (size_t)s.n * s.k);
  }
  Fill<<<1024, 256>>>(reinterpret_cast<F8*>(buf.x), max_mk, 3);
  Fill<<<1024, 256>>>(reinterpret_cast<F8*>(buf.w), max_nk, 4);
  auto xf = reinterpret_cast<const F8*>(buf.x);
  auto wf = reinterpret_cast<const F8*>(buf.w);
  auto plain_ref = [&](const SweepShape& s, E* out) -> Runner {
    return MakePlain<PlainFp8Pp>(s.m, s.n, s.k, xf, wf, out, buf.ws, kWsBytes, kVariants[0]);
  };
  std::vector<Config> fp8 = {
      {"plain_pp_128x128_c2x1_fastaccum",
       [&](const SweepShape& s, Variant v) {
         return MakePlain<PlainFp8Pp>(s.m, s.n, s.k, xf, wf, buf.d, buf.ws, kWsBytes, v);
       }},
  };
  AddHookColumns<Fp8PpInstance, true>(&fp8, "pp_128x128_c2x1", xf, wf, buf.d, scales, buf.ws, kWsBytes);
  fp8.push_back(ours("ours_pp_128x128_c2x1", Instance(128, 2, true, true, scales), xf, wf));
  fp8.push_back(ours("ours_coop_128x256", Instance(256, 1, false, true, scales), xf, wf));
  printf("fp8: us per call (best of 7 loops, min of 2 passes); ratio = config / plain pp 128x128 2x1 sw1,N\n");
  RunSweep("fp8", "plain", shapes, 1200.0, plain_ref, fp8, buf.d, buf.d2, buf.acc);
  const cudaError_t err = cudaDeviceSynchronize();
  printf("%s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
