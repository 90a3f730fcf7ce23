// The overlap GEMM's tile order as a plain function, shared by the CUDA
// scheduler (kernels/cuda/gated_gemm.cuh) and the Python extension, which
// exposes it so CPU tests can check it (tests/test_tile_order.py).
//
// Linear id t (plain raster along N) -> tile (m, n): groups of `group` M tiles
// are swept together across N, column by column, then m is rotated:
//
//   group = 2, tiles_n = 4:    t:  0  2  4  6      then  8 10 12 14
//                                  1  3  5  7            9 11 13 15
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

FLUX_JAX_HOST_DEVICE inline TileCoord GroupedTile(int t, int tiles_m, int tiles_n, int group, int rotate) {
  const int first = (t / (group * tiles_n)) * group;
  const int rows = group < tiles_m - first ? group : tiles_m - first;
  const int idx = t - first * tiles_n;
  int m = first + idx % rows + rotate;
  if (m >= tiles_m) m -= tiles_m;
  return {m, idx / rows};
}

// The same order for clusters of CTAs that share an operand tile by TMA multicast: cluster_m x 1
// (B shared, so the CTAs work on the same n) or 1 x cluster_n (A shared, the same m). The base
// scheduler hands out cluster ids t (plain raster along N over the grid of clusters) and the CTA's
// position `cta` in its cluster.
//
// cluster_m x 1: the cluster rows are ordered by GroupedTile with groups of max(1, group /
// cluster_m) cluster rows, rotated by rotate / cluster_m cluster rows (so with an odd rotation a
// rank's first cluster starts one tile early), then the CTA takes tile m = cluster row * cluster_m
// + cta. tiles_m is padded to whole clusters.
//
// 1 x cluster_n: GroupedTile over tiles_m x ceil(tiles_n / cluster_n) cluster columns with the
// same group and rotation (whole row tiles: a rank's own rows still go first, and no cluster
// spans two chunks), then the CTA takes tile n = cluster column * cluster_n + cta. tiles_n is
// padded to whole clusters.
//
// Tiles in the padding are computed out of bounds (TMA zero-fills their loads and drops their
// stores). With 1x1 clusters this is GroupedTile.
FLUX_JAX_HOST_DEVICE inline TileCoord ClusteredTile(int t, int cta, int tiles_m, int tiles_n, int group, int rotate,
                                                    int cluster_m, int cluster_n = 1) {
  if (cluster_n > 1) {
    const TileCoord c = GroupedTile(t, tiles_m, (tiles_n + cluster_n - 1) / cluster_n, group, rotate);
    return {c.m, c.n * cluster_n + cta};
  }
  if (cluster_m <= 1) return GroupedTile(t, tiles_m, tiles_n, group, rotate);
  const int cluster_rows = (tiles_m + cluster_m - 1) / cluster_m;
  const int cluster_group = group / cluster_m > 1 ? group / cluster_m : 1;
  const TileCoord c = GroupedTile(t, cluster_rows, tiles_n, cluster_group, rotate / cluster_m);
  return {c.m * cluster_m + cta, c.n};
}

}  // namespace flux_jax
