// CPU backend transport: one channel per (fused call site, TP group).
//
// The CPU backend runs the same push protocol the GPU kernels use, over
// process-global memory instead of peer-mapped HBM:
//
//   rank s (sender)                               rank r (receiver), epoch e, parity b = e & 1
//   wait  mailbox[s].freed[b][r] >= e-2  (local)
//   copy  chunk -> mailbox[r].slot[b][s]           wait mailbox[r].arrived[b][s] >= e  (local)
//   write mailbox[r].arrived[b][s] = e  (remote)   use  mailbox[r].slot[b][s]
//                                                  write mailbox[s].freed[b][r] = e    (remote)
//
// Every wait is on the waiter's own mailbox; remote operations are writes only.
// Epochs increase by one per call and are compared with >=, so flags are never
// reset. Double buffering by parity lets a sender run one call ahead of a slow
// receiver; the freed flag stops it from running two ahead.
//
// Why one channel per call site and not one per device: XLA:CPU runs
// independent thunks concurrently, so two fused calls with no data dependency
// may run in different orders on different devices. Pairing calls by call site
// makes that harmless. (On GPU everything is stream-ordered, so the GPU
// workspace is shared per device.)
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "flux_jax/params.h"
#include "flux_jax/status.h"

namespace flux_jax::cpu {

enum class FlagKind { kArrived, kFreed };

// What a wait is for, to build the timeout diagnostic.
struct WaitInfo {
  const char* op;  // "ag_matmul" / "matmul_rs"
  int peer;        // rank expected to write the flag
  int chunk;       // which chunk of rows the flag guards
};

class Channel {
 public:
  Channel(const TpGroup& group, int64_t callsite, size_t slot_bytes);

  int size() const { return size_; }
  size_t slot_bytes() const { return slot_bytes_; }
  int64_t callsite() const { return callsite_; }
  const std::vector<int64_t>& devices() const { return devices_; }

  // Receive slot `slot` (= sender rank) of parity `parity` in `owner`'s mailbox.
  std::byte* Slot(int owner, int parity, int slot);

  // Writes `value` into flag (kind, parity, slot) of `target`'s mailbox.
  void Signal(int target, FlagKind kind, int parity, int slot, uint64_t value,
              const CommConfig& cfg);

  // Blocks until flag (kind, parity, slot) of `me`'s mailbox is >= value, the
  // channel fails, or cfg.timeout_us passes. A timeout fails the channel.
  Status Wait(int me, FlagKind kind, int parity, int slot, uint64_t value, uint64_t epoch,
              const CommConfig& cfg, const WaitInfo& info);

  // Marks the channel failed and wakes every waiter; later calls fail fast.
  void Fail(const std::string& message);
  Status Health() const;

  // Per-rank call bookkeeping. Begin returns the epoch of this call (1, 2, ...).
  Status BeginCall(int rank, uint64_t* epoch);
  void EndCall(int rank);

 private:
  struct Mailbox {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<uint64_t> flags;  // [kind][parity][slot]
    std::vector<std::byte> data;  // [parity][slot][slot_bytes]
  };
  size_t FlagIndex(FlagKind kind, int parity, int slot) const;

  const int size_;
  const int64_t callsite_;
  const int64_t group_index_;
  const std::vector<int64_t> devices_;
  const size_t slot_bytes_;
  std::vector<std::unique_ptr<Mailbox>> mailboxes_;
  std::vector<uint64_t> epochs_;               // epochs_[r] touched only by rank r's thread
  std::unique_ptr<std::atomic<int>[]> in_flight_;
  std::atomic<bool> failed_{false};
  mutable std::mutex failure_mu_;
  std::string failure_;
};

// Returns the channel of (call site, TP group), creating it on first use.
std::shared_ptr<Channel> GetChannel(const TpGroup& group, int64_t callsite, size_t slot_bytes,
                                    Status* status);

// RAII: BeginCall/EndCall around one op invocation on one rank.
class CallScope {
 public:
  CallScope(Channel* channel, int rank) : channel_(channel), rank_(rank) {}
  Status Begin(uint64_t* epoch) {
    Status s = channel_->BeginCall(rank_, epoch);
    begun_ = s.ok();
    return s;
  }
  ~CallScope() {
    if (begun_) channel_->EndCall(rank_);
  }

 private:
  Channel* channel_;
  int rank_;
  bool begun_ = false;
};

}  // namespace flux_jax::cpu
