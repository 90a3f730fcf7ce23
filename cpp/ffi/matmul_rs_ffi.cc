// FFI adapter of the fused GEMM -> ReduceScatter: decode buffers and attributes
// into MatmulRsParams, call the backend, turn its Status into ffi::Error.
#include <optional>

#include "attrs.h"
#include "cpu_async.h"
#include "ffi_common.h"
#include "flux_jax/matmul_rs.h"
#include "handler_stats.h"
#include "handlers.h"

namespace flux_jax::ffi_adapter {
namespace {

Status MakeParams(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::RemainingArgs& scales, ffi::Result<ffi::AnyBuffer> out,
                  const GemmAttrs& attrs, const TpGroup& group, MatmulRsParams* p) {
  auto wd = w.dimensions();
  Folded xf;
  FLUX_JAX_RETURN_IF_ERROR(Fold(x, "matmul_rs x", &xf));
  if (wd.size() != 2) return Status::InvalidArgument("matmul_rs: w must be 2-D");
  p->w_transposed = attrs.w_transposed;
  p->m = xf.rows;
  p->k = xf.cols;
  p->n = p->w_transposed ? wd[0] : wd[1];
  if ((p->w_transposed ? wd[1] : wd[0]) != p->k) {
    return Status::InvalidArgument("matmul_rs: contraction sizes of x and w differ");
  }
  FLUX_JAX_RETURN_IF_ERROR(
      DecodeOperandTypes("matmul_rs", x, w, *out, scales, p->w_transposed, p->m, p->n, &p->dtype, &p->fp8));
  p->x = x.untyped_data();
  p->w = w.untyped_data();
  p->out = out->untyped_data();
  FLUX_JAX_RETURN_IF_ERROR(MatmulRsCanImplement(*p, group));
  return CheckElements("matmul_rs out", out->element_count(), p->m / group.size * p->n);
}

// `host_position` on CPU only (see ag_matmul_ffi.cc).
Status Decode(Platform platform, int32_t device_ordinal, std::optional<int32_t> host_position, ffi::AnyBuffer x,
              ffi::AnyBuffer w, ffi::RemainingArgs& scales, ffi::Result<ffi::AnyBuffer> out, const GemmAttrs& attrs,
              TpGroup* group, CommConfig* cfg, MatmulRsParams* p) {
  FLUX_JAX_RETURN_IF_ERROR(DecodeGemm(attrs, platform, device_ordinal, host_position, group, cfg));
  return MakeParams(x, w, scales, out, attrs, *group, p);
}

ffi::Future MatmulRsCpu(int32_t device_ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> rank,
                        ffi::RemainingArgs scales, ffi::Result<ffi::AnyBuffer> out, GemmAttrs attrs) {
  TpGroup group;
  CommConfig cfg;
  MatmulRsParams p;
  Status s = Decode(Platform::kCpu, device_ordinal, rank.typed_data()[0], x, w, scales, out, attrs, &group, &cfg, &p);
  return RunOnOwnThread(HandlerOp::kMatmulRs, s, p, group, cfg, RunMatmulRsCpu);
}

ffi::Error MatmulRsCuda(void* stream, int32_t device_ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::RemainingArgs scales, ffi::Result<ffi::AnyBuffer> out, GemmAttrs attrs) {
  ScopedHandlerTimer timer(HandlerOp::kMatmulRs);
  TpGroup group;
  CommConfig cfg;
  MatmulRsParams p;
  Status s = Decode(Platform::kCuda, device_ordinal, std::nullopt, x, w, scales, out, attrs, &group, &cfg, &p);
  if (s.ok()) s = RunMatmulRsCuda(p, group, cfg, stream);
  return ToFfiError(s);
}

}  // namespace
}  // namespace flux_jax::ffi_adapter

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(FluxJaxMatmulRsCpu, flux_jax::ffi_adapter::MatmulRsCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()         // x [m, k_local]
                                  .Arg<ffi::AnyBuffer>()         // w [k_local, n] or [n, k_local]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // position by lax.axis_index
                                  .RemainingArgs()               // FP8: row scales, column scales
                                  .Ret<ffi::AnyBuffer>()         // out [m/tp, n]
                                  .Attrs<flux_jax::ffi_adapter::GemmAttrs>());

#ifdef FLUX_JAX_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(FluxJaxMatmulRsCuda, flux_jax::ffi_adapter::MatmulRsCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // x [m, k_local]
                                  .Arg<ffi::AnyBuffer>()  // w [k_local, n] or [n, k_local]
                                  .RemainingArgs()        // FP8: row scales, column scales
                                  .Ret<ffi::AnyBuffer>()  // out [m/tp, n]
                                  .Attrs<flux_jax::ffi_adapter::GemmAttrs>());
#endif
