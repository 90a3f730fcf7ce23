// Host API of the low-latency collectives behind the small-M ("latency") path.
//
// For small M the weight streaming of the GEMM dominates and the collective is
// a latency problem, not a bandwidth one: the latency path runs
//   ag_matmul:  all_gather (ours, one kernel)  ->  XLA's own GEMM
//   matmul_rs:  XLA's own GEMM  ->  reduce_scatter (ours, one kernel)
//   matmul_ar:  XLA's own GEMM  ->  all_reduce (ours, one kernel)
// where "ours" moves the rows with SM stores over NVLink, signals with epoch
// flags and never meets on the host. See docs/kernels.md, "The latency path".
#pragma once

#include "flux_jax/params.h"
#include "flux_jax/status.h"

namespace flux_jax {

// all_gather: out[tp*rows, cols] = concat over ranks of x[rows, cols].
// reduce_scatter: out[rows/tp, cols] = sum over ranks (in rank order 0..tp-1)
// of rank q's x[rank*rows/tp : (rank+1)*rows/tp, cols].
// all_reduce: out[rows, cols] = sum over ranks (in rank order 0..tp-1) of x,
// in float32, rounded once: bitwise the same on every rank.
struct CollectiveParams {
  const void* x = nullptr;
  void* out = nullptr;
  int64_t rows = 0, cols = 0;  // of x
  DType dtype = DType::kBF16;
};

Status AllGatherCanImplement(const CollectiveParams& p, const TpGroup& group);
Status ReduceScatterCanImplement(const CollectiveParams& p, const TpGroup& group);

Status RunAllGatherCpu(const CollectiveParams& p, const TpGroup& group, const CommConfig& cfg);
Status RunReduceScatterCpu(const CollectiveParams& p, const TpGroup& group, const CommConfig& cfg);

Status AllReduceCanImplement(const CollectiveParams& p, const TpGroup& group);
Status RunAllReduceCpu(const CollectiveParams& p, const TpGroup& group, const CommConfig& cfg);
Status RunAllReduceCuda(const CollectiveParams& p, const TpGroup& group, const CommConfig& cfg, void* stream);

Status RunAllGatherCuda(const CollectiveParams& p, const TpGroup& group, const CommConfig& cfg, void* stream);
Status RunReduceScatterCuda(const CollectiveParams& p, const TpGroup& group, const CommConfig& cfg, void* stream);

}  // namespace flux_jax
