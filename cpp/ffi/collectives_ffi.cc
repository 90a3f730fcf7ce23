// FFI adapters of the latency path's collectives (all_gather, reduce_scatter, all_reduce):
// decode the buffers into CollectiveParams, call the backend, map the Status.
#include <optional>

#include "attrs.h"
#include "cpu_async.h"
#include "ffi_common.h"
#include "flux_jax/collectives.h"
#include "handler_stats.h"
#include "handlers.h"

namespace flux_jax::ffi_adapter {
namespace {

enum class Collective { kAllGather, kReduceScatter };

Status MakeParams(Collective op, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, const TpGroup& group,
                  CollectiveParams* p) {
  const char* name = op == Collective::kAllGather ? "all_gather" : "reduce_scatter";
  Folded xf;
  FLUX_JAX_RETURN_IF_ERROR(Fold(x, name, &xf));
  // The all_gather moves bytes (FP8 payloads too); reductions take float types only.
  FLUX_JAX_RETURN_IF_ERROR(op == Collective::kAllGather ? ToPayloadDType(x.element_type(), name, &p->dtype)
                                                        : ToDType(x.element_type(), name, &p->dtype));
  if (out->element_type() != x.element_type()) {
    return Status::InvalidArgument(std::string(name) + ": x and out must share one dtype");
  }
  p->rows = xf.rows;
  p->cols = xf.cols;
  p->x = x.untyped_data();
  p->out = out->untyped_data();
  if (op == Collective::kAllGather) {
    FLUX_JAX_RETURN_IF_ERROR(CheckElements("all_gather out", out->element_count(), group.size * p->rows * p->cols));
    return AllGatherCanImplement(*p, group);
  }
  FLUX_JAX_RETURN_IF_ERROR(ReduceScatterCanImplement(*p, group));
  return CheckElements("reduce_scatter out", out->element_count(), p->rows / group.size * p->cols);
}

constexpr HandlerOp TimerOp(Collective op) {
  return op == Collective::kAllGather ? HandlerOp::kAllGather : HandlerOp::kReduceScatter;
}

template <Collective op>
ffi::Future RunCpu(int32_t device_ordinal, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank,
                   ffi::Result<ffi::AnyBuffer> out, CollectiveAttrs attrs) {
  TpGroup group;
  CommConfig cfg;
  CollectiveParams p;
  Status s = DecodeCommon(attrs, Platform::kCpu, device_ordinal, rank.typed_data()[0], &group, &cfg);
  if (s.ok()) s = MakeParams(op, x, out, group, &p);
  return RunOnOwnThread(TimerOp(op), s, p, group, cfg,
                        op == Collective::kAllGather ? RunAllGatherCpu : RunReduceScatterCpu);
}

template <Collective op>
ffi::Error RunCuda(void* stream, int32_t device_ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                   CollectiveAttrs attrs) {
  ScopedHandlerTimer timer(TimerOp(op));
  TpGroup group;
  CommConfig cfg;
  CollectiveParams p;
  Status s = DecodeCommon(attrs, Platform::kCuda, device_ordinal, std::nullopt, &group, &cfg);
  if (s.ok()) s = MakeParams(op, x, out, group, &p);
  if (s.ok()) {
    s = op == Collective::kAllGather ? RunAllGatherCuda(p, group, cfg, stream)
                                     : RunReduceScatterCuda(p, group, cfg, stream);
  }
  return ToFfiError(s);
}

// all_reduce: out has x's shape; every rank gets the rank-ordered sum.
Status DecodeAllReduce(Platform platform, int32_t device_ordinal, std::optional<int32_t> host_position,
                       ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, const CollectiveAttrs& attrs,
                       TpGroup* group_out, CommConfig* cfg_out, CollectiveParams* p_out) {
  TpGroup& group = *group_out;
  CommConfig& cfg = *cfg_out;
  CollectiveParams& p = *p_out;
  Status s = DecodeCommon(attrs, platform, device_ordinal, host_position, &group, &cfg);
  Folded xf;
  if (s.ok()) s = Fold(x, "all_reduce", &xf);
  if (s.ok()) s = ToDType(x.element_type(), "all_reduce", &p.dtype);
  if (s.ok() && out->element_type() != x.element_type()) {
    s = Status::InvalidArgument("all_reduce: x and out must share one dtype");
  }
  if (s.ok()) {
    p.rows = xf.rows;
    p.cols = xf.cols;
    p.x = x.untyped_data();
    p.out = out->untyped_data();
    s = CheckElements("all_reduce out", out->element_count(), p.rows * p.cols);
  }
  if (s.ok()) s = AllReduceCanImplement(p, group);
  return s;
}

ffi::Future RunAllReduceCpuHandler(int32_t device_ordinal, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank,
                                   ffi::Result<ffi::AnyBuffer> out, CollectiveAttrs attrs) {
  TpGroup group;
  CommConfig cfg;
  CollectiveParams p;
  Status s = DecodeAllReduce(Platform::kCpu, device_ordinal, rank.typed_data()[0], x, out, attrs, &group, &cfg, &p);
  return RunOnOwnThread(HandlerOp::kAllReduce, s, p, group, cfg, RunAllReduceCpu);
}

ffi::Error RunAllReduceCudaHandler(void* stream, int32_t device_ordinal, ffi::AnyBuffer x,
                                   ffi::Result<ffi::AnyBuffer> out, CollectiveAttrs attrs) {
  ScopedHandlerTimer timer(HandlerOp::kAllReduce);
  TpGroup group;
  CommConfig cfg;
  CollectiveParams p;
  Status s = DecodeAllReduce(Platform::kCuda, device_ordinal, std::nullopt, x, out, attrs, &group, &cfg, &p);
  if (s.ok()) s = RunAllReduceCuda(p, group, cfg, stream);
  return ToFfiError(s);
}

}  // namespace
}  // namespace flux_jax::ffi_adapter

namespace ffi = xla::ffi;
using flux_jax::ffi_adapter::Collective;

// CPU: x, position (by lax.axis_index, cross-checked); CUDA: x only (see ag_matmul_ffi.cc).
#define FLUX_JAX_CPU_COLLECTIVE_BINDING()                            \
  ffi::Ffi::Bind()                                                   \
      .Ctx<ffi::DeviceOrdinal>()                                     \
      .Arg<ffi::AnyBuffer>()        /* x */                          \
      .Arg<ffi::Buffer<ffi::S32>>() /* position by lax.axis_index */ \
      .Ret<ffi::AnyBuffer>()        /* gathered / reduced rows */    \
      .Attrs<flux_jax::ffi_adapter::CollectiveAttrs>()
#define FLUX_JAX_CUDA_COLLECTIVE_BINDING()                 \
  ffi::Ffi::Bind()                                         \
      .Ctx<ffi::PlatformStream<void*>>()                   \
      .Ctx<ffi::DeviceOrdinal>()                           \
      .Arg<ffi::AnyBuffer>() /* x */                       \
      .Ret<ffi::AnyBuffer>() /* gathered / reduced rows */ \
      .Attrs<flux_jax::ffi_adapter::CollectiveAttrs>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(FluxJaxAllGatherCpu, flux_jax::ffi_adapter::RunCpu<Collective::kAllGather>,
                              FLUX_JAX_CPU_COLLECTIVE_BINDING());
XLA_FFI_DEFINE_HANDLER_SYMBOL(FluxJaxReduceScatterCpu, flux_jax::ffi_adapter::RunCpu<Collective::kReduceScatter>,
                              FLUX_JAX_CPU_COLLECTIVE_BINDING());
#ifdef FLUX_JAX_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(FluxJaxAllGatherCuda, flux_jax::ffi_adapter::RunCuda<Collective::kAllGather>,
                              FLUX_JAX_CUDA_COLLECTIVE_BINDING());
XLA_FFI_DEFINE_HANDLER_SYMBOL(FluxJaxReduceScatterCuda, flux_jax::ffi_adapter::RunCuda<Collective::kReduceScatter>,
                              FLUX_JAX_CUDA_COLLECTIVE_BINDING());
#endif

XLA_FFI_DEFINE_HANDLER_SYMBOL(FluxJaxAllReduceCpu, flux_jax::ffi_adapter::RunAllReduceCpuHandler,
                              FLUX_JAX_CPU_COLLECTIVE_BINDING());
#ifdef FLUX_JAX_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(FluxJaxAllReduceCuda, flux_jax::ffi_adapter::RunAllReduceCudaHandler,
                              FLUX_JAX_CUDA_COLLECTIVE_BINDING());
#endif
