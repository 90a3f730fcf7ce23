#include "flux_jax/cuda_runtime.h"

#include "flux_jax/tp_group.h"
#include "op_common.h"
#include "workspace.h"

namespace flux_jax {

void ResetCudaWorkspaces() { cuda::ResetWorkspaces(); }

size_t CudaWorkspaceBytes(int device) { return cuda::WorkspaceBytes(device); }

std::string CudaDeviceError(int device) {
  Status s = cuda::CheckDeviceError(device);
  return s.ok() ? std::string() : s.message();
}

Status CudaAutoGemmPlan(const std::string& dtype, bool w_transposed, int64_t m, int64_t k, int64_t n,
                        int64_t chunk_rows, int sm_count, int dram_gbps, int64_t* gemm_kernel, int32_t* tile_group_m) {
  const bool fp8 = dtype == "float8_e4m3fn" || dtype == "float8_e5m2";
  if (dtype != "bfloat16" && dtype != "float16" && !fp8) {
    return Status::InvalidArgument(
        "flux_jax: the overlap GEMM rule takes bfloat16, float16, float8_e4m3fn or float8_e5m2 rows, got " + dtype);
  }
  const DType t = dtype == "float16" ? DType::kF16 : DType::kBF16;  // FP8: bf16 out
  Fp8Operands rows;
  rows.on = fp8;
  rows.x_e5m2 = dtype == "float8_e5m2";
  CommConfig cfg;
  auto choose = [&](cuda::GemmPlan* plan) {
    return fp8 ? cuda::ChooseFp8GemmInstance(cfg, rows, m, k, n, sm_count, dram_gbps, plan)
               : cuda::ChooseGemmInstance(cfg, t, w_transposed, m, n, k, sm_count, dram_gbps, plan);
  };
  cuda::GemmPlan chosen{};
  chosen.m = m;  // TileGroupM reads the problem's size
  chosen.n = n;
  chosen.k = k;
  FLUX_JAX_RETURN_IF_ERROR(choose(&chosen));
  *tile_group_m = cuda::TileGroupM(cfg, chosen, chunk_rows);
  // The forced kernel whose plan is the chosen one: the Choose* switches stay the only map from a
  // GemmKernel to a plan. 128x160_pp_c2x1 last: with e4m3 rows it leaves the rule's choice.
  for (GemmKernel forced :
       {GemmKernel::k128x256, GemmKernel::k128x224, GemmKernel::k128x192, GemmKernel::k128x160Cluster2x1,
        GemmKernel::k128x128PingpongCluster2x1, GemmKernel::k128x320Cluster2x1, GemmKernel::k128x192PingpongCluster2x1,
        GemmKernel::k128x160PingpongCluster2x1}) {
    cfg.tuning.gemm_kernel = static_cast<int64_t>(forced);
    cuda::GemmPlan plan{};
    if (choose(&plan).ok() && plan.block_n == chosen.block_n && plan.cluster_m == chosen.cluster_m &&
        plan.pingpong == chosen.pingpong) {
      *gemm_kernel = static_cast<int64_t>(forced);
      return Status::Ok();
    }
  }
  return Status::Internal("flux_jax: the overlap GEMM rule chose an instance no GpuTuning.gemm_kernel names");
}

Status CudaGemmRuleInputs(int device, int* sm_count, int* dram_gbps) {
  FLUX_CUDA_TRY(cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, device));
  return cuda::PeakDramGbps(device, dram_gbps);
}

void CudaFailNextWorkspaceGrowthForTesting(int rank) { cuda::FailNextGrowthForTesting(rank); }

namespace {
Status Group(const std::vector<int64_t>& devices, const std::vector<int64_t>& processes, int32_t ordinal,
             TpGroup* group) {
  if (devices.size() != processes.size()) return Status::InvalidArgument("devices / processes differ in length");
  return ResolveTpGroup(devices.data(), processes.data(), devices.size(), static_cast<int64_t>(devices.size()),
                        Platform::kCuda, ordinal, std::nullopt, group);
}
}  // namespace

Status CudaIpcExport(const std::vector<int64_t>& devices, const std::vector<int64_t>& processes, int32_t ordinal,
                     size_t data_bytes, size_t slot_bytes, std::string* blob) {
  TpGroup group;
  FLUX_JAX_RETURN_IF_ERROR(Group(devices, processes, ordinal, &group));
  return cuda::ExportIpcMember(group, data_bytes, slot_bytes, blob);
}

Status CudaIpcImport(const std::vector<int64_t>& devices, const std::vector<int64_t>& processes, int32_t ordinal,
                     int peer_rank, const std::string& blob) {
  TpGroup group;
  FLUX_JAX_RETURN_IF_ERROR(Group(devices, processes, ordinal, &group));
  return cuda::ImportIpcPeer(group, peer_rank, blob);
}

}  // namespace flux_jax
