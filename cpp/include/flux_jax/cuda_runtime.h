// Process-wide controls of the CUDA backend (only built with CUDA).
#pragma once

#include <cstddef>
#include <string>

namespace flux_jax {

// Frees every GPU workspace and clears the device error records. Only call
// when no fused op is running.
void ResetCudaWorkspaces();

// Bytes of workspace held on a device (outside XLA's memory pool).
size_t CudaWorkspaceBytes(int device);

// "" if no device-side wait on `device` timed out, else the diagnostic.
std::string CudaDeviceError(int device);

}  // namespace flux_jax
