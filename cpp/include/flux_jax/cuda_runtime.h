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

// "" if no device-side wait on `device` gave up, else the diagnostic: one line per rank of a TP
// group on that GPU whose wait gave up, each naming the rank it waited for (else the GPU's first
// failure, e.g. copied from another GPU of its group).
std::string CudaDeviceError(int device);

// What GpuTuning.gemm_kernel = auto and tile_group_m = 0 resolve to for an m x k x n overlap GEMM
// on `sm_count` SMs with `dram_gbps` GB/s of peak DRAM bandwidth (0: unknown) (op_common.h
// ChooseGemmInstance / ChooseFp8GemmInstance and TileGroupM: the rules themselves, for explain,
// benchmarks and tests): the GemmKernel that forces the chosen instance and the tile group over
// `chunk_rows` rows read in order. `dtype` is the rows': "bfloat16" or "float16" (w [n, k] if
// w_transposed), or "float8_e4m3fn" / "float8_e5m2" (FP8: w [n, k] e4m3).
Status CudaAutoGemmPlan(const std::string& dtype, bool w_transposed, int64_t m, int64_t k, int64_t n,
                        int64_t chunk_rows, int sm_count, int dram_gbps, int64_t* gemm_kernel, int32_t* tile_group_m);

// What the GEMM instance rule reads of GPU `device` (a CUDA ordinal): its SMs and its peak DRAM
// bandwidth in GB/s.
Status CudaGemmRuleInputs(int device, int* sm_count, int* dram_gbps);

// Tests (cpp/tests/loopback): the next growth of a workspace area by rank `rank` of any group fails
// as if its GPU were out of memory (-1: none).
void CudaFailNextWorkspaceGrowthForTesting(int rank);

// Cross-process TP groups: set up the member of `ordinal` in the group whose
// ranks are `devices` (global ids) in `processes`, returning its CUDA IPC blob;
// then open a remote rank's blob. Called from flux_jax/_ipc.py before tracing.
Status CudaIpcExport(const std::vector<int64_t>& devices, const std::vector<int64_t>& processes, int32_t ordinal,
                     size_t data_bytes, size_t slot_bytes, std::string* blob);
Status CudaIpcImport(const std::vector<int64_t>& devices, const std::vector<int64_t>& processes, int32_t ordinal,
                     int peer_rank, const std::string& blob);

}  // namespace flux_jax
