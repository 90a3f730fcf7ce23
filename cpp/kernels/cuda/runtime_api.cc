#include "flux_jax/cuda_runtime.h"

#include "workspace.h"

namespace flux_jax {

void ResetCudaWorkspaces() { cuda::ResetWorkspaces(); }

size_t CudaWorkspaceBytes(int device) { return cuda::WorkspaceBytes(device); }

std::string CudaDeviceError(int device) {
  Status s = cuda::CheckDeviceError(device);
  return s.ok() ? std::string() : s.message();
}

}  // namespace flux_jax
