// The `flux_jax._flux_jax_ffi` extension: handler capsules for jax.ffi
// registration, build facts, and process-state controls. No kernel code.
#include <nanobind/nanobind.h>

#include <stdexcept>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "flux_jax/cpu_channels.h"
#include "flux_jax/gpu_checks.h"
#include "flux_jax/wait_record.h"
#include "flux_jax/limits.h"
#include "flux_jax/process.h"
#include "flux_jax/tile_order.h"
#include "handler_stats.h"
#include "handlers.h"
#include "xla/ffi/api/c_api.h"

#ifdef FLUX_JAX_WITH_CUDA

#include "flux_jax/cuda_runtime.h"
#endif

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "FFI handlers must have the XLA_FFI_Handler signature");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict Registrations() {
  nb::dict cpu;
#define FLUX_JAX_OP(snake, Pascal) cpu["flux_jax_" #snake] = Capsule(FluxJax##Pascal##Cpu);
#include "flux_jax/ops.def"
#undef FLUX_JAX_OP
  nb::dict all;
  all["cpu"] = cpu;
#ifdef FLUX_JAX_WITH_CUDA
  nb::dict cuda;
#define FLUX_JAX_OP(snake, Pascal) cuda["flux_jax_" #snake] = Capsule(FluxJax##Pascal##Cuda);
#include "flux_jax/ops.def"
#undef FLUX_JAX_OP
  all["CUDA"] = cuda;
#endif
  return all;
}

// The ops of flux_jax/ops.def, in order.
std::vector<std::string> Ops() {
  return {
#define FLUX_JAX_OP(snake, Pascal) #snake,
#include "flux_jax/ops.def"
#undef FLUX_JAX_OP
  };
}

// The kernel limits the Python planner respects (flux_jax/limits.h).
nb::dict Limits() {
  namespace l = flux_jax::limits;
  nb::dict d;
  d["cpu_max_tp"] = l::kCpuMaxTp;
  d["gpu_max_tp"] = l::kGpuMaxTp;
  d["latency_max_tp"] = l::kLatencyMaxTp;
  d["decode_max_tp"] = l::kDecodeMaxTp;
  d["decode_ag_max_rows"] = l::kDecodeAgMaxRows;
  d["decode_rs_max_rows"] = l::kDecodeRsMaxRows;
  d["decode_rs_max_n"] = l::kDecodeRsMaxN;
  d["decode_ar_max_rows"] = l::kDecodeArMaxRows;
  d["decode_ar_max_elements"] = l::kDecodeArMaxElements;
  d["gpu_align_elements"] = l::kGpuAlignElements;
  return d;
}

nb::dict BuildInfo() {
  nb::dict info;
  info["version"] = FLUX_JAX_VERSION;
  info["ffi_api_version"] = std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
  info["jaxlib_headers"] = FLUX_JAX_JAXLIB_HEADERS_VERSION;
#ifdef FLUX_JAX_WITH_CUDA
  info["cuda"] = true;
  info["cuda_archs"] = FLUX_JAX_CUDA_ARCHS;
  info["cuda_version"] = FLUX_JAX_CUDA_VERSION;
  info["cutlass_version"] = FLUX_JAX_CUTLASS_VERSION;
#else
  info["cuda"] = false;
  info["cuda_archs"] = "";
  info["cuda_version"] = "";
  info["cutlass_version"] = "";
#endif
  return info;
}

// A device-side wait record (flux_jax/wait_record.h) from {field: value}; absent fields are 0.
flux_jax::DeviceError WaitRecord(const nb::dict& d) {
  auto get = [&](const char* key) -> int64_t { return d.contains(key) ? nb::cast<int64_t>(d[key]) : 0; };
  flux_jax::DeviceError e{};
  e.code = static_cast<int32_t>(get("code"));
  e.site = static_cast<int32_t>(get("site"));
  e.device = static_cast<int32_t>(get("device"));
  e.rank = static_cast<int32_t>(get("rank"));
  e.peer = static_cast<int32_t>(get("peer"));
  e.chunk = static_cast<int32_t>(get("chunk"));
  e.piece = static_cast<int32_t>(get("piece"));
  e.missing = static_cast<int32_t>(get("missing"));
  e.epoch = static_cast<uint64_t>(get("epoch"));
  e.seen = static_cast<uint64_t>(get("seen"));
  return e;
}

flux_jax::IpcAreaSizes AreaSizes(const std::vector<uint64_t>& v) {
  if (v.size() != 4) throw std::invalid_argument("need (ctrl, data, slots, ll) bytes");
  return {v[0], v[1], v[2], v[3]};
}

}  // namespace

NB_MODULE(_flux_jax_ffi, m) {
  m.doc() = "flux_jax native extension: FFI handlers and process-wide state.";
  m.def("registrations", &Registrations, "{platform: {target name: handler capsule}} for jax.ffi.register_ffi_target.");
  m.def("build_info", &BuildInfo, "What this extension was built with.");
  m.def("ops", &Ops, "The custom calls of this extension (flux_jax/ops.def), in order.");
  m.def("limits", &Limits, "Kernel limits the planner respects (flux_jax/limits.h).");
  m.def("reset_cpu_channels", &flux_jax::ResetCpuChannels, "Drop all CPU-backend channels (also clears failed state).");
  m.def("cpu_channel_count", &flux_jax::CpuChannelCount, "Number of live CPU-backend channels.");
  m.def("set_process_identity", &flux_jax::SetProcessIdentity, nb::arg("process_index"), nb::arg("session"),
        "This process's index and the job token ('' in a single-process job).");
  m.def(
      "register_local_devices",
      [](const std::string& platform, const std::vector<std::pair<int32_t, int64_t>>& pairs) {
        flux_jax::RegisterLocalDevices(platform == "cpu" ? flux_jax::Platform::kCpu : flux_jax::Platform::kCuda, pairs);
      },
      nb::arg("platform"), nb::arg("ordinal_to_id"),
      "Map local device ordinals (what handlers see) to global device ids (the mesh table).");
  m.def(
      "handler_host_stats",
      [] {
        namespace fa = flux_jax::ffi_adapter;
        nb::dict out;
        for (int i = 0; i < static_cast<int>(fa::HandlerOp::kCount); ++i) {
          const auto op = static_cast<fa::HandlerOp>(i);
          const fa::HandlerStat s = fa::GetHandlerStat(op);
          out[fa::HandlerOpName(op)] = nb::make_tuple(s.calls, s.total_ns, s.max_ns);
        }
        return out;
      },
      "{op: (calls, total host ns, max host ns)} of the FFI handlers since the last reset.");
  m.def("reset_handler_host_stats", &flux_jax::ffi_adapter::ResetHandlerStats,
        "Zero the handlers' host-time counters.");
  m.def(
      "grouped_tile_order",
      [](int tiles_m, int tiles_n, int group, int rotate, bool serpentine) {
        if (tiles_m < 1 || tiles_n < 1 || group < 1 || rotate < 0 || rotate >= tiles_m) {
          throw std::invalid_argument(
              "grouped_tile_order: need tiles_m, tiles_n, group >= 1 and 0 <= rotate < tiles_m");
        }
        const flux_jax::GroupedTileOrder grouped(tiles_m, tiles_n, group, rotate, serpentine);
        std::vector<std::pair<int, int>> order;
        order.reserve(static_cast<size_t>(tiles_m) * tiles_n);
        for (int t = 0; t < tiles_m * tiles_n; ++t) {
          const flux_jax::TileCoord c = grouped.At(t);
          order.emplace_back(c.m, c.n);
        }
        return order;
      },
      nb::arg("tiles_m"), nb::arg("tiles_n"), nb::arg("group"), nb::arg("rotate"), nb::arg("serpentine") = false,
      "The overlap GEMM's (m, n) tile order (flux_jax/tile_order.h), for tests.");
  m.def(
      "fast_divide",
      [](const std::vector<int>& numerators, int divisor) {
        if (divisor < 1) throw std::invalid_argument("fast_divide: need divisor >= 1");
        const flux_jax::FastDivisor d(divisor);
        std::vector<int> out;
        out.reserve(numerators.size());
        for (int n : numerators) {
          if (n < 0) throw std::invalid_argument("fast_divide: need numerators >= 0");
          out.push_back(d.Div(n));
        }
        return out;
      },
      nb::arg("numerators"), nb::arg("divisor"),
      "n // divisor for each n by the schedulers' multiply-and-shift division (flux_jax/tile_order.h), for tests.");
  // The CUDA backend's diagnostics and setup checks, host-only: tested on CPU
  // (tests/test_gpu_diagnostics.py) with the code the GPU build runs.
  m.def(
      "describe_wait_failure",
      [](const nb::dict& own, const nb::dict& first, int device, const std::string& group) {
        return flux_jax::DescribeWaitFailure(WaitRecord(own), WaitRecord(first), device, group);
      },
      nb::arg("own"), nb::arg("first"), nb::arg("device"), nb::arg("group"),
      "The error of a rank whose device-side wait record is `own`, after the GPU's first failure `first` "
      "(flux_jax/wait_record.h); '' if neither holds one.");
  m.def(
      "check_hardware_queues",
      [](std::optional<std::string> env, int ranks_on_gpu, int device, const std::string& group) {
        return flux_jax::CheckHardwareQueues(env ? env->c_str() : nullptr, ranks_on_gpu, device, group).message();
      },
      nb::arg("env").none(), nb::arg("ranks_on_gpu"), nb::arg("device"), nb::arg("group"),
      "'' if CUDA_DEVICE_MAX_CONNECTIONS=`env` (None: unset) serves `ranks_on_gpu` ranks of a TP group "
      "on one GPU, else the error (flux_jax/gpu_checks.h).");
  m.def(
      "check_ipc_peer",
      [](int peer, int tp, int declared_rank, int declared_tp, const std::vector<uint64_t>& declared,
         const std::vector<uint64_t>& expected, const std::vector<uint64_t>& mapped, const std::string& group) {
        return flux_jax::CheckIpcPeer(peer, tp, declared_rank, declared_tp, AreaSizes(declared), AreaSizes(expected),
                                      AreaSizes(mapped), group)
            .message();
      },
      nb::arg("peer"), nb::arg("tp"), nb::arg("declared_rank"), nb::arg("declared_tp"), nb::arg("declared"),
      nb::arg("expected"), nb::arg("mapped"), nb::arg("group"),
      "'' if a peer's CUDA IPC blob (declared sizes, mapped sizes) fits this process's member, else the error "
      "(flux_jax/gpu_checks.h).");
  m.def(
      "clustered_tile_order",
      [](int tiles_m, int tiles_n, int group, int rotate, int cluster_m, int cluster_n, bool serpentine) {
        if (tiles_m < 1 || tiles_n < 1 || group < 1 || rotate < 0 || rotate >= tiles_m || cluster_m < 1 ||
            cluster_n < 1 || (cluster_m > 1 && cluster_n > 1)) {
          throw std::invalid_argument(
              "clustered_tile_order: need tiles_m, tiles_n, group, cluster_m, cluster_n >= 1, one of the cluster "
              "sizes 1, and 0 <= rotate < tiles_m");
        }
        // The scheduler's order: cluster ids t, then the CTAs of each cluster.
        const int ctas = cluster_m * cluster_n;
        const int clusters = (tiles_m + cluster_m - 1) / cluster_m * ((tiles_n + cluster_n - 1) / cluster_n);
        const flux_jax::ClusteredTileOrder clustered(tiles_m, tiles_n, group, rotate, cluster_m, cluster_n, serpentine);
        std::vector<std::pair<int, int>> order;
        order.reserve(static_cast<size_t>(clusters) * ctas);
        for (int t = 0; t < clusters; ++t) {
          for (int cta = 0; cta < ctas; ++cta) {
            const flux_jax::TileCoord c = clustered.At(t, cta);
            order.emplace_back(c.m, c.n);
          }
        }
        return order;
      },
      nb::arg("tiles_m"), nb::arg("tiles_n"), nb::arg("group"), nb::arg("rotate"), nb::arg("cluster_m"),
      nb::arg("cluster_n") = 1, nb::arg("serpentine") = false,
      "The (m, n) tile order of an overlap GEMM with clusters of cluster_m x cluster_n CTAs (tiles_m, tiles_n "
      "padded to whole clusters), for tests.");
#ifdef FLUX_JAX_WITH_CUDA
  m.def("cuda_kernels", &Ops, "Ops with CUDA kernels in this build (all of ops.def).");
  m.def("reset_cuda_workspaces", &flux_jax::ResetCudaWorkspaces,
        "Free all GPU workspaces and clear device error records.");
  m.def("cuda_workspace_bytes", &flux_jax::CudaWorkspaceBytes, nb::arg("device"),
        "Workspace bytes held on a GPU outside XLA's pool.");
  m.def(
      "cuda_auto_gemm_plan",
      [](const std::string& dtype, bool w_transposed, int64_t m, int64_t k, int64_t n, int64_t chunk_rows, int sm_count,
         int dram_gbps) {
        int64_t kernel = 0;
        int32_t group = 0;
        flux_jax::Status s =
            flux_jax::CudaAutoGemmPlan(dtype, w_transposed, m, k, n, chunk_rows, sm_count, dram_gbps, &kernel, &group);
        if (!s.ok()) throw std::invalid_argument(s.message());
        return nb::make_tuple(kernel, group);
      },
      nb::arg("dtype"), nb::arg("w_transposed"), nb::arg("m"), nb::arg("k"), nb::arg("n"), nb::arg("chunk_rows"),
      nb::arg("sm_count"), nb::arg("dram_gbps"),
      "(GpuTuning.gemm_kernel, tile_group_m) that auto resolves to for an m x k x n overlap GEMM whose rows are "
      "read in chunks of chunk_rows, on sm_count SMs with dram_gbps GB/s of peak DRAM bandwidth (0: unknown): an "
      "index of GEMM_KERNELS and a group of row tiles.");
  m.def(
      "cuda_gemm_rule_inputs",
      [](int device) {
        int sm_count = 0, dram_gbps = 0;
        flux_jax::Status s = flux_jax::CudaGemmRuleInputs(device, &sm_count, &dram_gbps);
        if (!s.ok()) throw std::runtime_error(s.message());
        return nb::make_tuple(sm_count, dram_gbps);
      },
      nb::arg("device"),
      "(SMs, peak DRAM bandwidth in GB/s) of CUDA device `device`: what the overlap GEMM rule reads of the GPU.");
  m.def("cuda_device_error", &flux_jax::CudaDeviceError, nb::arg("device"),
        "Diagnostic of the device-side waits that gave up on a GPU (a line per rank), or ''.");
  m.def(
      "cuda_ipc_export",
      [](const std::vector<int64_t>& devices, const std::vector<int64_t>& processes, int32_t ordinal, size_t data_bytes,
         size_t slot_bytes) {
        std::string blob;
        flux_jax::Status s = flux_jax::CudaIpcExport(devices, processes, ordinal, data_bytes, slot_bytes, &blob);
        if (!s.ok()) throw std::runtime_error(s.message());
        return nb::bytes(blob.data(), blob.size());
      },
      nb::arg("devices"), nb::arg("processes"), nb::arg("ordinal"), nb::arg("data_bytes"), nb::arg("slot_bytes"),
      "Set up this process's member of a cross-process TP group; its IPC blob.");
  m.def(
      "cuda_ipc_import",
      [](const std::vector<int64_t>& devices, const std::vector<int64_t>& processes, int32_t ordinal, int peer_rank,
         nb::bytes blob) {
        flux_jax::Status s =
            flux_jax::CudaIpcImport(devices, processes, ordinal, peer_rank, std::string(blob.c_str(), blob.size()));
        if (!s.ok()) throw std::runtime_error(s.message());
      },
      nb::arg("devices"), nb::arg("processes"), nb::arg("ordinal"), nb::arg("peer_rank"), nb::arg("blob"),
      "Open a remote rank's IPC blob for the member of `ordinal`.");
#endif
}
