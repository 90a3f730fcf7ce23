#include <cuda.h>  // driver API types only; the entry point is resolved at run time

#include <mutex>
#include <string>

#include "cuda_util.h"
#include "stream_ops.h"

namespace flux_jax::cuda {
namespace {

// cuStreamWriteValue64 and cuStreamWaitValue64 share this signature.
using StreamValue64Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

// The driver entry point `name`, resolved once per name (Tag tells the two apart).
template <int Tag>
Status ResolveStreamValue64(const char* name, StreamValue64Fn* fn) {
  static StreamValue64Fn resolved = nullptr;
  static cudaError_t err = cudaSuccess;
  static std::once_flag once;
  std::call_once(once, [name] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult query{};
    err = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &query);
    if (err == cudaSuccess && query != cudaDriverEntryPointSuccess) err = cudaErrorSymbolNotFound;
    resolved = reinterpret_cast<StreamValue64Fn>(p);
  });
  *fn = resolved;
  return CudaStatus(err, (std::string("cudaGetDriverEntryPointByVersion(") + name + ")").c_str(), __FILE__,
                    __LINE__);
}

Status ResolveWriteValue64(StreamValue64Fn* fn) { return ResolveStreamValue64<0>("cuStreamWriteValue64", fn); }
Status ResolveWaitValue64(StreamValue64Fn* fn) { return ResolveStreamValue64<1>("cuStreamWaitValue64", fn); }

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
  StreamValue64Fn fn = nullptr;
  FLUX_JAX_RETURN_IF_ERROR(ResolveWriteValue64(&fn));
  CUresult r = fn(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(addr), value, 0);
  if (r != CUDA_SUCCESS) {
    return Status::Internal("flux_jax: cuStreamWriteValue64 failed with CUresult " + std::to_string(r));
  }
  return Status::Ok();
}

Status StreamWaitValue64Geq(cudaStream_t stream, const uint64_t* addr, uint64_t value) {
  StreamValue64Fn fn = nullptr;
  FLUX_JAX_RETURN_IF_ERROR(ResolveWaitValue64(&fn));
  CUresult r = fn(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(addr), value,
                  CU_STREAM_WAIT_VALUE_GEQ);
  if (r != CUDA_SUCCESS) {
    return Status::Internal("flux_jax: cuStreamWaitValue64 failed with CUresult " + std::to_string(r));
  }
  return Status::Ok();
}

Status PreloadStreamOps() {
  cudaFuncAttributes attrs;
  FLUX_CUDA_TRY(cudaFuncGetAttributes(&attrs, PresenceHandshakeKernel));
  StreamValue64Fn fn = nullptr;
  FLUX_JAX_RETURN_IF_ERROR(ResolveWriteValue64(&fn));
  return ResolveWaitValue64(&fn);
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
