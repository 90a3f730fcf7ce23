// tile_sweep's FP8 section: cuBLASLt (the FP8 matmul XLA calls: e4m3 operands, f32 compute and scale, fast
// accumulation) against plain CUTLASS sm90 configurations on D[M, N] = X[M, K] W[N, K]^T, X and W e4m3 row-major
// (both K-major, as Hopper's FP8 wgmma needs), D bf16, per-tensor scales 1, persistent tile scheduler.
// The check's reference accumulates fast: CUTLASS's fastaccum configurations matched it bit for bit on an H200, the
// others differed by 0.4-1.7e-2 at K = 2048-8192 (the reference's error, near the 2e-2 bar: at larger K they may
// read FAILED for that reason alone).
//
// cuBLASLt is loaded with dlopen (no cuBLAS headers here, so the few declarations below are written out, ABI-stable
// since CUDA 12.0): FLUX_PROBE_CUBLASLT if set, else FLUX_PROBE_CUBLAS with libcublas renamed libcublasLt (the same
// directory), else libcublasLt.so from the loader's search path.
#include <string>

#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED  // m64n160 atoms
#include "tile_sweep.cuh"

namespace {

using F8 = cutlass::float_e4m3_t;

// cuBLASLt's declarations used (statuses as int: 0 = CUBLAS_STATUS_SUCCESS).
using LtHandle = void*;
using LtDesc = void*;
using LtLayout = void*;
using LtPref = void*;
struct LtAlgo {  // cublasLtMatmulAlgo_t
  uint64_t data[8];
};
struct LtHeuristic {  // cublasLtMatmulHeuristicResult_t
  LtAlgo algo;
  size_t workspace_size;
  int state;
  float waves_count;
  int reserved[4];
};
using LtCreateFn = int (*)(LtHandle*);
using LtDescCreateFn = int (*)(LtDesc*, int, cudaDataType);
using LtDescSetFn = int (*)(LtDesc, int, const void*, size_t);
using LtLayoutCreateFn = int (*)(LtLayout*, cudaDataType, uint64_t, uint64_t, int64_t);
using LtPrefCreateFn = int (*)(LtPref*);
using LtPrefSetFn = int (*)(LtPref, int, const void*, size_t);
using LtHeuristicFn = int (*)(LtHandle, LtDesc, LtLayout, LtLayout, LtLayout, LtLayout, LtPref, int, LtHeuristic*,
                              int*);
using LtMatmulFn = int (*)(LtHandle, LtDesc, const void*, const void*, LtLayout, const void*, LtLayout, const void*,
                           const void*, LtLayout, void*, LtLayout, const LtAlgo*, void*, size_t, cudaStream_t);
using LtDestroyFn = int (*)(void*);
constexpr int kLtTransA = 3;            // CUBLASLT_MATMUL_DESC_TRANSA (int32 cublasOperation_t)
constexpr int kLtTransB = 4;            // CUBLASLT_MATMUL_DESC_TRANSB
constexpr int kLtFastAccum = 25;        // CUBLASLT_MATMUL_DESC_FAST_ACCUM (int8)
constexpr int kLtPrefMaxWorkspace = 1;  // CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES (uint64)
constexpr int kOpT = 1;                 // CUBLAS_OP_T
constexpr size_t kLtWsBytes = size_t{32} << 20;

// The matmul XLA's FP8 dot runs: in column-major terms D^T[N, M] = W[N, K] X^T[K, M], with W as cuBLASLt's A
// (stored K x N, ld K, transposed: FP8 needs this "TN" form) and X as its B (K x M, ld K). One plan per shape (its
// descriptors and the heuristic's first algorithm), so that the timed loop only launches.
struct CublasLt {
  LtHandle handle = nullptr;
  LtDescCreateFn desc_create = nullptr;
  LtDescSetFn desc_set = nullptr;
  LtLayoutCreateFn layout_create = nullptr;
  LtPrefCreateFn pref_create = nullptr;
  LtPrefSetFn pref_set = nullptr;
  LtHeuristicFn heuristic = nullptr;
  LtMatmulFn matmul = nullptr;
  LtDestroyFn desc_destroy = nullptr, layout_destroy = nullptr, pref_destroy = nullptr;
  void* ws = nullptr;

  bool Load() {
    std::string path = "libcublasLt.so";
    if (const char* lt = std::getenv("FLUX_PROBE_CUBLASLT")) {
      path = lt;
    } else if (const char* blas = std::getenv("FLUX_PROBE_CUBLAS")) {
      path = blas;
      const size_t at = path.rfind("libcublas");
      if (at != std::string::npos) path.insert(at + 9, "Lt");
    }
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) {
      printf("cuBLASLt not loaded (%s): set FLUX_PROBE_CUBLAS (or FLUX_PROBE_CUBLASLT) and LD_LIBRARY_PATH\n",
             dlerror());
      return false;
    }
    auto sym = [&](const char* name) { return dlsym(lib, name); };
    auto create = reinterpret_cast<LtCreateFn>(sym("cublasLtCreate"));
    desc_create = reinterpret_cast<LtDescCreateFn>(sym("cublasLtMatmulDescCreate"));
    desc_set = reinterpret_cast<LtDescSetFn>(sym("cublasLtMatmulDescSetAttribute"));
    layout_create = reinterpret_cast<LtLayoutCreateFn>(sym("cublasLtMatrixLayoutCreate"));
    pref_create = reinterpret_cast<LtPrefCreateFn>(sym("cublasLtMatmulPreferenceCreate"));
    pref_set = reinterpret_cast<LtPrefSetFn>(sym("cublasLtMatmulPreferenceSetAttribute"));
    heuristic = reinterpret_cast<LtHeuristicFn>(sym("cublasLtMatmulAlgoGetHeuristic"));
    matmul = reinterpret_cast<LtMatmulFn>(sym("cublasLtMatmul"));
    desc_destroy = reinterpret_cast<LtDestroyFn>(sym("cublasLtMatmulDescDestroy"));
    layout_destroy = reinterpret_cast<LtDestroyFn>(sym("cublasLtMatrixLayoutDestroy"));
    pref_destroy = reinterpret_cast<LtDestroyFn>(sym("cublasLtMatmulPreferenceDestroy"));
    if (!create || !desc_create || !desc_set || !layout_create || !pref_create || !pref_set || !heuristic || !matmul ||
        !desc_destroy || !layout_destroy || !pref_destroy || create(&handle) != 0) {
      printf("cuBLASLt symbols or handle missing\n");
      return false;
    }
    cudaMalloc(&ws, kLtWsBytes);
    return true;
  }

  // A plan for one shape; shared by the runners made from it, destroyed with the last one.
  struct Plan {
    const CublasLt* lt;
    LtDesc desc = nullptr;
    LtLayout a = nullptr, b = nullptr, c = nullptr;
    LtAlgo algo{};
    ~Plan() {
      if (desc) lt->desc_destroy(desc);
      for (LtLayout l : {a, b, c})
        if (l) lt->layout_destroy(l);
    }
  };

  // A runner of D[m, n] = X[m, k] W[n, k]^T for one shape; empty if cuBLASLt offers no algorithm or fails.
  Runner Make(int m, int n, int k, const F8* x, const F8* w, E* d) const {
    auto p = std::make_shared<Plan>();
    p->lt = this;
    const int32_t op_t = kOpT;
    const int8_t fast = 1;
    const uint64_t ws_bytes = kLtWsBytes;
    if (desc_create(&p->desc, kCompute32F, CUDA_R_32F) != 0 || desc_set(p->desc, kLtTransA, &op_t, sizeof op_t) != 0 ||
        desc_set(p->desc, kLtFastAccum, &fast, sizeof fast) != 0 ||
        layout_create(&p->a, CUDA_R_8F_E4M3, k, n, k) != 0 || layout_create(&p->b, CUDA_R_8F_E4M3, k, m, k) != 0 ||
        layout_create(&p->c, CUDA_R_16BF, n, m, n) != 0) {
      printf("cuBLASLt descriptors failed\n");
      return {};
    }
    LtPref pref = nullptr;
    LtHeuristic result{};
    int found = 0;
    const bool ok = pref_create(&pref) == 0 && pref_set(pref, kLtPrefMaxWorkspace, &ws_bytes, sizeof ws_bytes) == 0 &&
                    heuristic(handle, p->desc, p->a, p->b, p->c, p->c, pref, 1, &result, &found) == 0 && found > 0;
    if (pref) pref_destroy(pref);
    if (!ok) {
      printf("cuBLASLt has no FP8 algorithm for %dx%dx%d\n", m, k, n);
      return {};
    }
    p->algo = result.algo;
    void* lt_ws = ws;
    auto run = [p, lt_ws, x, w, d] {
      const float one = 1.f, zero = 0.f;
      return p->lt->matmul(p->lt->handle, p->desc, &one, w, p->a, x, p->b, &zero, d, p->c, d, p->c, &p->algo, lt_ws,
                           kLtWsBytes, nullptr);
    };
    if (run() != 0) {
      printf("cuBLASLt matmul failed for %dx%dx%d\n", m, k, n);
      return {};
    }
    return [run] { run(); };
  }
};

template <int TM, int TN, int CLM, int CLN, bool kPingpong = false, bool kFastAccum = false>
using Fp8 = PlainGemmT<F8, RM, CM, RM, TM, TN, CLM, CLN, cutlass::gemm::PersistentScheduler, kPingpong, kFastAccum>;

template <class I>
Config Make(const char* name, const F8* x, const F8* w, E* d, void* ws, size_t ws_bytes) {
  return {name, [=](const SweepShape& s, Variant v) { return MakePlain<I>(s.m, s.n, s.k, x, w, d, ws, ws_bytes, v); }};
}

}  // namespace

void SweepFp8(const std::vector<SweepShape>& shapes) {
  size_t max_mk = 0, max_nk = 0, max_mn = 0;
  for (const SweepShape& s : shapes) {
    max_mk = std::max(max_mk, (size_t)s.m * s.k);
    max_nk = std::max(max_nk, (size_t)s.n * s.k);
    max_mn = std::max(max_mn, (size_t)s.m * s.n);
  }
  constexpr size_t kWsBytes = size_t{64} << 20;
  F8 *x, *w;
  E *d, *ref_d;
  void* ws;
  unsigned* acc;
  cudaMalloc(&x, max_mk);
  cudaMalloc(&w, max_nk);
  cudaMalloc(&d, max_mn * 2);
  cudaMalloc(&ref_d, max_mn * 2);
  cudaMalloc(&ws, kWsBytes);
  cudaMalloc(&acc, 8);
  Fill<<<1024, 256>>>(x, max_mk, 3);
  Fill<<<1024, 256>>>(w, max_nk, 4);
  CublasLt lt;
  const bool have_lt = lt.Load();
  auto make_ref = [&](const SweepShape& s, E* out) -> Runner {
    return have_lt ? lt.Make(s.m, s.n, s.k, x, w, out) : Runner{};
  };
  // Tile K 128 (one 128-byte row of e4m3). Without fast accumulation the mainloop keeps a second f32 accumulator to
  // promote into every 4 k-blocks: with 128 accumulators per thread (a 64x256 or 128x128 warpgroup tile) the two no
  // longer fit in registers and spill (ptxas: 128x256 and 256x128 cooperative, 128x128 and 64x256 ping-pong), so
  // those shapes run only with fast accumulation ("fastaccum": no second accumulator, what cuBLASLt runs under XLA).
  const std::vector<Config> configs = {
      Make<Fp8<128, 128, 2, 1>>("coop_128x128_c2x1", x, w, d, ws, kWsBytes),
      Make<Fp8<128, 128, 1, 2>>("coop_128x128_c1x2", x, w, d, ws, kWsBytes),
      Make<Fp8<128, 256, 1, 1, false, true>>("coop_128x256_c1x1_fastaccum", x, w, d, ws, kWsBytes),
      Make<Fp8<128, 128, 2, 1, false, true>>("coop_128x128_c2x1_fastaccum", x, w, d, ws, kWsBytes),
      Make<Fp8<256, 128, 1, 2, false, true>>("coop_256x128_c1x2_fastaccum", x, w, d, ws, kWsBytes),
      Make<Fp8<128, 128, 1, 2, true, true>>("pp_128x128_c1x2_fastaccum", x, w, d, ws, kWsBytes),
      Make<Fp8<64, 256, 1, 1, true, true>>("pp_64x256_c1x1_fastaccum", x, w, d, ws, kWsBytes),
      Make<Fp8<128, 128, 2, 1, true, true>>("pp_128x128_c2x1_fastaccum", x, w, d, ws, kWsBytes),
      Make<Fp8<256, 160, 2, 1, false, true>>("coop_256x160_c2x1_fastaccum", x, w, d, ws, kWsBytes),
      Make<PlainWideGemmT<F8, CM, 128, 320, 160, 2>>("coop_128x320_c2x1_fastaccum", x, w, d, ws, kWsBytes),
  };
  printf("fp8: us per call (best of 7 loops, min of 2 passes); ratio = config / cuBLASLt (fast accumulation)\n");
  RunSweep("fp8", "cuBLASLt", shapes, 1200.0, make_ref, configs, d, ref_d, acc);
}
