// The overlap GEMM's tile order as a plain function, shared by the CUDA
// scheduler (kernels/cuda/gated_gemm.cuh) and the Python extension, which
// exposes it so CPU tests can check it (tests/test_tile_order.py).
//
// Linear id t (plain raster along N) -> tile (m, n) (GroupedTileOrder): groups
// of `group` M tiles are swept together across N, column by column, then m is
// rotated:
//
//   group = 2, tiles_n = 4:    t:  0  2  4  6      then  8 10 12 14
//                                  1  3  5  7            9 11 13 15
//
// Serpentine: every odd group sweeps N backwards, so it starts on the columns
// of B the group before it read last (still in L2) instead of those it read
// first:
//
//   group = 2, tiles_n = 4:    t:  0  2  4  6      then 14 12 10  8
//                                  1  3  5  7           15 13 11  9
//
// The last group may hold fewer rows. A bijection on [0, tiles_m * tiles_n)
// for any group >= 1 and 0 <= rotate < tiles_m.
#pragma once

#if defined(__CUDACC__)
#define FLUX_JAX_HOST_DEVICE __host__ __device__
#else
#define FLUX_JAX_HOST_DEVICE
#endif

namespace flux_jax {

struct TileCoord {
  int m;
  int n;
};

// n / d for 0 <= n < 2^31 and 1 <= d < 2^31 by a multiply-high and a shift (the round-up method of
// Granlund and Montgomery, as CUTLASS's FastDivmod), the multiplier computed once on the host. The
// schedulers remap every tile with it: the GPU's integer division is a float-reciprocal sequence
// that the compiler cannot keep on the uniform datapath, and with it every warp's tile arithmetic
// moved to per-thread registers (one H200, 2026-12-02,
// docs/decisions/2026-12-02-gemm-hooks-uniform-datapath.md). Exact: m = ceil(2^(31 + p) / d) with
// p = ceil(log2 d) errs by less than 1/d over n < 2^31.
struct FastDivisor {
  int divisor = 1;
  unsigned multiplier = 0;
  int shift = 0;

  FastDivisor() = default;
  explicit FastDivisor(int d) : divisor(d) {
    if (d <= 1) return;
    int p = 0;
    while ((1ll << p) < d) ++p;
    multiplier = static_cast<unsigned>(((1ull << (31 + p)) + static_cast<unsigned long long>(d) - 1) /
                                       static_cast<unsigned long long>(d));
    shift = p - 1;
  }

  FLUX_JAX_HOST_DEVICE int Div(int n) const { return Divide(n, divisor, multiplier, shift); }

  // By value, so that picking one of two divisors is a select, not a reference (a reference to a
  // member chosen at run time put the scheduler's whole order in local memory).
  FLUX_JAX_HOST_DEVICE static int Divide(int n, int divisor, unsigned multiplier, int shift) {
    if (divisor == 1) return n;
#if defined(__CUDA_ARCH__)
    return static_cast<int>(__umulhi(static_cast<unsigned>(n), multiplier) >> shift);
#else
    return static_cast<int>(((static_cast<unsigned long long>(n) * multiplier) >> 32) >> shift);
#endif
  }
};

// The grouped order over tiles_m x tiles_n, its divisors computed on the host once per launch:
// linear id t -> the group of `group` rows it falls in (the last group may hold fewer), then
// column by column within the group (backwards in odd groups if `serpentine`), then m rotated by
// `rotate` (mod tiles_m).
struct GroupedTileOrder {
  int tiles_m = 1;
  int tiles_n = 1;
  int group = 1;
  int rotate = 0;
  bool serpentine = false;
  int last_first = 0;       // first row of the last group
  FastDivisor group_tiles;  // group * tiles_n: t -> its group
  FastDivisor rows;         // group: the rows of every group but the last
  FastDivisor last_rows;    // tiles_m - last_first: the rows of the last group

  GroupedTileOrder() = default;
  GroupedTileOrder(int tiles_m_, int tiles_n_, int group_, int rotate_, bool serpentine_ = false)
      : tiles_m(tiles_m_),
        tiles_n(tiles_n_),
        group(group_),
        rotate(rotate_),
        serpentine(serpentine_),
        last_first((tiles_m_ - 1) / group_ * group_),
        group_tiles(group_ * tiles_n_),
        rows(group_),
        last_rows(tiles_m_ - (tiles_m_ - 1) / group_ * group_) {}

  FLUX_JAX_HOST_DEVICE TileCoord At(int t) const {
    const int g = group_tiles.Div(t);
    const int first = g * group;
    const int idx = t - g * group_tiles.divisor;
    const bool last = first == last_first;
    const int divisor = last ? last_rows.divisor : rows.divisor;
    const int n = FastDivisor::Divide(idx, divisor, last ? last_rows.multiplier : rows.multiplier,
                                      last ? last_rows.shift : rows.shift);
    int m = first + (idx - n * divisor) + rotate;
    if (m >= tiles_m) m -= tiles_m;
    return {m, serpentine && (g & 1) ? tiles_n - 1 - n : n};
  }
};

// The same order for clusters of CTAs that share an operand tile by TMA multicast: cluster_m x 1
// (B shared, so the CTAs work on the same n) or 1 x cluster_n (A shared, the same m). The base
// scheduler hands out cluster ids t (plain raster along N over the grid of clusters) and the CTA's
// position `cta` in its cluster.
//
// cluster_m x 1: the cluster rows are ordered by the grouped order with groups of max(1, group /
// cluster_m) cluster rows, rotated by rotate / cluster_m cluster rows (so with an odd rotation a
// rank's first cluster starts one tile early), then the CTA takes tile m = cluster row * cluster_m
// + cta. tiles_m is padded to whole clusters.
//
// 1 x cluster_n: the grouped order over tiles_m x ceil(tiles_n / cluster_n) cluster columns with
// the same group and rotation (whole row tiles: a rank's own rows still go first, and no cluster
// spans two chunks), then the CTA takes tile n = cluster column * cluster_n + cta. tiles_n is
// padded to whole clusters.
//
// Tiles in the padding are computed out of bounds (TMA zero-fills their loads and drops their
// stores). With 1x1 clusters this is the grouped order. `serpentine` applies to the grid of
// clusters.
struct ClusteredTileOrder {
  GroupedTileOrder clusters;
  int cluster_m = 1;
  int cluster_n = 1;

  ClusteredTileOrder() = default;
  ClusteredTileOrder(int tiles_m, int tiles_n, int group, int rotate, int cluster_m_, int cluster_n_ = 1,
                     bool serpentine = false)
      : cluster_m(cluster_m_), cluster_n(cluster_n_) {
    if (cluster_n_ > 1) {
      clusters = GroupedTileOrder(tiles_m, (tiles_n + cluster_n_ - 1) / cluster_n_, group, rotate, serpentine);
    } else {
      const int cluster_rows = (tiles_m + cluster_m_ - 1) / cluster_m_;
      const int cluster_group = group / cluster_m_ > 1 ? group / cluster_m_ : 1;
      clusters = GroupedTileOrder(cluster_rows, tiles_n, cluster_group, rotate / cluster_m_, serpentine);
    }
  }

  FLUX_JAX_HOST_DEVICE TileCoord At(int t, int cta) const {
    const TileCoord c = clusters.At(t);
    if (cluster_n > 1) return {c.m, c.n * cluster_n + cta};
    return {c.m * cluster_m + cta, c.n};
  }
};

}  // namespace flux_jax
