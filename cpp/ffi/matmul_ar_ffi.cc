// FFI adapter of the fused GEMM -> AllReduce: decode buffers and attributes
// into MatmulArParams, call the backend, turn its Status into ffi::Error.
#include <optional>

#include "attrs.h"
#include "cpu_async.h"
#include "ffi_common.h"
#include "flux_jax/matmul_ar.h"
#include "handler_stats.h"
#include "handlers.h"

namespace flux_jax::ffi_adapter {
namespace {

Status MakeParams(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::RemainingArgs& scales, ffi::Result<ffi::AnyBuffer> out,
                  const GemmAttrs& attrs, const TpGroup& group, MatmulArParams* p) {
  auto wd = w.dimensions();
  Folded xf;
  FLUX_JAX_RETURN_IF_ERROR(Fold(x, "matmul_ar x", &xf));
  if (wd.size() != 2) return Status::InvalidArgument("matmul_ar: w must be 2-D");
  p->w_transposed = attrs.w_transposed;
  p->m = xf.rows;
  p->k = xf.cols;
  p->n = p->w_transposed ? wd[0] : wd[1];
  if ((p->w_transposed ? wd[1] : wd[0]) != p->k) {
    return Status::InvalidArgument("matmul_ar: contraction sizes of x and w differ");
  }
  FLUX_JAX_RETURN_IF_ERROR(
      DecodeOperandTypes("matmul_ar", x, w, *out, scales, p->w_transposed, p->m, p->n, &p->dtype, &p->fp8));
  p->x = x.untyped_data();
  p->w = w.untyped_data();
  p->out = out->untyped_data();
  FLUX_JAX_RETURN_IF_ERROR(MatmulArCanImplement(*p, group));
  return CheckElements("matmul_ar out", out->element_count(), p->m * p->n);
}

// `host_position` on CPU only (see ag_matmul_ffi.cc).
Status Decode(Platform platform, int32_t device_ordinal, std::optional<int32_t> host_position, ffi::AnyBuffer x,
              ffi::AnyBuffer w, ffi::RemainingArgs& scales, ffi::Result<ffi::AnyBuffer> out, const GemmAttrs& attrs,
              TpGroup* group, CommConfig* cfg, MatmulArParams* p) {
  FLUX_JAX_RETURN_IF_ERROR(DecodeGemm(attrs, platform, device_ordinal, host_position, group, cfg));
  return MakeParams(x, w, scales, out, attrs, *group, p);
}

ffi::Future MatmulArCpu(int32_t device_ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> rank,
                        ffi::RemainingArgs scales, ffi::Result<ffi::AnyBuffer> out, GemmAttrs attrs) {
  TpGroup group;
  CommConfig cfg;
  MatmulArParams p;
  Status s = Decode(Platform::kCpu, device_ordinal, rank.typed_data()[0], x, w, scales, out, attrs, &group, &cfg, &p);
  return RunOnOwnThread(HandlerOp::kMatmulAr, s, p, group, cfg, RunMatmulArCpu);
}

ffi::Error MatmulArCuda(void* stream, int32_t device_ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::RemainingArgs scales, ffi::Result<ffi::AnyBuffer> out, GemmAttrs attrs) {
  ScopedHandlerTimer timer(HandlerOp::kMatmulAr);
  TpGroup group;
  CommConfig cfg;
  MatmulArParams p;
  Status s = Decode(Platform::kCuda, device_ordinal, std::nullopt, x, w, scales, out, attrs, &group, &cfg, &p);
  if (s.ok()) s = RunMatmulArCuda(p, group, cfg, stream);
  return ToFfiError(s);
}

}  // namespace
}  // namespace flux_jax::ffi_adapter

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(FluxJaxMatmulArCpu, flux_jax::ffi_adapter::MatmulArCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()         // x [m, k_local]
                                  .Arg<ffi::AnyBuffer>()         // w [k_local, n] or [n, k_local]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // position by lax.axis_index
                                  .RemainingArgs()               // FP8: row scales, column scales
                                  .Ret<ffi::AnyBuffer>()         // out [m, n], the same on every rank
                                  .Attrs<flux_jax::ffi_adapter::GemmAttrs>());

#ifdef FLUX_JAX_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(FluxJaxMatmulArCuda, flux_jax::ffi_adapter::MatmulArCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // x [m, k_local]
                                  .Arg<ffi::AnyBuffer>()  // w [k_local, n] or [n, k_local]
                                  .RemainingArgs()        // FP8: row scales, column scales
                                  .Ret<ffi::AnyBuffer>()  // out [m, n], the same on every rank
                                  .Attrs<flux_jax::ffi_adapter::GemmAttrs>());
#endif
