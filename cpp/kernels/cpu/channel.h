// CPU backend transport: one channel per (fused call site, TP group).
//
// The CPU backend runs the same push protocol the GPU kernels use, over host
// memory instead of peer-mapped HBM:
//
//   rank s (sender)                               rank r (receiver), epoch e, parity b = e & 1
//   wait  mailbox[s].freed[b][r] >= e-2  (local)
//   copy  chunk -> mailbox[r].slot[b][s]           wait mailbox[r].arrived[b][s] >= e  (local)
//   write mailbox[r].arrived[b][s] = e  (remote)   use  mailbox[r].slot[b][s]
//                                                  write mailbox[s].freed[b][r] = e    (remote)
//   last, every rank q (ChannelCall::Finish): mailbox[p].done[b][q] = e on every peer p, then
//   wait mailbox[q].done[b][p] >= e for every peer p: a rank that fails the call fails its peers too
//
// Every wait is on the waiter's own mailbox; remote operations are writes only.
// Epochs increase by one per call and are compared with >=, so flags are never
// reset. Double buffering by parity lets a sender run one call ahead of a slow
// receiver; the freed flag stops it from running two ahead.
//
// Flags are atomics in the region; a waiter sleeps on its mailbox's futex word,
// which every signal bumps. There are no locks: a peer that is stopped or dies at
// any point cannot block another rank longer than the wait's deadline
// (Config.timeout_s), after which the usual diagnostic names the missing rank.
//
// A channel is one contiguous region with a fixed layout: private heap memory when
// the whole group lives in this process, a POSIX shared-memory segment when it
// spans processes (jax.distributed on one host). Receiver r holds (tp-1) sender
// slots x 2 parities; the region is reserved in full when it is created, so a
// small /dev/shm is an error at setup, never a SIGBUS mid-call.
//
// Segment names: /fluxjax-<session>-<keyed hash>, the hash (SipHash-2-4, two
// halves) keyed by the job's secret (>= 128 bits from jax.distributed's key-value
// store, never in a name) over (reset generation, call site, group index, group
// size, the group's device ids). Whoever comes first creates the segment (O_EXCL,
// mode 0600, space reserved with posix_fallocate); the others check its owner and mode before
// mapping it. Once every process of the group has mapped it, the last one unlinks
// the name: nothing is left in /dev/shm, whatever happens to the processes later.
//
// Why one channel per call site and not one per device: XLA:CPU runs
// independent thunks concurrently, so two fused calls with no data dependency
// may run in different orders on different devices. Pairing calls by call site
// makes that harmless. (On GPU everything is stream-ordered, so the GPU
// workspace is shared per device.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "flux_jax/params.h"
#include "flux_jax/status.h"

namespace flux_jax::cpu {

enum class FlagKind { kArrived, kFreed, kDone };

// What a wait is for, to build the timeout diagnostic.
struct WaitInfo {
  const char* op;  // "ag_matmul" / "matmul_rs"
  int peer;        // rank expected to write the flag
  int chunk;       // which chunk of rows the flag guards
};

struct ChannelLayout;  // the shared region's header (channel.cc)

class Channel {
 public:
  ~Channel();

  int size() const { return size_; }
  size_t slot_bytes() const { return slot_bytes_; }
  bool shared() const { return shared_; }  // a shared-memory segment (the group spans processes)

  // Receive slot of sender `slot` (!= owner) for parity `parity` in `owner`'s mailbox.
  std::byte* Slot(int owner, int parity, int slot);

  // Writes `value` into flag (kind, parity, slot) of `target`'s mailbox.
  void Signal(int target, FlagKind kind, int parity, int slot, uint64_t value, const CommConfig& cfg);

  // Blocks until flag (kind, parity, slot) of `me`'s mailbox is >= value, the
  // channel fails, or cfg.timeout_us passes. A timeout fails the channel.
  // Lock-free: no peer can hold anything this waits for.
  Status Wait(int me, FlagKind kind, int parity, int slot, uint64_t value, uint64_t epoch, const CommConfig& cfg,
              const WaitInfo& info);

  // Marks the channel failed (in every process of the group) and wakes every
  // waiter; later calls fail fast. Never blocks.
  void Fail(const std::string& message);
  // Fails the channel for a rank that leaves its call at `epoch` before ChannelCall::Finish (an
  // exception unwinding it): its peers stop waiting for it at once, not at their timeout.
  void Abandon(int rank, uint64_t epoch);
  Status Health() const;

  // Every rank has begun the same number of calls (failed ones included) and none is running:
  // flux_jax.reset() waits for this, so no call of a failed program starts after it.
  bool Quiescent() const;

  // Per-rank call bookkeeping. Begin returns the epoch of this call (1, 2, ...).
  Status BeginCall(int rank, uint64_t* epoch);
  void EndCall(int rank);

 private:
  friend std::shared_ptr<Channel> GetChannel(const TpGroup&, int64_t, size_t, uint64_t, const CommConfig&, Status*);

  Channel() = default;
  void WakeAll();
  std::string NeverMapped() const;  // diagnostic: processes that never mapped a shared region

  int size_ = 0;
  size_t slot_bytes_ = 0;
  size_t slot_stride_ = 0;
  int64_t callsite_ = 0;
  uint64_t generation_ = 0;
  TpGroup group_;
  ChannelLayout* layout_ = nullptr;  // start of the region
  std::byte* data_ = nullptr;
  size_t region_bytes_ = 0;
  bool shared_ = false;   // mmap'ed segment (else heap)
  std::string shm_name_;  // the segment's name (shared only)
  int shm_fd_ = -1;       // held open with a shared flock while mapped (SweepOrphanedSegments)
};

// Returns the channel of (call site, TP group), creating or opening it on first
// use. `signature` identifies the op and its shapes; processes that disagree
// on it for one call site get an error instead of pairing different ops.
std::shared_ptr<Channel> GetChannel(const TpGroup& group, int64_t callsite, size_t slot_bytes, uint64_t signature,
                                    const CommConfig& cfg, Status* status);

// A stable 64-bit hash of a few integers (op signatures; not keyed, not secret).
uint64_t HashInts(std::initializer_list<int64_t> values);

// One op invocation on one rank (RAII: BeginCall in Open, EndCall on scope
// exit): the channel of the call site, this call's epoch and slot parity.
class ChannelCall {
 public:
  ChannelCall() = default;
  ChannelCall(const ChannelCall&) = delete;
  ChannelCall& operator=(const ChannelCall&) = delete;
  ~ChannelCall() {
    if (!begun_) return;
    if (!finished_) channel_->Abandon(rank_, epoch_);  // an error return has failed it already
    channel_->EndCall(rank_);
  }

  Status Open(const TpGroup& group, const CommConfig& cfg, size_t slot_bytes, uint64_t signature) {
    Status status;
    channel_ = GetChannel(group, cfg.callsite, slot_bytes, signature, cfg, &status);
    FLUX_JAX_RETURN_IF_ERROR(status);
    rank_ = group.rank;
    FLUX_JAX_RETURN_IF_ERROR(channel_->BeginCall(rank_, &epoch_));
    begun_ = true;
    return Status::Ok();
  }

  Channel& channel() { return *channel_; }
  uint64_t epoch() const { return epoch_; }
  int parity() const { return static_cast<int>(epoch_ & 1); }

  // The call's last step on every rank: tells every peer this rank finished the call and waits
  // until every peer has (bounded). A rank whose own part succeeded still fails when a peer's
  // failed, so no rank leaves a failed call with a success that strands it in the program's
  // next collective (an XLA one would wait for the failed ranks until XLA aborts the process).
  Status Finish(const CommConfig& cfg, const char* op);

 private:
  std::shared_ptr<Channel> channel_;
  int rank_ = 0;
  uint64_t epoch_ = 0;
  bool begun_ = false;
  bool finished_ = false;
};

}  // namespace flux_jax::cpu
