// FFI adapter of the fused AllGather -> GEMM: decode buffers and attributes
// into AgMatmulParams, call the backend, turn its Status into ffi::Error.
#include <optional>

#include "attrs.h"
#include "cpu_async.h"
#include "ffi_common.h"
#include "flux_jax/ag_matmul.h"
#include "handler_stats.h"
#include "handlers.h"

namespace flux_jax::ffi_adapter {
namespace {

Status MakeParams(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::RemainingArgs& scales, ffi::Result<ffi::AnyBuffer> out,
                  ffi::RemainingRets& extra, const GemmAttrs& attrs, const TpGroup& group, AgMatmulParams* p) {
  auto wd = w.dimensions();
  Folded xf;
  FLUX_JAX_RETURN_IF_ERROR(Fold(x, "ag_matmul x", &xf));
  if (wd.size() != 2) return Status::InvalidArgument("ag_matmul: w must be 2-D");
  p->w_transposed = attrs.w_transposed;
  p->m_local = xf.rows;
  p->k = xf.cols;
  p->n = p->w_transposed ? wd[0] : wd[1];
  if ((p->w_transposed ? wd[1] : wd[0]) != p->k) {
    return Status::InvalidArgument("ag_matmul: contraction sizes of x and w differ");
  }
  // FP8 row scales: every gathered row's, or this rank's rows' on the decode path (they travel
  // with the rows there).
  const int64_t scaled_rows = attrs.path == FusedPath::kDecode ? p->m_local : group.size * p->m_local;
  FLUX_JAX_RETURN_IF_ERROR(
      DecodeOperandTypes("ag_matmul", x, w, *out, scales, p->w_transposed, scaled_rows, p->n, &p->dtype, &p->fp8));
  p->x = x.untyped_data();
  p->w = w.untyped_data();
  p->out = out->untyped_data();
  const int64_t rows = group.size * p->m_local;
  FLUX_JAX_RETURN_IF_ERROR(CheckElements("ag_matmul out", out->element_count(), rows * p->n));
  p->gathered = nullptr;
  if (extra.size() > 0) {
    auto gathered = extra.get<ffi::AnyBuffer>(0);
    if (!gathered.has_value()) return Status::Internal("ag_matmul: cannot decode gathered result");
    FLUX_JAX_RETURN_IF_ERROR(CheckElements("ag_matmul gathered", (*gathered)->element_count(), rows * p->k));
    p->gathered = (*gathered)->untyped_data();
  }
  return AgMatmulCanImplement(*p, group);
}

// `host_position` is the device's place in the mesh table by lax.axis_index (group * tp + rank),
// cross-checked against the table: on CPU only. On GPU it would live in device memory, so the GPU
// lowering does not pass it (computing it cost a ~1 us convert kernel per call).
Status Decode(Platform platform, int32_t device_ordinal, std::optional<int32_t> host_position, ffi::AnyBuffer x,
              ffi::AnyBuffer w, ffi::RemainingArgs& scales, ffi::Result<ffi::AnyBuffer> out, ffi::RemainingRets& extra,
              const GemmAttrs& attrs, TpGroup* group, CommConfig* cfg, AgMatmulParams* p) {
  FLUX_JAX_RETURN_IF_ERROR(DecodeGemm(attrs, platform, device_ordinal, host_position, group, cfg));
  return MakeParams(x, w, scales, out, extra, attrs, *group, p);
}

ffi::Future AgMatmulCpu(int32_t device_ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> rank,
                        ffi::RemainingArgs scales, ffi::Result<ffi::AnyBuffer> out, ffi::RemainingRets extra,
                        GemmAttrs attrs) {
  TpGroup group;
  CommConfig cfg;
  AgMatmulParams p;
  Status s =
      Decode(Platform::kCpu, device_ordinal, rank.typed_data()[0], x, w, scales, out, extra, attrs, &group, &cfg, &p);
  return RunOnOwnThread(HandlerOp::kAgMatmul, s, p, group, cfg, RunAgMatmulCpu);
}

ffi::Error AgMatmulCuda(void* stream, int32_t device_ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::RemainingArgs scales, ffi::Result<ffi::AnyBuffer> out, ffi::RemainingRets extra,
                        GemmAttrs attrs) {
  ScopedHandlerTimer timer(HandlerOp::kAgMatmul);
  TpGroup group;
  CommConfig cfg;
  AgMatmulParams p;
  Status s = Decode(Platform::kCuda, device_ordinal, std::nullopt, x, w, scales, out, extra, attrs, &group, &cfg, &p);
  if (s.ok()) s = RunAgMatmulCuda(p, group, cfg, stream);
  return ToFfiError(s);
}

}  // namespace
}  // namespace flux_jax::ffi_adapter

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(FluxJaxAgMatmulCpu, flux_jax::ffi_adapter::AgMatmulCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()         // x [m_local, k]
                                  .Arg<ffi::AnyBuffer>()         // w [k, n] or [n, k]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // position by lax.axis_index
                                  .RemainingArgs()               // FP8: row scales, column scales
                                  .Ret<ffi::AnyBuffer>()         // out [tp*m_local, n]
                                  .RemainingRets()               // gathered x, optional
                                  .Attrs<flux_jax::ffi_adapter::GemmAttrs>());

#ifdef FLUX_JAX_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(FluxJaxAgMatmulCuda, flux_jax::ffi_adapter::AgMatmulCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // x [m_local, k]
                                  .Arg<ffi::AnyBuffer>()  // w [k, n] or [n, k]
                                  .RemainingArgs()        // FP8: row scales, column scales
                                  .Ret<ffi::AnyBuffer>()  // out [tp*m_local, n]
                                  .RemainingRets()        // gathered x, optional
                                  .Attrs<flux_jax::ffi_adapter::GemmAttrs>());
#endif
