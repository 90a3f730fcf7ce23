// Shared by the diagnostics that time cuBLAS (what XLA's jnp.dot calls): cuBLAS loaded with dlopen
// (the build needs no cuBLAS headers or libraries; FLUX_PROBE_CUBLAS = libcublas.so.N and its
// directory on LD_LIBRARY_PATH), an agreement check between two outputs, the shapes and buffers.
//
// Row-major D[m, n] = X[m, k] W[k, n] is column-major D^T = W^T X^T: cuBLAS gets (n, m, k) with
// W as its A (leading dimension n) and X as its B (leading dimension k).
#pragma once

#include <dlfcn.h>
#include <library_types.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "plain_cutlass.cuh"

namespace {

// The few cuBLAS declarations used (ABI-stable since CUDA 11).
using CublasHandle = void*;
using CreateFn = int (*)(CublasHandle*);
using SetStreamFn = int (*)(CublasHandle, cudaStream_t);
using GemmExFn = int (*)(CublasHandle, int, int, int, int, int, const void*, const void*, cudaDataType, int,
                         const void*, cudaDataType, int, const void*, void*, cudaDataType, int, int, int);
constexpr int kOpN = 0;           // CUBLAS_OP_N
constexpr int kCompute32F = 68;   // CUBLAS_COMPUTE_32F
constexpr int kGemmDefault = -1;  // CUBLAS_GEMM_DEFAULT

struct Cublas {
  CublasHandle handle = nullptr;
  GemmExFn gemm = nullptr;
  bool Load() {
    const char* path = std::getenv("FLUX_PROBE_CUBLAS");
    void* lib = dlopen(path ? path : "libcublas.so", RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) {
      printf("cuBLAS not loaded (%s): set FLUX_PROBE_CUBLAS and LD_LIBRARY_PATH\n", dlerror());
      return false;
    }
    auto create = reinterpret_cast<CreateFn>(dlsym(lib, "cublasCreate_v2"));
    auto set_stream = reinterpret_cast<SetStreamFn>(dlsym(lib, "cublasSetStream_v2"));
    gemm = reinterpret_cast<GemmExFn>(dlsym(lib, "cublasGemmEx"));
    if (!create || !set_stream || !gemm || create(&handle) != 0 || set_stream(handle, nullptr) != 0) {
      printf("cuBLAS symbols or handle missing\n");
      return false;
    }
    return true;
  }
  int Run(int m, int n, int k, const E* x, const E* w, E* d) const {
    const float one = 1.f, zero = 0.f;
    return gemm(handle, kOpN, kOpN, n, m, k, &one, w, CUDA_R_16BF, n, x, CUDA_R_16BF, k, &zero, d, CUDA_R_16BF, n,
                kCompute32F, kGemmDefault);
  }
};

// max |a - b| / max |b| over n elements (one block-stride pass, atomics on float bits: values >= 0). A NaN difference
// counts as infinite: fmaxf would drop it, and an output left poisoned (0xff bytes: bf16 NaN) would pass.
__global__ void MaxDiff(const E* a, const E* b, size_t n, unsigned* diff, unsigned* mag) {
  float dl = 0.f, ml = 0.f;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float e = fabsf(float(a[i]) - float(b[i]));
    dl = fmaxf(dl, isnan(e) ? INFINITY : e);
    ml = fmaxf(ml, fabsf(float(b[i])));
  }
  atomicMax(diff, __float_as_uint(dl));
  atomicMax(mag, __float_as_uint(ml));
}

// max |a - b| / max |b| over n elements, on the host; acc: two unsigned of device scratch.
float RelativeDiff(const E* a, const E* b, size_t n, unsigned* acc) {
  cudaMemset(acc, 0, 8);
  MaxDiff<<<1024, 256>>>(a, b, n, acc, acc + 1);
  unsigned h[2];
  cudaMemcpy(h, acc, 8, cudaMemcpyDeviceToHost);
  float df, mg;
  memcpy(&df, &h[0], 4);
  memcpy(&mg, &h[1], 4);
  return df / mg;
}

// A per-GPU GEMM (M x K x N) and its label.
struct Shape {
  int m, k, n;
  const char* what;
};

// Shapes given on the command line as MxKxN (labelled "cli"); false if an argument is not one.
bool ParseShapes(int argc, char** argv, int first, std::vector<Shape>* shapes) {
  for (int i = first; i < argc; ++i) {
    Shape s{0, 0, 0, "cli"};
    char tail = 0;
    if (std::sscanf(argv[i], "%dx%dx%d%c", &s.m, &s.k, &s.n, &tail) != 3 || s.m <= 0 || s.k <= 0 || s.n <= 0 ||
        s.k % 8 != 0 || s.n % 8 != 0) {
      printf("not a shape: %s (want MxKxN, K and N multiples of 8)\n", argv[i]);
      return false;
    }
    shapes->push_back(s);
  }
  return true;
}

// Device buffers for the largest of `shapes`: random x and w, outputs d and d2, a CUTLASS
// workspace of ws_bytes and 8 bytes of scratch (acc). Freed at exit. x and w are uniform in
// [-0.5, 0.5), or with SWEEP_FILL=normal as benchmarks/gemm_parity.py makes them (FillNormal; w
// scaled by the largest K).
struct ProbeBuffers {
  E *x = nullptr, *w = nullptr, *d = nullptr, *d2 = nullptr;
  void* ws = nullptr;
  unsigned* acc = nullptr;
  size_t ws_bytes = 0;
  ProbeBuffers(const std::vector<Shape>& shapes, size_t workspace_bytes) : ws_bytes(workspace_bytes) {
    size_t maxe = 0;
    // x: M rounded up to whole 128-row tiles (the decode GEMM may read that many rows).
    for (auto& s : shapes)
      maxe = std::max({maxe, (size_t)(s.m + 127) / 128 * 128 * s.k, (size_t)s.k * s.n, (size_t)s.m * s.n});
    cudaMalloc(&x, maxe * 2);
    cudaMalloc(&w, maxe * 2);
    cudaMalloc(&d, maxe * 2);
    cudaMalloc(&d2, maxe * 2);
    cudaMalloc(&ws, ws_bytes);
    cudaMalloc(&acc, 8);
    const char* fill = std::getenv("SWEEP_FILL");
    if (fill != nullptr && std::strcmp(fill, "normal") == 0) {  // as benchmarks/gemm_parity.py makes them
      int max_k = 1;
      for (auto& s : shapes) max_k = std::max(max_k, s.k);
      FillNormal<<<1024, 256>>>(x, maxe, 1, 1.f);
      FillNormal<<<1024, 256>>>(w, maxe, 2, 1.f / std::sqrt(static_cast<float>(max_k)));
    } else {
      Fill<<<1024, 256>>>(x, maxe, 1);
      Fill<<<1024, 256>>>(w, maxe, 2);
    }
  }
};

}  // namespace
