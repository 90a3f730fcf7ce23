#include <cuda.h>  // driver API types only; the entry point is resolved at run time

#include <mutex>
#include <string>

#include "cuda_util.h"
#include "stream_ops.h"

namespace flux_jax::cuda {
namespace {

using WriteValue64Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

Status ResolveWriteValue64(WriteValue64Fn* fn) {
  static WriteValue64Fn resolved = nullptr;
  static cudaError_t err = cudaSuccess;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult query{};
    err = cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &p, 12000, cudaEnableDefault,
                                           &query);
    if (err == cudaSuccess && query != cudaDriverEntryPointSuccess) err = cudaErrorSymbolNotFound;
    resolved = reinterpret_cast<WriteValue64Fn>(p);
  });
  *fn = resolved;
  return CudaStatus(err, "cudaGetDriverEntryPointByVersion(cuStreamWriteValue64)", __FILE__, __LINE__);
}

__global__ void PresenceHandshakeKernel(PresenceSignal signal, const uint64_t* present, int tp,
                                        WaitContext ctx) {
  const int peer = static_cast<int>(threadIdx.x);
  if (peer >= tp || peer == ctx.rank) return;
  if (signal.signal) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(signal.peer_slot[peer]), "l"(ctx.epoch) : "memory");
  }
  WaitFlag(present + peer, ctx, kSitePresent, peer, -1, -1);
}

}  // namespace

Status StreamWriteValue64(cudaStream_t stream, uint64_t* addr, uint64_t value) {
  WriteValue64Fn fn = nullptr;
  FLUX_JAX_RETURN_IF_ERROR(ResolveWriteValue64(&fn));
  CUresult r = fn(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(addr), value, 0);
  if (r != CUDA_SUCCESS) {
    return Status::Internal("flux_jax: cuStreamWriteValue64 failed with CUresult " + std::to_string(r));
  }
  return Status::Ok();
}

Status PreloadStreamOps() {
  cudaFuncAttributes attrs;
  FLUX_CUDA_TRY(cudaFuncGetAttributes(&attrs, PresenceHandshakeKernel));
  WriteValue64Fn fn = nullptr;
  return ResolveWriteValue64(&fn);
}

Status LaunchPresenceHandshake(cudaStream_t stream, const PresenceSignal& signal,
                               const uint64_t* present, int tp, const WaitContext& ctx) {
  if (tp > kMaxPresenceRanks) {
    return Status::InvalidArgument("flux_jax: presence handshake supports TP <= " +
                                   std::to_string(kMaxPresenceRanks));
  }
  PresenceHandshakeKernel<<<1, 32, 0, stream>>>(signal, present, tp, ctx);
  FLUX_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

}  // namespace flux_jax::cuda
