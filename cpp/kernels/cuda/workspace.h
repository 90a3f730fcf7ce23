// Symmetric workspace of a TP group on the GPUs of one process.
//
// One GroupWorkspace per (device, TP group), allocated with cudaMalloc outside
// XLA's pool on the first call, peer access enabled between the group's GPUs,
// every member's pointers visible to the others. Layout of each member:
//
//   ctrl (device, fixed): present[kMaxTp] | arrived[kMaxFlags] | cells[2] |
//                         block_arrived[kMaxTp][kMaxLatencyBlocks] | tiles_done[kMaxPieces]
//   alpha (device float): 1.0, NaN once a wait timed out (poisons results)
//   data (device, grows): receive / staging buffers of the overlapped (large-M) ops
//   slots (device, grows): receive slots of the latency-path collectives,
//                          [parity][sender][chunk]; a separate area because a
//                          latency call never waits for its peer to finish the
//                          previous call, whose GEMM may still read `data`
//   ll (device, grows, zeroed when allocated): matmul_rs's decode-path receive
//                          slots in the low-latency format (each 8-byte word: 4
//                          bytes of data and the epoch that wrote them), so a
//                          reader polls the data itself; nothing else writes
//                          there, so no stale word can carry a current epoch
//
// Flags hold epochs (one per fused call of the group, increasing) and are only
// compared with >=, so they are never reset. The data area grows when a call
// needs more: all members meet on a host barrier, drain their streams (so no
// push into an old buffer is still pending), reallocate, and meet again. A
// setup or growth that fails on any member marks the whole group failed (the
// members' views of each other are in doubt): every later call of any member
// returns that error, naming the GPU and the bytes, until flux_jax.reset().
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <mutex>
#include <vector>

#include "device_sync.cuh"
#include "flux_jax/limits.h"
#include "flux_jax/params.h"
#include "flux_jax/status.h"

namespace flux_jax::cuda {

inline constexpr int kMaxTp = limits::kGpuMaxTp;
inline constexpr int kMaxPieces = 16;
inline constexpr int kMaxFlags = kMaxTp * kMaxPieces;
inline constexpr int kMaxLatencyBlocks = 128;  // thread blocks of one latency collective

// What one member can see of another (device pointers valid in its own space
// through peer access).
struct PeerView {
  uint64_t* present = nullptr;
  uint64_t* arrived = nullptr;
  uint64_t* block_arrived = nullptr;
  char* data = nullptr;
  char* slots = nullptr;
  char* ll = nullptr;
};

struct GroupWorkspace {
  int device = 0;
  int rank = 0;
  int tp = 1;
  int sm_count = 0;
  int dram_gbps = 0;   // peak DRAM bandwidth in GB/s (PeakDramGbps), for the GEMM instance rule
  uint64_t epoch = 0;  // calls of this group so far (host side)

  uint64_t* present = nullptr;        // [kMaxTp]: present[p] = last epoch rank p reached
  uint64_t* arrived = nullptr;        // [kMaxFlags]: row pieces of the current call
  uint64_t* cells = nullptr;          // [2]: cells[1] = epoch, the source of copy-engine flag writes
  uint64_t* block_arrived = nullptr;  // [kMaxTp][kMaxLatencyBlocks]: latency and decode paths
  // [kMaxPieces]: output tiles written per piece of rows, kTileSignalLanes each (TileSignal; only grow), and
  // the totals the launches enqueued so far will have raised them to (host side).
  uint64_t* tiles_done = nullptr;
  uint64_t tiles_done_expected[kMaxPieces] = {};
  float* alpha = nullptr;
  char* data = nullptr;
  size_t capacity = 0;
  char* slots = nullptr;
  size_t slots_capacity = 0;
  char* ll = nullptr;
  size_t ll_capacity = 0;

  cudaStream_t comm = nullptr;  // high-priority copy stream
  cudaEvent_t ev_start = nullptr, ev_comm_done = nullptr;
  cudaEvent_t ev_step[kMaxTp] = {};

  std::vector<PeerView> peers;  // by rank, own included
  // Error records (mapped host memory, flux_jax/wait_record.h): this member's own (its first wait
  // that gave up; `error_host` is the host's view of it) and this device's (the first timeout on
  // the GPU, which makes every other wait there give up).
  DeviceError* error = nullptr;
  DeviceError* error_host = nullptr;
  DeviceError* device_error = nullptr;

  WaitContext Wait(int64_t timeout_us) const {
    WaitContext ctx;
    ctx.error = error;
    ctx.device_error = device_error;
    ctx.alpha = alpha;
    ctx.timeout_ns = timeout_us * 1000;
    ctx.device = device;
    ctx.rank = rank;
    ctx.epoch = epoch;
    return ctx;
  }
};

// Returns this device's workspace of `group`, set up (first call) and grown to
// at least `data_bytes`. Every member of the group must call it for the same
// calls in the same order (the same program runs on every device).
// `compute_stream` is drained (synchronized) only when the workspace grows.
// `slot_bytes`: size the latency path's slot area needs (0: leave it); `ll_bytes`: the same
// for the low-latency area.
Status AcquireWorkspace(const TpGroup& group, size_t data_bytes, const CommConfig& cfg, cudaStream_t compute_stream,
                        GroupWorkspace** out, size_t slot_bytes = 0, size_t ll_bytes = 0);

// Cross-process TP groups (one process per GPU under jax.distributed): each
// process allocates its member once, with fixed capacities, and exports CUDA
// IPC handles (`blob`); Python passes them through jax.distributed's key-value
// store and every process imports its remote peers' blobs. No growth later
// (the low-latency area gets `slot_bytes` too).
Status ExportIpcMember(const TpGroup& group, size_t data_bytes, size_t slot_bytes, std::string* blob);
Status ImportIpcPeer(const TpGroup& group, int peer_rank, const std::string& blob);

// The sticky error of `device`, if a device-side wait gave up: one line per member of a TP group
// on it whose wait gave up (each names the rank it waited for), else the device's first failure
// (e.g. copied from another GPU of its group).
Status CheckDeviceError(int device);

// Tests (cpp/tests/loopback): the next allocation of a growing workspace area by rank `rank` of any
// group fails as if the GPU were out of memory (-1: none).
void FailNextGrowthForTesting(int rank);

// Frees every workspace and clears the error records (no op may be running).
void ResetWorkspaces();

// Loads the latency-path kernels (latency_collectives.cu) into the current context.
Status PreloadLatencyCollectives();

// Peak DRAM bandwidth of `device` in GB/s: memory clock x bus width x 2 (double data rate), from
// the device attributes (H100 SXM about 3350, H200 about 4900).
Status PeakDramGbps(int device, int* gbps);

// Bytes held by workspaces on `device`.
size_t WorkspaceBytes(int device);

}  // namespace flux_jax::cuda
