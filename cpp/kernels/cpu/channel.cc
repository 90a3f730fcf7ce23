#include "channel.h"

#include <chrono>
#include <cstdio>
#include <map>
#include <random>
#include <sstream>
#include <thread>
#include <tuple>

#include "flux_jax/cpu_channels.h"

namespace flux_jax::cpu {
namespace {

constexpr int kNumFlagKinds = 2;
constexpr int kParities = 2;

using ChannelKey = std::tuple<int64_t, std::vector<int64_t>>;

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}

std::map<ChannelKey, std::shared_ptr<Channel>>& Registry() {
  static auto* registry = new std::map<ChannelKey, std::shared_ptr<Channel>>();
  return *registry;
}

void MaybeJitter(const CommConfig& cfg) {
  if (cfg.jitter_us <= 0) return;
  thread_local std::mt19937_64 rng(std::hash<std::thread::id>()(std::this_thread::get_id()));
  std::uniform_int_distribution<int64_t> dist(0, cfg.jitter_us);
  std::this_thread::sleep_for(std::chrono::microseconds(dist(rng)));
}

}  // namespace

Channel::Channel(const TpGroup& group, int64_t callsite, size_t slot_bytes)
    : size_(group.size),
      callsite_(callsite),
      group_index_(group.group_index),
      devices_(group.devices),
      slot_bytes_(slot_bytes),
      epochs_(group.size, 0),
      in_flight_(new std::atomic<int>[group.size]) {
  for (int r = 0; r < size_; ++r) {
    auto box = std::make_unique<Mailbox>();
    box->flags.assign(static_cast<size_t>(kNumFlagKinds) * kParities * size_, 0);
    box->data.resize(static_cast<size_t>(kParities) * size_ * slot_bytes_);
    mailboxes_.push_back(std::move(box));
    in_flight_[r].store(0);
  }
}

size_t Channel::FlagIndex(FlagKind kind, int parity, int slot) const {
  return (static_cast<size_t>(kind) * kParities + parity) * size_ + slot;
}

std::byte* Channel::Slot(int owner, int parity, int slot) {
  return mailboxes_[owner]->data.data() +
         (static_cast<size_t>(parity) * size_ + slot) * slot_bytes_;
}

void Channel::Signal(int target, FlagKind kind, int parity, int slot, uint64_t value,
                     const CommConfig& cfg) {
  MaybeJitter(cfg);
  Mailbox& box = *mailboxes_[target];
  {
    std::lock_guard<std::mutex> lock(box.mu);  // also orders the data written before it
    uint64_t& flag = box.flags[FlagIndex(kind, parity, slot)];
    if (value > flag) flag = value;
  }
  box.cv.notify_all();
}

Status Channel::Wait(int me, FlagKind kind, int parity, int slot, uint64_t value, uint64_t epoch,
                     const CommConfig& cfg, const WaitInfo& info) {
  Mailbox& box = *mailboxes_[me];
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(cfg.timeout_us);
  std::unique_lock<std::mutex> lock(box.mu);
  const uint64_t& flag = box.flags[FlagIndex(kind, parity, slot)];
  bool ready = box.cv.wait_until(lock, deadline, [&] {
    return flag >= value || failed_.load(std::memory_order_acquire);
  });
  if (ready && flag >= value) return Status::Ok();
  lock.unlock();
  if (failed_.load(std::memory_order_acquire)) return Health();

  TpGroup g;
  g.group_index = group_index_;
  g.devices = devices_;
  std::ostringstream os;
  os << "flux_jax." << info.op << " (cpu backend): rank " << me << " of " << g.Describe()
     << " timed out after " << static_cast<double>(cfg.timeout_us) / 1e6 << " s waiting for ";
  if (kind == FlagKind::kArrived) {
    os << "chunk " << info.chunk << " from rank " << info.peer;
  } else {
    os << "rank " << info.peer << " to release its receive slot (chunk " << info.chunk << ")";
  }
  os << " (epoch " << epoch << ", flag value " << flag << " < " << value << ", call site "
     << callsite_ << "). The peer never reached this op or is stuck; every device of the TP "
     << "group must run the same fused ops in the same order. Raise flux_jax.Config.timeout_s "
     << "if the peer is merely slow.";
  Fail(os.str());
  return Status::DeadlineExceeded(os.str());
}

void Channel::Fail(const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failure_.empty()) failure_ = message;
  }
  failed_.store(true, std::memory_order_release);
  for (auto& box : mailboxes_) {
    std::lock_guard<std::mutex> lock(box->mu);
    box->cv.notify_all();
  }
}

Status Channel::Health() const {
  if (!failed_.load(std::memory_order_acquire)) return Status::Ok();
  std::lock_guard<std::mutex> lock(failure_mu_);
  return Status::Internal(
      "flux_jax: this fused call site failed earlier and its TP group state is unusable: " +
      failure_ + " Call flux_jax.reset() (or re-jit) before running it again.");
}

Status Channel::BeginCall(int rank, uint64_t* epoch) {
  FLUX_JAX_RETURN_IF_ERROR(Health());
  if (in_flight_[rank].fetch_add(1) != 0) {
    in_flight_[rank].fetch_sub(1);
    std::string msg =
        "flux_jax (cpu backend): the same fused call site (id " + std::to_string(callsite_) +
        ") is running twice at once on rank " + std::to_string(rank) +
        "; XLA:CPU ran two copies of it concurrently (e.g. an inlined jitted function called "
        "twice on independent data). Make the calls data-dependent or call the op from distinct "
        "call sites.";
    Fail(msg);
    return Status::Internal(msg);
  }
  *epoch = ++epochs_[rank];
  return Status::Ok();
}

void Channel::EndCall(int rank) { in_flight_[rank].fetch_sub(1); }

std::shared_ptr<Channel> GetChannel(const TpGroup& group, int64_t callsite, size_t slot_bytes,
                                    Status* status) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  ChannelKey key{callsite, group.devices};
  auto& slot = Registry()[key];
  if (!slot) slot = std::make_shared<Channel>(group, callsite, slot_bytes);
  if (slot->slot_bytes() != slot_bytes) {
    *status = Status::Internal("flux_jax (cpu backend): call site " + std::to_string(callsite) +
                               " changed its message size from " +
                               std::to_string(slot->slot_bytes()) + " to " +
                               std::to_string(slot_bytes) + " bytes");
    return nullptr;
  }
  *status = Status::Ok();
  return slot;
}

}  // namespace flux_jax::cpu

namespace flux_jax {

void ResetCpuChannels() {
  std::lock_guard<std::mutex> lock(cpu::RegistryMutex());
  cpu::Registry().clear();
}

size_t CpuChannelCount() {
  std::lock_guard<std::mutex> lock(cpu::RegistryMutex());
  return cpu::Registry().size();
}

}  // namespace flux_jax
