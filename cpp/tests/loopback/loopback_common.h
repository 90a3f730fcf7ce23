// Shared by the loopback tests: CUDA error checks, host conversions of 16-bit floats, and the
// process setup every loopback program does before its first CUDA call.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#define CHECK_CUDA(expr)                                                                           \
  do {                                                                                             \
    cudaError_t err_ = (expr);                                                                     \
    if (err_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(err_)); \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)

namespace loopback {

// CUDA_DEVICE_MAX_CONNECTIONS (hardware work queues per device): CUDA's default and maximum.
inline constexpr int kDefaultConnections = 8;
inline constexpr int kMaxConnections = 32;

// Sets the process environment for `ranks` ranks sharing one GPU, each issuing work on
// `streams_per_rank` streams. Must run before the first CUDA call (the driver reads both variables
// when it creates the context).
//
// - CUDA_DEVICE_MAX_CONNECTIONS: streams share the device's hardware queues (8 by default). A
//   rank's persistent kernel that spins waiting for a peer blocks every later launch in its queue,
//   so when the peer's launch sits behind it the two wait for each other until the timeout
//   (measured on one H200 at TP 8 with the default 8 queues: thousands of presence timeouts; with
//   32 every normal case passed). The tests use at least 2 x ranks x streams per rank: the user's
//   value (or, unset, CUDA's default) is kept if it is that large, else raised; never more than
//   CUDA's maximum, 32.
// - CUDA_MODULE_LOADING=EAGER (unless set): a lazily loaded kernel's first launch waits until the
//   GPU is idle, which it never is while another rank's kernel spins (flux_jax sets the same on
//   import).
inline void SetUpProcess(int ranks, int streams_per_rank) {
  const int want = 2 * ranks * streams_per_rank;
  const char* user = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const int user_value = user != nullptr ? std::atoi(user) : 0;  // unset, empty or not a number: 0
  const int have = user_value > 0 ? user_value : kDefaultConnections;
  const int use = std::min(std::max(want, have), kMaxConnections);
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", std::to_string(use).c_str(), 1);
  setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  const char* from = user_value > 0 ? "the user's value" : "CUDA's default";
  std::printf(
      "CUDA_DEVICE_MAX_CONNECTIONS=%d (%s %s %d; the tests want 2 x %d ranks x %d stream(s) per rank = %d, "
      "at most %d), CUDA_MODULE_LOADING=%s\n",
      use, use == have ? "kept" : (use > have ? "raised from" : "capped, from"), from, have, ranks, streams_per_rank,
      want, kMaxConnections, std::getenv("CUDA_MODULE_LOADING"));
  std::fflush(stdout);
}

inline float Bf16ToFloat(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as __float2bfloat16_rn (no NaN inputs here).
inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float F16ToFloat(uint16_t v) {
  __half h;
  std::memcpy(&h, &v, 2);
  return __half2float(h);
}

inline uint16_t FloatToF16(float f) {
  const __half h = __float2half_rn(f);
  uint16_t v;
  std::memcpy(&v, &h, 2);
  return v;
}

}  // namespace loopback
