// Device-side flag waits with deadlines, and the error records they fill.
//
// Every wait on the GPU is bounded: a flag that does not reach its epoch
// within the timeout records who waited for what (flux_jax/wait_record.h:
// in its member's record, and as the device's first failure) and poisons the
// GEMM's alpha with NaN so the tiles it could not compute correctly come out
// as NaN, never as a silent wrong answer. After that, other waits on the
// device give up at once; each records that it gave up (not a timeout of its
// own) in its member's record and poisons its own alpha.
#pragma once

#include <cstdint>

#include "flux_jax/tile_order.h"
#include "flux_jax/wait_record.h"

namespace flux_jax::cuda {

// Everything a device-side wait needs besides the flag.
struct WaitContext {
  DeviceError* error = nullptr;         // device pointer of this member's record (the rank's first give-up)
  DeviceError* device_error = nullptr;  // this device's record: its first timeout; once set, every wait gives up
  float* alpha = nullptr;               // GEMM alpha in device memory (1.0f; NaN once poisoned)
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
  int32_t skip_chunk = -1;     // rows already present (the local chunk)
  int32_t peer_of_chunk0 = 0;  // for diagnostics: rank that sends chunk c = c + this (mod tp)
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
// rows: each output tile adds kTileSignalLanes to the counter of every piece its
// rows touch, once its stores are complete, so a stream waiting for counters[q]
// to reach its expected value (cuStreamWaitValue64) may copy piece q. The
// counters only grow; the host adds kTileSignalLanes times each launch's tiles
// per piece to the value it waits for.
struct TileSignal {
  uint64_t* counters = nullptr;  // null: no signal
  FastDivisor rows_per_piece;
  int32_t total_rows = 0;  // rows of D (the last tile may stop short)
  bool immediate = false;  // wait for a tile's stores right after them (else at the next tile)
};

// Every lane of a tile's storing warp raises the counters (SignalTileStored), so a tile adds
// this much to each piece it touches.
inline constexpr int32_t kTileSignalLanes = 32;

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

// Fills `e` unless it already holds a record (the first one stays).
__device__ __forceinline__ void FillRecord(DeviceError* e, int32_t code, const WaitContext& ctx, int32_t site,
                                           int32_t peer, int32_t chunk, int32_t piece, uint64_t seen, int32_t missing) {
  if (atomicCAS(&e->code, kWaitNone, kWaitWriting) != kWaitNone) return;
  e->site = site;
  e->device = ctx.device;
  e->rank = ctx.rank;
  e->peer = peer;
  e->chunk = chunk;
  e->piece = piece;
  e->missing = missing;
  e->epoch = ctx.epoch;
  e->seen = seen;
  __threadfence_system();
  atomicExch(&e->code, code);
}

// Records a wait that gave up and poisons alpha, so the GEMM tiles computed from
// now on are NaN. Every wait that gives up calls it. `how` (WaitDeadline::Expired):
// kWaitTimedOut fills the member's record and, if it is the first on this
// device, the device's (which makes every other wait on it give up);
// kWaitGaveUp (another wait had failed first) fills only the member's record,
// so it never passes for a timeout of its own nor names a peer as the cause.
__device__ __forceinline__ void RecordGiveUp(const WaitContext& ctx, int32_t how, int32_t site, int32_t peer,
                                             int32_t chunk, int32_t piece, uint64_t seen, int32_t missing = 0) {
  FillRecord(ctx.error, how, ctx, site, peer, chunk, piece, seen, missing);
  if (how == kWaitTimedOut) FillRecord(ctx.device_error, how, ctx, site, peer, chunk, piece, seen, missing);
  *reinterpret_cast<volatile float*>(ctx.alpha) = __int_as_float(0x7fc00000);
  __threadfence();
}

// A deadline for a spinning wait: Expired() every 256 polls reads the clock.
// Returns 0 (keep waiting), kWaitTimedOut, or kWaitGaveUp at once if another
// wait on this device already failed (or flux_jax.reset() is draining it).
struct WaitDeadline {
  uint64_t start = 0;
  uint32_t polls = 0;
  __device__ __forceinline__ int32_t Expired(const WaitContext& ctx) {
    if ((++polls & 255u) != 0) return 0;
    if (*reinterpret_cast<volatile int32_t*>(&ctx.device_error->code) != kWaitNone) return kWaitGaveUp;
    const uint64_t now = GlobalTimerNs();
    if (start == 0) start = now;
    return static_cast<int64_t>(now - start) > ctx.timeout_ns ? kWaitTimedOut : 0;
  }
};

// Spins until *flag >= ctx.epoch. Returns false (after recording) on timeout,
// or at once if another wait on this device already failed.
static __device__ __noinline__ bool WaitFlag(const uint64_t* flag, const WaitContext& ctx, int32_t site, int32_t peer,
                                             int32_t chunk, int32_t piece) {
  WaitDeadline deadline;
  for (;;) {
    const uint64_t seen = LoadAcquireSys(flag);
    if (seen >= ctx.epoch) return true;
    if (const int32_t how = deadline.Expired(ctx)) {
      // Also when another wait on this device failed first: this wait's GEMM must still poison its
      // own alpha, or the tiles computed from rows that never came would come out finite and wrong
      // (found by the loopback tests at TP 8).
      RecordGiveUp(ctx, how, site, peer, chunk, piece, seen);
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
      if (!WaitFlag(g.flags + chunk * g.pieces_per_chunk + piece, g.ctx, g.site, peer, chunk, piece)) {
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

// After the warp's TMA stores (cp.async.bulk) of an output tile, in every lane of the
// storing warp: wait until they are written (not only read from shared memory), then add 1 to
// the counter of every piece that rows [row0, row0 + rows) touch (kTileSignalLanes per tile).
// Each lane orders its own wait before its own add, so no lane waits for another: a warp
// barrier here (or a lane-0-only signal behind one) moved the consumer's MMA descriptors into
// per-thread registers. Release at GPU scope: the copy engine that waits on the counter reads
// the rows from the same device.
__device__ __forceinline__ void SignalTileStored(const TileSignal& s, int32_t row0, int32_t rows) {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
  const int32_t last = (row0 + rows < s.total_rows ? row0 + rows : s.total_rows) - 1;
  if (last < row0) return;
  for (int32_t q = s.rows_per_piece.Div(row0); q <= s.rows_per_piece.Div(last); ++q) {
    asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(s.counters + q) : "memory");
  }
}

#endif  // __CUDACC__

}  // namespace flux_jax::cuda
