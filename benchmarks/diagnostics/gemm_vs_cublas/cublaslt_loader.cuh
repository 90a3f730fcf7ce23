// Shared by tile_sweep's sections: cuBLASLt (what XLA's dots call) loaded with dlopen, one matmul per shape, its
// algorithm the heuristic's first or, as XLA's autotuner does, the fastest of the heuristic's first few.
//
// cuBLASLt is loaded with dlopen (no cuBLAS headers here, so the few declarations below are written out, ABI-stable
// since CUDA 12.0): FLUX_PROBE_CUBLASLT if set, else FLUX_PROBE_CUBLAS with libcublas renamed libcublasLt (the same
// directory), else libcublasLt.so from the loader's search path.
#pragma once

#include <map>
#include <memory>
#include <tuple>
#include <vector>
#include <string>

#include "tile_sweep.cuh"

namespace {

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

// One matmul in cuBLASLt's column-major terms, D[m, n] = op(A)[m, k] B[k, n] (A stored k x m when trans_a, else m x
// k), over packed operands; D is bf16.
struct LtProblem {
  cudaDataType ab_type;
  bool trans_a, fast_accum;
  int m, n, k;
  const void *a, *b;
  E* d;
};

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

  // A runner of problem q; empty if cuBLASLt offers no algorithm or fails. candidates > 1: the fastest of the
  // heuristic's first `candidates` algorithms, each timed from idle (best of 3 loops of 3 calls), as XLA's autotuner
  // picks; its index and the count go to *chosen / *offered. index >= 0: that one of them, untimed.
  Runner Make(const LtProblem& q, int candidates = 1, int* chosen = nullptr, int* offered = nullptr,
              int index = -1) const {
    auto p = std::make_shared<Plan>();
    p->lt = this;
    const int32_t op_t = kOpT;
    const int8_t fast = q.fast_accum ? 1 : 0;
    const uint64_t ws_bytes = kLtWsBytes;
    if (desc_create(&p->desc, kCompute32F, CUDA_R_32F) != 0 ||
        (q.trans_a && desc_set(p->desc, kLtTransA, &op_t, sizeof op_t) != 0) ||
        desc_set(p->desc, kLtFastAccum, &fast, sizeof fast) != 0 ||
        layout_create(&p->a, q.ab_type, q.trans_a ? q.k : q.m, q.trans_a ? q.m : q.k, q.trans_a ? q.k : q.m) != 0 ||
        layout_create(&p->b, q.ab_type, q.k, q.n, q.k) != 0 || layout_create(&p->c, CUDA_R_16BF, q.m, q.n, q.m) != 0) {
      printf("cuBLASLt descriptors failed\n");
      return {};
    }
    LtPref pref = nullptr;
    std::vector<LtHeuristic> results(std::max(candidates, 1));
    int found = 0;
    const bool ok = pref_create(&pref) == 0 && pref_set(pref, kLtPrefMaxWorkspace, &ws_bytes, sizeof ws_bytes) == 0 &&
                    heuristic(handle, p->desc, p->a, p->b, p->c, p->c, pref, static_cast<int>(results.size()),
                              results.data(), &found) == 0 &&
                    found > 0;
    if (pref) pref_destroy(pref);
    if (!ok) {
      printf("cuBLASLt has no algorithm for %dx%dx%d (column-major m x k x n)\n", q.m, q.k, q.n);
      return {};
    }
    void* lt_ws = ws;
    const LtProblem r = q;
    auto run = [p, lt_ws, r] {
      const float one = 1.f, zero = 0.f;
      return p->lt->matmul(p->lt->handle, p->desc, &one, r.a, p->a, r.b, p->b, &zero, r.d, p->c, r.d, p->c, &p->algo,
                           lt_ws, kLtWsBytes, nullptr);
    };
    int best = -1;
    float best_us = 1e30f;
    for (int i = index >= 0 ? std::min(index, found - 1) : 0; i < found; ++i) {
      p->algo = results[i].algo;
      if (run() != 0 || cudaDeviceSynchronize() != cudaSuccess) {
        cudaGetLastError();
        continue;
      }
      if (found == 1 || index >= 0) {
        best = i;
        break;
      }
      const float us = BestUsPerCall([&] { run(); }, 3, 3);
      if (us < best_us) {
        best_us = us;
        best = i;
      }
    }
    if (best < 0) {
      printf("cuBLASLt matmul failed for %dx%dx%d (column-major m x k x n)\n", q.m, q.k, q.n);
      return {};
    }
    p->algo = results[best].algo;
    if (chosen) *chosen = best;
    if (offered) *offered = found;
    return [run] { run(); };
  }
};

// The column `cublaslt_autotuned` of a section: XLA's pick, the fastest of cuBLASLt's first 32 algorithms for
// `problem(shape)` timed from idle, chosen once per shape (printed as an `LT <section>` line) and reused for every
// variant; the kernel XLA's dot runs, where cublasGemmEx (and the FP8 section's reference) take the heuristic's
// first.
template <class ProblemOf>
Config CublasLtAutotuned(const char* section, ProblemOf problem) {
  auto lt = std::make_shared<CublasLt>();
  const bool have_lt = lt->Load();
  auto picked = std::make_shared<std::map<std::tuple<int, int, int>, int>>();
  return {"cublaslt_autotuned", [=](const SweepShape& s, Variant) -> Runner {
            if (!have_lt) return {};
            const LtProblem q = problem(s);
            const auto key = std::make_tuple(s.m, s.k, s.n);
            if (auto it = picked->find(key); it != picked->end()) return lt->Make(q, 32, nullptr, nullptr, it->second);
            int chosen = -1, offered = 0;
            Runner r = lt->Make(q, 32, &chosen, &offered);
            if (r) {
              (*picked)[key] = chosen;
              printf("LT %s %dx%dx%d: algorithm %d of the heuristic's %d\n", section, s.m, s.k, s.n, chosen, offered);
            }
            return r;
          }};
}

// bf16 X[M, K] W[K, N] (W N-major) into d: D^T[N, M] = W^T X^T, as XLA's jnp.dot.
inline Config CublasLtAutotunedBf16(const E* x, const E* w, E* d) {
  return CublasLtAutotuned(
      "bf16", [=](const SweepShape& s) { return LtProblem{CUDA_R_16BF, false, false, s.n, s.m, s.k, w, x, d}; });
}

// e4m3 X[M, K] W[N, K] (both K-major) into bf16 d, fast accumulation: D^T[N, M] = W X^T, XLA's FP8 dot ("TN").
inline Config CublasLtAutotunedFp8(const void* x, const void* w, E* d) {
  return CublasLtAutotuned(
      "fp8", [=](const SweepShape& s) { return LtProblem{CUDA_R_8F_E4M3, true, true, s.n, s.m, s.k, w, x, d}; });
}

}  // namespace
