// CUDA error plumbing: every runtime call returns a Status naming what failed.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "flux_jax/status.h"

namespace flux_jax::cuda {

inline Status CudaStatus(cudaError_t err, const char* what, const char* file, int line) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string("flux_jax CUDA error in ") + what + " (" + file + ":" + std::to_string(line) +
                          "): " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

#define FLUX_CUDA_TRY(expr) FLUX_JAX_RETURN_IF_ERROR(::flux_jax::cuda::CudaStatus((expr), #expr, __FILE__, __LINE__))

// Restores the calling thread's current device on scope exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

}  // namespace flux_jax::cuda
