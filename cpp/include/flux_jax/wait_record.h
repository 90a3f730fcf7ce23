// What a device-side wait that gave up leaves behind, and its text.
//
// The GPU writes these records into mapped host memory (cpp/kernels/cuda/device_sync.cuh); the
// host turns them into the errors the next fused call raises and `flux_jax.device_errors()`
// returns. No CUDA types here: the CPU build formats records too (tests/test_gpu_diagnostics.py).
//
// Two records matter for one failure:
//   - the member's own record (one per rank of a TP group on a GPU): the first wait of that rank
//     that gave up, so every rank's error names the rank it waited for;
//   - the device's record: the first wait on the GPU whose own deadline passed. Every other wait on
//     the GPU gives up at once when it is set (recorded as kWaitGaveUp in its member's record, never
//     as a timeout of its own), and the host copies it to the other GPUs of the group.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>

namespace flux_jax {

enum WaitSite : int32_t {
  kSitePresent = 1,
  kSiteGemmA = 2,
  kSiteEpilogueC = 3,
  kSiteAllGather = 4,        // latency path; piece = thread block
  kSiteReduceScatter = 5,    // latency path; piece = thread block
  kSiteDecodeRows = 6,       // decode path's GEMM; piece = push block
  kSiteDecodeSums = 7,       // matmul_rs's decode GEMM epilogue; piece = output tile
  kSiteAllReduce = 8,        // latency path; piece = thread block
  kSiteDecodeAllReduce = 9,  // matmul_ar's decode GEMM epilogue; piece = output tile
};

// DeviceError::code.
inline constexpr int32_t kWaitNone = 0;
inline constexpr int32_t kWaitTimedOut = 1;  // this wait's own deadline passed
inline constexpr int32_t kWaitReset = 2;     // device records only: flux_jax.reset() is draining the GPU
inline constexpr int32_t kWaitGaveUp = 3;    // gave up because another wait on the GPU had failed first
inline constexpr int32_t kWaitWriting = -1;  // the GPU is filling the record

// One wait that gave up (48 bytes; mapped host memory).
struct DeviceError {
  int32_t code;  // kWait*
  int32_t site;  // WaitSite
  int32_t device;
  int32_t rank;
  int32_t peer;   // rank expected to write the flag (-1 unknown)
  int32_t chunk;  // chunk / step of rows the flag guards (-1 none)
  int32_t piece;
  int32_t missing;  // kSitePresent: bit p set = rank p had not reached the op (0 elsewhere)
  uint64_t epoch;
  uint64_t seen;  // flag value when the wait gave up
};

// "rank 5 waited for rank 7 to reach the op; epoch 12, flag value seen 11"
inline std::string DescribeWait(const DeviceError& e) {
  std::ostringstream os;
  os << "rank " << e.rank;
  switch (e.site) {
    case kSitePresent: os << " waited for rank " << e.peer << " to reach the op"; break;
    case kSiteGemmA:
      os << " waited for rows of chunk " << e.chunk << ", piece " << e.piece << " from rank " << e.peer;
      break;
    case kSiteEpilogueC: os << " waited for partial sums, piece " << e.piece << ", from rank " << e.peer; break;
    case kSiteAllGather:
      os << " waited in all_gather for block " << e.piece << " of the rows of rank " << e.peer;
      break;
    case kSiteReduceScatter:
      os << " waited in reduce_scatter for block " << e.piece << " of the partial sums of rank " << e.peer;
      break;
    case kSiteDecodeRows:
      os << " waited in ag_matmul's decode GEMM for push block " << e.piece << " of the rows of rank " << e.peer;
      break;
    case kSiteDecodeSums:
      os << " waited in matmul_rs's decode GEMM for the partial sums of output tile " << e.piece << " from rank "
         << e.peer;
      break;
    case kSiteAllReduce:
      os << " waited in all_reduce for block " << e.piece << " of the partial sums of rank " << e.peer;
      break;
    case kSiteDecodeAllReduce:
      os << " waited in matmul_ar's decode GEMM for the partial sums of output tile " << e.piece << " from rank "
         << e.peer;
      break;
    default: os << " waited on an unknown site " << e.site << " for rank " << e.peer; break;
  }
  os << "; epoch " << e.epoch << ", flag value seen " << e.seen;
  if (e.site == kSitePresent && (e.missing & (e.missing - 1)) != 0) {  // more than one rank missing
    os << "; ranks not there:";
    const char* sep = " ";
    for (int p = 0; p < 32; ++p) {
      if (e.missing & (1u << p)) os << sep << p, sep = ", ";
    }
  }
  return os.str();
}

// The error of a fused call on `device` whose member record is `own` (code kWaitNone: this rank
// never gave up) after the device's first failure `first` (code kWaitNone: none). `group`
// describes the member's TP group ("" if unknown). "" if neither record holds a failure.
inline std::string DescribeWaitFailure(const DeviceError& own, const DeviceError& first, int device,
                                       const std::string& group) {
  const bool has_own = own.code == kWaitTimedOut || own.code == kWaitGaveUp;
  const bool has_first = first.code == kWaitTimedOut;
  if (!has_own && !has_first) return std::string();
  std::ostringstream os;
  os << "flux_jax: ";
  if (has_own && own.code == kWaitTimedOut) {
    os << "a fused op on GPU " << own.device << " timed out (" << DescribeWait(own) << ")";
  } else if (has_own) {
    os << "a fused op on GPU " << own.device << " gave up (" << DescribeWait(own) << ") because ";
    if (has_first) {
      os << "a wait on GPU " << first.device << " had timed out first (" << DescribeWait(first) << ")";
    } else {
      os << "an earlier wait on GPU " << device << " had failed";
    }
  } else {
    os << "a fused op on GPU " << first.device << " timed out (" << DescribeWait(first) << ")";
    if (first.device != device) os << "; fused ops on GPU " << device << " of the same group stop too";
  }
  if (!group.empty()) os << " in " << group;
  os << ". The outputs of that call are invalid (NaN where they depend on the missing data) and "
        "those of later fused calls on this GPU are NaN. Every device of a TP group must run the "
        "same fused ops in the same order. Call flux_jax.reset() to clear.";
  return os.str();
}

}  // namespace flux_jax
