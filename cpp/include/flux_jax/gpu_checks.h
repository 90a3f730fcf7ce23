// Host-side checks of the CUDA backend's setup, kept free of CUDA types so the CPU build runs
// them in tests (tests/test_gpu_diagnostics.py): the hardware queues that ranks sharing a GPU
// need, and the sizes a peer's CUDA IPC blob declares and maps.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "flux_jax/status.h"

namespace flux_jax {

// CUDA's default number of hardware work queues per device (CUDA_DEVICE_MAX_CONNECTIONS unset).
inline constexpr int kDefaultDeviceConnections = 8;
inline constexpr int kMaxDeviceConnections = 32;

// The hardware queues that `ranks_on_gpu` ranks of one TP group on one GPU need, given
// CUDA_DEVICE_MAX_CONNECTIONS (`env`, null when unset). Why (docs/kernels.md, "Hardware queues"):
// every stream of a CUDA context feeds one of that many in-order queues; streams that share a
// queue are served in the order their work was enqueued, and an operation that must wait (a
// stream-ordered successor of a kernel that spins on a peer's flag, an event wait) holds back
// everything queued behind it. One rank per GPU cannot deadlock that way, whatever the value:
// on each GPU everything a peer waits for (the presence store, the pushes, the push kernels) is
// enqueued before the first operation of ours that waits for a peer. Ranks sharing a GPU (the
// loopback tests; a JAX mesh never repeats a device) enqueue from different host threads into the
// same queues, so one rank's waiting work can sit in front of the pushes another rank's GEMM
// waits for: each of their streams (two per rank: the compute stream and our comm stream) needs a
// queue of its own.
inline Status CheckHardwareQueues(const char* env, int ranks_on_gpu, int device, const std::string& group) {
  if (ranks_on_gpu <= 1) return Status::Ok();
  int connections = kDefaultDeviceConnections;
  if (env != nullptr && *env != '\0') {
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(env, &end, 10);
    if (errno == 0 && end != env && *end == '\0' && v >= 1)
      connections = v > kMaxDeviceConnections ? kMaxDeviceConnections : static_cast<int>(v);
  }
  const int needed = 2 * ranks_on_gpu;
  if (connections >= needed) return Status::Ok();
  return Status::InvalidArgument(
      "flux_jax: " + std::to_string(ranks_on_gpu) + " ranks of " + group + " share GPU " + std::to_string(device) +
      ", and CUDA_DEVICE_MAX_CONNECTIONS=" +
      (env != nullptr && *env != '\0' ? std::string(env) : std::string("(unset)")) + " gives that GPU's streams " +
      std::to_string(connections) +
      " hardware queue(s). Ranks that share a GPU need a queue for each of their streams (2 per rank: the compute "
      "stream and flux_jax's comm stream), at least " +
      std::to_string(needed) +
      ": in a shared queue, work that waits for a peer holds back the pushes that the peer's GEMM waits for, and "
      "the ranks deadlock until the timeout. Set CUDA_DEVICE_MAX_CONNECTIONS=" +
      std::to_string(needed) +
      " or more (at most 32) before CUDA starts. (With one rank per GPU, as in every JAX mesh, any value works, "
      "1 included.)");
}

// Bytes of the four areas of a workspace member, as a CUDA IPC blob declares them or as the
// mappings opened from it hold them.
struct IpcAreaSizes {
  uint64_t ctrl = 0, data = 0, slots = 0, ll = 0;
};

// Checks a peer's CUDA IPC blob against this process's member of the same group: the blob must
// come from `peer` (`declared_rank`, `declared_tp`) and declare exactly this member's sizes
// (every process allocates its member with the same gpu_workspace_mib; a peer with other sizes
// would be overrun, or would overrun us, and the latency path's parity halves would not line up),
// and the mappings opened from it must hold at least the declared bytes (`mapped`; all zero: not
// opened yet). Every error names the peer.
inline Status CheckIpcPeer(int peer, int tp, int declared_rank, int declared_tp, const IpcAreaSizes& declared,
                           const IpcAreaSizes& expected, const IpcAreaSizes& mapped, const std::string& group) {
  const std::string who = "rank " + std::to_string(peer) + " of " + group;
  if (declared_rank != peer || declared_tp != tp) {
    return Status::InvalidArgument("flux_jax: the CUDA IPC blob given for " + who + " was published by rank " +
                                   std::to_string(declared_rank) + " of a group of " + std::to_string(declared_tp) +
                                   " ranks");
  }
  struct Area {
    const char* name;
    uint64_t IpcAreaSizes::* bytes;
  };
  const Area areas[] = {{"control", &IpcAreaSizes::ctrl},
                        {"data", &IpcAreaSizes::data},
                        {"slot", &IpcAreaSizes::slots},
                        {"low-latency", &IpcAreaSizes::ll}};
  const bool opened = mapped.ctrl != 0 || mapped.data != 0 || mapped.slots != 0 || mapped.ll != 0;
  for (const Area& a : areas) {
    const uint64_t d = declared.*a.bytes, e = expected.*a.bytes;
    if (d != e) {
      return Status::InvalidArgument(
          "flux_jax: " + who + " declares a " + a.name + " area of " + std::to_string(d) +
          " bytes in its CUDA IPC "
          "blob; this process's member has " +
          std::to_string(e) +
          " bytes. Every process must set up the group "
          "with the same flux_jax.initialize_distributed(gpu_workspace_mib=...) and the same flux_jax build.");
    }
    if (opened && (mapped.*a.bytes) < d) {
      return Status::InvalidArgument("flux_jax: the " + std::string(a.name) + " area mapped from " + who +
                                     "'s CUDA IPC handle holds " + std::to_string(mapped.*a.bytes) +
                                     " bytes, but its blob declares " + std::to_string(d));
    }
  }
  return Status::Ok();
}

}  // namespace flux_jax
