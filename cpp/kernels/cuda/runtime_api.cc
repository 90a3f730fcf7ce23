#include "flux_jax/cuda_runtime.h"

#include "flux_jax/tp_group.h"
#include "workspace.h"

namespace flux_jax {

void ResetCudaWorkspaces() { cuda::ResetWorkspaces(); }

size_t CudaWorkspaceBytes(int device) { return cuda::WorkspaceBytes(device); }

std::string CudaDeviceError(int device) {
  Status s = cuda::CheckDeviceError(device);
  return s.ok() ? std::string() : s.message();
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
