#include "workspace.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <tuple>

#include "ag_matmul_decode.h"
#include "cuda_util.h"
#include "gemm_plan.h"
#include "stream_ops.h"

namespace flux_jax::cuda {
namespace {

constexpr int kMaxDevices = 64;
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
    if (!cv_.wait_for(lock, std::chrono::microseconds(timeout_us),
                      [&] { return generation_ != generation; })) {
      --count_;
      return Status::DeadlineExceeded("flux_jax: timed out after " +
                                      std::to_string(timeout_us / 1e6) + " s at " + what);
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
      : devices(g.devices), barrier(g.size), members(g.size), remote(g.size),
        cross_process(g.cross_process) {}
  std::vector<int64_t> devices;
  HostBarrier barrier;
  std::vector<std::unique_ptr<GroupWorkspace>> members;  // by rank; each owned by its device's thread
  // Cross-process groups: members in other processes, mapped through CUDA IPC
  // (set up once, fixed capacity, see ExportIpcMember / ImportIpcPeer).
  std::vector<PeerView> remote;                           // by rank
  std::vector<std::pair<int, void*>> opened;              // (device, IPC mapping) to close
  bool cross_process = false;
};

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
std::map<std::vector<int64_t>, std::shared_ptr<Group>>& Registry() {
  static auto* registry = new std::map<std::vector<int64_t>, std::shared_ptr<Group>>();
  return *registry;
}

DeviceError* ErrorRecords(Status* status) {
  static DeviceError* records = nullptr;
  static std::once_flag once;
  static cudaError_t err = cudaSuccess;
  std::call_once(once, [] {
    err = cudaHostAlloc(reinterpret_cast<void**>(&records), sizeof(DeviceError) * kMaxDevices,
                        cudaHostAllocMapped | cudaHostAllocPortable);
    if (err == cudaSuccess) std::memset(records, 0, sizeof(DeviceError) * kMaxDevices);
  });
  *status = CudaStatus(err, "cudaHostAlloc(error records)", __FILE__, __LINE__);
  return records;
}

std::string Describe(const TpGroup& g) { return g.Describe(); }

Status AllocationError(int device, size_t bytes, cudaError_t err) {
  size_t free_bytes = 0, total = 0;
  cudaMemGetInfo(&free_bytes, &total);
  cudaGetLastError();
  std::ostringstream os;
  os << "flux_jax: cannot allocate the fused-op workspace on GPU " << device << ": asked for "
     << (bytes >> 20) << " MiB, " << (free_bytes >> 20) << " MiB free of " << (total >> 20)
     << " MiB (" << cudaGetErrorString(err) << "). XLA preallocates 75% of GPU memory; leave room "
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
  FLUX_CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&w->error), records + device, 0));
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
    if (*code != 0) continue;
    DeviceError copy = records[device];
    copy.code = 0;
    std::memcpy(&records[d], &copy, sizeof(copy));
    std::atomic_thread_fence(std::memory_order_seq_cst);
    *code = 1;
  }
}

// ---- Cross-process groups (CUDA IPC) -----------------------------------------

// What one member publishes: IPC handles of its three allocations.
struct IpcBlob {
  cudaIpcMemHandle_t ctrl, data, slots, ll;
  uint64_t data_bytes, slot_bytes, ll_bytes;
};

std::shared_ptr<Group> GroupOf(const TpGroup& g, bool create) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(g.devices);
  if (it != Registry().end()) return it->second;
  if (!create) return nullptr;
  auto group = std::make_shared<Group>(g);
  Registry()[g.devices] = group;
  return group;
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
        " MiB (slots) / " + std::to_string(w->ll_capacity >> 20) + " MiB (low-latency slots) and cannot grow; raise it with "
        "flux_jax.initialize_distributed(gpu_workspace_mib=...) before the first fused op");
  }
  *out = w;
  return Status::Ok();
}

}  // namespace

Status AcquireWorkspace(const TpGroup& g, size_t data_bytes, const CommConfig& cfg,
                        cudaStream_t compute_stream, GroupWorkspace** out, size_t slot_bytes,
                        size_t ll_bytes) {
  const int device = g.ordinals[g.rank];
  if (device < 0 || device >= kMaxDevices) return Status::InvalidArgument("device ordinal out of range");
  if (Status err = CheckDeviceError(device); !err.ok()) {
    PropagateError(g.ordinals, device);
    return err;
  }
  if (g.cross_process) return AcquireIpcWorkspace(g, data_bytes, slot_bytes, ll_bytes, out);
  std::shared_ptr<Group> group;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    auto& slot = Registry()[g.devices];
    if (!slot) slot = std::make_shared<Group>(g);
    group = slot;
  }
  const std::string who = "rank " + std::to_string(g.rank) + " of " + Describe(g);
  std::unique_ptr<GroupWorkspace>& member = group->members[g.rank];
  if (!member) {
    auto fresh = std::make_unique<GroupWorkspace>();
    FLUX_JAX_RETURN_IF_ERROR(InitMember(g, fresh.get()));
    member = std::move(fresh);
    FLUX_JAX_RETURN_IF_ERROR(group->barrier.Arrive(
        cfg.timeout_us, "workspace setup (" + who + " waited for its peers to reach the first fused op)"));
    RefreshPeers(*group, member.get());
    // Warm up every copy path (local and peer) once while the device is idle:
    // the runtime may load internal kernels for them lazily (see InitMember).
    // On the comm stream, waited for here: a device-to-device cudaMemcpy returns
    // before it lands, and a 0 landing in our present slot on a peer after this
    // call's presence kernel wrote the epoch there made the peer wait until its
    // timeout (seen in the loopback tests at TP 4 and 8).
    GroupWorkspace* m = member.get();
    DeviceGuard guard(device);
    FLUX_CUDA_TRY(cudaMemcpyAsync(m->cells + 1, m->cells, sizeof(uint64_t), cudaMemcpyDeviceToDevice, m->comm));
    for (int p = 0; p < g.size; ++p) {
      if (p == g.rank) continue;  // writes 0 into our own present slot on the peer: a no-op
      FLUX_CUDA_TRY(cudaMemcpyAsync(m->peers[p].present + g.rank, m->cells, sizeof(uint64_t),
                                    cudaMemcpyDeviceToDevice, m->comm));
    }
    FLUX_CUDA_TRY(cudaStreamSynchronize(m->comm));
  }
  GroupWorkspace* w = member.get();
  // Grows one area of every member: all reach this call, drain what they
  // enqueued (pushes into peers' old buffers included), and only then may
  // anyone free a buffer.
  // `zeroed`: the low-latency area, whose readers take any word whose epoch matches (0 is no
  // call's epoch), is cleared before any peer can write to it (the barrier below).
  auto grow = [&](char** area, size_t* capacity, size_t bytes, char* PeerView::*peer_area,
                  const char* name, bool zeroed) -> Status {
    if (bytes <= *capacity) return Status::Ok();
    DeviceGuard guard(device);
    const std::string what = std::string(name) + " growth (" + who + ")";
    FLUX_JAX_RETURN_IF_ERROR(group->barrier.Arrive(cfg.timeout_us, what));
    FLUX_CUDA_TRY(cudaStreamSynchronize(compute_stream));
    FLUX_CUDA_TRY(cudaStreamSynchronize(w->comm));
    FLUX_JAX_RETURN_IF_ERROR(group->barrier.Arrive(cfg.timeout_us, what + ", drain"));
    if (*area) FLUX_CUDA_TRY(cudaFree(*area));
    *area = nullptr;
    *capacity = 0;
    const size_t rounded = (bytes + kGrowGranule - 1) / kGrowGranule * kGrowGranule;
    cudaError_t err = cudaMalloc(reinterpret_cast<void**>(area), rounded);
    if (err != cudaSuccess) {
      cudaGetLastError();
      Status st = AllocationError(device, rounded, err);
      group->barrier.Arrive(cfg.timeout_us, what + ", reallocation");  // keep peers in step
      return st;
    }
    *capacity = rounded;
    if (zeroed) {  // landed before any peer may write into it (see InitMember)
      FLUX_CUDA_TRY(cudaMemsetAsync(*area, 0, rounded, w->comm));
      FLUX_CUDA_TRY(cudaStreamSynchronize(w->comm));
    }
    FLUX_JAX_RETURN_IF_ERROR(group->barrier.Arrive(cfg.timeout_us, what + ", reallocation"));
    RefreshPeers(*group, w);
    for (const PeerView& peer : w->peers) {
      if (peer.*peer_area == nullptr) {
        return Status::ResourceExhausted("flux_jax: a peer failed to allocate its workspace");
      }
    }
    return Status::Ok();
  };
  FLUX_JAX_RETURN_IF_ERROR(grow(&w->data, &w->capacity, data_bytes, &PeerView::data, "data workspace", false));
  FLUX_JAX_RETURN_IF_ERROR(grow(&w->slots, &w->slots_capacity, slot_bytes, &PeerView::slots, "slot workspace", false));
  FLUX_JAX_RETURN_IF_ERROR(grow(&w->ll, &w->ll_capacity, ll_bytes, &PeerView::ll, "low-latency workspace", true));
  *out = w;
  return Status::Ok();
}

Status ExportIpcMember(const TpGroup& g, size_t data_bytes, size_t slot_bytes, std::string* blob) {
  const int device = g.ordinals[g.rank];
  if (device < 0 || device >= kMaxDevices) return Status::InvalidArgument("device ordinal out of range");
  std::shared_ptr<Group> group = GroupOf(g, true);
  if (group->members[g.rank]) return Status::InvalidArgument("flux_jax: " + g.Describe() + " is already set up");
  auto w = std::make_unique<GroupWorkspace>();
  FLUX_JAX_RETURN_IF_ERROR(InitMember(g, w.get()));
  DeviceGuard guard(device);
  IpcBlob b{};
  for (auto [area, capacity, bytes] : {std::tuple{&w->data, &w->capacity, data_bytes},
                                       std::tuple{&w->slots, &w->slots_capacity, slot_bytes},
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

Status ImportIpcPeer(const TpGroup& g, int peer, const std::string& blob) {
  std::shared_ptr<Group> group = GroupOf(g, false);
  if (!group || !group->members[g.rank]) return Status::Internal("flux_jax: import before export");
  if (blob.size() != sizeof(IpcBlob)) return Status::InvalidArgument("flux_jax: malformed IPC handle blob");
  if (peer < 0 || peer >= g.size || g.ordinals[peer] >= 0) {
    return Status::InvalidArgument("flux_jax: rank " + std::to_string(peer) + " is not a remote rank");
  }
  IpcBlob b;
  std::memcpy(&b, blob.data(), sizeof(b));
  const int device = g.ordinals[g.rank];
  DeviceGuard guard(device);
  void *ctrl = nullptr, *data = nullptr, *slots = nullptr, *ll = nullptr;
  FLUX_CUDA_TRY(cudaIpcOpenMemHandle(&ctrl, b.ctrl, cudaIpcMemLazyEnablePeerAccess));
  FLUX_CUDA_TRY(cudaIpcOpenMemHandle(&data, b.data, cudaIpcMemLazyEnablePeerAccess));
  FLUX_CUDA_TRY(cudaIpcOpenMemHandle(&slots, b.slots, cudaIpcMemLazyEnablePeerAccess));
  FLUX_CUDA_TRY(cudaIpcOpenMemHandle(&ll, b.ll, cudaIpcMemLazyEnablePeerAccess));
  std::lock_guard<std::mutex> lock(RegistryMutex());
  for (void* p : {ctrl, data, slots, ll}) group->opened.emplace_back(device, p);
  auto* words = static_cast<uint64_t*>(ctrl);
  group->remote[peer] = PeerView{words, words + kMaxTp, words + kMaxTp + kMaxFlags + 2,
                                 static_cast<char*>(data), static_cast<char*>(slots), static_cast<char*>(ll)};
  // A peer with less room than ours would be overrun: use the smaller capacity.
  GroupWorkspace* w = group->members[g.rank].get();
  w->capacity = std::min<size_t>(w->capacity, b.data_bytes);
  w->slots_capacity = std::min<size_t>(w->slots_capacity, b.slot_bytes);
  w->ll_capacity = std::min<size_t>(w->ll_capacity, b.ll_bytes);
  return Status::Ok();
}

Status CheckDeviceError(int device) {
  Status st;
  DeviceError* records = ErrorRecords(&st);
  FLUX_JAX_RETURN_IF_ERROR(st);
  const DeviceError& e = records[device];
  if (*reinterpret_cast<const volatile int32_t*>(&e.code) != 1) return Status::Ok();
  std::ostringstream os;
  os << "flux_jax: a fused op on GPU " << e.device << " timed out (rank " << e.rank;
  switch (e.site) {
    case kSitePresent: os << " waited for rank " << e.peer << " to reach the op"; break;
    case kSiteGemmA: os << " waited for rows of chunk " << e.chunk << ", piece " << e.piece << " from rank " << e.peer; break;
    case kSiteEpilogueC: os << " waited for partial sums, piece " << e.piece << ", from rank " << e.peer; break;
    case kSiteAllGather: os << " waited in all_gather for block " << e.piece << " of the rows of rank " << e.peer; break;
    case kSiteReduceScatter: os << " waited in reduce_scatter for block " << e.piece << " of the partial sums of rank " << e.peer; break;
    case kSiteDecodeRows: os << " waited in ag_matmul's decode GEMM for push block " << e.piece << " of the rows of rank " << e.peer; break;
    case kSiteDecodeSums: os << " waited in matmul_rs's decode GEMM for the partial sums of output tile " << e.piece << " from rank " << e.peer; break;
    case kSiteAllReduce: os << " waited in all_reduce for block " << e.piece << " of the partial sums of rank " << e.peer; break;
    default: os << " waited on an unknown site"; break;
  }
  os << "; epoch " << e.epoch << ", flag value seen " << e.seen
     << "). The outputs of that call are invalid (NaN where they depend on the missing data) and "
        "those of later fused calls on this GPU are NaN. Every device of "
        "a TP group must run the same fused ops in the same order. Call flux_jax.reset() to clear.";
  return Status::DeadlineExceeded(os.str());
}

void ResetWorkspaces() {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Status st;
  DeviceError* records = ErrorRecords(&st);
  if (st.ok()) {  // make every pending device-side wait give up before we drain the GPUs
    for (int d = 0; d < kMaxDevices; ++d) *reinterpret_cast<volatile int32_t*>(&records[d].code) = 2;
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
  if (st.ok()) std::memset(records, 0, sizeof(DeviceError) * kMaxDevices);
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

}  // namespace flux_jax::cuda
