// matmul_rs's decode exchange with all ranks on ONE GPU ("loopback"): each rank's decode GEMM with
// its exchanging epilogue (RunDecodeGemm + DecodeExchange, the same code matmul_rs_decode.cu
// launches) runs on its own stream and on 120 / tp SMs, and the "peer" buffers are the other
// ranks' allocations on the same device. TP 2, 4 and 8.
//
//   stream r: rank r's decode GEMM, call e -> call e+1 -> ...   (120 / tp persistent CTAs)
//             each output tile: rows of rank q -> q's low-latency receive words,
//             wait for every peer's rows of the tile, out = sum over q of P_q[own rows], rank order
//
// What it checks (and what it cannot): the exchange's indexing, epochs and parity halves, and its
// waits, on real hardware, over back-to-back calls whose inputs change every call (a stale receive
// area gives a wrong sum); not NVLink's ordering or speed (the peers are local memory). Per call:
//   - out of each rank, poisoned before, equals bf16(sum over q of float(P_q[rows])) bit for bit,
//     P_q being the partial that rank q's GEMM wrote (read back);
//   - P_q against a float32 host reference of x_q @ w_q, within bf16 rounding (first call only);
//   - no device error record (a timed-out wait).
// Then a loop of back-to-back calls without host syncs (checked at its end), and, per TP size, a
// call in which rank 1 does not signal: every other rank must record a timeout at the exchange
// site naming rank 1, with NaN output, and rank 1 (whose peers did signal) must finish right.
//
// Build and run: README.md in this directory (CMake target `rs_decode_loopback`). `--tp=N` runs
// one TP size.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "decode_gemm.h"
#include "loopback_common.h"
#include "workspace.h"

using flux_jax::DType;
using loopback::Bf16ToFloat;
using loopback::FloatToBf16;
using namespace flux_jax;
using namespace flux_jax::cuda;

namespace {

constexpr int kMaxRanks = kDecodeMaxRanks;  // the exchange serves up to 8 ranks
constexpr int kCtas = 120;                  // all ranks' persistent grids resident at once (132 SMs)
constexpr int kInputSets = 3;               // calls e and e+2 share a parity half, never inputs
constexpr int kStreamsPerRank = 1;

struct Rank {
  std::vector<std::vector<uint16_t>> x_host;  // [set][readable rows * k]
  std::vector<uint16_t> w_host;               // [k * n]
  void* x[kInputSets] = {};
  void* w = nullptr;
  void* partial[2] = {};  // P, one per parity
  void* out = nullptr;
  void* ll = nullptr;  // low-latency receive words, two parity halves
  float* alpha = nullptr;
  DeviceError* error_host = nullptr;
  DeviceError* error_dev = nullptr;
  cudaStream_t stream = nullptr;
};

struct Shape {
  int tp;
  int64_t m, k, n;  // per rank: P = x [m, k] @ w [k, n]; out = rows m/tp of the sum
};

class Loopback {
 public:
  explicit Loopback(const Shape& s) : s_(s), tp_(s.tp), rpr_(s.m / s.tp), readable_(DecodeRowsReadable(s.m)) {
    std::mt19937 gen(1234 + static_cast<unsigned>(s.m * 7 + s.k * 3 + s.n));
    std::normal_distribution<float> normal(0.f, 1.f);
    const float w_scale = 1.f / std::sqrt(static_cast<float>(s.k));
    const size_t part_bytes = static_cast<size_t>(s.m * s.n) * 2;
    for (int i = 0; i < tp_; ++i) {
      Rank& r = ranks_[i];
      CHECK_CUDA(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
      r.x_host.assign(kInputSets, std::vector<uint16_t>(static_cast<size_t>(readable_ * s.k)));
      for (int set = 0; set < kInputSets; ++set) {
        for (auto& v : r.x_host[set]) v = FloatToBf16(normal(gen));
        CHECK_CUDA(cudaMalloc(&r.x[set], r.x_host[set].size() * 2));
        CHECK_CUDA(cudaMemcpy(r.x[set], r.x_host[set].data(), r.x_host[set].size() * 2, cudaMemcpyHostToDevice));
      }
      r.w_host.resize(static_cast<size_t>(s.k * s.n));
      for (auto& v : r.w_host) v = FloatToBf16(normal(gen) * w_scale);
      CHECK_CUDA(cudaMalloc(&r.w, r.w_host.size() * 2));
      CHECK_CUDA(cudaMemcpy(r.w, r.w_host.data(), r.w_host.size() * 2, cudaMemcpyHostToDevice));
      for (auto& p : r.partial) CHECK_CUDA(cudaMalloc(&p, part_bytes));
      CHECK_CUDA(cudaMalloc(&r.out, part_bytes / tp_));
      CHECK_CUDA(cudaMalloc(&r.ll, 2 * DecodeExchangeBytes(s.m, s.n)));
      CHECK_CUDA(cudaMemset(r.ll, 0, 2 * DecodeExchangeBytes(s.m, s.n)));  // epoch 0: never a call's
      CHECK_CUDA(cudaMalloc(&r.alpha, sizeof(float)));
      const float one = 1.f;
      CHECK_CUDA(cudaMemcpy(r.alpha, &one, sizeof(float), cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaHostAlloc(&r.error_host, sizeof(DeviceError), cudaHostAllocMapped));
      std::memset(r.error_host, 0, sizeof(DeviceError));
      CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&r.error_dev), r.error_host, 0));
    }
    // Copies from pageable memory may return before their DMA has landed, and the rank streams
    // do not wait for the legacy stream they run on.
    CHECK_CUDA(cudaDeviceSynchronize());
  }

  ~Loopback() {
    for (int i = 0; i < tp_; ++i) {
      Rank& r = ranks_[i];
      for (void* p : r.x) cudaFree(p);
      for (void* p : r.partial) cudaFree(p);
      cudaFree(r.w), cudaFree(r.out), cudaFree(r.ll), cudaFree(r.alpha);
      cudaFreeHost(r.error_host);
      cudaStreamDestroy(r.stream);
    }
  }

  // Enqueues call `epoch` of every rank (inputs: set epoch % kInputSets). drop_rank: that rank's
  // epilogue does not signal (its peers' waits must time out).
  void Enqueue(uint64_t epoch, bool poison, int drop_rank = -1, int64_t timeout_ns = 2'000'000'000) {
    const int b = static_cast<int>(epoch & 1);
    const size_t part_bytes = static_cast<size_t>(s_.m * s_.n) * 2;
    const size_t ll_half = DecodeExchangeBytes(s_.m, s_.n);
    for (int r = 0; r < tp_; ++r) {
      Rank& me = ranks_[r];
      if (poison) {
        CHECK_CUDA(cudaMemsetAsync(me.out, 0xFF, part_bytes / tp_, me.stream));
        CHECK_CUDA(cudaMemsetAsync(me.partial[b], 0xFF, part_bytes, me.stream));
      }
      DecodeGemmPlan plan;
      plan.rows = s_.m;
      plan.n = s_.n;
      plan.k = s_.k;
      plan.x = me.x[epoch % kInputSets];
      plan.x_rows_readable = readable_;
      plan.w = me.w;
      plan.d = me.partial[b];
      plan.alpha_ptr = me.alpha;
      DecodeExchange& e = plan.exchange;
      e.tp = tp_;
      e.rank = r;
      e.reduced_rows = static_cast<int32_t>(rpr_);
      e.n = static_cast<int32_t>(s_.n);
      e.partial = plan.d;
      e.out = me.out;
      e.signal_peers = r != drop_rank;
      e.ctx.error = me.error_dev;
      e.ctx.device_error = me.error_dev;  // each rank its own "device": a silent peer times out here
      e.ctx.alpha = me.alpha;
      e.ctx.timeout_ns = timeout_ns;
      e.ctx.device = 0;
      e.ctx.rank = r;
      e.ctx.epoch = epoch;
      e.recv = static_cast<char*>(me.ll) + b * ll_half;
      for (int q = 0; q < tp_; ++q) {
        if (q != r)
          e.peer_recv[q] = static_cast<char*>(ranks_[q].ll) + b * ll_half + DecodeExchangeBytes(r * rpr_, s_.n);
      }
      const flux_jax::Status st = RunDecodeGemm(plan, DType::kBF16, me.stream, 0, kCtas / tp_);
      if (!st.ok()) {
        std::fprintf(stderr, "RunDecodeGemm rank %d: %s\n", r, st.message().c_str());
        std::exit(2);
      }
    }
  }

  void Sync() {
    for (int r = 0; r < tp_; ++r) CHECK_CUDA(cudaStreamSynchronize(ranks_[r].stream));
  }

  // Checks call `epoch`'s results (after Sync): every rank's, or with only >= 0 the silent rank's
  // output, which must be NaN or right: peers whose waits gave up poison their later tiles and stop
  // serving it, so it may time out in turn (noted, not a failure). Returns the number of failed
  // properties.
  int Check(uint64_t epoch, bool check_partial, int only = -1) {
    const int b = static_cast<int>(epoch & 1);
    const size_t part = static_cast<size_t>(s_.m * s_.n), outn = part / tp_;
    std::vector<uint16_t> p[kMaxRanks], out[kMaxRanks];
    int failures = 0;
    for (int r = 0; r < tp_; ++r) {
      if ((only < 0 || r == only) && ranks_[r].error_host->code != 0) {
        const DeviceError& d = *ranks_[r].error_host;
        std::printf("  %s call %llu: rank %d recorded a timeout (site %d peer %d piece %d epoch %llu seen %llu)\n",
                    only < 0 ? "FAIL" : "note:", static_cast<unsigned long long>(epoch), r, d.site, d.peer, d.piece,
                    static_cast<unsigned long long>(d.epoch), static_cast<unsigned long long>(d.seen));
        if (only < 0) ++failures;
      }
      p[r].resize(part);
      out[r].resize(outn);
      CHECK_CUDA(cudaMemcpy(p[r].data(), ranks_[r].partial[b], part * 2, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(out[r].data(), ranks_[r].out, outn * 2, cudaMemcpyDeviceToHost));
    }
    for (int r = 0; r < tp_; ++r) {  // the exchange: bit for bit, summed in rank order
      if (only >= 0 && r != only) continue;
      int64_t bad = 0, first = -1;
      for (size_t i = 0; i < outn; ++i) {
        const size_t src = r * outn + i;  // row r * rpr + i / n of P
        const float want = Expected(p, src);
        const bool nan_ok = only >= 0 && std::isnan(Bf16ToFloat(out[r][i]));  // the silent rank: NaN or right
        if (!nan_ok && out[r][i] != FloatToBf16(want)) {
          if (first < 0) first = static_cast<int64_t>(i);
          ++bad;
        }
      }
      if (bad) {
        const size_t i = static_cast<size_t>(first);
        std::printf(
            "  FAIL call %llu: rank %d out differs from the sum of the partials at %lld of %zu elements "
            "(first: row %zu col %zu: %g, expected %g)\n",
            static_cast<unsigned long long>(epoch), r, static_cast<long long>(bad), outn, i / s_.n, i % s_.n,
            Bf16ToFloat(out[r][i]), Bf16ToFloat(FloatToBf16(Expected(p, r * outn + i))));
        ++failures;
      }
    }
    if (check_partial) failures += CheckPartials(epoch, p);
    return failures;
  }

  Rank& rank(int r) { return ranks_[r]; }

 private:
  // P_q against a float32 host reference: |P - ref| <= 2^-8 |ref| + 2^-8 * scale (bf16 rounding of
  // the result, and of values near zero where the f32 summation orders differ).
  int CheckPartials(uint64_t epoch, const std::vector<uint16_t>* p) {
    int failures = 0;
    for (int q = 0; q < tp_; ++q) {
      const auto& x = ranks_[q].x_host[epoch % kInputSets];
      const auto& w = ranks_[q].w_host;
      std::vector<float> wf(w.size()), row(s_.n);
      for (size_t i = 0; i < w.size(); ++i) wf[i] = Bf16ToFloat(w[i]);
      int64_t bad = 0;
      double worst = 0;
      for (int64_t i = 0; i < s_.m; ++i) {
        std::fill(row.begin(), row.end(), 0.f);
        for (int64_t kk = 0; kk < s_.k; ++kk) {
          const float a = Bf16ToFloat(x[i * s_.k + kk]);
          const float* wr = wf.data() + kk * s_.n;
          for (int64_t j = 0; j < s_.n; ++j) row[j] += a * wr[j];
        }
        for (int64_t j = 0; j < s_.n; ++j) {
          const float got = Bf16ToFloat(p[q][i * s_.n + j]);
          const double err = std::fabs(static_cast<double>(got) - row[j]);
          const double tol = std::ldexp(std::fabs(row[j]), -8) + std::ldexp(1.0, -8);
          worst = std::max(worst, err / tol);
          if (!(err <= tol)) ++bad;  // NaN fails too
        }
      }
      if (bad) {
        std::printf("  FAIL call %llu: rank %d partial off the float32 reference at %lld elements (worst %.2f x tol)\n",
                    static_cast<unsigned long long>(epoch), q, static_cast<long long>(bad), worst);
        ++failures;
      }
    }
    return failures;
  }

  float Expected(const std::vector<uint16_t>* p, size_t src) const {
    float sum = 0.f;
    for (int q = 0; q < tp_; ++q) sum += Bf16ToFloat(p[q][src]);
    return sum;
  }

  Shape s_;
  int tp_;
  int64_t rpr_, readable_;
  Rank ranks_[kMaxRanks];
};

void PrintShape(const Shape& s) {
  std::printf("tp %d, %4lld x %5lld x %5lld", s.tp, static_cast<long long>(s.m), static_cast<long long>(s.k),
              static_cast<long long>(s.n));
}

int RunShape(const Shape& s, uint64_t* epoch_base) {
  Loopback lb(s);
  uint64_t epoch = *epoch_base;
  int failures = 0;
  // 1. Checked calls, both parities, each input set at least twice.
  constexpr int kChecked = 12;
  for (int i = 0; i < kChecked; ++i) {
    ++epoch;
    lb.Enqueue(epoch, /*poison=*/true);
    lb.Sync();
    failures += lb.Check(epoch, /*check_partial=*/i == 0);  // the GEMM itself: once
  }
  // 2. Back-to-back calls without host syncs (ranks may run one call apart), checked at the end.
  constexpr int kLoop = 200;
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  CHECK_CUDA(cudaEventRecord(start, lb.rank(0).stream));
  for (int r = 1; r < s.tp; ++r) CHECK_CUDA(cudaStreamWaitEvent(lb.rank(r).stream, start));
  for (int i = 0; i < kLoop; ++i) lb.Enqueue(++epoch, /*poison=*/i == kLoop - 1);
  cudaEvent_t done[kMaxRanks];
  for (int r = 1; r < s.tp; ++r) {
    CHECK_CUDA(cudaEventCreateWithFlags(&done[r], cudaEventDisableTiming));
    CHECK_CUDA(cudaEventRecord(done[r], lb.rank(r).stream));
    CHECK_CUDA(cudaStreamWaitEvent(lb.rank(0).stream, done[r]));
  }
  CHECK_CUDA(cudaEventRecord(stop, lb.rank(0).stream));
  lb.Sync();
  float ms = 0.f;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  for (int r = 1; r < s.tp; ++r) CHECK_CUDA(cudaEventDestroy(done[r]));
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  failures += lb.Check(epoch, /*check_partial=*/false);
  PrintShape(s);
  std::printf(
      ": %d checked calls + %d back to back, %.1f us per call (one GPU shared by the ranks: not a timing of "
      "the path): %s\n",
      kChecked, kLoop, 1000.f * ms / kLoop, failures ? "FAIL" : "ok");
  std::fflush(stdout);
  *epoch_base = epoch;
  return failures;
}

// Rank 1 computes but does not signal: every other rank must give up within the timeout, record
// the exchange site, rank 1 and the call's epoch, and write NaN everywhere; rank 1 (whose peers
// did signal) must record nothing and sum what it received: right, or NaN where a peer's tile was
// computed after that peer's wait gave up (it poisons its alpha).
int RunDropped(const Shape& s) {
  constexpr int kSilent = 1;
  Loopback lb(s);
  lb.Enqueue(1, true);
  lb.Sync();
  if (lb.Check(1, false) != 0) {
    PrintShape(s);
    std::printf(", rank %d silent: FAIL (the call before it was wrong)\n", kSilent);
    return 1;
  }
  const auto t0 = std::chrono::steady_clock::now();
  lb.Enqueue(2, true, /*drop_rank=*/kSilent, /*timeout_ns=*/200'000'000);
  lb.Sync();
  const double s_elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int failures = lb.Check(2, false, /*only=*/kSilent);
  std::vector<uint16_t> out(static_cast<size_t>(s.m / s.tp * s.n));
  for (int r = 0; r < s.tp; ++r) {
    if (r == kSilent) continue;
    const DeviceError& d = *lb.rank(r).error_host;
    CHECK_CUDA(cudaMemcpy(out.data(), lb.rank(r).out, out.size() * 2, cudaMemcpyDeviceToHost));
    int64_t nan = 0;
    for (uint16_t v : out) nan += std::isnan(Bf16ToFloat(v));
    const bool ok = d.code == 1 && d.site == kSiteDecodeSums && d.peer == kSilent && d.epoch == 2 &&
                    nan == static_cast<int64_t>(out.size());
    if (!ok) {
      std::printf("  FAIL rank %d: error code %d site %d peer %d epoch %llu seen %llu, %lld of %zu outputs NaN\n", r,
                  d.code, d.site, d.peer, static_cast<unsigned long long>(d.epoch),
                  static_cast<unsigned long long>(d.seen), static_cast<long long>(nan), out.size());
      ++failures;
    }
  }
  if (s_elapsed >= 5.0) {
    std::printf("  FAIL the call took %.2f s (timeout 0.2 s)\n", s_elapsed);
    ++failures;
  }
  PrintShape(s);
  std::printf(
      ", rank %d silent: the other ranks timed out at the exchange naming rank %d with NaN outputs, rank %d "
      "NaN or right, %.2f s: %s\n",
      kSilent, kSilent, kSilent, s_elapsed, failures ? "FAIL" : "ok");
  std::fflush(stdout);
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  int only_tp = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--tp=", 5) == 0 && std::atoi(argv[i] + 5) >= 2 && std::atoi(argv[i] + 5) <= kMaxRanks) {
      only_tp = std::atoi(argv[i] + 5);
    } else {
      std::fprintf(stderr, "usage: %s [--tp=N]   (N: 2 to %d; default: every shape)\n", argv[0], kMaxRanks);
      return 2;
    }
  }
  // Per-rank shapes (m rows, k = global K / 2, n): x padded to whole row tiles, tails of N, both
  // tile heights, the LLaMA-70B out-projection at 64 and 128 rows; at TP 4 and 8 each rank's GEMM
  // runs on 30 / 15 SMs.
  const Shape shapes[] = {{2, 2, 264, 136},    {2, 8, 1024, 512},    {2, 16, 2048, 1000},  {2, 30, 512, 2056},
                          {2, 64, 1024, 4096}, {2, 64, 4096, 8192},  {2, 66, 776, 1544},   {2, 100, 2048, 3000},
                          {2, 128, 1024, 520}, {2, 128, 4096, 8192}, {2, 128, 8192, 8200}, {4, 8, 512, 1024},
                          {4, 64, 1024, 2048}, {4, 128, 1024, 4096}, {4, 100, 256, 776},   {8, 16, 512, 1024},
                          {8, 64, 256, 2056},  {8, 128, 1024, 4096}};
  // The silent-rank calls: both tile heights at TP 2, one shape at TP 4 and 8.
  const Shape dropped[] = {{2, 64, 1024, 2048}, {2, 128, 1024, 2048}, {4, 64, 1024, 2048}, {8, 128, 1024, 2048}};
  loopback::SetUpProcess(only_tp ? only_tp : kMaxRanks, kStreamsPerRank);  // before any CUDA call
  CHECK_CUDA(cudaSetDevice(0));
  if (!PreloadDecodeGemmKernels().ok()) return 2;
  uint64_t epoch = 0;
  int failures = 0;
  for (const Shape& s : shapes) {
    if (only_tp == 0 || s.tp == only_tp) failures += RunShape(s, &epoch);
  }
  for (const Shape& s : dropped) {
    if (only_tp == 0 || s.tp == only_tp) failures += RunDropped(s);
  }
  std::printf(failures ? "FAILED: %d\n" : "all ok\n", failures);
  return failures ? 1 : 0;
}
