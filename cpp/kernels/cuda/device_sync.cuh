// Device-side flag waits with deadlines, and the error record they fill.
//
// Every wait on the GPU is bounded: a flag that does not reach its epoch
// within the timeout records who waited for what in a DeviceError (mapped host
// memory, read by the next host call) and poisons the GEMM's alpha with NaN so
// the tiles it could not compute correctly come out as NaN, never as a silent
// wrong answer. After that, other waits on the device give up at once.
#pragma once

#include <cstdint>

namespace flux_jax::cuda {

enum WaitSite : int32_t {
  kSitePresent = 1,
  kSiteGemmA = 2,
  kSiteEpilogueC = 3,
  kSiteAllGather = 4,      // latency path; piece = thread block
  kSiteReduceScatter = 5,  // latency path; piece = thread block
  kSiteDecodeRows = 6,     // decode path's GEMM; piece = push block
  kSiteDecodeSums = 7,     // matmul_rs's decode GEMM epilogue; piece = output tile
};

// Host-visible error record, one per device (cudaHostAllocMapped).
struct DeviceError {
  int32_t code;  // 0: none, 1: wait timed out
  int32_t site;  // WaitSite
  int32_t device;
  int32_t rank;
  int32_t peer;   // rank expected to write the flag (-1 unknown)
  int32_t chunk;  // chunk / step of rows the flag guards (-1 none)
  int32_t piece;
  int32_t pad;
  uint64_t epoch;
  uint64_t seen;  // flag value when the wait gave up
};

// Everything a device-side wait needs besides the flag.
struct WaitContext {
  DeviceError* error = nullptr;  // device pointer of this device's record
  float* alpha = nullptr;        // GEMM alpha in device memory (1.0f; NaN once poisoned)
  int64_t timeout_ns = 0;
  int32_t device = 0;
  int32_t rank = 0;
  uint64_t epoch = 0;
};

// Rows of a matrix that arrive in pieces, each guarded by a flag that reaches
// `ctx.epoch` once the piece is in place: flag index = chunk * pieces + piece.
struct RowGate {
  const uint64_t* flags = nullptr;  // null: nothing to wait for
  int32_t rows_per_chunk = 0;
  int32_t rows_per_piece = 0;
  int32_t pieces_per_chunk = 0;
  int32_t total_rows = 0;
  int32_t skip_chunk = -1;          // rows already present (the local chunk)
  int32_t peer_of_chunk0 = 0;       // for diagnostics: rank that sends chunk c = c + this (mod tp)
  int32_t tp = 1;
  int32_t site = kSiteGemmA;
  WaitContext ctx;
};

// The decode path's row pushes (ag_matmul_decode.cu): block i of sender q
// raises flags[q * stride + i] to ctx.epoch once its slice of q's rows is in
// place, for q < senders, i < blocks (the sender's own rank included).
struct PushGate {
  const uint64_t* flags = nullptr;  // null: nothing to wait for
  int32_t senders = 0;
  int32_t blocks = 0;
  int32_t stride = 0;
  // Rows each sender pushes (chunk q = rows [q * rows_per_sender, +rows_per_sender)), so a
  // tile waits only for the senders of its rows; 0: every tile waits for every sender.
  int32_t rows_per_sender = 0;
  WaitContext ctx;
};

// Counters a GEMM raises as its output rows are written, one per piece of
// rows: each output tile adds 1 to the counter of every piece its rows touch,
// once its stores are complete, so a stream waiting for counters[q] to reach
// its expected value (cuStreamWaitValue64) may copy piece q. The counters only
// grow; the host adds each launch's tiles per piece to the value it waits for.
struct TileSignal {
  uint64_t* counters = nullptr;  // null: no signal
  int32_t rows_per_piece = 0;
  int32_t total_rows = 0;        // rows of D (the last tile may stop short)
  bool immediate = false;        // wait for a tile's stores right after them (else at the next tile)
};

#if defined(__CUDACC__)

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t LoadAcquireSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Records a wait that gave up (the first failure on this device fills the
// record; later ones keep it) and poisons alpha, so the GEMM tiles computed
// from now on are NaN. Every wait that gives up calls it.
__device__ __forceinline__ void RecordTimeout(const WaitContext& ctx, int32_t site, int32_t peer, int32_t chunk,
                                              int32_t piece, uint64_t seen) {
  if (atomicCAS(&ctx.error->code, 0, -1) == 0) {
    ctx.error->site = site;
    ctx.error->device = ctx.device;
    ctx.error->rank = ctx.rank;
    ctx.error->peer = peer;
    ctx.error->chunk = chunk;
    ctx.error->piece = piece;
    ctx.error->epoch = ctx.epoch;
    ctx.error->seen = seen;
    __threadfence_system();
    atomicExch(&ctx.error->code, 1);
  }
  *reinterpret_cast<volatile float*>(ctx.alpha) = __int_as_float(0x7fc00000);
  __threadfence();
}

// A deadline for a spinning wait: Expired() every 256 polls reads the clock,
// and gives up at once if another wait on this device already failed.
struct WaitDeadline {
  uint64_t start = 0;
  uint32_t polls = 0;
  __device__ __forceinline__ bool Expired(const WaitContext& ctx) {
    if ((++polls & 255u) != 0) return false;
    if (*reinterpret_cast<volatile int32_t*>(&ctx.error->code) != 0) return true;
    const uint64_t now = GlobalTimerNs();
    if (start == 0) start = now;
    return static_cast<int64_t>(now - start) > ctx.timeout_ns;
  }
};

// Spins until *flag >= ctx.epoch. Returns false (after recording) on timeout,
// or at once if another wait on this device already failed.
static __device__ __noinline__ bool WaitFlag(const uint64_t* flag, const WaitContext& ctx, int32_t site,
                                             int32_t peer, int32_t chunk, int32_t piece) {
  WaitDeadline deadline;
  for (;;) {
    const uint64_t seen = LoadAcquireSys(flag);
    if (seen >= ctx.epoch) return true;
    if (deadline.Expired(ctx)) {
      // Also when another wait on this device failed first (its record stays: RecordTimeout keeps
      // the first): this wait's GEMM must still poison its own alpha, or the tiles computed from
      // rows that never came would come out finite and wrong (found by the loopback tests at TP 8).
      RecordTimeout(ctx, site, peer, chunk, piece, seen);
      return false;
    }
  }
}

// Waits for every piece that covers rows [row0, row0 + rows) (clamped). False
// if a wait gave up (recorded, alpha poisoned): the rows may be stale or torn.
__device__ __forceinline__ bool WaitRows(const RowGate& g, int32_t row0, int32_t rows) {
  if (g.flags == nullptr) return true;
  const int32_t last = min(row0 + rows, g.total_rows) - 1;
  int32_t row = row0;
  while (row <= last) {
    const int32_t chunk = row / g.rows_per_chunk;
    const int32_t in_chunk = row - chunk * g.rows_per_chunk;
    const int32_t piece = in_chunk / g.rows_per_piece;
    if (chunk != g.skip_chunk) {
      const int32_t peer = (chunk + g.peer_of_chunk0) % g.tp;
      if (!WaitFlag(g.flags + chunk * g.pieces_per_chunk + piece, g.ctx, g.site, peer, chunk,
                    piece)) {
        return false;
      }
    }
    const int32_t next_piece_row = chunk * g.rows_per_chunk + (piece + 1) * g.rows_per_piece;
    row = min(next_piece_row, (chunk + 1) * g.rows_per_chunk);
  }
  // TMA (async proxy) reads of data another agent wrote follow this wait.
  asm volatile("fence.proxy.async.global;" ::: "memory");
  return true;
}

// The whole warp (every lane calls it) writes NaN (all bits set: NaN in
// bfloat16 and float16) into rows [row0, row0 + rows) x columns [col0, col0 +
// cols) of a row-major matrix of 2-byte elements (`ld` elements per row; col0,
// cols and ld multiples of 8, `base` 16-byte aligned), clamped to
// total_rows x total_cols, for TMA (async proxy) loads issued after it by any
// lane. A tile whose input rows never came reads NaN instead of stale rows: a
// copy that lands late overwrites NaN with this epoch's data, never leaves an
// older value.
__device__ __forceinline__ void WarpPoisonTile(void* base, int64_t ld, int32_t row0, int32_t rows, int32_t col0,
                                               int32_t cols, int32_t total_rows, int32_t total_cols) {
  const int32_t lane = threadIdx.x & 31;
  rows = min(rows, total_rows - row0);
  const int32_t vecs = min(cols, total_cols - col0) / 8;  // 16-byte vectors per row
  for (int32_t i = lane; rows > 0 && vecs > 0 && i < rows * vecs; i += 32) {
    const int32_t r = i / vecs, v = i - r * vecs;
    auto* p = static_cast<char*>(base) + ((row0 + r) * ld + col0 + v * 8) * 2;
    *reinterpret_cast<uint4*>(p) = make_uint4(~0u, ~0u, ~0u, ~0u);
  }
  // Each writer orders its stores before the async proxy's reads, then the warp meets (as
  // CUTLASS orders shared-memory writes before a TMA store).
  asm volatile("fence.proxy.async.global;" ::: "memory");
  __syncwarp();
}

// The whole warp waits for every flag of senders q_lo..q_hi of a PushGate, each
// lane for its share (senders * blocks <= 64 flags: one or two acquire loads per
// lane, in parallel, instead of one thread polling them in turn).
__device__ __forceinline__ void WarpWaitPushes(const PushGate& g, int32_t q_lo, int32_t q_hi) {
  if (g.flags == nullptr) return;
  const int32_t lane = threadIdx.x & 31;
  for (int32_t j = q_lo * g.blocks + lane; j < (q_hi + 1) * g.blocks; j += 32) {
    const int32_t q = j / g.blocks, i = j - q * g.blocks;
    if (!WaitFlag(g.flags + q * g.stride + i, g.ctx, kSiteDecodeRows, q, q, i)) break;
  }
  __syncwarp();
  // TMA (async proxy) reads of the rows other agents wrote follow this wait.
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// After this thread's TMA stores (cp.async.bulk) of an output tile: wait until
// they are written (not only read from shared memory), then raise the counter
// of every piece that rows [row0, row0 + rows) touch. Release at GPU scope: the
// copy engine that waits on the counter reads the rows from the same device.
__device__ __forceinline__ void SignalTileStored(const TileSignal& s, int32_t row0, int32_t rows) {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
  __syncwarp();
  if ((threadIdx.x & 31) != 0) return;
  const int32_t last = (row0 + rows < s.total_rows ? row0 + rows : s.total_rows) - 1;
  if (last < row0) return;
  for (int32_t q = row0 / s.rows_per_piece; q <= last / s.rows_per_piece; ++q) {
    asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(s.counters + q) : "memory");
  }
}

#endif  // __CUDACC__

}  // namespace flux_jax::cuda
