#include <cuda.h>  // driver API types only; the entry point is resolved at run time

#include <algorithm>
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
  return CudaStatus(err, (std::string("cudaGetDriverEntryPointByVersion(") + name + ")").c_str(), __FILE__, __LINE__);
}

Status ResolveWriteValue64(StreamValue64Fn* fn) { return ResolveStreamValue64<0>("cuStreamWriteValue64", fn); }
Status ResolveWaitValue64(StreamValue64Fn* fn) { return ResolveStreamValue64<1>("cuStreamWaitValue64", fn); }

// Lane p announces this rank to peer p, then waits for peer p. The lanes whose
// wait gave up are recorded once, together (DeviceError::missing), naming the
// lowest missing rank as the peer, so a rank's error lists every rank that had
// not reached the op instead of whichever lane's record landed first.
__global__ void PresenceHandshakeKernel(PresenceSignal signal, const uint64_t* present, int tp, WaitContext ctx) {
  const int peer = static_cast<int>(threadIdx.x);
  const bool mine = peer < tp && peer != ctx.rank;
  if (mine && signal.signal) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(signal.peer_slot[peer]), "l"(ctx.epoch) : "memory");
  }
  int32_t how = 0;
  uint64_t seen = 0;
  if (mine) {
    WaitDeadline deadline;
    for (;;) {
      seen = LoadAcquireSys(present + peer);
      if (seen >= ctx.epoch) break;
      if ((how = deadline.Expired(ctx)) != 0) break;
    }
  }
  const uint32_t missing = __ballot_sync(0xffffffffu, how != 0);
  // A timeout of any lane makes the record a timeout (the others may have given up because of it).
  const bool timed_out = __any_sync(0xffffffffu, how == kWaitTimedOut);
  if (missing != 0 && peer == __ffs(missing) - 1) {
    RecordGiveUp(ctx, timed_out ? kWaitTimedOut : kWaitGaveUp, kSitePresent, peer, -1, -1, seen,
                 static_cast<int32_t>(missing));
  }
}

__global__ void __launch_bounds__(512) CopyUnlessPoisonedKernel(uint4* dst, const uint4* src, int64_t vecs,
                                                                int64_t skip_lo, int64_t skip_len, const float* alpha) {
  const float a = *reinterpret_cast<const volatile float*>(alpha);
  const bool poisoned = a != a;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vecs; i += stride) {
    const int64_t v = i < skip_lo ? i : i + skip_len;
    dst[v] = poisoned ? make_uint4(~0u, ~0u, ~0u, ~0u) : src[v];
  }
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
  CUresult r =
      fn(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(addr), value, CU_STREAM_WAIT_VALUE_GEQ);
  if (r != CUDA_SUCCESS) {
    return Status::Internal("flux_jax: cuStreamWaitValue64 failed with CUresult " + std::to_string(r));
  }
  return Status::Ok();
}

Status LaunchCopyUnlessPoisoned(cudaStream_t stream, void* dst, const void* src, int64_t bytes, int64_t skip_lo,
                                int64_t skip_hi, const float* alpha, int sm_count) {
  constexpr int kThreads = 512;
  skip_lo = std::clamp<int64_t>(skip_lo, 0, bytes);
  skip_hi = std::clamp<int64_t>(skip_hi, skip_lo, bytes);
  const int64_t vecs = (bytes - (skip_hi - skip_lo)) / 16;
  if (vecs <= 0) return Status::Ok();
  if ((bytes | skip_lo | skip_hi | reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) % 16 != 0) {
    return Status::Internal("flux_jax: the gathered copy needs 16-byte sizes and addresses");
  }
  // Four blocks per SM: a plain grid-stride copy at close to the bandwidth of a device-local copy.
  const int64_t blocks = std::min<int64_t>((vecs + kThreads - 1) / kThreads, 4 * std::max(1, sm_count));
  CopyUnlessPoisonedKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<uint4*>(dst), static_cast<const uint4*>(src), vecs, skip_lo / 16, (skip_hi - skip_lo) / 16, alpha);
  FLUX_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

Status PreloadStreamOps() {
  cudaFuncAttributes attrs;
  FLUX_CUDA_TRY(cudaFuncGetAttributes(&attrs, PresenceHandshakeKernel));
  FLUX_CUDA_TRY(cudaFuncGetAttributes(&attrs, CopyUnlessPoisonedKernel));
  StreamValue64Fn fn = nullptr;
  FLUX_JAX_RETURN_IF_ERROR(ResolveWriteValue64(&fn));
  return ResolveWaitValue64(&fn);
}

Status LaunchPresenceHandshake(cudaStream_t stream, const PresenceSignal& signal, const uint64_t* present, int tp,
                               const WaitContext& ctx) {
  if (tp > kMaxPresenceRanks) {
    return Status::InvalidArgument("flux_jax: presence handshake supports TP <= " + std::to_string(kMaxPresenceRanks));
  }
  PresenceHandshakeKernel<<<1, 32, 0, stream>>>(signal, present, tp, ctx);
  FLUX_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

}  // namespace flux_jax::cuda
