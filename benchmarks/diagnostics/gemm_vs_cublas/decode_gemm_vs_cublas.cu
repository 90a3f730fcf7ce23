// Decode-sized GEMMs (8-1024 rows): our GEMMs against cuBLAS and against what else could stream
// the weight. At these M a per-GPU GEMM is bound by reading the weight; the decode path's GEMM
// (decode_gemm.cuh: nvjet's orientation, the weight's columns along the tile's M) exists so that
// it reads the weight as fast as cuBLAS. Times, on one GPU, with the same event timer for every
// variant:
//   cuBLAS          cublasGemmEx's own heuristic (XLA autotunes among cuBLASLt algorithms too)
//   read W          a plain kernel reading the weight once: the bandwidth roof
//   decode gemm     our decode path's GEMM (RunDecodeGemm, no exchange), at M <= 256
//   ours 256        our overlap GEMM (the gated kernel), nothing gated
//   swap*           nvjet's orientation D^T = W^T X^T: the weight's columns along the tile's M
//                   (128 or 64), X's rows along its N (64 / 128 / 256), so 64 rows waste nothing
//   ours*           our orientation with 128-row tiles (half empty at M = 64: TMA zero-fills)
//   SK h / sN       CUTLASS's stream-K scheduler (cooperative only): its heuristic, or split-K
//                   forced to N splits (f32 partials in the workspace, reduced by the last split)
//   PP              ping-pong, one 64-row tile per warpgroup, persistent
// The stream-K variants re-initialize every call (their locks count up and never reset); the
// "init" line times that alone, so it can be subtracted: a fused kernel would use epoch flags.
// Every variant's first call is checked against cuBLAS (poisoned output, max |diff| / max |value|).
// Columns: us per call (best of 7 loops), its ratio to cuBLAS, the weight's bytes per second.
//
//   decode_gemm_vs_cublas                 # M = 64-1024 at LLaMA 8B / 70B layers, every variant
//   decode_gemm_vs_cublas --small-m       # M = 8-128, the ping-pong variants only
//   decode_gemm_vs_cublas --narrow-n      # AG at K = N = 8192 (4096 columns per rank), ping-pong only
//   decode_gemm_vs_cublas [--small-m] 64x8192x5120 ...   # per-GPU MxKxN shapes instead
//
// cuBLAS is loaded with dlopen: FLUX_PROBE_CUBLAS and LD_LIBRARY_PATH as in gemm_vs_cublas.cu.
#include <string>
#include <vector>

#include "cublas_loader.cuh"
#include "decode_gemm.h"
#include "gemm_plan.h"

namespace {

using cutlass::gemm::PersistentScheduler;
using cutlass::gemm::StreamKScheduler;
using SKMode = cutlass::gemm::kernel::detail::DecompositionMode;

// D^T[N, M] = W^T X^T: CUTLASS problem (N, M, K), A = W (column-major N x K), B = X (K-major).
using SwapSK64 = PlainGemm<CM, CM, CM, 128, 64, 1, StreamKScheduler>;
using SwapSK128 = PlainGemm<CM, CM, CM, 128, 128, 1, StreamKScheduler>;
using SwapPP64 = PlainGemm<CM, CM, CM, 64, 64, 1, PersistentScheduler, true>;
using SwapPP128 = PlainGemm<CM, CM, CM, 64, 128, 1, PersistentScheduler, true>;
using Swap256 = PlainGemm<CM, CM, CM, 128, 256, 1, PersistentScheduler>;
// D[M, N] = X W in our orientation.
using OursSK64 = PlainGemm<RM, RM, RM, 128, 64, 1, StreamKScheduler>;
using OursSK128 = PlainGemm<RM, RM, RM, 128, 128, 1, StreamKScheduler>;

// Reads n 16-byte words once (no L1 allocation) and keeps the result alive through *sink.
__global__ void ReadAll(const uint4* p, size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p + i));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

bool RunOurs(int m, int n, int k, const E* a, const E* b, E* d, const float* one, int sms) {
  flux_jax::cuda::GemmPlan p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.a = a;
  p.b = b;
  p.d = d;
  p.alpha_ptr = one;
  p.group_m_tiles = 8;
  p.block_n = 256;
  return flux_jax::cuda::RunGemm(p, flux_jax::DType::kBF16, 0, 0, sms).ok();
}

// The decode path's own GEMM (decode_gemm.cuh), nothing to wait for.
bool RunDecode(int m, int n, int k, const E* x, const E* w, E* d, const float* one, int sms) {
  flux_jax::cuda::DecodeGemmPlan p;
  p.rows = m;
  p.n = n;
  p.k = k;
  p.x = x;
  p.w = w;
  p.d = d;
  p.alpha_ptr = one;
  p.x_rows_readable = flux_jax::cuda::DecodeRowsReadable(m);  // x holds that many rows
  return flux_jax::cuda::RunDecodeGemm(p, flux_jax::DType::kBF16, 0, 0, sms).ok();
}

// A CUTLASS variant set up once: plain persistent, or stream-K in a mode with `splits`.
template <class I>
struct Variant {
  typename I::Kernel::Arguments args;
  typename I::Gemm gemm;
  bool stream_k = false;
  void* ws = nullptr;
  // Returns 0, or a negative code (-1 cannot implement, -2 init failed, -3 workspace too small).
  int Setup(int m, int n, int k, const E* a, const E* b, E* d, void* workspace, size_t ws_bytes, int splits,
            bool heuristic) {
    args = PlainArguments<typename I::Kernel>(m, n, k, a, b, d);
    args.scheduler.max_swizzle_size = 1;
    ws = workspace;
    if constexpr (std::is_same_v<typename I::Kernel::TileSchedulerTag, StreamKScheduler>) {
      stream_k = true;
      args.scheduler.splits = splits;
      args.scheduler.decomposition_mode = heuristic ? SKMode::Heuristic : SKMode::SplitK;
    }
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return -1;
    if (I::Gemm::get_workspace_size(args) > ws_bytes) return -3;
    if (gemm.initialize(args, ws) != cutlass::Status::kSuccess) return -2;
    return 0;
  }
  void Run() {
    if (stream_k) gemm.initialize(args, ws);
    gemm.run();
  }
  void Init() { gemm.initialize(args, ws); }
};

template <class T>
struct Tag {
  using type = T;
};

struct Row {
  const char* name;
  float us;
  float check;
};

}  // namespace

int main(int argc, char** argv) {
  // Per-GPU GEMMs at TP = 2 (AG: all M rows x N / 2 columns; RS: all M rows x K / 2).
  std::vector<Shape> shapes;
  const bool narrow_n = argc > 1 && std::string(argv[1]) == "--narrow-n";
  const bool small_m = narrow_n || (argc > 1 && std::string(argv[1]) == "--small-m");
  const int first_shape = small_m ? 2 : 1;
  if (argc > first_shape) {
    if (!ParseShapes(argc, argv, first_shape, &shapes)) return 2;
  } else if (narrow_n) {  // AG at K = N = 8192: 4096 columns per rank, 64 tiles of 64
    for (int m : {16, 64, 128, 256}) shapes.push_back({m, 8192, 4096, "AG 8192^2"});
    for (int m : {64, 128}) shapes.push_back({m, 8192, 5120, "70B qkv"});
  } else if (small_m) {  // how the time moves below 64 rows (the decode path at M = 8-32)
    for (int m : {8, 16, 32, 64, 128}) shapes.push_back({m, 8192, 5120, "70B qkv"});
    for (int m : {8, 16, 64}) shapes.push_back({m, 8192, 28672, "70B gate+up"});
    for (int m : {8, 64}) shapes.push_back({m, 4096, 3072, "8B qkv"});
  } else {
    for (int m : {64, 128, 256, 512, 1024}) shapes.push_back({m, 8192, 5120, "70B qkv"});
    for (int m : {64, 128, 256, 512, 1024}) shapes.push_back({m, 4096, 8192, "70B out"});
    for (int m : {64, 256, 1024}) shapes.push_back({m, 4096, 3072, "8B qkv"});
    for (int m : {64, 256}) shapes.push_back({m, 2048, 4096, "8B out"});
    for (int m : {64, 256}) shapes.push_back({m, 8192, 28672, "70B gate+up"});
    for (int m : {64, 256}) shapes.push_back({m, 14336, 8192, "70B down"});
  }
  constexpr size_t kWsBytes = size_t{512} << 20;
  const ProbeBuffers buf(shapes, kWsBytes);
  E *x = buf.x, *w = buf.w, *d = buf.d, *d2 = buf.d2;
  void* ws = buf.ws;
  float* one;
  cudaMalloc(&one, 4);
  const float h1 = 1.f;
  cudaMemcpy(one, &h1, 4, cudaMemcpyHostToDevice);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  const int sms = prop.multiProcessorCount;
  Cublas cublas;
  if (!cublas.Load()) return 1;
  if (!flux_jax::cuda::PreloadDecodeGemmKernels().ok()) return 1;

  printf("# %s, %d SMs; us per call = best of 7 loops of back-to-back launches\n", prop.name, sms);
  printf("%-12s %5s %5s %5s  %-12s %8s %7s %7s  %s\n", "layer", "M", "K", "N", "variant", "us", "/cuBLAS", "W TB/s",
         "check");
  for (int pass = 0; pass < 2; ++pass) {
    for (const Shape& s : shapes) {
      const int M = s.m, K = s.k, N = s.n;
      const double wbytes = 2.0 * K * N;
      cudaMemset(d, 0xff, (size_t)M * N * 2);
      if (cublas.Run(M, N, K, x, w, d) != 0) {
        printf("cuBLAS failed\n");
        return 1;
      }
      const float t_cublas0 = BestUsPerCall([&] { cublas.Run(M, N, K, x, w, d); }, 10, 1);
      const int it = std::max(10, std::min(400, (int)(3000.f / t_cublas0)));
      std::vector<Row> rows;
      auto check = [&](auto&& launch) {
        if (pass != 0) return -1.f;
        cudaMemset(d2, 0xff, (size_t)M * N * 2);
        launch();
        return RelativeDiff(d2, d, (size_t)M * N, buf.acc);
      };
      rows.push_back({"cuBLAS", BestUsPerCall([&] { cublas.Run(M, N, K, x, w, d); }, it, 7), 0.f});
      rows.push_back(
          {"read W",
           BestUsPerCall(
               [&] { ReadAll<<<sms * 4, 512>>>(reinterpret_cast<const uint4*>(w), (size_t)K * N / 8, buf.acc); }, it,
               7),
           -1.f});
      {
        const float c = check([&] { RunOurs(M, N, K, x, w, d2, one, sms); });
        rows.push_back({"ours 256", BestUsPerCall([&] { RunOurs(M, N, K, x, w, d, one, sms); }, it, 7), c});
      }
      // swap = true: CUTLASS problem (N, M, K) with A = W, B = X.
      auto add = [&](auto tag, const char* name, bool swap, int splits, bool heuristic) {
        using I = typename decltype(tag)::type;
        Variant<I> v;
        const int rc = swap ? v.Setup(N, M, K, w, x, d2, ws, kWsBytes, splits, heuristic)
                            : v.Setup(M, N, K, x, w, d2, ws, kWsBytes, splits, heuristic);
        if (rc != 0) {
          rows.push_back({name, (float)rc, -1.f});
          return;
        }
        const float c = check([&] { v.Run(); });
        rows.push_back({name, BestUsPerCall([&] { v.Run(); }, it, 7), c});
        if (v.stream_k && splits == 2 && !heuristic && swap)
          rows.push_back({"  (SK init)", BestUsPerCall([&] { v.Init(); }, it, 7), -1.f});
      };
      if (flux_jax::cuda::HasDecodeGemm(flux_jax::DType::kBF16, /*w_transposed=*/false, M)) {
        const float c = check([&] { RunDecode(M, N, K, x, w, d2, one, sms); });
        rows.push_back({"decode gemm", BestUsPerCall([&] { RunDecode(M, N, K, x, w, d, one, sms); }, it, 7), c});
      }
      if (small_m) {
        add(Tag<SwapPP64>{}, "swapPP64", true, 1, false);
        add(Tag<SwapPP128>{}, "swapPP128", true, 1, false);
      } else {
        add(Tag<SwapSK64>{}, "swapSK64 h", true, 1, true);
        add(Tag<SwapSK64>{}, "swapSK64 s2", true, 2, false);
        add(Tag<SwapSK64>{}, "swapSK64 s4", true, 4, false);
        add(Tag<SwapSK128>{}, "swapSK128 h", true, 1, true);
        add(Tag<SwapSK128>{}, "swapSK128 s2", true, 2, false);
        add(Tag<SwapPP64>{}, "swapPP64", true, 1, false);
        add(Tag<SwapPP128>{}, "swapPP128", true, 1, false);
        add(Tag<Swap256>{}, "swap256", true, 1, false);
        add(Tag<OursSK64>{}, "oursSK64 h", false, 1, true);
        add(Tag<OursSK64>{}, "oursSK64 s2", false, 2, false);
        add(Tag<OursSK128>{}, "oursSK128 h", false, 1, true);
      }
      const float base = rows[0].us;
      for (const Row& r : rows) {
        char c[32] = "";
        if (r.check >= 0) snprintf(c, sizeof c, "%.1e", r.check);
        const bool ran = r.us > 0;
        printf("%-12s %5d %5d %5d  %-12s %8.1f %7.3f %7.2f  %s\n", s.what, M, K, N, r.name, r.us,
               ran ? r.us / base : 0.f, ran ? wbytes / (r.us * 1e6) : 0.f, c);
      }
      fflush(stdout);
    }
  }
  printf("%s\n", cudaGetErrorString(cudaDeviceSynchronize()));
  return 0;
}
