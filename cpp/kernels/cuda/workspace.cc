#include "workspace.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <tuple>

#include <cuda.h>  // driver API types only (cuMemGetAddressRange, resolved at run time)

#include "ag_matmul_decode.h"
#include "cuda_util.h"
#include "flux_jax/gpu_checks.h"
#include "gemm_plan.h"
#include "stream_ops.h"

namespace flux_jax::cuda {
namespace {

constexpr int kMaxDevices = 64;
// Members of TP groups in this process, over all groups and devices, until flux_jax.reset().
constexpr int kMaxMembers = 1024;
constexpr size_t kCtrlWords = kMaxTp + kMaxFlags + 2 + kMaxTp * kMaxLatencyBlocks + kMaxPieces;
constexpr size_t kGrowGranule = size_t{64} << 20;  // grow in 64 MiB steps

// Host-side rendezvous of the group's handler threads (one per device; XLA
// runs each device's program on its own thread). Bounded by the op timeout.
class HostBarrier {
 public:
  explicit HostBarrier(int size) : size_(size) {}
  Status Arrive(int64_t timeout_us, const std::string& what) {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t generation = generation_;
    if (++count_ == size_) {
      count_ = 0;
      ++generation_;
      cv_.notify_all();
      return Status::Ok();
    }
    if (!cv_.wait_for(lock, std::chrono::microseconds(timeout_us), [&] { return generation_ != generation; })) {
      --count_;
      return Status::DeadlineExceeded("flux_jax: timed out after " + std::to_string(timeout_us / 1e6) + " s at " +
                                      what);
    }
    return Status::Ok();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int size_;
  int count_ = 0;
  uint64_t generation_ = 0;
};

struct Group {
  explicit Group(const TpGroup& g)
      : devices(g.devices),
        barrier(g.size),
        members(g.size),
        remote(g.size),
        cross_process(g.cross_process),
        name(g.Describe()) {}
  std::vector<int64_t> devices;
  HostBarrier barrier;
  std::vector<std::unique_ptr<GroupWorkspace>> members;  // by rank; each owned by its device's thread
  // Cross-process groups: members in other processes, mapped through CUDA IPC
  // (set up once, fixed capacity, see ExportIpcMember / ImportIpcPeer).
  std::vector<PeerView> remote;               // by rank
  std::vector<std::pair<int, void*>> opened;  // (device, IPC mapping) to close
  bool cross_process = false;
  std::string name;  // TpGroup::Describe()

  // Set when a member's setup or growth failed: the members' views of each other are in doubt
  // (a peer may hold a freed or null area), so every later call of every member fails with this.
  void MarkFailed(const std::string& why) {
    std::lock_guard<std::mutex> lock(failed_mu);
    if (failed.empty()) failed = why;
  }
  Status Failed() {
    std::lock_guard<std::mutex> lock(failed_mu);
    if (failed.empty()) return Status::Ok();
    return Status::ResourceExhausted(failed + " The workspace of " + name +
                                     " is unusable: every fused op of the group fails until flux_jax.reset().");
  }
  std::mutex failed_mu;
  std::string failed;
};

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
std::map<std::vector<int64_t>, std::shared_ptr<Group>>& Registry() {
  static auto* registry = new std::map<std::vector<int64_t>, std::shared_ptr<Group>>();
  return *registry;
}

// Error records in mapped host memory: [0, kMaxDevices) one per device, then one per member.
DeviceError* ErrorRecords(Status* status) {
  static DeviceError* records = nullptr;
  static std::once_flag once;
  static cudaError_t err = cudaSuccess;
  std::call_once(once, [] {
    constexpr size_t bytes = sizeof(DeviceError) * (kMaxDevices + kMaxMembers);
    err = cudaHostAlloc(reinterpret_cast<void**>(&records), bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (err == cudaSuccess) std::memset(records, 0, bytes);
  });
  *status = CudaStatus(err, "cudaHostAlloc(error records)", __FILE__, __LINE__);
  return records;
}

std::atomic<int>& MembersRecorded() {  // member records handed out since the last reset
  static std::atomic<int> count{0};
  return count;
}

// A consistent copy of a record the GPU may be writing (code kWaitWriting: wait for it).
DeviceError Snapshot(const DeviceError& e) {
  const volatile int32_t* code = &e.code;
  for (int spins = 0; *code == kWaitWriting && spins < 1'000'000; ++spins) {
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  DeviceError copy;
  std::memcpy(&copy, &e, sizeof(copy));
  copy.code = *code;
  return copy;
}

std::atomic<int>& GrowthFailureRank() {  // FailNextGrowthForTesting
  static std::atomic<int> rank{-1};
  return rank;
}

std::string Describe(const TpGroup& g) { return g.Describe(); }

Status AllocationError(int device, size_t bytes, cudaError_t err) {
  size_t free_bytes = 0, total = 0;
  cudaMemGetInfo(&free_bytes, &total);
  cudaGetLastError();
  std::ostringstream os;
  os << "flux_jax: cannot allocate the fused-op workspace on GPU " << device << ": asked for " << (bytes >> 20)
     << " MiB, " << (free_bytes >> 20) << " MiB free of " << (total >> 20) << " MiB (" << cudaGetErrorString(err)
     << "). XLA preallocates 75% of GPU memory; leave room "
     << "with XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 (or lower) or XLA_PYTHON_CLIENT_PREALLOCATE=false.";
  return Status::ResourceExhausted(os.str());
}

Status InitMember(const TpGroup& g, GroupWorkspace* w) {
  const int device = g.ordinals[g.rank];
  DeviceGuard guard(device);
  w->device = device;
  w->rank = g.rank;
  w->tp = g.size;
  for (int32_t peer : g.ordinals) {
    if (peer == device || peer < 0) continue;  // < 0: a rank in another process (CUDA IPC)
    int can = 0;
    FLUX_CUDA_TRY(cudaDeviceCanAccessPeer(&can, device, static_cast<int>(peer)));
    if (!can) {
      return Status::InvalidArgument("flux_jax: GPU " + std::to_string(device) + " cannot access GPU " +
                                     std::to_string(peer) +
                                     " directly (no peer access); the fused ops need NVLink/P2P "
                                     "between the GPUs of a TP group. Use impl='xla'.");
    }
    cudaError_t err = cudaDeviceEnablePeerAccess(static_cast<int>(peer), 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();
    } else {
      FLUX_CUDA_TRY(err);
    }
  }
  int least = 0, greatest = 0;
  FLUX_CUDA_TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  FLUX_CUDA_TRY(cudaStreamCreateWithPriority(&w->comm, cudaStreamNonBlocking, greatest));
  void* ctrl = nullptr;
  cudaError_t err = cudaMalloc(&ctrl, kCtrlWords * sizeof(uint64_t) + 64);
  if (err != cudaSuccess) return AllocationError(device, kCtrlWords * 8, err);
  w->present = static_cast<uint64_t*>(ctrl);
  w->arrived = w->present + kMaxTp;
  w->cells = w->arrived + kMaxFlags;
  w->block_arrived = w->cells + 2;
  w->tiles_done = w->block_arrived + kMaxTp * kMaxLatencyBlocks;
  w->alpha = reinterpret_cast<float*>(w->tiles_done + kMaxPieces);
  // Zeroed flags and alpha = 1, landed before this returns: a plain cudaMemset (or a copy from
  // pageable memory) may still be in flight when it returns, on the legacy stream, which
  // non-blocking streams (ours, XLA's if so created) do not wait for; a peer's flag written before
  // it lands would be zeroed,
  // and a freshly allocated block can hold an earlier workspace's larger epochs (after reset()).
  const float one = 1.0f;
  FLUX_CUDA_TRY(cudaMemsetAsync(ctrl, 0, kCtrlWords * sizeof(uint64_t) + 64, w->comm));
  FLUX_CUDA_TRY(cudaMemcpyAsync(w->alpha, &one, sizeof(one), cudaMemcpyHostToDevice, w->comm));
  FLUX_CUDA_TRY(cudaStreamSynchronize(w->comm));
  FLUX_CUDA_TRY(cudaEventCreateWithFlags(&w->ev_start, cudaEventDisableTiming));
  FLUX_CUDA_TRY(cudaEventCreateWithFlags(&w->ev_comm_done, cudaEventDisableTiming));
  for (auto& ev : w->ev_step) FLUX_CUDA_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  FLUX_CUDA_TRY(cudaDeviceGetAttribute(&w->sm_count, cudaDevAttrMultiProcessorCount, device));
  FLUX_JAX_RETURN_IF_ERROR(PeakDramGbps(device, &w->dram_gbps));
  // Ranks of one group on one GPU (cpp/tests/loopback, which tests the multi-rank paths on one GPU; a
  // JAX mesh never repeats a device) split its SMs: their persistent kernels wait for each other,
  // so all of them must be resident at once, and a tenth stays free for the pushes they wait on.
  const auto sharing = std::count(g.ordinals.begin(), g.ordinals.end(), device);
  if (sharing > 1) w->sm_count = std::max(1, static_cast<int>(w->sm_count * 9 / 10 / sharing));
  // Load every kernel now, while nothing of ours spins on this device.
  FLUX_JAX_RETURN_IF_ERROR(PreloadGemmKernels());
  FLUX_JAX_RETURN_IF_ERROR(PreloadStreamOps());
  FLUX_JAX_RETURN_IF_ERROR(PreloadLatencyCollectives());
  FLUX_JAX_RETURN_IF_ERROR(PreloadAgMatmulDecode());
  Status st;
  DeviceError* records = ErrorRecords(&st);
  FLUX_JAX_RETURN_IF_ERROR(st);
  const int slot = MembersRecorded().fetch_add(1);
  if (slot >= kMaxMembers) {
    return Status::ResourceExhausted("flux_jax: more than " + std::to_string(kMaxMembers) +
                                     " TP group members in this process since the last flux_jax.reset()");
  }
  w->error_host = records + kMaxDevices + slot;
  FLUX_CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&w->error), w->error_host, 0));
  FLUX_CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&w->device_error), records + device, 0));
  return Status::Ok();
}

void RefreshPeers(Group& group, GroupWorkspace* w) {
  w->peers.resize(group.members.size());
  for (size_t r = 0; r < group.members.size(); ++r) {
    if (!group.members[r]) {  // in another process
      w->peers[r] = group.remote[r];
      continue;
    }
    const GroupWorkspace& m = *group.members[r];
    w->peers[r] = PeerView{m.present, m.arrived, m.block_arrived, m.data, m.slots, m.ll};
  }
}

void FreeMember(GroupWorkspace* w) {
  DeviceGuard guard(w->device);
  cudaDeviceSynchronize();
  if (w->data) cudaFree(w->data);
  if (w->slots) cudaFree(w->slots);
  if (w->ll) cudaFree(w->ll);
  if (w->present) cudaFree(w->present);
  if (w->comm) cudaStreamDestroy(w->comm);
  for (cudaEvent_t ev : {w->ev_start, w->ev_comm_done}) {
    if (ev) cudaEventDestroy(ev);
  }
  for (cudaEvent_t ev : w->ev_step) {
    if (ev) cudaEventDestroy(ev);
  }
  cudaGetLastError();
}

// Copies `device`'s error into the records of the other devices of its group,
// so their pending device-side waits give up at once instead of timing out.
void PropagateError(const std::vector<int32_t>& devices, int device) {
  Status st;
  DeviceError* records = ErrorRecords(&st);
  if (!st.ok()) return;
  for (int32_t d : devices) {
    if (d == device || d < 0 || d >= kMaxDevices) continue;
    volatile int32_t* code = &records[d].code;
    if (*code != kWaitNone) continue;
    DeviceError copy = Snapshot(records[device]);
    if (copy.code != kWaitTimedOut) return;
    copy.code = kWaitNone;
    std::memcpy(&records[d], &copy, sizeof(copy));
    std::atomic_thread_fence(std::memory_order_seq_cst);
    *code = kWaitTimedOut;
  }
}

// The error of `member` (null: not set up) of `g` on `device`, if one of its waits gave up or the
// device has failed (flux_jax/wait_record.h); copied to the group's other devices in this
// process, so their pending waits give up at once.
Status MemberError(const TpGroup& g, const GroupWorkspace* member, int device) {
  Status st;
  DeviceError* records = ErrorRecords(&st);
  FLUX_JAX_RETURN_IF_ERROR(st);
  const bool own_set = member != nullptr && member->error_host != nullptr &&
                       *reinterpret_cast<const volatile int32_t*>(&member->error_host->code) != kWaitNone;
  if (!own_set && *reinterpret_cast<const volatile int32_t*>(&records[device].code) == kWaitNone) {
    return Status::Ok();  // every call: two loads, no formatting
  }
  const DeviceError own = own_set ? Snapshot(*member->error_host) : DeviceError{};
  const DeviceError first = Snapshot(records[device]);
  const std::string text = DescribeWaitFailure(own, first, device, g.Describe());
  if (text.empty()) return Status::Ok();
  if (first.code == kWaitTimedOut) PropagateError(g.ordinals, device);
  return Status::DeadlineExceeded(text);
}

// ---- Cross-process groups (CUDA IPC) -----------------------------------------

// What one member publishes: who it is, the sizes of its areas, and their IPC handles.
constexpr uint32_t kIpcMagic = 0x464a5731;  // "FJW1"; a different layout gets a different value
struct IpcBlob {
  uint32_t magic;
  int32_t rank, tp, pad;
  uint64_t ctrl_bytes, data_bytes, slot_bytes, ll_bytes;
  cudaIpcMemHandle_t ctrl, data, slots, ll;
};
constexpr size_t kCtrlBytes = kCtrlWords * sizeof(uint64_t) + 64;  // the words and alpha

std::shared_ptr<Group> GroupOf(const TpGroup& g, bool create) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(g.devices);
  if (it != Registry().end()) return it->second;
  if (!create) return nullptr;
  auto group = std::make_shared<Group>(g);
  Registry()[g.devices] = group;
  return group;
}

// The areas a call of `w` uses (`needed`: data, slots, low-latency) exist on every peer.
Status ValidatePeers(const TpGroup& g, const GroupWorkspace& w, size_t data_bytes, size_t slot_bytes, size_t ll_bytes) {
  if (static_cast<int>(w.peers.size()) != g.size) {
    return Status::Internal("flux_jax: rank " + std::to_string(g.rank) + " of " + g.Describe() +
                            " has no view of its peers' workspaces (its setup did not finish)");
  }
  for (int p = 0; p < g.size; ++p) {
    const PeerView& v = w.peers[p];
    const char* missing = v.present == nullptr                   ? "control"
                          : data_bytes > 0 && v.data == nullptr  ? "data"
                          : slot_bytes > 0 && v.slots == nullptr ? "slot"
                          : ll_bytes > 0 && v.ll == nullptr      ? "low-latency"
                                                                 : nullptr;
    if (missing != nullptr) {
      return Status::Internal("flux_jax: rank " + std::to_string(p) + " of " + g.Describe() + " (GPU " +
                              std::to_string(g.ordinals[p]) + ") has no " + missing + " workspace area");
    }
  }
  return Status::Ok();
}

Status AcquireIpcWorkspace(const TpGroup& g, size_t data_bytes, size_t slot_bytes, size_t ll_bytes,
                           GroupWorkspace** out) {
  std::shared_ptr<Group> group = GroupOf(g, false);
  GroupWorkspace* w = group ? group->members[g.rank].get() : nullptr;
  if (w == nullptr) {
    return Status::Internal("flux_jax: the cross-process workspace of " + g.Describe() +
                            " is not set up (it is set up when a program with fused ops is "
                            "lowered; after flux_jax.reset(), jit the function again)");
  }
  FLUX_JAX_RETURN_IF_ERROR(MemberError(g, w, g.ordinals[g.rank]));
  if (w->peers.empty()) {
    for (int r = 0; r < g.size; ++r) {
      if (!group->members[r] && group->remote[r].present == nullptr) {
        return Status::Internal("flux_jax: rank " + std::to_string(r) + " of " + g.Describe() +
                                " never published its workspace");
      }
    }
    std::lock_guard<std::mutex> lock(RegistryMutex());
    RefreshPeers(*group, w);
  }
  if (data_bytes > w->capacity || slot_bytes > w->slots_capacity || ll_bytes > w->ll_capacity) {
    return Status::ResourceExhausted(
        "flux_jax: this call needs " + std::to_string((std::max({data_bytes, slot_bytes, ll_bytes}) >> 20) + 1) +
        " MiB of workspace but the cross-process workspace of " + g.Describe() + " has " +
        std::to_string(w->capacity >> 20) + " MiB (data) / " + std::to_string(w->slots_capacity >> 20) +
        " MiB (slots) / " + std::to_string(w->ll_capacity >> 20) +
        " MiB (low-latency slots) and cannot grow; raise it with "
        "flux_jax.initialize_distributed(gpu_workspace_mib=...) before the first fused op");
  }
  FLUX_JAX_RETURN_IF_ERROR(ValidatePeers(g, *w, data_bytes, slot_bytes, ll_bytes));
  *out = w;
  return Status::Ok();
}

}  // namespace

Status AcquireWorkspace(const TpGroup& g, size_t data_bytes, const CommConfig& cfg, cudaStream_t compute_stream,
                        GroupWorkspace** out, size_t slot_bytes, size_t ll_bytes) {
  const int device = g.ordinals[g.rank];
  if (device < 0 || device >= kMaxDevices) return Status::InvalidArgument("device ordinal out of range");
  if (g.cross_process) return AcquireIpcWorkspace(g, data_bytes, slot_bytes, ll_bytes, out);
  std::shared_ptr<Group> group = GroupOf(g, true);
  std::unique_ptr<GroupWorkspace>& member = group->members[g.rank];  // only this rank's thread touches it
  FLUX_JAX_RETURN_IF_ERROR(MemberError(g, member.get(), device));
  FLUX_JAX_RETURN_IF_ERROR(group->Failed());
  const std::string who = "rank " + std::to_string(g.rank) + " of " + Describe(g);
  if (!member) {
    // Ranks that share a GPU need their own hardware queues (flux_jax/gpu_checks.h): checked
    // before anything is set up, so every rank of the group fails alike at every call.
    const int sharing = static_cast<int>(std::count(g.ordinals.begin(), g.ordinals.end(), device));
    FLUX_JAX_RETURN_IF_ERROR(
        CheckHardwareQueues(std::getenv("CUDA_DEVICE_MAX_CONNECTIONS"), sharing, device, Describe(g)));
    member = std::make_unique<GroupWorkspace>();  // kept even if its setup fails: reset() frees it
    GroupWorkspace* m = member.get();
    const std::string what = "workspace setup (" + who + " waited for its peers to reach the first fused op)";
    if (Status st = InitMember(g, m); !st.ok()) {
      group->MarkFailed("flux_jax: setting up the workspace of " + who + " on GPU " + std::to_string(device) +
                        " failed: " + st.message());
      group->barrier.Arrive(cfg.timeout_us, what);  // keep the peers in step: they fail right after it
      return group->Failed();
    }
    if (Status st = group->barrier.Arrive(cfg.timeout_us, what); !st.ok()) {
      group->MarkFailed(st.message() + ".");
      return group->Failed();
    }
    FLUX_JAX_RETURN_IF_ERROR(group->Failed());  // a peer's setup failed
    RefreshPeers(*group, m);
    // Warm up every copy path (local and peer) once while the device is idle:
    // the runtime may load internal kernels for them lazily (see InitMember).
    // On the comm stream, waited for here: a device-to-device cudaMemcpy returns
    // before it lands, and a 0 landing in our present slot on a peer after this
    // call's presence kernel wrote the epoch there made the peer wait until its
    // timeout (seen in the loopback tests at TP 4 and 8).
    DeviceGuard guard(device);
    Status warm =
        CudaStatus(cudaMemcpyAsync(m->cells + 1, m->cells, sizeof(uint64_t), cudaMemcpyDeviceToDevice, m->comm),
                   "cudaMemcpyAsync(warm-up)", __FILE__, __LINE__);
    for (int p = 0; p < g.size && warm.ok(); ++p) {
      if (p == g.rank) continue;  // writes 0 into our own present slot on the peer: a no-op
      warm = CudaStatus(
          cudaMemcpyAsync(m->peers[p].present + g.rank, m->cells, sizeof(uint64_t), cudaMemcpyDeviceToDevice, m->comm),
          "cudaMemcpyAsync(warm-up)", __FILE__, __LINE__);
    }
    if (warm.ok())
      warm = CudaStatus(cudaStreamSynchronize(m->comm), "cudaStreamSynchronize(warm-up)", __FILE__, __LINE__);
    if (!warm.ok()) {
      group->MarkFailed("flux_jax: setting up the workspace of " + who + " on GPU " + std::to_string(device) +
                        " failed: " + warm.message());
      return group->Failed();
    }
  }
  GroupWorkspace* w = member.get();
  // Grows one area of every member: all reach this call, drain what they
  // enqueued (pushes into peers' old buffers included), and only then may
  // anyone free a buffer. Any failure from the first barrier on marks the group
  // failed: members may have left with different views of each other (a freed
  // old area, a null new one), and using them would fault the GPU.
  // `zeroed`: the low-latency area, whose readers take any word whose epoch matches (0 is no
  // call's epoch), is cleared before any peer can write to it (the barrier below).
  auto grow = [&](char** area, size_t* capacity, size_t bytes, char* PeerView::* peer_area, const char* name,
                  bool zeroed) -> Status {
    if (bytes <= *capacity) return Status::Ok();
    DeviceGuard guard(device);
    const std::string what = std::string(name) + " growth (" + who + ")";
    const size_t rounded = (bytes + kGrowGranule - 1) / kGrowGranule * kGrowGranule;
    auto fail = [&](const Status& st) {
      group->MarkFailed("flux_jax: growing the " + std::string(name) + " of " + who + " on GPU " +
                        std::to_string(device) + " to " + std::to_string(rounded >> 20) +
                        " MiB failed: " + st.message());
      return group->Failed();
    };
    if (Status st = group->barrier.Arrive(cfg.timeout_us, what); !st.ok()) return fail(st);
    Status drained =
        CudaStatus(cudaStreamSynchronize(compute_stream), "cudaStreamSynchronize(compute)", __FILE__, __LINE__);
    if (drained.ok())
      drained = CudaStatus(cudaStreamSynchronize(w->comm), "cudaStreamSynchronize(comm)", __FILE__, __LINE__);
    if (!drained.ok()) fail(drained);  // before the barrier: the peers see it after it
    if (Status st = group->barrier.Arrive(cfg.timeout_us, what + ", drain"); !st.ok()) return fail(st);
    FLUX_JAX_RETURN_IF_ERROR(group->Failed());  // a member could not drain: nobody frees anything
    if (*area) cudaFree(*area);
    *area = nullptr;
    *capacity = 0;
    int fail_rank = g.rank;
    cudaError_t err = GrowthFailureRank().compare_exchange_strong(fail_rank, -1)
                          ? cudaErrorMemoryAllocation  // FailNextGrowthForTesting
                          : cudaMalloc(reinterpret_cast<void**>(area), rounded);
    if (err == cudaSuccess && zeroed) {  // landed before any peer may write into it (see InitMember)
      err = cudaMemsetAsync(*area, 0, rounded, w->comm);
      if (err == cudaSuccess) err = cudaStreamSynchronize(w->comm);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      if (*area) cudaFree(*area);
      *area = nullptr;
      fail(AllocationError(device, rounded, err));                     // before the barrier: the peers see it after it
      group->barrier.Arrive(cfg.timeout_us, what + ", reallocation");  // keep the peers in step
      return group->Failed();
    }
    *capacity = rounded;
    if (Status st = group->barrier.Arrive(cfg.timeout_us, what + ", reallocation"); !st.ok()) return fail(st);
    FLUX_JAX_RETURN_IF_ERROR(group->Failed());  // a peer's allocation failed
    RefreshPeers(*group, w);
    for (int p = 0; p < g.size; ++p) {
      if (w->peers[p].*peer_area == nullptr) {
        return fail(Status::Internal("rank " + std::to_string(p) + " (GPU " + std::to_string(g.ordinals[p]) +
                                     ") has no " + name + " after it"));
      }
    }
    return Status::Ok();
  };
  FLUX_JAX_RETURN_IF_ERROR(grow(&w->data, &w->capacity, data_bytes, &PeerView::data, "data workspace", false));
  FLUX_JAX_RETURN_IF_ERROR(grow(&w->slots, &w->slots_capacity, slot_bytes, &PeerView::slots, "slot workspace", false));
  FLUX_JAX_RETURN_IF_ERROR(grow(&w->ll, &w->ll_capacity, ll_bytes, &PeerView::ll, "low-latency workspace", true));
  // Every call, not only after growth: a view of a peer that a failed setup or growth left behind
  // must never reach a kernel (it would fault the GPU).
  if (Status st = ValidatePeers(g, *w, data_bytes, slot_bytes, ll_bytes); !st.ok()) {
    group->MarkFailed(st.message() + ".");
    return group->Failed();
  }
  *out = w;
  return Status::Ok();
}

void FailNextGrowthForTesting(int rank) { GrowthFailureRank().store(rank); }

Status ExportIpcMember(const TpGroup& g, size_t data_bytes, size_t slot_bytes, std::string* blob) {
  const int device = g.ordinals[g.rank];
  if (device < 0 || device >= kMaxDevices) return Status::InvalidArgument("device ordinal out of range");
  std::shared_ptr<Group> group = GroupOf(g, true);
  if (group->members[g.rank]) return Status::InvalidArgument("flux_jax: " + g.Describe() + " is already set up");
  auto w = std::make_unique<GroupWorkspace>();
  FLUX_JAX_RETURN_IF_ERROR(InitMember(g, w.get()));
  DeviceGuard guard(device);
  IpcBlob b{};
  for (auto [area, capacity, bytes] :
       {std::tuple{&w->data, &w->capacity, data_bytes}, std::tuple{&w->slots, &w->slots_capacity, slot_bytes},
        std::tuple{&w->ll, &w->ll_capacity, slot_bytes}}) {
    const size_t rounded = std::max<size_t>(kGrowGranule, (bytes + kGrowGranule - 1) / kGrowGranule * kGrowGranule);
    cudaError_t err = cudaMalloc(reinterpret_cast<void**>(area), rounded);
    if (err != cudaSuccess) {
      cudaGetLastError();
      FreeMember(w.get());
      return AllocationError(device, rounded, err);
    }
    *capacity = rounded;
  }
  // The low-latency area starts at epoch 0, landed before the blob is published (see InitMember).
  FLUX_CUDA_TRY(cudaMemsetAsync(w->ll, 0, w->ll_capacity, w->comm));
  FLUX_CUDA_TRY(cudaStreamSynchronize(w->comm));
  b.magic = kIpcMagic;
  b.rank = g.rank;
  b.tp = g.size;
  b.ctrl_bytes = kCtrlBytes;
  b.data_bytes = w->capacity;
  b.slot_bytes = w->slots_capacity;
  b.ll_bytes = w->ll_capacity;
  FLUX_CUDA_TRY(cudaIpcGetMemHandle(&b.ctrl, w->present));
  FLUX_CUDA_TRY(cudaIpcGetMemHandle(&b.data, w->data));
  FLUX_CUDA_TRY(cudaIpcGetMemHandle(&b.slots, w->slots));
  FLUX_CUDA_TRY(cudaIpcGetMemHandle(&b.ll, w->ll));
  blob->assign(reinterpret_cast<const char*>(&b), sizeof(b));
  std::lock_guard<std::mutex> lock(RegistryMutex());
  group->members[g.rank] = std::move(w);
  return Status::Ok();
}

namespace {

// Bytes of the allocation that holds `p` (cuMemGetAddressRange, resolved at run time): what a
// CUDA IPC mapping opened from a peer's handle really spans.
Status MappedBytes(const void* p, uint64_t* bytes) {
  using Fn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static Fn fn = nullptr;
  static cudaError_t err = cudaSuccess;
  static std::once_flag once;
  std::call_once(once, [] {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult query{};
    err = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &entry, 12000, cudaEnableDefault, &query);
    if (err == cudaSuccess && query != cudaDriverEntryPointSuccess) err = cudaErrorSymbolNotFound;
    fn = reinterpret_cast<Fn>(entry);
  });
  FLUX_JAX_RETURN_IF_ERROR(
      CudaStatus(err, "cudaGetDriverEntryPointByVersion(cuMemGetAddressRange)", __FILE__, __LINE__));
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult r = fn(&base, &size, reinterpret_cast<CUdeviceptr>(p));
  if (r != CUDA_SUCCESS)
    return Status::Internal("flux_jax: cuMemGetAddressRange failed with CUresult " + std::to_string(r));
  // The mapping starts at the allocation's base (cudaIpcOpenMemHandle maps whole allocations).
  *bytes = size - (reinterpret_cast<CUdeviceptr>(p) - base);
  return Status::Ok();
}

}  // namespace

Status ImportIpcPeer(const TpGroup& g, int peer, const std::string& blob) {
  std::shared_ptr<Group> group = GroupOf(g, false);
  if (!group || !group->members[g.rank]) return Status::Internal("flux_jax: import before export");
  if (peer < 0 || peer >= g.size || g.ordinals[peer] >= 0) {
    return Status::InvalidArgument("flux_jax: rank " + std::to_string(peer) + " is not a remote rank");
  }
  IpcBlob b{};
  if (blob.size() >= sizeof(b.magic)) std::memcpy(&b.magic, blob.data(), sizeof(b.magic));
  if (blob.size() != sizeof(IpcBlob) || b.magic != kIpcMagic) {
    return Status::InvalidArgument("flux_jax: the CUDA IPC blob of rank " + std::to_string(peer) + " of " +
                                   g.Describe() + " is not one of this build's (" + std::to_string(blob.size()) +
                                   " bytes, expected " + std::to_string(sizeof(IpcBlob)) +
                                   "): every process must run the same flux_jax build");
  }
  std::memcpy(&b, blob.data(), sizeof(b));
  GroupWorkspace* w = group->members[g.rank].get();
  const IpcAreaSizes declared{b.ctrl_bytes, b.data_bytes, b.slot_bytes, b.ll_bytes};
  const IpcAreaSizes expected{kCtrlBytes, w->capacity, w->slots_capacity, w->ll_capacity};
  FLUX_JAX_RETURN_IF_ERROR(CheckIpcPeer(peer, g.size, b.rank, b.tp, declared, expected, IpcAreaSizes{}, g.Describe()));
  const int device = g.ordinals[g.rank];
  DeviceGuard guard(device);
  void* mapped[4] = {};
  const cudaIpcMemHandle_t handles[4] = {b.ctrl, b.data, b.slots, b.ll};
  IpcAreaSizes sizes;
  uint64_t* size_of[4] = {&sizes.ctrl, &sizes.data, &sizes.slots, &sizes.ll};
  Status st;
  for (int i = 0; i < 4 && st.ok(); ++i) {
    st = CudaStatus(cudaIpcOpenMemHandle(&mapped[i], handles[i], cudaIpcMemLazyEnablePeerAccess),
                    "cudaIpcOpenMemHandle", __FILE__, __LINE__);
    if (st.ok()) st = MappedBytes(mapped[i], size_of[i]);
  }
  if (st.ok()) st = CheckIpcPeer(peer, g.size, b.rank, b.tp, declared, expected, sizes, g.Describe());
  if (!st.ok()) {
    for (void* p : mapped) {
      if (p) cudaIpcCloseMemHandle(p);
    }
    cudaGetLastError();
    return st;
  }
  std::lock_guard<std::mutex> lock(RegistryMutex());
  for (void* p : mapped) group->opened.emplace_back(device, p);
  auto* words = static_cast<uint64_t*>(mapped[0]);
  group->remote[peer] = PeerView{words,
                                 words + kMaxTp,
                                 words + kMaxTp + kMaxFlags + 2,
                                 static_cast<char*>(mapped[1]),
                                 static_cast<char*>(mapped[2]),
                                 static_cast<char*>(mapped[3])};
  return Status::Ok();
}

Status CheckDeviceError(int device) {
  if (device < 0 || device >= kMaxDevices) return Status::InvalidArgument("device ordinal out of range");
  Status st;
  DeviceError* records = ErrorRecords(&st);
  FLUX_JAX_RETURN_IF_ERROR(st);
  const DeviceError first = Snapshot(records[device]);
  std::string text;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    for (auto& [devices, group] : Registry()) {
      for (auto& m : group->members) {
        if (!m || m->device != device || m->error_host == nullptr) continue;
        const DeviceError own = Snapshot(*m->error_host);
        if (own.code != kWaitTimedOut && own.code != kWaitGaveUp) continue;
        text += (text.empty() ? "" : "\n") + DescribeWaitFailure(own, first, device, group->name);
      }
    }
  }
  if (text.empty()) text = DescribeWaitFailure(DeviceError{}, first, device, std::string());
  return text.empty() ? Status::Ok() : Status::DeadlineExceeded(text);
}

void ResetWorkspaces() {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Status st;
  DeviceError* records = ErrorRecords(&st);
  if (st.ok()) {  // make every pending device-side wait give up before we drain the GPUs
    for (int d = 0; d < kMaxDevices; ++d) *reinterpret_cast<volatile int32_t*>(&records[d].code) = kWaitReset;
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  for (auto& [devices, group] : Registry()) {
    for (auto& member : group->members) {
      if (member) FreeMember(member.get());
    }
    for (auto [device, ptr] : group->opened) {
      DeviceGuard guard(device);
      cudaIpcCloseMemHandle(ptr);
    }
    cudaGetLastError();
  }
  Registry().clear();
  if (st.ok()) std::memset(records, 0, sizeof(DeviceError) * (kMaxDevices + kMaxMembers));
  MembersRecorded().store(0);
  GrowthFailureRank().store(-1);
}

size_t WorkspaceBytes(int device) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  size_t total = 0;
  for (auto& [devices, group] : Registry()) {
    for (auto& member : group->members) {
      if (member && member->device == device) {
        total += member->capacity + member->slots_capacity + member->ll_capacity + kCtrlWords * 8;
      }
    }
  }
  return total;
}

Status PeakDramGbps(int device, int* gbps) {
  int clock_khz = 0, bus_bits = 0;
  FLUX_CUDA_TRY(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device));
  FLUX_CUDA_TRY(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device));
  *gbps = static_cast<int>(int64_t{clock_khz} * 2 * bus_bits / 8 / 1000000);
  return Status::Ok();
}

}  // namespace flux_jax::cuda
