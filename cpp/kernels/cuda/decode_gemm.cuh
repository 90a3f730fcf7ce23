// The decode paths' GEMM (ag_matmul at M <= 256 rows, matmul_rs and matmul_ar
// at <= 128): CUTLASS sm90 ping-pong kernel in cuBLAS/nvjet's orientation,
// whose producer streams the weight before the gathered rows have arrived;
// bfloat16, or FP8 with the scales in its epilogue. Included only by the
// instantiation units gemm_decode_bf16.cu and gemm_decode_e4m3.cu.
//
// Orientation: out[M, N] = X[M, K] W[K, N] is computed as out^T = W^T X^T, so
// the weight's N columns run along the tile's 64-wide M and X's rows along
// its N (64, 128 or 256): at M = 64 no MMA row is wasted, and N / 64 tiles (80 at
// N = 5120, 128 at 8192) put the weight stream on that many SMs. Measured
// alone on one H200 (docs/decisions/2026-11-30-ag-decode-path.md):
// 26.5 us at 64 x 8192 x 5120 against cuBLAS's 29.7, 28.2 vs 28.3 at 128 rows.
//
// Schedule of one CTA (producer warp; the MMA warpgroups are CUTLASS's):
//
//   stage:   0    1    2   ..  S-1   S    S+1 ..
//   A (W):   |----|----|--..--|      (issued at once: the weight streams)
//   wait:                      [push flags of every rank >= epoch]
//   B (X):   |----|----|--..--|----|----|..   (then A and B together)
//
// Each stage's full barrier expects A + B bytes, so a stage whose A landed
// before the rows did simply completes later; no MMA reads a stage early.
#pragma once

#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "decode_exchange.cuh"
#include "decode_gemm.h"
#include "device_sync.cuh"
#include "fp8_scale_epilogue.cuh"
#include "launch_params_cache.h"

namespace flux_jax::cuda {

// B's element type as the mainloop's TMA reads it: CUTLASS's FP8 mainloop with
// promotion names it ElementB, the others InternalElementB.
template <class Mainloop, class = void>
struct LoadedElementB {
  using type = typename Mainloop::ElementB;
};
template <class Mainloop>
struct LoadedElementB<Mainloop, std::void_t<typename Mainloop::InternalElementB>> {
  using type = typename Mainloop::InternalElementB;
};

// Mainloop whose first tile of each CTA issues the weight (A) loads of every
// pipeline stage, then waits for the pushed rows (PushGate), then loads X (B).
template <class Base>
struct DeferredRowsMainloop : Base {
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  static_assert(cute::size(ClusterShape{}) == 1, "DeferredRowsMainloop supports cluster 1x1 only");
  static constexpr int kStages = Base::K_PIPE_MAX;

  struct Arguments : Base::Arguments {
    PushGate gate;
    // Rows of B (X) that may be read, >= the problem's: the row tile rounded up. A TMA box that
    // runs past its tensor's end takes a slow path (the GEMM alone: 40.3 us at 8 rows against
    // 27.4 at 64, 64 x 8192 x 5120 on one H200); rows
    // past the problem's are read (any values) but never stored.
    int32_t b_rows_readable = 0;
  };
  struct Params : Base::Params {
    PushGate gate;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    using namespace cute;
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(problem_shape, args, workspace);
    params.gate = args.gate;
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    if (args.b_rows_readable > static_cast<int32_t>(N)) {
      auto ptr = reinterpret_cast<typename LoadedElementB<Base>::type const*>(args.ptr_B);
      Tensor tensor = make_tensor(ptr, make_layout(make_shape(args.b_rows_readable, K, L), args.dB));
      params.tma_load_b = make_tma_copy_B_sm90(typename Base::GmemTiledCopyB{}, tensor, SmemLayoutB{}(_, _, Int<0>{}),
                                               TileShape{}, ClusterShape{});
    }
    return params;
  }

  // Producer warp, once per work tile (the whole warp enters).
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int /*thread_idx*/,
                           uint32_t /*block_rank_in_cluster*/, TensorStorage& shared_tensors) {
    using namespace cute;
    const bool leader = cute::elect_one_sync();
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    auto block_tma_a = params.tma_load_a.get_slice(0);
    auto block_tma_b = params.tma_load_b.get_slice(0);
    Tensor tAgA = block_tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord));
    Tensor tAsA = block_tma_a.partition_D(sA);
    Tensor tBgB = block_tma_b.partition_S(get<1>(load_inputs)(_, _, n_coord, _, l_coord));
    Tensor tBsB = block_tma_b.partition_D(sB);

    // Senders whose rows this tile reads (its row tile is mode 1 of the problem), as a mask.
    const uint32_t needed = SendersOf(params.gate, static_cast<int32_t>(get<1>(blk_coord)));
    if (needed & ~senders_ready_) {
      const int deferred = k_tile_count < kStages ? k_tile_count : kStages;
      PipelineState write = smem_pipe_write;
      KTileIterator k_iter = k_tile_iter;
      for (int j = 0; j < deferred; ++j, ++write, ++k_iter) {
        if (leader) {
          pipeline.producer_acquire(write);
          copy(params.tma_load_a.with(*pipeline.producer_get_barrier(write), 0), tAgA(_, _, _, *k_iter),
               tAsA(_, _, _, write.index()));
        }
      }
      __syncwarp();
      WarpWaitPushes(params.gate, __ffs(needed) - 1, 31 - __clz(needed));
      senders_ready_ |= needed;
      for (int j = 0; j < deferred; ++j, ++smem_pipe_write, ++k_tile_iter) {
        if (leader) {
          copy(params.tma_load_b.with(*pipeline.producer_get_barrier(smem_pipe_write), 0), tBgB(_, _, _, *k_tile_iter),
               tBsB(_, _, _, smem_pipe_write.index()));
        }
      }
      k_tile_count -= deferred;
    }
    if (!leader) return;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count, ++smem_pipe_write, ++k_tile_iter) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      copy(params.tma_load_a.with(*barrier, 0), tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, smem_pipe_write.index()));
      copy(params.tma_load_b.with(*barrier, 0), tBgB(_, _, _, *k_tile_iter), tBsB(_, _, _, smem_pipe_write.index()));
    }
  }

 private:
  static constexpr int kTileRows = cute::size<1>(TileShape{});

  // Bit q set: the tile of row tile `row_tile` reads rows that sender q pushes.
  static CUTLASS_DEVICE uint32_t SendersOf(PushGate const& g, int32_t row_tile) {
    if (g.flags == nullptr || g.senders <= 0) return 0;
    const uint32_t all = (g.senders >= 32 ? ~0u : (1u << g.senders) - 1);
    if (g.rows_per_sender <= 0) return all;
    const int32_t q_lo = row_tile * kTileRows / g.rows_per_sender;
    const int32_t q_hi = min(g.senders - 1, (row_tile * kTileRows + kTileRows - 1) / g.rows_per_sender);
    if (q_lo > q_hi) return 0;  // rows past the last sender's: read, never stored
    return (all >> q_lo << q_lo) & ((2u << q_hi) - 1);
  }

  // Per CTA: senders whose flags it has seen this call, so each row tile waits only for its own
  // rows' senders, and only the first time (at decode sizes every CTA's first tile waits).
  uint32_t senders_ready_ = 0;
};

// out^T[N, M] = W^T[N, K] X^T: CUTLASS problem (N, M, K). In CUTLASS 2.x layout
// terms: A = W^T column-major (w[k, n] row-major as it comes), B = X K-major
// (ColumnMajor), D = out^T column-major (out[m, n] row-major). kExchange: the epilogue can also
// reduce-scatter or all-reduce (DecodeExchange); an instance without it serves ag_matmul only.
template <class Element, int kRowsPerTile, bool kExchange_ = true>
struct DecodeGemmInstance {
  static constexpr bool kExchange = kExchange_;
  using Layout = cutlass::layout::ColumnMajor;
  static constexpr int kAlignment = 8;  // 16 bytes: K and N multiples of 8
  using TileShape = cute::Shape<cute::_64, cute::Int<kRowsPerTile>, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;

  using BaseEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, Layout, kAlignment, Element, Layout,
      kAlignment, cutlass::epilogue::TmaWarpSpecialized>::CollectiveOp;
  // One kernel for every decode path: the exchange runs only when the plan has one (matmul_rs,
  // matmul_ar).
  using Epilogue = std::conditional_t<kExchange, ExchangingEpilogue<BaseEpilogue>, BaseEpilogue>;

  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, Layout, kAlignment, Element, Layout, kAlignment,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, DeferredRowsMainloop<BaseMainloop>,
                                           Epilogue, cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static constexpr const char* kRequirement = "K and N must be multiples of 8";

  // D = alpha * acc, alpha read per tile: a wait that times out poisons alpha after the epilogue
  // would have read it once at kernel start, so a nonzero batch stride makes it read alpha per
  // tile (batch 0 only) and the tile whose rows never came (its epilogue runs after its loads)
  // comes out NaN.
  template <class EpilogueArguments>
  static void SetEpilogue(EpilogueArguments& ep, const DecodeGemmPlan& p) {
    ep.thread.alpha = 1.0f;
    ep.thread.alpha_ptr = p.alpha_ptr;
    ep.thread.dAlpha = {cute::_0{}, cute::_0{}, 1};
    ep.thread.beta = 0.0f;
    ep.ptr_C = static_cast<Element const*>(p.d);
    ep.dC = cutlass::make_cute_packed_stride(typename Kernel::StrideC{},
                                             cute::make_shape(static_cast<int>(p.n), static_cast<int>(p.rows), 1));
  }
};

// The FP8 decode GEMM: w float8_e4m3fn transposed ([n, k], K-major: A = W^T row-major) and the
// rows float8_e4m3fn (K-major, as in DecodeGemmInstance), float32 accumulation, bfloat16 out, the
// scales in a visitor epilogue; in the kernel's (N, M) orientation
//
//   D[j, i] = alpha * (col_scale[j] * (row_scale[i] * acc[j, i]))   (j: w's column, i: x's row)
//
// w's column scales run along the tile's M (a column broadcast), x's row scales along its N (a row
// broadcast, predicated past the last row). 128 bytes of K per stage, as the FP8 overlap GEMM.
// The accumulator is promoted to float32 every 128 elements of K (CUTLASS's FP8 mainloop without
// fast accumulation): the tensor cores' own FP8 accumulation lost precision with K (one H200,
// against the exact product of the quantized operands: 11x the twin's error at K = 28672). It
// costs time: 5% at 64 rows, 62% with 128-row tiles (docs/decisions/2026-12-02-fp8-decode-accumulation.md).
template <int kRowsPerTile>
struct DecodeGemmInstanceFp8 {
  static constexpr bool kExchange = true;
  using Element = cutlass::float_e4m3_t;
  using ElementD = cutlass::bfloat16_t;
  static constexpr int kAlignmentAB = 16;  // 16 bytes: K a multiple of 16
  static constexpr int kAlignmentD = 8;    // N a multiple of 8
  using TileShape = cute::Shape<cute::_64, cute::Int<kRowsPerTile>, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;

  using Scale = Fp8ScaleTree<TileShape, 1>;
  using Fusion = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, ElementD, float,
                                             cutlass::FloatRoundStyle::round_to_nearest>,
      typename Scale::Alpha, typename Scale::Vectors>;

  using BaseEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::ColumnMajor, kAlignmentD,
      ElementD, cutlass::layout::ColumnMajor, kAlignmentD, cutlass::epilogue::TmaWarpSpecialized, Fusion>::CollectiveOp;
  using Epilogue = ExchangingEpilogue<BaseEpilogue>;

  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlignmentAB, Element,
      cutlass::layout::ColumnMajor, kAlignmentAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, DeferredRowsMainloop<BaseMainloop>,
                                           Epilogue, cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static constexpr const char* kRequirement = "K must be a multiple of 16 and N of 8";

  // The visitor tree's arguments: {alpha, {w_scale, {row_scale, acc, *}, *}, *} (in the kernel's
  // orientation w's column scales run along M, x's row scales along N).
  template <class EpilogueArguments>
  static void SetEpilogue(EpilogueArguments& ep, const DecodeGemmPlan& p) {
    Scale::Set(ep.thread, p.alpha_ptr, p.col_scale, p.row_scale);
  }
};

// What a launch's kernel parameters are built from, less the epoch (patched per call). No
// padding: keys compare as bytes (launch_params_cache.h).
struct DecodeGemmKey {
  const void* x;
  const void* w;
  void* d;
  const float* alpha_ptr;
  const float* row_scale;
  const float* col_scale;
  const uint64_t* flags;
  DeviceError* error;
  int64_t rows, x_rows_readable, n, k, sm_count;
  int32_t senders, blocks, stride, device;
};

// CUTLASS arguments of a launch (built on a cache miss only).
template <class Instance>
typename Instance::Kernel::Arguments DecodeArguments(const DecodeGemmPlan& p, int device, int sm_count) {
  using Kernel = typename Instance::Kernel;
  const int rows = static_cast<int>(p.rows), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
  typename Kernel::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {n, rows, k, 1};
  auto& ml = args.mainloop;
  ml.ptr_A = static_cast<typename Kernel::ElementA const*>(p.w);
  ml.dA = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, cute::make_shape(n, k, 1));
  ml.ptr_B = static_cast<typename Kernel::ElementB const*>(p.x);
  ml.dB = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, cute::make_shape(rows, k, 1));
  ml.gate = p.gate;
  ml.b_rows_readable = static_cast<int32_t>(p.x_rows_readable);
  auto& ep = args.epilogue;
  Instance::SetEpilogue(ep, p);
  ep.ptr_D = static_cast<typename Kernel::ElementD*>(p.d);
  ep.dD = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, cute::make_shape(n, rows, 1));
  if constexpr (Instance::kExchange) ep.exchange = p.exchange;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  return args;
}

template <class Instance>
Status RunDecodeGemmInstance(const DecodeGemmPlan& p, cudaStream_t stream, int device, int sm_count) {
  using Kernel = typename Instance::Kernel;
  using Params = typename Kernel::Params;
  if constexpr (!Instance::kExchange) {
    if (p.exchange.tp > 0) return Status::Internal("flux_jax: this decode GEMM instance has no exchange");
  }
  DecodeGemmKey key{};
  key.x = p.x;
  key.w = p.w;
  key.d = p.d;
  key.alpha_ptr = p.alpha_ptr;
  key.row_scale = p.row_scale;
  key.col_scale = p.col_scale;
  key.flags = p.gate.flags;
  key.error = p.gate.ctx.error;
  key.rows = p.rows;
  key.x_rows_readable = p.x_rows_readable;
  key.n = p.n;
  key.k = p.k;
  key.senders = p.gate.senders;
  key.blocks = p.gate.blocks;
  key.stride = p.gate.stride;
  key.device = device;
  key.sm_count = sm_count;
  static LaunchParamsCache<DecodeGemmKey, Params> cache;
  Params params;
  cutlass::Status st = cache.Get(
      key, cutlass::Status::kSuccess,
      [&](Params* out) {
        const auto args = DecodeArguments<Instance>(p, device, sm_count);
        if (Instance::Gemm::can_implement(args) != cutlass::Status::kSuccess)
          return cutlass::Status::kErrorInvalidProblem;
        *out = Kernel::to_underlying_arguments(args, nullptr);  // the persistent scheduler takes no workspace
        return cutlass::Status::kSuccess;
      },
      &params);
  if (st == cutlass::Status::kErrorInvalidProblem) {
    return Status::InvalidArgument("flux_jax: CUTLASS cannot implement the decode GEMM rows=" + std::to_string(p.rows) +
                                   " n=" + std::to_string(p.n) + " k=" + std::to_string(p.k) + " (" +
                                   Instance::kRequirement + ")");
  }
  // This call's epoch and timeout (and, with an exchange, its output and receive slots).
  params.mainloop.gate = p.gate;
  if constexpr (Instance::kExchange) params.epilogue.exchange = p.exchange;
  // The kernel's shared-memory size was set once per device (PreloadDecodeGemmInstance).
  if (st == cutlass::Status::kSuccess) st = Instance::Gemm::run(params, stream, nullptr, p.early_launch);
  if (st != cutlass::Status::kSuccess) {
    return Status::Internal(std::string("flux_jax: decode GEMM launch failed: ") + cutlass::cutlassGetStatusString(st) +
                            " / " + cudaGetErrorString(cudaGetLastError()));
  }
  return Status::Ok();
}

template <class Instance>
Status PreloadDecodeGemmInstance() {
  using Kernel = typename Instance::Kernel;
  cudaError_t err = cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(Kernel::SharedStorageSize));
  if (err != cudaSuccess) {
    return Status::Internal(std::string("flux_jax: loading the decode GEMM failed: ") + cudaGetErrorString(err));
  }
  return Status::Ok();
}

}  // namespace flux_jax::cuda
