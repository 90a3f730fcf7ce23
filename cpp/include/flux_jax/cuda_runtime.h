// Process-wide controls of the CUDA backend (only built with CUDA).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "flux_jax/status.h"

namespace flux_jax {

// Frees every GPU workspace and clears the device error records. Only call
// when no fused op is running.
void ResetCudaWorkspaces();

// Bytes of workspace held on a device (outside XLA's memory pool).
size_t CudaWorkspaceBytes(int device);

// "" if no device-side wait on `device` timed out, else the diagnostic.
std::string CudaDeviceError(int device);

// Cross-process TP groups: set up the member of `ordinal` in the group whose
// ranks are `devices` (global ids) in `processes`, returning its CUDA IPC blob;
// then open a remote rank's blob. Called from flux_jax/_ipc.py before tracing.
Status CudaIpcExport(const std::vector<int64_t>& devices, const std::vector<int64_t>& processes,
                     int32_t ordinal, size_t data_bytes, size_t slot_bytes, std::string* blob);
Status CudaIpcImport(const std::vector<int64_t>& devices, const std::vector<int64_t>& processes,
                     int32_t ordinal, int peer_rank, const std::string& blob);

}  // namespace flux_jax
