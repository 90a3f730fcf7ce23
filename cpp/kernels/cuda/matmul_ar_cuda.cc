// GEMM -> AllReduce on Hopper, as one custom call (the "overlap" path of matmul_ar):
//
//   compute stream S (XLA's)
//   our GEMM: partial = x @ op(w)  -> this rank's own slot of the call's parity (workspace)
//   the latency path's all_reduce kernel on that partial: push it whole to every peer over
//   NVLink, per-block epoch flags, rank-ordered float32 sum of the tp partials, rounded once
//
// The same all_reduce kernel as the latency path (XLA's GEMM next to flux_jax_all_reduce), so
// both paths give the same bits on every rank. The GEMM and the push do not overlap yet: the
// GEMM writes its whole partial before the kernel starts. The decode path (at most 128 rows) is
// one launch whose epilogue all-reduces tile by tile (matmul_ar_decode.cu).
#include "all_reduce.h"
#include "flux_jax/matmul_ar.h"
#include "matmul_ar_decode.h"
#include "op_common.h"

namespace flux_jax {

Status RunMatmulArCuda(const MatmulArParams& p, const TpGroup& group, const CommConfig& cfg, void* stream_ptr) {
  using namespace cuda;
  FLUX_JAX_RETURN_IF_ERROR(MatmulArCanImplement(p, group));
  if (p.dtype == DType::kF32) {
    return Status::InvalidArgument("matmul_ar: the CUDA kernels take bfloat16 or float16");
  }
  auto S = static_cast<cudaStream_t>(stream_ptr);
  const int device = group.ordinals[group.rank];
  DeviceGuard guard(device);
  if (p.fp8.on) FLUX_JAX_RETURN_IF_ERROR(CheckFp8Call("matmul_ar", cfg, p.w_transposed, p.k, /*fp8_decode=*/true));
  if (cfg.path == FusedPath::kDecode) return RunMatmulArDecode(p, group, cfg, S);
  CollectiveParams c;  // the all_reduce of the [m, n] partial, which the GEMM writes
  c.out = p.out;
  c.rows = p.m;
  c.cols = p.n;
  c.dtype = p.dtype;
  auto gemm = [&](GroupWorkspace& ws, void* partial) -> Status {
    GemmPlan plan = BasePlan(p.m, p.n, p.k, p.w, p.w_transposed, cfg);
    plan.a = p.x;
    plan.d = partial;
    plan.alpha_ptr = ws.alpha;  // NaN once a wait of this device timed out: NaN, never wrong
    if (p.fp8.on) {
      FLUX_JAX_RETURN_IF_ERROR(ChooseFp8GemmInstance(cfg, p.fp8, p.m, p.k, p.n, ws.sm_count, ws.dram_gbps, &plan));
    } else {
      FLUX_JAX_RETURN_IF_ERROR(
          ChooseGemmInstance(cfg, p.dtype, p.w_transposed, p.m, p.n, p.k, ws.sm_count, ws.dram_gbps, &plan));
    }
    plan.group_m_tiles = TileGroupM(cfg, plan, p.m);
    return RunGemm(plan, p.dtype, S, device, ws.sm_count);
  };
  return EnqueueAllReduce(c, group, cfg, S, gemm);
}

}  // namespace flux_jax
