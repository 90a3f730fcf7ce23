// CUTLASS sm90 extensions that turn the warp-specialized persistent GEMM into
// the FLUX kernels, without forking CUTLASS: three small derived types plug into
// the hooks `GemmUniversal<Problem, Mainloop, Epilogue, SchedulerTag>` exposes.
//
//  RotatedScheduler  PersistentTileSchedulerSm90 with a grouped tile order
//                    (L2 reuse) whose M tile index is rotated by a per-launch
//                    offset, so rank r starts on its own rows.
//  GatedMainloop     the TMA producer warp waits on the row-piece flags of a
//                    tile's A rows before loading them; tiles inside the local
//                    chunk read A straight from the caller's buffer through a
//                    second TMA descriptor (no local copy).
//  GatedEpilogue     the epilogue producer waits on the flags of a tile's C rows
//                    (received partial sums) before loading C; optionally the
//                    epilogue raises per-piece tile counters once a tile's D
//                    stores are written (a copy stream waits on them).
//
// Consumers (the MMA warpgroups) never poll.
//
// Clusters: 1x1; cluster_m x 1 along M (the CTAs of a cluster compute
// adjacent 128-row tiles of the same n and share the B tile by TMA multicast,
// each CTA loading 1/cluster_m of it into every CTA of the cluster); or
// 1 x cluster_n along N (adjacent column tiles of the same m sharing the A tile
// the same way). Each CTA waits for its own tile's A rows before it loads its
// share, so results stay correct either way.
//  - cluster_m x 1: a CTA whose rows have not arrived also holds back its share
//    of B, so its peer waits for the later of the two tiles' rows. Both tiles
//    wait for the same piece when pieces and chunks are whole clusters of rows
//    (op_common.h rounds pieces to whole clusters; a chunk of an odd number of
//    128-row tiles still puts one cluster across two chunks).
//  - 1 x cluster_n: every CTA of a cluster waits for the same rows (the A rows
//    it loads a share of are its own tile's), so the gate costs nothing extra.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "device_sync.cuh"
#include "flux_jax/tile_order.h"

namespace flux_jax::cuda {

// ---------------------------------------------------------------------------
// Tile order: grouped raster, then the M index rotated by a per-launch offset.
//
// The scheduler counts its CTAs' work as the base does (raster along N, no
// swizzle, cluster by cluster), giving cluster ids t = 0, 1, ...;
// flux_jax::ClusteredTileOrder (flux_jax/tile_order.h,
// tested on CPU) maps t to a tile of a group of `group_m` M tiles swept
// together across N, so the ~132 tiles in flight share ~group_m row blocks of A and ~132/group_m
// column blocks of B, which stay in L2 (plain raster along N streams the whole
// of B once per ~132/tiles_n row blocks: 15-30% slower at N >= 14336). The last
// group may hold fewer rows; nothing is padded. Then m += rotate (mod tiles_m),
// so rank r starts on its own rows.
// ---------------------------------------------------------------------------
struct RotatedSchedulerTag {};

// kClusterM, kClusterN: the cluster shape (one of them 1), compile-time constants so that 1x1
// clusters remap exactly as GroupedTileOrder (no extra registers in any warp).
template <int kClusterM = 1, int kClusterN = 1>
class RotatedScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  struct Arguments : Base::Arguments {
    int32_t rotate_m_tiles = 0;
    int32_t group_m_tiles = 1;
    bool serpentine = false;  // odd groups sweep N backwards (flux_jax/tile_order.h)
  };
  struct Params : Base::Params {
    ClusteredTileOrder order;  // divisors precomputed here: no integer division per tile
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShape cluster_shape, cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Arguments base_args = args;  // the base must raster plainly: get_current_work's index relies on it
    base_args.max_swizzle_size = 1;
    base_args.raster_order = Base::RasterOrderOptions::AlongN;
    Params params;
    static_cast<Base::Params&>(params) =
        Base::to_underlying_arguments(problem_shape_mnkl, tile_shape, cluster_shape, hw_info, base_args, workspace,
                                      epilogue_subtile, ktile_start_alignment_count);
    const int m = static_cast<int>(cute::get<0>(problem_shape_mnkl));
    const int n = static_cast<int>(cute::get<1>(problem_shape_mnkl));
    const int tiles_m = (m + cute::size<0>(tile_shape) - 1) / cute::size<0>(tile_shape);
    const int tiles_n = (n + cute::size<1>(tile_shape) - 1) / cute::size<1>(tile_shape);
    const int rotate = tiles_m > 0 ? args.rotate_m_tiles % tiles_m : 0;
    const int group = args.group_m_tiles < 1 ? 1 : args.group_m_tiles;
    params.order = ClusteredTileOrder(tiles_m > 0 ? tiles_m : 1, tiles_n > 0 ? tiles_n : 1, group, rotate, kClusterM,
                                      kClusterN, args.serpentine);
    static_assert(cute::size<0>(ClusterShape{}) == kClusterM && cute::size<1>(ClusterShape{}) == kClusterN,
                  "RotatedScheduler: cluster shape mismatch");
    return params;
  }

  CUTLASS_HOST_DEVICE RotatedScheduler() {}
  CUTLASS_DEVICE explicit RotatedScheduler(Params const& params)
      : Base(params), order_(params.order), tiles_(static_cast<int>(params.blocks_per_problem_)) {
#if defined(__CUDA_ARCH__)
    linear_ = static_cast<int>(blockIdx.x + blockIdx.y * gridDim.x);  // as the base's, which rasters along N
    stride_ = static_cast<int>(gridDim.x * gridDim.y * gridDim.z);
#endif
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return get_current_work();
  }

  // The cooperative kernel steps with fetch_next_work (both overloads: advance one grid stride);
  // the ping-pong kernel with advance_to_next_work(count), then reads get_current_work().
  template <class... Unused>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo, Unused&&...) {
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }

  CUTLASS_DEVICE void advance_to_next_work(uint32_t advance_count = 1) {
    Base::advance_to_next_work(advance_count);  // the base's own index (is_last_tile reads it)
    linear_ += stride_ * static_cast<int>(advance_count);
  }

  // The base's linear index counts CTAs cluster by cluster (clusters padded whole), so the
  // cluster's id in the plain order is linear / cluster size and the CTA's place in it the
  // hardware's: no run-time division (the base's own mapping divides in 64 bits per tile).
  CUTLASS_DEVICE WorkTileInfo get_current_work() const {
    if (linear_ >= tiles_) return WorkTileInfo::invalid_work_tile();
    static_assert(kClusterM == 1 || kClusterN == 1, "RotatedScheduler: clusters along M or N");
    int cta = 0;
    if constexpr (kClusterM * kClusterN > 1) {
      auto [cta_m, cta_n, unused] = cute::block_id_in_cluster();
      cta = static_cast<int>(kClusterN > 1 ? cta_n : cta_m);
    }
    const TileCoord c = order_.At(linear_ / (kClusterM * kClusterN), cta);
    return {c.m, c.n, 0, true};
  }

 private:
  ClusteredTileOrder order_;
  int tiles_ = 0;  // CTAs' tiles of the problem, padded to whole clusters
  int linear_ = 0;
  int stride_ = 0;
};

// ---------------------------------------------------------------------------
// Mainloop: gate A loads on row-piece flags; local tiles from a 2nd descriptor.
// ---------------------------------------------------------------------------
template <class Base>
struct GatedMainloop : Base {
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  static constexpr int kClusterM = cute::size<0>(ClusterShape{});
  static constexpr int kClusterN = cute::size<1>(ClusterShape{});
  static constexpr int kBlockM = cute::size<0>(TileShape{});

  struct Arguments : Base::Arguments {
    // Optional: rows [local_first_tile * kBlockM, + local_rows) of A are read
    // from ptr_A_local (same strides) instead of ptr_A.
    typename Base::ElementA const* ptr_A_local = nullptr;
    int32_t local_rows = 0;
    int32_t local_first_tile = 0;
    RowGate gate;
  };

  struct Params : Base::Params {
    typename Base::Params::TMA_A tma_load_a_local;
    int32_t local_rows = 0;
    int32_t local_first_tile = 0;
    int32_t local_tiles = 0;
    int32_t k = 0;
    RowGate gate;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    using namespace cute;
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(problem_shape, args, workspace);
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    params.k = static_cast<int32_t>(K);
    params.gate = args.gate;
    params.tma_load_a_local = params.tma_load_a;
    if (args.ptr_A_local != nullptr && args.local_rows > 0) {
      auto ptr = reinterpret_cast<typename Base::InternalElementA const*>(args.ptr_A_local);
      Tensor tensor = make_tensor(ptr, make_layout(make_shape(args.local_rows, K, L), args.dA));
      params.tma_load_a_local = make_tma_copy_A_sm90(typename Base::GmemTiledCopyA{}, tensor,
                                                     SmemLayoutA{}(_, _, Int<0>{}), TileShape{}, ClusterShape{});
      params.local_rows = args.local_rows;
      params.local_first_tile = args.local_first_tile;
      params.local_tiles = (args.local_rows + kBlockM - 1) / kBlockM;
    }
    return params;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
    if (params.local_tiles > 0) cute::prefetch_tma_descriptor(params.tma_load_a_local.get_tma_descriptor());
  }

  // Producer warp, once per work tile (the whole warp enters).
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int /*thread_idx*/,
                           uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    using namespace cute;
    using X = Underscore;
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    const int tile_m = static_cast<int>(m_coord);
    const int local_tile_m = tile_m - params.local_first_tile;
    const bool local = params.local_tiles > 0 && local_tile_m >= 0 && local_tile_m < params.local_tiles;

    // One lane waits for the rows and issues the tile's loads (no warp barrier between the two).
    if (cute::elect_one_sync()) {
      if (!local) WaitRows(params.gate, tile_m * kBlockM, kBlockM);
      Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
      Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
      Tensor gB = get<1>(load_inputs)(_, _, n_coord, _, l_coord);  // (BLK_N,BLK_K,k)
      // As CUTLASS's own mainloop: this CTA loads its 1/kClusterN share of the A tile into every
      // CTA of its cluster row and its 1/kClusterM share of the B tile into every CTA of its
      // cluster column. The CTAs of a row work on the same m, so the rows this CTA waited for
      // are the rows it loads.
      const int cluster_m = block_rank_in_cluster % kClusterM;
      const int cluster_n = block_rank_in_cluster / kClusterM;
      auto block_tma_b = params.tma_load_b.get_slice(cluster_m);
      Tensor tBgB = block_tma_b.partition_S(gB);
      Tensor tBsB = block_tma_b.partition_D(sB);
      auto block_layout = Layout<ClusterShape>{};  // (m, n) -> block id
      uint16_t mcast_mask_a = 0;
      uint16_t mcast_mask_b = 0;
      if constexpr (cute::is_same_v<typename Base::GmemTiledCopyA, cute::SM90_TMA_LOAD_MULTICAST>) {
        for (int n = 0; n < kClusterN; ++n) mcast_mask_a |= uint16_t(1) << block_layout(cluster_m, n, Int<0>{});
      }
      if constexpr (cute::is_same_v<typename Base::GmemTiledCopyB, cute::SM90_TMA_LOAD_MULTICAST>) {
        for (int m = 0; m < kClusterM; ++m) mcast_mask_b |= uint16_t(1) << block_layout(m, cluster_n, Int<0>{});
      }

      auto issue = [&](auto const& tma_a, auto const& gA) {
        auto block_tma_a = tma_a.get_slice(cluster_n);
        Tensor tAgA = block_tma_a.partition_S(gA);
        Tensor tAsA = block_tma_a.partition_D(sA);
        CUTLASS_PRAGMA_NO_UNROLL
        for (; k_tile_count > 0; --k_tile_count) {
          pipeline.producer_acquire(smem_pipe_write);
          auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
          const int stage = smem_pipe_write.index();
          copy(tma_a.with(*barrier, mcast_mask_a), tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, stage));
          copy(params.tma_load_b.with(*barrier, mcast_mask_b), tBgB(_, _, _, *k_tile_iter), tBsB(_, _, _, stage));
          ++k_tile_iter;
          ++smem_pipe_write;
        }
      };

      if (local) {
        Tensor mA = params.tma_load_a_local.get_tma_tensor(make_shape(params.local_rows, params.k, 1));
        Tensor gA_mkl = local_tile(mA, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});
        issue(params.tma_load_a_local, gA_mkl(_, _, local_tile_m, _, 0));
      } else {
        issue(params.tma_load_a, get<0>(load_inputs)(_, _, m_coord, _, l_coord));
      }
    }
  }
};

// ---------------------------------------------------------------------------
// Epilogue: gate the C (source) loads of a tile on its row-piece flags; raise
// the tile counters of its D rows once they are written (TileSignal).
//
// A C wait that gives up makes the tile NaN by its C, not by alpha: the
// consumers read alpha when the tile's store begins, which may be before the
// load warp's wait gives up (and poisons alpha), so the load warp writes NaN
// into the tile's C rows (the received partial sums, in our workspace) before
// it loads them. A push that lands late overwrites NaN with this epoch's
// partial sums, never with older ones, so every element is NaN or right.
//
// The counters: warp 0 of the consumers issues the tile's TMA stores. With
// `immediate` it waits for them right after the tile (the next tile's MMAs of
// that warpgroup start ~1 us later); otherwise at the start of the next tile's
// epilogue, when they finished long ago (the piece is signalled one tile
// later), and for the last tile in store_tail.
// ---------------------------------------------------------------------------
template <class Base>
struct GatedEpilogue : Base {
  using typename Base::LoadPipeline;
  using typename Base::LoadPipelineState;
  using typename Base::StorePipeline;
  using typename Base::StorePipelineState;
  using typename Base::TensorStorage;

  static_assert(sizeof(typename Base::ElementC) == 2, "WarpPoisonTile writes 2-byte NaNs");

  struct Arguments : Base::Arguments {
    RowGate gate;
    TileSignal signal;
  };
  struct Params : Base::Params {
    RowGate gate;
    TileSignal signal;
    void* c = nullptr;  // C (row-major, ldc elements per row): poisoned per tile when its wait gives up
    int64_t ldc = 0;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                                  void* workspace) {
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(problem_shape, args, workspace);
    params.gate = args.gate;
    params.signal = args.signal;
    params.c = const_cast<void*>(static_cast<void const*>(args.ptr_C));
    params.ldc = static_cast<int64_t>(cute::get<0>(args.dC));
    return params;
  }

  CUTLASS_HOST_DEVICE GatedEpilogue(Params const& params, TensorStorage& shared_tensors)
      : Base(params, shared_tensors), gated_(&params), signal_(&params.signal) {}

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class TiledMma, class... Rest>
  CUTLASS_DEVICE auto load(typename Base::LoadPipeline load_pipeline,
                           typename Base::LoadPipelineState load_pipe_producer_state,
                           ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                           TileCoordMNKL tile_coord_mnkl, TiledMma tiled_mma, int thread_idx,
                           TensorStorage& shared_tensors, Rest... rest) {
    const int block_m = cute::size<0>(tile_shape_MNK);
    const int row0 = static_cast<int>(cute::get<0>(tile_coord_mnkl)) * block_m;
    bool arrived = true;
    if (cute::elect_one_sync()) arrived = WaitRows(gated_->gate, row0, block_m);
    if (!__all_sync(0xffffffffu, arrived)) {  // the rows may be stale or torn: load NaN instead
      const int block_n = cute::size<1>(tile_shape_MNK);
      WarpPoisonTile(gated_->c, gated_->ldc, row0, block_m, static_cast<int>(cute::get<1>(tile_coord_mnkl)) * block_n,
                     block_n, static_cast<int>(cute::get<0>(problem_shape_mnkl)),
                     static_cast<int>(cute::get<1>(problem_shape_mnkl)));
    }
    return Base::load(load_pipeline, load_pipe_producer_state, problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl,
                      tiled_mma, thread_idx, shared_tensors, rest...);
  }

  // Consumer warpgroups, once per work tile; warp 0 (thread_idx < 32) issues the TMA stores.
  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class Accumulators, class TiledMma,
            class... Rest>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadPipelineState load_pipe_consumer_state,
                            StorePipeline store_pipeline, StorePipelineState store_pipe_producer_state,
                            ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                            TileCoordMNKL tile_coord_mnkl, Accumulators accumulators, TiledMma tiled_mma,
                            int thread_idx, TensorStorage& shared_tensors, Rest... rest) {
    const bool signals = signal_->counters != nullptr && thread_idx < 32;
    const int block_m = cute::size<0>(tile_shape_MNK);
    if (signals && pending_row0_ >= 0) {  // the previous tile's stores: long written by now
      SignalTileStored(*signal_, pending_row0_, block_m);
      pending_row0_ = -1;
    }
    auto states = Base::store(load_pipeline, load_pipe_consumer_state, store_pipeline, store_pipe_producer_state,
                              problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl, accumulators, tiled_mma, thread_idx,
                              shared_tensors, rest...);
    // A tile of the column padding of 1 x 2 clusters (n past N) stores nothing and counts for no piece.
    const int col0 = static_cast<int>(cute::get<1>(tile_coord_mnkl)) * static_cast<int>(cute::size<1>(tile_shape_MNK));
    if (signals && col0 < static_cast<int>(cute::get<1>(problem_shape_mnkl))) {
      const int row0 = static_cast<int>(cute::get<0>(tile_coord_mnkl)) * block_m;
      if (signal_->immediate) {
        SignalTileStored(*signal_, row0, block_m);
      } else {
        pending_row0_ = row0;
      }
    }
    return states;
  }

  // Consumer warpgroups, after their last tile.
  CUTLASS_DEVICE auto store_tail(LoadPipeline load_pipeline, LoadPipelineState load_pipe_consumer_state,
                                 StorePipeline store_pipeline, StorePipelineState store_pipe_producer_state) {
    auto states = Base::store_tail(load_pipeline, load_pipe_consumer_state, store_pipeline, store_pipe_producer_state);
    if (pending_row0_ >= 0) {  // only warp 0 of a signalling epilogue ever sets it
      SignalTileStored(*signal_, pending_row0_, kTileRows);
      pending_row0_ = -1;
    }
    return states;
  }

 private:
  static constexpr int kTileRows = cute::size<0>(typename Base::CtaTileMNK{});
  Params const* gated_;
  TileSignal const* signal_;
  int pending_row0_ = -1;
};

}  // namespace flux_jax::cuda

// Route our scheduler tag to RotatedScheduler inside GemmUniversal.
namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<flux_jax::cuda::RotatedSchedulerTag, ArchTag, TileShape, ClusterShape, Stages> {
  using Scheduler = flux_jax::cuda::RotatedScheduler<cute::size<0>(ClusterShape{}), cute::size<1>(ClusterShape{})>;
};
}  // namespace cutlass::gemm::kernel::detail
