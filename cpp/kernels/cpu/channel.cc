#include "channel.h"

#include <errno.h>
#include <fcntl.h>
#include <dirent.h>
#include <linux/futex.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
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
constexpr int kFlagKinds = 3;
constexpr uint64_t kReady = 0x666c75786a617832ull;  // "fluxjax2": layout version 2
constexpr size_t kAlign = 64;
constexpr size_t kFailureBytes = 1536;

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free &&
                  sizeof(std::atomic<uint32_t>) == sizeof(uint32_t),
              "channel flags live in shared memory: they must be plain lock-free words");

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

using Clock = std::chrono::steady_clock;

}  // namespace

// Shared header of a channel region; mailboxes and data follow it. Every field
// is written by the creator before `ready`, or is an atomic.
struct alignas(64) ChannelLayout {
  std::atomic<uint64_t> ready;
  int32_t tp;
  int32_t mappers;  // processes that map the region
  int64_t callsite;
  int64_t group_index;
  uint64_t generation;  // flux_jax.reset() generation of the creator
  uint64_t slot_bytes;
  uint64_t signature;
  std::atomic<int32_t> mapped;  // processes that mapped it so far
  std::atomic<int32_t> failed;  // 0 healthy, 1 message being written, 2 written
  char failure[kFailureBytes];
  std::atomic<uint64_t> epochs[kMaxTp];      // epochs[r]: touched only by rank r
  std::atomic<int32_t> in_flight[kMaxTp];    // in_flight[r]: calls of rank r running now
  std::atomic<uint64_t> arrivals[kMaxTp];    // arrivals[r]: calls rank r began, failed ones included
  std::atomic<int32_t> rank_mapped[kMaxTp];  // the process of rank r has mapped the region
};

namespace {

struct alignas(64) Mailbox {
  std::atomic<uint32_t> seq;      // futex word: bumped by every signal into this mailbox
  std::atomic<uint32_t> waiters;  // ranks sleeping on `seq` (signals skip the wake syscall at 0)
  std::atomic<uint64_t> flags[kFlagKinds][kParities][kMaxTp];  // [kind][parity][sender]
};

size_t MailboxOffset(int r) { return AlignUp(sizeof(ChannelLayout)) + r * AlignUp(sizeof(Mailbox)); }
size_t DataOffset(int tp) { return MailboxOffset(tp); }
// Receiver r: (tp-1) sender slots x 2 parities; a rank never sends to itself.
size_t RegionBytes(int tp, size_t slot_stride) {
  return DataOffset(tp) + static_cast<size_t>(tp) * kParities * (tp - 1) * slot_stride;
}

Mailbox* MailboxAt(ChannelLayout* layout, int r) {
  return reinterpret_cast<Mailbox*>(reinterpret_cast<std::byte*>(layout) + MailboxOffset(r));
}

// ---- futex ------------------------------------------------------------------

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, Clock::duration timeout, bool shared) {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
  timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE, expected, &ts,
          nullptr, 0);  // EAGAIN, EINTR, ETIMEDOUT: the caller re-checks
}

void FutexWakeAll(std::atomic<uint32_t>* word, bool shared) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), shared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Builds the header and mailboxes in a zeroed region; `ready` is set last.
void InitLayout(ChannelLayout* layout, const TpGroup& group, int64_t callsite, uint64_t generation, size_t slot_bytes,
                uint64_t signature, int mappers) {
  layout->tp = group.size;
  layout->mappers = mappers;
  layout->callsite = callsite;
  layout->group_index = group.group_index;
  layout->generation = generation;
  layout->slot_bytes = slot_bytes;
  layout->signature = signature;
  layout->mapped.store(0);
  layout->failed.store(0);
  for (int r = 0; r < kMaxTp; ++r) {
    layout->epochs[r].store(0);
    layout->in_flight[r].store(0);
    layout->arrivals[r].store(0);
    layout->rank_mapped[r].store(0);
  }
  for (int r = 0; r < group.size; ++r) {
    Mailbox* box = MailboxAt(layout, r);
    box->seq.store(0);
    box->waiters.store(0);
    for (auto& kind : box->flags)
      for (auto& parity : kind)
        for (auto& flag : parity) flag.store(0);
  }
  layout->ready.store(kReady, std::memory_order_release);
}

void MaybeJitter(const CommConfig& cfg) {
  if (cfg.jitter_us <= 0) return;
  thread_local std::mt19937_64 rng(std::hash<std::thread::id>()(std::this_thread::get_id()));
  std::uniform_int_distribution<int64_t> dist(0, cfg.jitter_us);
  std::this_thread::sleep_for(std::chrono::microseconds(dist(rng)));
}

std::string Mib(size_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.1f MiB (%zu bytes)", static_cast<double>(bytes) / (1 << 20), bytes);
  return buf;
}

// ---- registry, generations and shared-memory names ---------------------------

// A channel, or why setting it up failed (later ranks of this process then fail
// at once with the same message instead of each waiting out the timeout).
struct Entry {
  std::shared_ptr<Channel> channel;
  Status error;
};
// (call site, group index, group size, the group's global device ids in rank order): one program
// run on two sets of devices (a function jitted for two meshes, pipeline stages of one layer) has
// the same call-site ids, and its groups must not share a channel.
using ChannelKey = std::tuple<int64_t, int64_t, int, std::vector<int64_t>>;
ChannelKey KeyOf(int64_t callsite, const TpGroup& group) {
  return ChannelKey{callsite, group.group_index, group.size, group.devices};
}

// Timed: a setup that waits for a peer process holds it, and no other thread may
// wait for it longer than its own call's timeout.
std::timed_mutex& RegistryMutex() {
  static std::timed_mutex mu;
  return mu;
}
std::map<ChannelKey, Entry>& Registry() {
  static auto* registry = new std::map<ChannelKey, Entry>();
  return *registry;
}
// Bumped by every flux_jax.reset(): segment names of one generation are never
// those of another, so a process that missed a reset cannot pair with new state.
std::atomic<uint64_t> g_generation{0};

// Names this process created or opened that may still be linked (not every
// process of the group has mapped them yet); unlinked at exit and on reset.
std::mutex& LinkedMutex() {
  static std::mutex mu;
  return mu;
}
std::set<std::string>& LinkedSegments() {
  static auto* names = new std::set<std::string>();
  return *names;
}

void UnlinkSegment(const std::string& name) {
  shm_unlink(name.c_str());  // ENOENT: the last mapper (or a failure) already did
  std::lock_guard<std::mutex> lock(LinkedMutex());
  LinkedSegments().erase(name);
}

void UnlinkLinkedSegments() {
  std::lock_guard<std::mutex> lock(LinkedMutex());
  for (const std::string& name : LinkedSegments()) shm_unlink(name.c_str());
  LinkedSegments().clear();
}

void RememberLinked(const std::string& name) {
  std::lock_guard<std::mutex> lock(LinkedMutex());
  static bool registered = false;
  if (!registered) {
    std::atexit(UnlinkLinkedSegments);
    registered = true;
  }
  LinkedSegments().insert(name);
}

uint64_t HashRange(const std::vector<int64_t>& values) {  // FNV-1a over 64-bit words
  uint64_t h = 1469598103934665603ull;
  for (int64_t v : values) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
  return h;
}

// SipHash-2-4 (Aumasson and Bernstein), 64-bit output: a keyed hash, so names
// cannot be predicted without the key.
uint64_t SipHash24(const uint8_t key[16], const uint8_t* msg, size_t len) {
  auto load = [](const uint8_t* p, size_t n) {
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
    return v;
  };
  auto rotl = [](uint64_t x, int b) { return (x << b) | (x >> (64 - b)); };
  const uint64_t k0 = load(key, 8), k1 = load(key + 8, 8);
  uint64_t v0 = k0 ^ 0x736f6d6570736575ull, v1 = k1 ^ 0x646f72616e646f6dull;
  uint64_t v2 = k0 ^ 0x6c7967656e657261ull, v3 = k1 ^ 0x7465646279746573ull;
  auto rounds = [&](int n) {
    for (int i = 0; i < n; ++i) {
      v0 += v1;
      v1 = rotl(v1, 13);
      v1 ^= v0;
      v0 = rotl(v0, 32);
      v2 += v3;
      v3 = rotl(v3, 16);
      v3 ^= v2;
      v0 += v3;
      v3 = rotl(v3, 21);
      v3 ^= v0;
      v2 += v1;
      v1 = rotl(v1, 17);
      v1 ^= v2;
      v2 = rotl(v2, 32);
    }
  };
  const size_t tail = len - len % 8;
  for (size_t i = 0; i < tail; i += 8) {
    const uint64_t m = load(msg + i, 8);
    v3 ^= m;
    rounds(2);
    v0 ^= m;
  }
  const uint64_t b = (static_cast<uint64_t>(len & 0xff) << 56) | load(msg + tail, len - tail);
  v3 ^= b;
  rounds(2);
  v0 ^= b;
  v2 ^= 0xff;
  rounds(4);
  return v0 ^ v1 ^ v2 ^ v3;
}

// /fluxjax-<session>-<128-bit keyed hash of (generation, call site, group and its devices)> in hex
// (tests/shm_names.py recomputes it). The job token only groups a job's
// segments for people; the hash is what makes the name unpredictable.
std::string SegmentName(const std::string& session, const std::string& secret, uint64_t generation, int64_t callsite,
                        const TpGroup& group) {
  std::string out = "/fluxjax-" + session + "-";
  std::vector<int64_t> words = {0, static_cast<int64_t>(generation), callsite, group.group_index, group.size};
  words.insert(words.end(), group.devices.begin(), group.devices.end());
  for (int64_t half = 0; half < 2; ++half) {
    words[0] = half;
    std::vector<uint8_t> msg(words.size() * 8);
    for (size_t i = 0; i < msg.size(); ++i) {
      msg[i] = static_cast<uint8_t>(static_cast<uint64_t>(words[i / 8]) >> (8 * (i % 8)));
    }
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx",
                  static_cast<unsigned long long>(
                      SipHash24(reinterpret_cast<const uint8_t*>(secret.data()), msg.data(), msg.size())));
    out += hex;
  }
  return out;
}

Status SysError(const std::string& what, int err) {
  return Status::Internal("flux_jax (cpu backend): " + what + ": " + std::strerror(err));
}

// What a segment is for, in messages.
std::string SegmentWhat(const std::string& name, int64_t callsite, const TpGroup& group) {
  return "shared-memory segment /dev/shm" + name + " (call site " + std::to_string(callsite) + " of " +
         group.Describe() + ")";
}

// What to do when /dev/shm is too small (every process that meets it says the same).
const char* ShmRemedy() {
  return ". A TP group that spans processes keeps tp x (tp-1) x 2 message slots in /dev/shm for every "
         "fused call site it has run (until flux_jax.reset()). Give the job more shared memory (docker run "
         "--shm-size=<bytes>, Kubernetes: an emptyDir with medium Memory on /dev/shm, or mount -o "
         "remount,size=<bytes> /dev/shm), use smaller messages per call, or keep each TP group "
         "inside one process.";
}

// Reserves `bytes` in a fresh segment: posix_fallocate both sizes it and backs
// every page, and tmpfs makes the size visible only once all pages are
// reserved, so a process that opens the segment never maps unreserved memory.
Status Reserve(int fd, size_t bytes, const std::string& what) {
  int rc;
  do {
    rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  } while (rc == EINTR);
  if (rc == 0) return Status::Ok();
  std::ostringstream os;
  os << "flux_jax (cpu backend): cannot reserve " << Mib(bytes) << " in /dev/shm for the " << what
     << " (posix_fallocate: " << std::strerror(rc) << ")";
  struct statvfs vfs;
  if (fstatvfs(fd, &vfs) == 0) {
    os << "; /dev/shm has " << Mib(static_cast<size_t>(vfs.f_bavail) * vfs.f_frsize) << " free of "
       << Mib(static_cast<size_t>(vfs.f_blocks) * vfs.f_frsize);
  }
  os << ShmRemedy();
  return rc == ENOSPC || rc == ENOMEM || rc == EFBIG ? Status::ResourceExhausted(os.str()) : Status::Internal(os.str());
}

// A process holds a shared flock on every segment it has open, from right after shm_open until
// its channel goes, and the last process to map a segment unlinks its name. So a sized segment
// of this user's (mode 0600, as flux_jax makes them) that nobody holds a lock on was left by
// processes killed before every peer mapped it (SIGKILL skips atexit): nothing can pair with
// it, and it would hold /dev/shm until reboot. Removed once per process, before its first
// segment; the job's own names are left alone.
void SweepOrphanedSegments(const std::string& own_prefix) {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  while (const dirent* entry = readdir(dir)) {
    const std::string file = entry->d_name;
    if (file.rfind("fluxjax-", 0) != 0 || file.rfind(own_prefix, 0) == 0) continue;
    const std::string name = "/" + file;
    const int fd = shm_open(name.c_str(), O_RDWR, 0);  // another user's (mode 0600) does not open
    if (fd < 0) continue;
    struct stat st;
    const bool ours = fstat(fd, &st) == 0 && st.st_uid == geteuid() && (st.st_mode & 07777) == 0600;
    if (ours && st.st_size > 0 && flock(fd, LOCK_EX | LOCK_NB) == 0) {
      shm_unlink(name.c_str());
    }
    close(fd);
  }
  closedir(dir);
}

// Creates (O_EXCL, 0600, reserved) or opens-and-checks the segment `name` and
// maps it. `*created` says which; `*fd_out` is the open, shared-locked descriptor to close
// after unmapping. Every wait is bounded by `deadline`.
Status MapSegment(const std::string& name, const std::string& what, size_t bytes, Clock::time_point deadline,
                  void** out, bool* created, int* fd_out) {
  for (;;) {
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0) {
      *created = true;
      flock(fd, LOCK_SH);  // before it is sized: a sweeper passes over unsized segments
      // umask-proof; before the size, so an opener that sees a size also sees the mode
      if (fchmod(fd, 0600) != 0) {
        const int err = errno;
        close(fd);
        shm_unlink(name.c_str());
        return SysError("fchmod of the " + what, err);
      }
      Status reserved = Reserve(fd, bytes, what);
      if (!reserved.ok()) {
        close(fd);
        shm_unlink(name.c_str());
        return reserved;
      }
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      const int err = errno;
      if (p == MAP_FAILED) {
        close(fd);
        shm_unlink(name.c_str());
        return SysError("mmap of the " + what, err);
      }
      *out = p;
      *fd_out = fd;
      return Status::Ok();
    }
    if (const int err = errno; err != EEXIST) return SysError("shm_open of the " + what, err);
    fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) {
      const int err = errno;
      if (err == ENOENT && Clock::now() < deadline) continue;  // unlinked meanwhile: create it
      return SysError("shm_open of the " + what, err);
    }
    *created = false;
    flock(fd, LOCK_SH);
    for (;;) {  // the creator may not have reserved it yet
      struct stat st;
      if (fstat(fd, &st) != 0) {
        const int err = errno;
        close(fd);
        return SysError("fstat of the " + what, err);
      }
      const unsigned mode = st.st_mode & 07777;
      const bool sized = st.st_size != 0;
      std::string refused;
      if (st.st_uid != geteuid()) {
        refused = "it is owned by uid " + std::to_string(st.st_uid) + ", not by this process's uid " +
                  std::to_string(geteuid());
      } else if (mode != 0600 && (sized || (mode & ~0600u) != 0)) {
        char buf[96];
        std::snprintf(buf, sizeof(buf), "its mode is 0%03o, not 0600", mode);
        refused = buf;
      }
      if (!refused.empty()) {
        close(fd);
        return Status::Internal(
            "flux_jax (cpu backend): refusing the " + what + ": " + refused +
            ". flux_jax creates its "
            "segments with O_EXCL and mode 0600 under names derived from a secret of the job; this one "
            "was made by someone else (another local user squatting the name?). Nothing was read "
            "from or written to it; remove it, or call flux_jax.reset() in every process for fresh names.");
      }
      if (sized) {
        if (static_cast<size_t>(st.st_size) != bytes) {
          close(fd);
          return Status::Internal("flux_jax (cpu backend): processes disagree on the size of the " + what + " (" +
                                  std::to_string(st.st_size) + " vs " + std::to_string(bytes) +
                                  " bytes): they compiled different fused ops for one call site");
        }
        break;
      }
      if (st.st_nlink == 0) {
        close(fd);
        return Status::ResourceExhausted("flux_jax (cpu backend): the process that created the " + what +
                                         " removed it before sizing it: it could not reserve " + Mib(bytes) +
                                         " of /dev/shm" + ShmRemedy());
      }
      if (Clock::now() > deadline) {
        close(fd);
        return Status::DeadlineExceeded(
            "flux_jax (cpu backend): timed out waiting for the process that "
            "creates the " +
            what + " to reserve it");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int err = errno;
    if (p == MAP_FAILED) {
      close(fd);
      return SysError("mmap of the " + what, err);
    }
    *out = p;
    *fd_out = fd;
    return Status::Ok();
  }
}

}  // namespace

uint64_t HashInts(std::initializer_list<int64_t> values) { return HashRange(std::vector<int64_t>(values)); }

// ---- Channel ----------------------------------------------------------------

Channel::~Channel() {
  if (layout_ == nullptr) return;
  if (shared_) {
    munmap(layout_, region_bytes_);
    if (shm_fd_ >= 0) close(shm_fd_);
  } else {
    ::operator delete(static_cast<void*>(layout_), std::align_val_t(kAlign));
  }
}

std::byte* Channel::Slot(int owner, int parity, int slot) {
  const int index = slot < owner ? slot : slot - 1;  // slot == owner does not exist
  return data_ + ((static_cast<size_t>(owner) * kParities + parity) * (size_ - 1) + index) * slot_stride_;
}

void Channel::Signal(int target, FlagKind kind, int parity, int slot, uint64_t value, const CommConfig& cfg) {
  MaybeJitter(cfg);
  Mailbox* box = MailboxAt(layout_, target);
  std::atomic<uint64_t>& flag = box->flags[static_cast<int>(kind)][parity][slot];
  uint64_t current = flag.load(std::memory_order_relaxed);
  // seq_cst: publishes the data written before it; ordered before `seq` below
  while (current < value && !flag.compare_exchange_weak(current, value)) {
  }
  box->seq.fetch_add(1);
  if (box->waiters.load() != 0) FutexWakeAll(&box->seq, shared_);
}

void Channel::WakeAll() {
  for (int r = 0; r < size_; ++r) {
    Mailbox* box = MailboxAt(layout_, r);
    box->seq.fetch_add(1);
    FutexWakeAll(&box->seq, shared_);
  }
}

Status Channel::Wait(int me, FlagKind kind, int parity, int slot, uint64_t value, uint64_t epoch, const CommConfig& cfg,
                     const WaitInfo& info) {
  Mailbox* box = MailboxAt(layout_, me);
  const std::atomic<uint64_t>& flag = box->flags[static_cast<int>(kind)][parity][slot];
  uint64_t seen = flag.load(std::memory_order_acquire);
  for (int i = 0; i < 64 && seen < value; ++i) {
    CpuRelax();
    seen = flag.load(std::memory_order_acquire);
  }
  if (seen >= value) return Status::Ok();

  const auto deadline = Clock::now() + std::chrono::microseconds(cfg.timeout_us);
  // A signal bumps `seq` after its flag and wakes if `waiters` is non-zero; all
  // seq_cst, so either it sees this waiter or this waiter sees its flag.
  box->waiters.fetch_add(1);
  for (;;) {
    const uint32_t seq = box->seq.load();
    seen = flag.load();
    if (seen >= value || layout_->failed.load() != 0) break;
    const auto now = Clock::now();
    if (now >= deadline) break;
    FutexWait(&box->seq, seq, std::min<Clock::duration>(deadline - now, std::chrono::seconds(1)), shared_);
  }
  box->waiters.fetch_sub(1);
  if (seen >= value) return Status::Ok();
  if (layout_->failed.load() != 0) return Health();

  std::ostringstream os;
  os << "flux_jax." << info.op << " (cpu backend): rank " << me << " of " << group_.Describe() << " timed out after "
     << static_cast<double>(cfg.timeout_us) / 1e6 << " s waiting for ";
  if (kind == FlagKind::kArrived) {
    os << "chunk " << info.chunk << " from rank " << info.peer;
  } else if (kind == FlagKind::kDone) {
    os << "rank " << info.peer << " to finish the call";
  } else {
    os << "rank " << info.peer << " to release its receive slot (chunk " << info.chunk << ")";
  }
  os << " (epoch " << epoch << ", flag value " << seen << " < " << value << ", call site " << callsite_ << "). Rank "
     << info.peer << " never reached this op, is stuck, or its process "
     << "died; every device of the TP group must run the same fused ops in the same order. "
     << "Raise flux_jax.Config.timeout_s if the peer is merely slow." << NeverMapped();
  Fail(os.str());
  return Status::DeadlineExceeded(os.str());
}

std::string Channel::NeverMapped() const {
  if (!shared_) return "";
  std::set<int64_t> processes;
  for (int r = 0; r < size_; ++r) {
    if (layout_->rank_mapped[r].load() == 0) processes.insert(group_.processes[r]);
  }
  if (processes.empty()) return "";
  std::ostringstream os;
  os << " Process" << (processes.size() > 1 ? "es " : " ");
  bool first = true;
  for (int64_t p : processes) {
    os << (first ? "" : ", ") << p;
    first = false;
  }
  os << " never opened this call site's channel (flux_jax.reset() generation " << generation_ << " of process "
     << ProcessIndex() << "): not running this program, died before it, gave up on it before this "
     << "process came (its own error says so), on "
     << "another reset generation (flux_jax.reset() must be called in every process), or it lowered this call "
     << "site differently (another flux_jax.Config, e.g. FLUX_JAX_CONFIG set in one process only, or other "
     << "shapes or dtypes: they are part of the channel's name).";
  return os.str();
}

void Channel::Fail(const std::string& message) {
  // First the name: a process that never mapped the segment must not find it, and a job that
  // ends now leaves nothing in /dev/shm. Before the failure is visible: another thread of this
  // process may return the error at once and the process exit (os._exit) while this one is
  // still descheduled (a segment was left behind that way on a loaded 2-core host).
  if (shared_) UnlinkSegment(shm_name_);
  int32_t expected = 0;
  if (layout_->failed.compare_exchange_strong(expected, 1)) {
    std::snprintf(layout_->failure, kFailureBytes, "%s", message.c_str());
    layout_->failed.store(2, std::memory_order_release);
  }
  WakeAll();
}

void Channel::Abandon(int rank, uint64_t epoch) {
  Fail("flux_jax (cpu backend): rank " + std::to_string(rank) + " of " + group_.Describe() + " left call site " +
       std::to_string(callsite_) + "'s call (epoch " + std::to_string(epoch) +
       ") before finishing it; that rank's own error says why.");
}

Status Channel::Health() const {
  int32_t state = layout_->failed.load(std::memory_order_acquire);
  if (state == 0) return Status::Ok();
  // The failing rank is writing its message; that takes microseconds once its thread runs, but
  // on a loaded host the thread can be descheduled for 100+ ms right between the two stores
  // (seen on 2 cores during a build). Wait up to 2 s; only a process stopped right then costs
  // that much, and it then reads as "not available".
  for (int i = 0; i < 20000 && state == 1; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    state = layout_->failed.load(std::memory_order_acquire);
  }
  const std::string failure = state == 2 ? std::string(layout_->failure, strnlen(layout_->failure, kFailureBytes))
                                         : "(a rank of the group failed it; its message is not available)";
  return Status::Internal(
      "flux_jax: this fused call site failed earlier and its TP group state is unusable: " + failure +
      " Call flux_jax.reset() before running it again (a re-jit compiles the same call sites).");
}

Status Channel::BeginCall(int rank, uint64_t* epoch) {
  layout_->arrivals[rank].fetch_add(1);
  FLUX_JAX_RETURN_IF_ERROR(Health());
  if (layout_->in_flight[rank].fetch_add(1) != 0) {
    layout_->in_flight[rank].fetch_sub(1);
    std::string msg = "flux_jax (cpu backend): the same fused call site (id " + std::to_string(callsite_) +
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

bool Channel::Quiescent() const {
  uint64_t first = layout_->arrivals[0].load();
  for (int r = 0; r < size_; ++r) {
    if (layout_->arrivals[r].load() != first || layout_->in_flight[r].load() != 0) return false;
  }
  return true;
}

namespace {

// Creates or opens the shared region of a channel, checks it and counts this
// process as mapped (the last one unlinks the name); see channel.h.
Status OpenShared(ChannelLayout** layout, const TpGroup& group, int64_t callsite, uint64_t generation,
                  size_t slot_bytes, uint64_t signature, size_t region_bytes, Clock::time_point deadline,
                  std::string* name_out, int* fd_out) {
  const std::string session = Session(), secret = ShmSecret();
  if (session.empty() || secret.size() < 16) {
    return Status::InvalidArgument("flux_jax (cpu backend): this TP group spans processes (" + group.Describe() +
                                   ") but this process has no session secret: call flux_jax.initialize_distributed() "
                                   "in every process after jax.distributed.initialize() (lowering a fused op does "
                                   "it; a program deserialized from jax.export is not lowered here)");
  }
  const std::string name = SegmentName(session, secret, generation, callsite, group);
  const std::string what = SegmentWhat(name, callsite, group);
  std::set<int64_t> processes(group.processes.begin(), group.processes.end());
  const int mappers = static_cast<int>(processes.size());

  void* region = nullptr;
  bool created = false;
  static std::once_flag swept;
  std::call_once(swept, [&] { SweepOrphanedSegments("fluxjax-" + session + "-"); });
  FLUX_JAX_RETURN_IF_ERROR(MapSegment(name, what, region_bytes, deadline, &region, &created, fd_out));
  RememberLinked(name);
  *name_out = name;
  auto* l = static_cast<ChannelLayout*>(region);
  *layout = l;
  if (created) {  // a fresh segment is zero-filled by the kernel
    InitLayout(l, group, callsite, generation, slot_bytes, signature, mappers);
  } else {
    while (l->ready.load(std::memory_order_acquire) != kReady) {
      if (Clock::now() > deadline) {
        UnlinkSegment(name);
        return Status::DeadlineExceeded("flux_jax (cpu backend): timed out waiting for the " + what +
                                        " to be initialized by the process that created it");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (l->tp != group.size || l->callsite != callsite || l->group_index != group.group_index ||
        l->generation != generation || l->mappers != mappers) {
      return Status::Internal("flux_jax (cpu backend): the " + what +
                              " was created for another group, "
                              "call site or reset generation; every process must run the same program");
    }
  }
  const int me = ProcessIndex();
  for (int r = 0; r < group.size; ++r) {
    if (group.processes[r] == me) l->rank_mapped[r].store(1);
  }
  // The last process to map the segment unlinks its name: from now on nobody can
  // open it, and it disappears with the last mapping, however the processes end.
  if (l->mapped.fetch_add(1) + 1 == mappers) UnlinkSegment(name);
  return Status::Ok();
}

}  // namespace

std::shared_ptr<Channel> GetChannel(const TpGroup& group, int64_t callsite, size_t slot_bytes, uint64_t signature,
                                    const CommConfig& cfg, Status* status) {
  if (group.size > kMaxTp) {
    *status = Status::InvalidArgument("flux_jax (cpu backend): TP groups larger than 64 ranks");
    return nullptr;
  }
  const auto deadline = Clock::now() + std::chrono::microseconds(cfg.timeout_us);
  std::unique_lock<std::timed_mutex> lock(RegistryMutex(), std::defer_lock);
  if (!lock.try_lock_until(deadline)) {
    std::ostringstream os;
    os << "flux_jax (cpu backend): rank " << group.rank << " of " << group.Describe() << " timed out after "
       << static_cast<double>(cfg.timeout_us) / 1e6 << " s waiting to set up the channel of call site " << callsite
       << ": another channel's setup in this process is waiting for a peer process (its "
       << "error says which)";
    *status = Status::DeadlineExceeded(os.str());
    return nullptr;
  }
  Entry& entry = Registry()[KeyOf(callsite, group)];
  if (!entry.error.ok()) {
    *status = entry.error;
    return nullptr;
  }
  if (!entry.channel) {
    auto channel = std::shared_ptr<Channel>(new Channel());
    channel->size_ = group.size;
    channel->slot_bytes_ = slot_bytes;
    channel->slot_stride_ = AlignUp(slot_bytes);
    channel->callsite_ = callsite;
    channel->generation_ = g_generation.load();
    channel->group_ = group;
    channel->region_bytes_ = RegionBytes(group.size, channel->slot_stride_);
    if (!group.cross_process) {
      void* region = ::operator new(channel->region_bytes_, std::align_val_t(kAlign));
      std::memset(region, 0, DataOffset(group.size));
      channel->layout_ = static_cast<ChannelLayout*>(region);
      InitLayout(channel->layout_, group, callsite, channel->generation_, slot_bytes, signature, 1);
    } else {
      channel->shared_ = true;
      Status s = OpenShared(&channel->layout_, group, callsite, channel->generation_, slot_bytes, signature,
                            channel->region_bytes_, deadline, &channel->shm_name_, &channel->shm_fd_);
      if (!s.ok()) {
        if (channel->layout_ == nullptr) channel->shared_ = false;  // nothing mapped
        // A region that is ours but unusable: tell the peers instead of letting them time out.
        if (channel->layout_ != nullptr && channel->layout_->ready.load() == kReady) channel->Fail(s.message());
        entry.error = s;
        *status = s;
        return nullptr;
      }
    }
    channel->data_ = reinterpret_cast<std::byte*>(channel->layout_) + DataOffset(group.size);
    entry.channel = channel;
  }
  const ChannelLayout* layout = entry.channel->layout_;
  if (layout->slot_bytes != slot_bytes || layout->signature != signature || layout->tp != group.size) {
    const std::string msg = "flux_jax (cpu backend): call site " + std::to_string(callsite) + " of " +
                            group.Describe() + " is used by different fused ops or shapes (message " +
                            std::to_string(layout->slot_bytes) + " vs " + std::to_string(slot_bytes) +
                            " bytes); every process and device must compile the "
                            "same program";
    entry.channel->Fail(msg);  // the peers get this instead of a timeout
    *status = Status::Internal(msg);
    return nullptr;
  }
  *status = Status::Ok();
  return entry.channel;
}

Status ChannelCall::Finish(const CommConfig& cfg, const char* op) {
  finished_ = true;
  const int tp = channel_->size();
  if (rank_ != cfg.drop_rank) {  // drop_rank (tests): silent to the end
    for (int q = 0; q < tp; ++q) {
      if (q != rank_) channel_->Signal(q, FlagKind::kDone, parity(), rank_, epoch_, cfg);
    }
  }
  // Twice the call's timeout: a peer's own wait that gives up fails the channel first, so its
  // message (the rank that never sent) is the one every rank reports.
  CommConfig twice = cfg;
  twice.timeout_us = 2 * cfg.timeout_us;
  for (int i = 1; i < tp; ++i) {
    const int q = (rank_ + i) % tp;
    FLUX_JAX_RETURN_IF_ERROR(channel_->Wait(rank_, FlagKind::kDone, parity(), q, epoch_, epoch_, twice, {op, q, -1}));
  }
  return Status::Ok();
}

}  // namespace flux_jax::cpu

namespace flux_jax {

void ResetCpuChannels() {
  // A failed call returns on the device that saw the failure while other devices' threads may not
  // have reached that call yet; one that came after the reset would open a fresh channel of the
  // same call site and wait there for peers that already left. So first let every rank of each
  // in-process channel reach the same call (bounded: a rank that never comes is dead anyway).
  std::vector<std::shared_ptr<cpu::Channel>> local;
  {
    std::lock_guard<std::timed_mutex> lock(cpu::RegistryMutex());
    for (auto& [key, entry] : cpu::Registry()) {
      if (entry.channel && !entry.channel->shared()) local.push_back(entry.channel);
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (const auto& channel : local) {
    while (!channel->Quiescent() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  std::lock_guard<std::timed_mutex> lock(cpu::RegistryMutex());
  const uint64_t old_generation = cpu::g_generation.load();
  for (auto& [key, entry] : cpu::Registry()) {
    if (entry.channel && entry.channel->shared()) {
      // Peers that did not reset (yet) fail with this instead of pairing stale state.
      entry.channel->Fail("process " + std::to_string(ProcessIndex()) +
                          " called flux_jax.reset() and moved from reset "
                          "generation " +
                          std::to_string(old_generation) + " to " + std::to_string(old_generation + 1) +
                          " while this channel of generation " + std::to_string(old_generation) +
                          " was open here; in a "
                          "multi-process job every process must call flux_jax.reset() (it is collective).");
    }
  }
  cpu::Registry().clear();
  cpu::g_generation.fetch_add(1);
  cpu::UnlinkLinkedSegments();
}

void FailCpuCallSite(const TpGroup& group, int64_t callsite, const Status& error) {
  std::unique_lock<std::timed_mutex> lock(cpu::RegistryMutex(), std::defer_lock);
  // Bounded: another channel's setup may hold the registry while it waits for a peer process.
  if (!lock.try_lock_for(std::chrono::seconds(1))) return;
  cpu::Entry& entry = cpu::Registry()[cpu::KeyOf(callsite, group)];
  if (entry.channel) {
    entry.channel->Fail(error.message());
  } else if (entry.error.ok()) {
    entry.error = Status::Internal("flux_jax: this fused call site failed on another rank of " + group.Describe() +
                                   ": " + error.message() + ". Call flux_jax.reset() before running it again.");
  }
}

size_t CpuChannelCount() {
  std::lock_guard<std::timed_mutex> lock(cpu::RegistryMutex());
  size_t n = 0;
  for (const auto& [key, entry] : cpu::Registry()) n += entry.channel != nullptr;
  return n;
}

}  // namespace flux_jax
