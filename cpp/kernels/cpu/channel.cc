#include "channel.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>
#include <vector>

#include "flux_jax/cpu_channels.h"
#include "flux_jax/process.h"

namespace flux_jax::cpu {

namespace {

constexpr int kMaxTp = 64;
constexpr int kParities = 2;
constexpr uint64_t kReady = 0x666c75786a617831ull;  // "fluxjax1"
constexpr size_t kAlign = 64;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

// Shared header of a channel region; mailboxes and data follow it.
struct alignas(64) ChannelLayout {
  std::atomic<uint64_t> ready;
  int32_t tp;
  int32_t pad;
  int64_t callsite;
  uint64_t slot_bytes;
  uint64_t signature;
  std::atomic<int32_t> failed;
  pthread_mutex_t failure_mu;
  char failure[1536];
  std::atomic<uint64_t> epochs[kMaxTp];    // epochs[r]: touched only by rank r
  std::atomic<int32_t> in_flight[kMaxTp];  // in_flight[r]: calls of rank r running now
};

namespace {

struct alignas(64) Mailbox {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t flags[2][kParities][kMaxTp];  // [kind][parity][slot]
};

size_t MailboxOffset(int r) { return AlignUp(sizeof(ChannelLayout)) + r * AlignUp(sizeof(Mailbox)); }
size_t DataOffset(int tp) { return MailboxOffset(tp); }
size_t RegionBytes(int tp, size_t slot_bytes) {
  return DataOffset(tp) + static_cast<size_t>(tp) * kParities * tp * slot_bytes;
}

Mailbox* MailboxAt(ChannelLayout* layout, int r) {
  return reinterpret_cast<Mailbox*>(reinterpret_cast<std::byte*>(layout) + MailboxOffset(r));
}

// Lock that survives a peer process dying while it held the mutex.
void Lock(pthread_mutex_t* mu) {
  if (pthread_mutex_lock(mu) == EOWNERDEAD) pthread_mutex_consistent(mu);
}

void InitMutex(pthread_mutex_t* mu) {
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init(mu, &attr);
  pthread_mutexattr_destroy(&attr);
}

void InitCond(pthread_cond_t* cv) {
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(cv, &attr);
  pthread_condattr_destroy(&attr);
}

// Builds the header and mailboxes in a zeroed region; `ready` is set last.
void InitLayout(ChannelLayout* layout, const TpGroup& group, int64_t callsite, size_t slot_bytes,
                uint64_t signature) {
  layout->tp = group.size;
  layout->callsite = callsite;
  layout->slot_bytes = slot_bytes;
  layout->signature = signature;
  layout->failed.store(0);
  InitMutex(&layout->failure_mu);
  for (int r = 0; r < kMaxTp; ++r) {
    layout->epochs[r].store(0);
    layout->in_flight[r].store(0);
  }
  for (int r = 0; r < group.size; ++r) {
    Mailbox* box = MailboxAt(layout, r);
    InitMutex(&box->mu);
    InitCond(&box->cv);
    std::memset(box->flags, 0, sizeof(box->flags));
  }
  layout->ready.store(kReady, std::memory_order_release);
}

timespec DeadlineAfter(int64_t timeout_us) {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  int64_t ns = ts.tv_nsec + (timeout_us % 1'000'000) * 1000;
  ts.tv_sec += timeout_us / 1'000'000 + ns / 1'000'000'000;
  ts.tv_nsec = ns % 1'000'000'000;
  return ts;
}

void MaybeJitter(const CommConfig& cfg) {
  if (cfg.jitter_us <= 0) return;
  thread_local std::mt19937_64 rng(std::hash<std::thread::id>()(std::this_thread::get_id()));
  std::uniform_int_distribution<int64_t> dist(0, cfg.jitter_us);
  std::this_thread::sleep_for(std::chrono::microseconds(dist(rng)));
}

// ---- registry and shared-memory names -------------------------------------

using ChannelKey = std::tuple<int64_t, std::vector<int64_t>>;

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
std::map<ChannelKey, std::shared_ptr<Channel>>& Registry() {
  static auto* registry = new std::map<ChannelKey, std::shared_ptr<Channel>>();
  return *registry;
}

// Segments this process created, unlinked at exit (their names carry the
// session token, so a crashed job cannot collide with a later one).
std::set<std::string>& CreatedSegments() {
  static auto* names = new std::set<std::string>();
  return *names;
}

void UnlinkCreatedSegments() {
  for (const std::string& name : CreatedSegments()) shm_unlink(name.c_str());
  CreatedSegments().clear();
}

uint64_t HashRange(const std::vector<int64_t>& values) {  // FNV-1a over 64-bit words
  uint64_t h = 1469598103934665603ull;
  for (int64_t v : values) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
  return h;
}

std::string SegmentName(const std::string& session, const TpGroup& group, int64_t callsite) {
  const uint64_t h = HashRange(group.devices);
  char buf[128];
  std::snprintf(buf, sizeof(buf), "/fluxjax-%s-%lld-%016llx", session.c_str(),
                static_cast<long long>(callsite), static_cast<unsigned long long>(h));
  return buf;
}

Status SysError(const std::string& what) {
  return Status::Internal("flux_jax (cpu backend): " + what + ": " + std::strerror(errno));
}

// Creates or opens the shared segment of a channel. `*created` says which.
Status MapSegment(const std::string& name, size_t bytes, int64_t timeout_us, void** out,
                  bool* created) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(timeout_us);
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  *created = fd >= 0;
  if (fd >= 0) {
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      close(fd);
      shm_unlink(name.c_str());
      return SysError("ftruncate of shared segment " + name);
    }
  } else {
    if (errno != EEXIST) return SysError("shm_open " + name);
    fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) return SysError("shm_open " + name);
    for (;;) {  // the creator may not have sized it yet
      struct stat st;
      if (fstat(fd, &st) != 0) {
        close(fd);
        return SysError("fstat " + name);
      }
      if (static_cast<size_t>(st.st_size) == bytes) break;
      if (st.st_size != 0 && static_cast<size_t>(st.st_size) != bytes) {
        close(fd);
        return Status::Internal("flux_jax (cpu backend): processes disagree on the size of " + name +
                                " (" + std::to_string(st.st_size) + " vs " + std::to_string(bytes) +
                                " bytes): they compiled different fused ops for one call site");
      }
      if (std::chrono::steady_clock::now() > deadline) {
        close(fd);
        return Status::DeadlineExceeded("flux_jax (cpu backend): timed out waiting for the process "
                                        "that creates " + name + " to size it");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return SysError("mmap " + name);
  *out = p;
  return Status::Ok();
}

}  // namespace

uint64_t HashInts(std::initializer_list<int64_t> values) { return HashRange(std::vector<int64_t>(values)); }

// ---- Channel ----------------------------------------------------------------

Channel::~Channel() {
  if (layout_ == nullptr) return;
  if (shared_) {
    munmap(layout_, region_bytes_);
  } else {
    ::operator delete(static_cast<void*>(layout_), std::align_val_t(kAlign));
  }
}

std::byte* Channel::Slot(int owner, int parity, int slot) {
  return data_ + ((static_cast<size_t>(owner) * kParities + parity) * size_ + slot) * slot_bytes_;
}

void Channel::Signal(int target, FlagKind kind, int parity, int slot, uint64_t value,
                     const CommConfig& cfg) {
  MaybeJitter(cfg);
  Mailbox* box = MailboxAt(layout_, target);
  Lock(&box->mu);  // also orders the data written before it
  uint64_t& flag = box->flags[static_cast<int>(kind)][parity][slot];
  if (value > flag) flag = value;
  pthread_mutex_unlock(&box->mu);
  pthread_cond_broadcast(&box->cv);
}

Status Channel::Wait(int me, FlagKind kind, int parity, int slot, uint64_t value, uint64_t epoch,
                     const CommConfig& cfg, const WaitInfo& info) {
  Mailbox* box = MailboxAt(layout_, me);
  const timespec deadline = DeadlineAfter(cfg.timeout_us);
  Lock(&box->mu);
  const uint64_t& flag = box->flags[static_cast<int>(kind)][parity][slot];
  bool timed_out = false;
  while (flag < value && !layout_->failed.load(std::memory_order_acquire)) {
    int rc = pthread_cond_timedwait(&box->cv, &box->mu, &deadline);
    if (rc == EOWNERDEAD) pthread_mutex_consistent(&box->mu);
    if (rc == ETIMEDOUT) {
      timed_out = flag < value;
      break;
    }
  }
  const uint64_t seen = flag;
  pthread_mutex_unlock(&box->mu);
  if (!timed_out && seen >= value) return Status::Ok();
  if (layout_->failed.load(std::memory_order_acquire)) return Health();

  std::ostringstream os;
  os << "flux_jax." << info.op << " (cpu backend): rank " << me << " of " << group_.Describe()
     << " timed out after " << static_cast<double>(cfg.timeout_us) / 1e6 << " s waiting for ";
  if (kind == FlagKind::kArrived) {
    os << "chunk " << info.chunk << " from rank " << info.peer;
  } else {
    os << "rank " << info.peer << " to release its receive slot (chunk " << info.chunk << ")";
  }
  os << " (epoch " << epoch << ", flag value " << seen << " < " << value << ", call site "
     << callsite_ << "). Rank " << info.peer << " never reached this op, is stuck, or its process "
     << "died; every device of the TP group must run the same fused ops in the same order. "
     << "Raise flux_jax.Config.timeout_s if the peer is merely slow.";
  Fail(os.str());
  return Status::DeadlineExceeded(os.str());
}

void Channel::Fail(const std::string& message) {
  Lock(&layout_->failure_mu);
  if (layout_->failure[0] == '\0') {
    std::snprintf(layout_->failure, sizeof(layout_->failure), "%s", message.c_str());
  }
  pthread_mutex_unlock(&layout_->failure_mu);
  layout_->failed.store(1, std::memory_order_release);
  for (int r = 0; r < size_; ++r) {
    Mailbox* box = MailboxAt(layout_, r);
    Lock(&box->mu);
    pthread_mutex_unlock(&box->mu);
    pthread_cond_broadcast(&box->cv);
  }
}

Status Channel::Health() const {
  if (!layout_->failed.load(std::memory_order_acquire)) return Status::Ok();
  Lock(&layout_->failure_mu);
  std::string failure(layout_->failure);
  pthread_mutex_unlock(&layout_->failure_mu);
  return Status::Internal(
      "flux_jax: this fused call site failed earlier and its TP group state is unusable: " +
      failure + " Call flux_jax.reset() (or re-jit) before running it again.");
}

Status Channel::BeginCall(int rank, uint64_t* epoch) {
  FLUX_JAX_RETURN_IF_ERROR(Health());
  if (layout_->in_flight[rank].fetch_add(1) != 0) {
    layout_->in_flight[rank].fetch_sub(1);
    std::string msg =
        "flux_jax (cpu backend): the same fused call site (id " + std::to_string(callsite_) +
        ") is running twice at once on rank " + std::to_string(rank) +
        "; XLA:CPU ran two copies of it concurrently (e.g. an inlined jitted function called "
        "twice on independent data). Make the calls data-dependent or call the op from distinct "
        "call sites.";
    Fail(msg);
    return Status::Internal(msg);
  }
  *epoch = layout_->epochs[rank].fetch_add(1) + 1;
  return Status::Ok();
}

void Channel::EndCall(int rank) { layout_->in_flight[rank].fetch_sub(1); }

std::shared_ptr<Channel> GetChannel(const TpGroup& group, int64_t callsite, size_t slot_bytes,
                                    uint64_t signature, const CommConfig& cfg, Status* status) {
  if (group.size > kMaxTp) {
    *status = Status::InvalidArgument("flux_jax (cpu backend): TP groups larger than 64 ranks");
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(RegistryMutex());
  ChannelKey key{callsite, group.devices};
  auto& entry = Registry()[key];
  if (!entry) {
    auto channel = std::shared_ptr<Channel>(new Channel());
    channel->size_ = group.size;
    channel->slot_bytes_ = slot_bytes;
    channel->callsite_ = callsite;
    channel->group_ = group;
    channel->region_bytes_ = RegionBytes(group.size, slot_bytes);
    void* region = nullptr;
    if (!group.cross_process) {
      region = ::operator new(channel->region_bytes_, std::align_val_t(kAlign));
      std::memset(region, 0, DataOffset(group.size));
      channel->layout_ = static_cast<ChannelLayout*>(region);
      InitLayout(channel->layout_, group, callsite, slot_bytes, signature);
    } else {
      const std::string session = Session();
      if (session.empty()) {
        *status = Status::InvalidArgument(
            "flux_jax (cpu backend): this TP group spans processes (" + group.Describe() +
            ") but no session is set; fused ops across processes need jax.distributed");
        return nullptr;
      }
      const std::string name = SegmentName(session, group, callsite);
      bool created = false;
      *status = MapSegment(name, channel->region_bytes_, cfg.timeout_us, &region, &created);
      if (!status->ok()) return nullptr;
      channel->shared_ = true;
      channel->layout_ = static_cast<ChannelLayout*>(region);
      if (created) {  // a fresh segment is zero-filled by the kernel
        InitLayout(channel->layout_, group, callsite, slot_bytes, signature);
        if (CreatedSegments().empty()) std::atexit(UnlinkCreatedSegments);
        CreatedSegments().insert(name);
        channel->shm_name_ = name;
      } else {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(cfg.timeout_us);
        while (channel->layout_->ready.load(std::memory_order_acquire) != kReady) {
          if (std::chrono::steady_clock::now() > deadline) {
            *status = Status::DeadlineExceeded("flux_jax (cpu backend): timed out waiting for " +
                                               name + " to be initialized by its creator");
            return nullptr;
          }
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      }
    }
    channel->data_ = static_cast<std::byte*>(region) + DataOffset(group.size);
    entry = channel;
  }
  const ChannelLayout* layout = entry->layout_;
  if (layout->slot_bytes != slot_bytes || layout->signature != signature || layout->tp != group.size) {
    *status = Status::Internal(
        "flux_jax (cpu backend): call site " + std::to_string(callsite) + " of " + group.Describe() +
        " is used by different fused ops or shapes (message " + std::to_string(layout->slot_bytes) +
        " vs " + std::to_string(slot_bytes) + " bytes); every process and device must compile the "
        "same program");
    return nullptr;
  }
  *status = Status::Ok();
  return entry;
}

}  // namespace flux_jax::cpu

namespace flux_jax {

void ResetCpuChannels() {
  std::lock_guard<std::mutex> lock(cpu::RegistryMutex());
  cpu::Registry().clear();
  cpu::UnlinkCreatedSegments();
}

size_t CpuChannelCount() {
  std::lock_guard<std::mutex> lock(cpu::RegistryMutex());
  return cpu::Registry().size();
}

}  // namespace flux_jax
