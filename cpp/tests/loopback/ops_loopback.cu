// The fused ops' multi-rank GPU paths with every rank on ONE GPU ("loopback"): TP 2, 4 and 8 on
// a single device, each rank a host thread with its own stream (as XLA runs one thread per
// device), all calling the same host APIs the FFI handlers call (RunAgMatmulCuda,
// RunMatmulRsCuda, RunMatmulArCuda, RunAllGatherCuda, RunReduceScatterCuda, RunAllReduceCuda)
// on a TP group whose
// ranks all map to device 0. The workspace gives each rank 9/10 / tp of the SMs (workspace.cc),
// so every rank's persistent kernels are resident at once.
//
//   thread r:  case 1: call, check, call, check, ..., 30 calls back to back, call, check
//              case 2: ...            (every rank runs the same calls in the same order:
//                                      epochs agree, as under XLA)
//
// What it checks (and what it cannot): the protocols (flags, epochs, parity halves, chunk and
// piece indexing, tile gating, rank order of sums) of the overlap, decode and latency paths on real
// hardware, at TP sizes beyond the GPUs at hand; not NVLink's ordering or speed, since the peers
// are local memory. Every checked call runs with poisoned outputs on inputs that change
// from call to call (three sets, so a stale chunk or receive area gives wrong numbers) against a
// float64 host reference:
//   |out - ref| <= eps * (|ref| + sum over ranks of |partial|) + acc * sum |x| |w|
// (eps = 2^-7 bf16 / 2^-10 f16: the output's rounding and, for matmul_rs, the partials'; acc =
// 2^-14, or 2^-10 for FP8: its fast accumulation keeps ~14 bits, and XLA's FP8 GEMM (cuBLASLt)
// measured up to 2^-12.6 of sum |x| |w| on one H200, the same as ours element for element); the
// collectives bit for bit (reduce_scatter, all_reduce: float32 sums in rank order, rounded once).
// matmul_ar: rank 0 against the reference, every other rank bit for bit against rank 0 (its
// output must be the same bits on every rank) and failed wherever rank 0's output is. FP8 cases
// (ag_matmul, matmul_rs overlap): e4m3 (or e5m2) x and e4m3 w^T with row and column scales, bf16
// out, against the same reference with the scales applied.
//
// Build and run: README.md in this directory (CMake target `ops_loopback`).
// `--cpu` runs the same calls on the CPU backend (no GPU needed: checks this program);
// `--self-test` feeds the last rank a wrong input set and passes only if every check fails;
// `--tp=N`, `--op=matmul_rs`, `--path=decode` pick cases; `--gemm-kernel=128x160_c2x1` (any forced
// GpuTuning.gemm_kernel name but "decode") runs the overlap cases whose dtype and weight layout have that instance
// with it (the A/B instances have to pass here before a rule may pick them); `--rs-tile-signal=N`
// forces GpuTuning.rs_tile_signal (the cases' shapes take 2 by default; 1 signals each tile at the
// next one); `--tile-group-m=G` and `--tile-serpentine=S` force the overlap GEMM's tile order
// (GpuTuning.tile_group_m, tile_serpentine: the cases hold a few groups of 8 row tiles at most, so
// groups of 2 make the serpentine order turn several times).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "flux_jax/ag_matmul.h"
#include "flux_jax/collectives.h"
#include "flux_jax/cpu_channels.h"
#include "flux_jax/cuda_runtime.h"
#include "flux_jax/matmul_ar.h"
#include "flux_jax/matmul_rs.h"
#include "flux_jax/params.h"
#include "loopback_common.h"

using namespace flux_jax;
using loopback::SetUpProcess;

namespace {

enum class Op { kAgMatmul, kMatmulRs, kAllGather, kReduceScatter, kMatmulAr, kAllReduce };
enum class Path { kOverlap, kDecode, kCollective };

struct Case {
  Op op;
  Path path;
  int64_t m, k, n;  // ag_matmul: m_local, K, n_local; matmul_rs / matmul_ar: M, k_local, N;
                    // collectives: rows, cols
  DType dtype = DType::kBF16;
  bool w_transposed = false;
  bool gathered = false;  // ag_matmul's return_gathered
  bool fp8 = false;       // x, w in float8_e4m3fn with row / column scales (Fp8Operands), out in dtype
  bool x_e5m2 = false;    // FP8: x in float8_e5m2 (a backward's dy rows), w still e4m3fn
};

constexpr int kInputSets = 3;  // calls e and e+2 share a parity half, never inputs
constexpr int kChecked = 3;    // checked calls before the back-to-back run (one per input set)
constexpr int kBackToBack = 30;
constexpr int64_t kTimeoutUs = 3'000'000;

// --cpu: the same calls on the CPU backend (RunAgMatmulCpu, ...; host memory, blocking calls), to
// check this program's references and checks where there is no GPU.
bool g_cpu = false;
// --self-test: the last rank computes on the wrong input set (as a stale chunk or receive area
// would), so every checked call must fail on every rank: shows that the checks can fail.
bool g_self_test = false;
// --gemm-kernel: the overlap GEMM instance every picked case forces (GemmKernel; kAuto: none).
GemmKernel g_gemm_kernel = GemmKernel::kAuto;
// --rs-tile-signal: GpuTuning.rs_tile_signal of every call (-1: by shape).
int g_rs_tile_signal = -1;
// --tile-group-m, --tile-serpentine: GpuTuning.tile_group_m (0: the default) and tile_serpentine (-1: the default).
int g_tile_group_m = 0;
int g_tile_serpentine = -1;

// Streams each rank issues work on: its own (XLA's) and its workspace member's comm stream.
constexpr int kStreamsPerRank = 2;

// How one call is configured. MakeCommConfig is the only place that fills a CommConfig.
struct CallOptions {
  int64_t callsite = 0;  // CPU channels: one per call site
  int64_t timeout_us = kTimeoutUs;
  int drop_rank = -1;           // this rank never signals (the silent-rank cases)
  bool poison_outputs = false;  // outputs NaN-filled first, so unwritten elements fail the checks
};

CommConfig MakeCommConfig(const Case& c, const CallOptions& o) {
  CommConfig cfg;
  cfg.callsite = o.callsite;
  cfg.timeout_us = o.timeout_us;
  cfg.drop_rank = o.drop_rank;
  cfg.poison_outputs = o.poison_outputs;
  cfg.path = c.path == Path::kDecode ? FusedPath::kDecode : FusedPath::kOverlap;
  cfg.tuning.gemm_kernel = static_cast<int64_t>(g_gemm_kernel);
  cfg.tuning.rs_tile_signal = g_rs_tile_signal;
  cfg.tuning.tile_group_m = g_tile_group_m;
  cfg.tuning.tile_serpentine = g_tile_serpentine;
  return cfg;
}

// The forced instances by name (flux_jax/_config.py GEMM_KERNELS), kAuto for an unknown name.
GemmKernel ForcedKernel(const std::string& name) {
  if (name == "128x256") return GemmKernel::k128x256;
  if (name == "128x192") return GemmKernel::k128x192;
  if (name == "128x224") return GemmKernel::k128x224;
  if (name == "128x160_c2x1") return GemmKernel::k128x160Cluster2x1;
  if (name == "128x128_pp_c2x1") return GemmKernel::k128x128PingpongCluster2x1;
  if (name == "128x320_c2x1") return GemmKernel::k128x320Cluster2x1;
  if (name == "128x160_pp_c2x1") return GemmKernel::k128x160PingpongCluster2x1;
  if (name == "128x192_pp_c2x1") return GemmKernel::k128x192PingpongCluster2x1;
  return GemmKernel::kAuto;
}

// Whether the build has the forced instance for this case (cpp/kernels/cuda/gemm_plan.h,
// HasGemmInstance; FP8: ChooseFp8GemmInstance): only overlap cases of the GEMM ops run it.
bool HasForcedInstance(const Case& c, GemmKernel k) {
  if (k == GemmKernel::kAuto) return true;
  if (c.path != Path::kOverlap || (c.op != Op::kAgMatmul && c.op != Op::kMatmulRs)) return false;
  if (c.fp8) {
    return k == GemmKernel::k128x128PingpongCluster2x1 || k == GemmKernel::k128x160PingpongCluster2x1 ||
           k == GemmKernel::k128x192PingpongCluster2x1 || (k == GemmKernel::k128x256 && !c.x_e5m2);
  }
  if (k == GemmKernel::k128x160PingpongCluster2x1) return false;  // FP8 only
  if (k == GemmKernel::k128x192PingpongCluster2x1) return !c.w_transposed;
  if (k == GemmKernel::k128x160Cluster2x1 || k == GemmKernel::k128x224) return c.w_transposed;
  return true;  // bfloat16 and float16 have every other instance
}
// The last checked output of each rank (matmul_ar: compared across ranks bit for bit) and rank 0's
// verdict on its own (matmul_ar: every rank's output is wrong where rank 0's is).
std::vector<std::vector<uint16_t>> g_outputs;
int g_rank0_bad = 0;

std::string Describe(const Case& c, int tp) {
  const char* op[] = {"ag_matmul", "matmul_rs", "all_gather", "reduce_scatter", "matmul_ar", "all_reduce"};
  const char* path[] = {"overlap", "decode", "collective"};
  char buf[200];
  std::snprintf(buf, sizeof(buf), "tp %d %-14s %-10s %5lld x %5lld x %5lld %s%s%s", tp, op[static_cast<int>(c.op)],
                path[static_cast<int>(c.path)], static_cast<long long>(c.m), static_cast<long long>(c.k),
                static_cast<long long>(c.n),
                c.fp8 ? (c.x_e5m2 ? "e5m2xe4m3->bfloat16" : "e4m3->bfloat16") : DTypeName(c.dtype),
                c.w_transposed ? " w^T" : "", c.gathered ? " +gathered" : "");
  return buf;
}

float ToFloat(uint16_t v, DType t) { return t == DType::kF16 ? loopback::F16ToFloat(v) : loopback::Bf16ToFloat(v); }

uint16_t FromFloat(float f, DType t) {  // round to nearest even
  return t == DType::kF16 ? loopback::FloatToF16(f) : loopback::FloatToBf16(f);
}

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN.
float E4m3ToFloat(uint16_t v) {
  const int exp = (v >> 3) & 0xf, man = v & 0x7;
  if (exp == 0xf && man == 0x7) return std::nanf("");
  const float mag = exp == 0 ? std::ldexp(static_cast<float>(man), -9) : std::ldexp(8.f + man, exp - 10);
  return (v & 0x80) ? -mag : mag;
}

// Round to nearest even, saturating at +-448 (never NaN). a = q * 2^(exp - 3), q in 8..16 (a carry to
// 16 is the next binade's first value); below 2^-6 (exp = -6) q in 0..8 is the subnormal's bits.
uint16_t FloatToE4m3(float f) {
  const uint16_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  int e = 0;
  std::frexp(a, &e);  // a = 1.m * 2^(e - 1)
  const int exp = a < std::ldexp(1.f, -6) ? -6 : e - 1;
  const int q = static_cast<int>(std::nearbyint(std::ldexp(a, 3 - exp)));
  const int bits = exp == -6 && q < 8 ? q : ((exp + 7) << 3) + q - 8;
  return static_cast<uint16_t>(sign | std::min(bits, 0x7E));
}

bool IsFp8Nan(uint16_t v) { return (v & 0x7F) == 0x7F; }

// float8_e5m2: 1 sign, 5 exponent (bias 15), 2 mantissa bits, the high byte of a float16.
float E5m2ToFloat(uint16_t v) { return loopback::F16ToFloat(static_cast<uint16_t>(v << 8)); }

// Round to nearest even (through float16), saturating at +-57344 (never infinite or NaN).
uint16_t FloatToE5m2(float f) {
  const uint16_t h = loopback::FloatToF16(f);
  uint16_t top = h >> 8;
  const uint16_t rem = h & 0xFF;
  if (rem > 0x80 || (rem == 0x80 && (top & 1))) ++top;
  if ((top & 0x7C) == 0x7C) top = (top & 0x80) | 0x7B;  // exponent all ones: the largest finite
  return top;
}

bool IsE5m2Nan(uint16_t v) { return (v & 0x7C) == 0x7C && (v & 0x3) != 0; }

// x's and w's elements on the host: uint16_t words, FP8 cases one byte each (w e4m3, x e4m3 or e5m2).
size_t OperandSize(const Case& c) { return c.fp8 ? 1 : 2; }
float OperandToFloat(uint16_t v, const Case& c) { return c.fp8 ? E4m3ToFloat(v) : ToFloat(v, c.dtype); }
float XToFloat(uint16_t v, const Case& c) { return c.fp8 && c.x_e5m2 ? E5m2ToFloat(v) : OperandToFloat(v, c); }
bool OperandIsNan(uint16_t v, const Case& c) {
  if (c.fp8) return c.x_e5m2 ? IsE5m2Nan(v) : IsFp8Nan(v);
  return std::isnan(ToFloat(v, c.dtype));
}

void* Alloc(size_t bytes) {
  void* p = nullptr;
  if (g_cpu) return std::malloc(bytes);
  CHECK_CUDA(cudaMalloc(&p, bytes));
  return p;
}
// On the rank's stream: a cudaMemcpy from pageable memory may return before its DMA has landed,
// and the rank streams (non-blocking) do not wait for the legacy stream it runs on.
void Upload(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (g_cpu)
    std::memcpy(dst, src, bytes);
  else
    CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
}
void Download(void* dst, const void* src, size_t bytes) {
  if (g_cpu)
    std::memcpy(dst, src, bytes);
  else
    CHECK_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
// Host operands in the buffers' layout (FP8: one byte per element); `staging` keeps the bytes until
// the rank's stream has been synchronized.
void UploadOperands(void* dst, const std::vector<uint16_t>& v, const Case& c, cudaStream_t stream,
                    std::vector<std::vector<uint8_t>>* staging) {
  if (!c.fp8) return Upload(dst, v.data(), v.size() * 2, stream);
  staging->emplace_back(v.begin(), v.end());
  Upload(dst, staging->back().data(), v.size(), stream);
}
std::vector<uint16_t> DownloadOperands(const void* src, size_t elems, const Case& c) {
  std::vector<uint16_t> v(elems);
  if (!c.fp8) {
    Download(v.data(), src, elems * 2);
    return v;
  }
  std::vector<uint8_t> bytes(elems);
  Download(bytes.data(), src, elems);
  std::copy(bytes.begin(), bytes.end(), v.begin());
  return v;
}
void Release(void* p) {
  if (g_cpu)
    std::free(p);
  else if (p)
    cudaFree(p);
}

// A reusable barrier for the rank threads (bounded: a rank stuck in a call fails the run).
class Rendezvous {
 public:
  explicit Rendezvous(int n) : n_(n) {}
  void Arrive() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, std::chrono::seconds(120), [&] { return gen_ != gen; })) {
      std::fprintf(stderr, "a rank did not reach the rendezvous in 120 s\n");
      std::exit(3);
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, count_ = 0;
  uint64_t gen_ = 0;
};

// The host inputs of every rank of one case (read by every thread for the references), and the
// same as float: x row-major, op(w) transposed to [n][k], so a reference dot runs over memory in order.
// FP8 cases: the scales of each rank's x rows change with the set (they travel with the rows; the
// ag_matmul call takes every rank's, in rank order), the column scales are per rank as w is.
struct Inputs {
  std::vector<std::vector<uint16_t>> x[kInputSets];       // [set][rank]
  std::vector<std::vector<uint16_t>> w;                   // [rank]
  std::vector<std::vector<float>> xf[kInputSets];         // [set][rank]
  std::vector<std::vector<float>> wt;                     // [rank], [n][k]
  std::vector<std::vector<float>> row_scale[kInputSets];  // FP8: [set][rank], one per row of x
  std::vector<std::vector<float>> col_scale;              // FP8: [rank], [n]
};

Inputs MakeInputs(const Case& c, int tp, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const bool matmul = c.op == Op::kAgMatmul || c.op == Op::kMatmulRs || c.op == Op::kMatmulAr;
  const float w_scale = 1.f / std::sqrt(static_cast<float>(c.k));
  Inputs in;
  for (auto& set : in.x) {
    set.resize(tp);
    for (auto& x : set) {
      x.resize(static_cast<size_t>(c.m * (matmul ? c.k : c.n)));
      for (auto& v : x) {
        const float f = normal(gen);
        v = c.fp8 ? (c.x_e5m2 ? FloatToE5m2(f) : FloatToE4m3(f)) : FromFloat(f, c.dtype);
      }
    }
  }
  if (!matmul) return in;
  in.w.resize(tp);
  in.wt.resize(tp);
  for (int q = 0; q < tp; ++q) {
    auto& w = in.w[q];
    w.resize(static_cast<size_t>(c.k * c.n));
    for (auto& v : w) v = c.fp8 ? FloatToE4m3(normal(gen)) : FromFloat(normal(gen) * w_scale, c.dtype);
    auto& wt = in.wt[q];
    wt.resize(w.size());
    for (int64_t kk = 0; kk < c.k; ++kk) {
      for (int64_t col = 0; col < c.n; ++col) {  // w [k, n], or [n, k] when transposed
        wt[col * c.k + kk] = OperandToFloat(c.w_transposed ? w[col * c.k + kk] : w[kk * c.n + col], c);
      }
    }
  }
  for (int s = 0; s < kInputSets; ++s) {
    for (const auto& x : in.x[s]) {
      std::vector<float> f(x.size());
      for (size_t i = 0; i < x.size(); ++i) f[i] = XToFloat(x[i], c);
      in.xf[s].push_back(std::move(f));
    }
  }
  if (!c.fp8) return in;
  std::uniform_real_distribution<float> exponent(-4.f, 4.f);  // scales 2^-4 .. 2^4
  for (auto& set : in.row_scale) {
    set.assign(tp, std::vector<float>(static_cast<size_t>(c.m)));
    for (auto& scales : set) {
      for (auto& v : scales) v = std::exp2(exponent(gen));
    }
  }
  in.col_scale.assign(tp, std::vector<float>(static_cast<size_t>(c.n)));
  for (auto& scales : in.col_scale) {
    for (auto& v : scales) v = std::exp2(exponent(gen)) * w_scale;
  }
  return in;
}

// One output element's reference: the value, the sum of the partials' magnitudes and of |x| |w|.
struct Ref {
  double value = 0, partials = 0, magnitude = 0;
};

// sum over kk of x[row][kk] * op(w)[kk][col] for one rank's x and w (wt = op(w) as [n][k]).
Ref Dot(const Case& c, const std::vector<float>& x, int64_t row, const std::vector<float>& wt, int64_t col) {
  const float* a = x.data() + row * c.k;
  const float* b = wt.data() + col * c.k;
  Ref r;
  for (int64_t kk = 0; kk < c.k; ++kk) {
    const double p = static_cast<double>(a[kk]) * b[kk];
    r.value += p;
    r.magnitude += std::fabs(p);
  }
  r.partials = std::fabs(r.value);
  return r;
}

// Dot for output row `row` of rank q_x's x (input set `set`) and column `col` of rank q_w's w, times
// the row's and the column's scale in FP8 cases.
Ref ScaledDot(const Case& c, const Inputs& in, int set, int q_x, int64_t row, int q_w, int64_t col) {
  Ref r = Dot(c, in.xf[set][q_x], row, in.wt[q_w], col);
  if (!c.fp8) return r;
  const double scale = static_cast<double>(in.row_scale[set][q_x][row]) * in.col_scale[q_w][col];
  r.value *= scale, r.partials *= scale, r.magnitude *= scale;
  return r;
}

class RankThread {
 public:
  RankThread(int rank, int tp, Rendezvous* rendezvous, std::atomic<int>* failures)
      : rank_(rank), tp_(tp), rendezvous_(rendezvous), failures_(failures) {
    group_.rank = rank;
    group_.size = tp;
    for (int q = 0; q < tp; ++q) {
      group_.devices.push_back(1000 * tp + q);  // distinct ids: one group per TP size
      group_.processes.push_back(0);
      group_.ordinals.push_back(0);
    }
  }

  // Every case in order (see the file comment), then, for the cases in `drop_cases`, a call in
  // which the last rank never signals: the others must fail within the timeout with an error that
  // names that rank, never hang; then the workspaces are reset (flux_jax.reset()) and the case runs
  // right again.
  // Then, for case `growth_case` (an overlap case; -1: none), a workspace growth that fails on the
  // last rank (GrowthFails).
  void Run(const std::vector<Case>& cases, const std::vector<Inputs>& inputs, const std::vector<size_t>& drop_cases,
           int growth_case) {
    if (!g_cpu) {
      CHECK_CUDA(cudaSetDevice(0));
      CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    }
    uint64_t call = 0;
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      opts_.callsite = static_cast<int64_t>(i) + 1;
      Buffers b = Allocate(c, inputs[i]);
      int bad = 0;
      for (int j = 0; j < kChecked; ++j) bad += Call(c, b, call++, inputs[i], /*check=*/true);
      const auto t0 = std::chrono::steady_clock::now();
      for (int j = 0; j < kBackToBack; ++j) bad += Call(c, b, call++, inputs[i], /*check=*/false);
      if (!g_cpu) CHECK_CUDA(cudaStreamSynchronize(stream_));
      const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      bad += Call(c, b, call++, inputs[i], /*check=*/true);
      Free(b);
      if (g_self_test) bad = bad == kChecked + 1 ? 0 : 1;  // every checked call must have failed
      rendezvous_->Arrive();
      if (rank_ == 0) {
        std::printf("%s: %d checked calls + %d back to back (%.0f us per call, one device shared: not a timing)\n",
                    Describe(c, tp_).c_str(), kChecked + 1, kBackToBack, us / kBackToBack);
      }
      if (bad) failures_->fetch_add(bad);
      rendezvous_->Arrive();
      if (rank_ == 0) {
        std::printf(failures_->load() ? "  -> failures so far: %d\n" : "  -> ok\n", failures_->load());
        const std::string error = g_cpu ? std::string() : CudaDeviceError(0);
        if (!error.empty()) {  // a wait timed out: reset, so later cases start clean
          std::printf("  -> device error, reset: %s\n", error.c_str());
          ResetCudaWorkspaces();
        }
      }
      rendezvous_->Arrive();
      std::fflush(stdout);
    }
    for (size_t i : drop_cases) DropLastRank(cases[i], inputs[i], i, &call);
    if (!g_cpu && !g_self_test && growth_case >= 0)
      GrowthFails(cases[growth_case], inputs[growth_case], growth_case, &call);
    if (!g_cpu) CHECK_CUDA(cudaStreamDestroy(stream_));
  }

 private:
  struct Buffers {
    void* x[kInputSets] = {};
    void* w = nullptr;
    void* out = nullptr;
    void* gathered = nullptr;
    void* row_scale[kInputSets] = {};  // FP8: set s's scales of the call's rows
    void* col_scale = nullptr;
    size_t out_elems = 0, gathered_elems = 0;
  };

  void DropLastRank(const Case& c, const Inputs& in, size_t index, uint64_t* call) {
    opts_.callsite = static_cast<int64_t>(index) + 1;
    Buffers b = Allocate(c, in);
    const int dropped = tp_ - 1;
    int bad = Call(c, b, (*call)++, in, /*check=*/true);
    const CallOptions saved = opts_;
    opts_.drop_rank = dropped;
    opts_.timeout_us = 300'000;
    // Every rank enters the failing call together: a rank still computing the host reference of
    // the checked call above (up to ~1 s) would make its peers time out waiting for it, a true
    // report that names that rank instead of the silent one.
    rendezvous_->Arrive();
    const auto t0 = std::chrono::steady_clock::now();
    std::string error = CallStatus(c, b);  // CPU: the waits fail in this call
    if (!g_cpu) {
      // Never a silent wrong answer: every output element of the failed call is NaN or right.
      CHECK_CUDA(cudaStreamSynchronize(stream_));
      std::vector<uint16_t> out(b.out_elems), gathered;
      Download(out.data(), b.out, out.size() * 2);
      if (b.gathered) gathered = DownloadOperands(b.gathered, b.gathered_elems, c);
      if (Compare(c, in, 0, out, gathered, *call - 1, /*nan_ok=*/true) != 0) {
        std::printf("  FAIL rank %d, %s, rank %d silent: finite wrong outputs\n", rank_, Describe(c, tp_).c_str(),
                    dropped);
        ++bad;
      }
    }
    rendezvous_->Arrive();
    const std::string next = CallStatus(c, b);  // GPU: the next call reports the device's error
    if (error.empty()) error = next;
    *call += 2;  // the same count on every rank, whatever failed
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    opts_ = saved;
    // Each rank's error names its own wait, for the silent rank ("(rank r waited ... rank 7"),
    // before any cause it gave up for (" because a wait ... had timed out first (rank q ...").
    const std::string who = "rank " + std::to_string(dropped);
    const std::string own = error.substr(0, error.find(" because "));
    const bool named = error.find("timed out") != std::string::npos &&
                       (g_cpu || own.find("(rank " + std::to_string(rank_) + " ") != std::string::npos) &&
                       own.find(who) != std::string::npos;
    if (rank_ != dropped && (!named || s > 10.0)) {
      std::printf("  FAIL rank %d, %s, rank %d silent: %.2f s, error: %s\n", rank_, Describe(c, tp_).c_str(), dropped,
                  s, error.empty() ? "(none)" : error.c_str());
      ++bad;
    }
    if (!g_cpu) CHECK_CUDA(cudaStreamSynchronize(stream_));
    Free(b);
    rendezvous_->Arrive();
    if (rank_ == 0) {
      std::printf("%s, rank %d silent: rank 0 failed after %.2f s: %s\n", Describe(c, tp_).c_str(), dropped, s,
                  error.substr(0, 260).c_str());
      g_cpu ? ResetCpuChannels() : ResetCudaWorkspaces();
    }
    rendezvous_->Arrive();
    RightAfterReset(c, in, call, bad);
  }

  // A workspace growth that fails on the last rank (CudaFailNextWorkspaceGrowthForTesting: its
  // allocation fails as if the GPU were out of memory) on a fresh group: every rank's call must
  // fail with an error naming the GPU and the size, and so must the next call (the group is marked
  // failed; its members' views of each other are in doubt: the failed rank has no data area, and
  // a peer pushing into it would fault the GPU, ending this program in CHECK_CUDA); after the reset
  // the case runs right.
  void GrowthFails(const Case& c, const Inputs& in, size_t index, uint64_t* call) {
    opts_.callsite = static_cast<int64_t>(index) + 1;
    rendezvous_->Arrive();
    if (rank_ == 0) {  // a fresh group: its first call grows the data area from nothing
      ResetCudaWorkspaces();
      CudaFailNextWorkspaceGrowthForTesting(tp_ - 1);
    }
    rendezvous_->Arrive();
    Buffers b = Allocate(c, in);
    int bad = 0;
    for (int attempt = 0; attempt < 2; ++attempt) {
      const auto t0 = std::chrono::steady_clock::now();
      const std::string error = CallStatus(c, b);
      CHECK_CUDA(cudaStreamSynchronize(stream_));  // a fault (null peer area) ends the program here
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const bool named = error.find("on GPU 0") != std::string::npos && error.find("MiB") != std::string::npos &&
                         error.find("rank " + std::to_string(tp_ - 1)) != std::string::npos;
      if (!named || s > 10.0) {
        std::printf("  FAIL rank %d, %s, growth failed on rank %d, call %d: %.2f s, error: %s\n", rank_,
                    Describe(c, tp_).c_str(), tp_ - 1, attempt, s, error.empty() ? "(none)" : error.c_str());
        ++bad;
      }
      if (rank_ == 0 && attempt == 0) {
        std::printf("%s, growth failed on rank %d: rank 0: %s\n", Describe(c, tp_).c_str(), tp_ - 1,
                    error.substr(0, 300).c_str());
      }
      rendezvous_->Arrive();
    }
    *call += 2;
    Free(b);
    rendezvous_->Arrive();
    if (rank_ == 0) ResetCudaWorkspaces();
    rendezvous_->Arrive();
    RightAfterReset(c, in, call, bad);
  }

  // After a reset the case runs right again; adds this rank's failed checks (`bad` and that call's).
  void RightAfterReset(const Case& c, const Inputs& in, uint64_t* call, int bad) {
    Buffers b = Allocate(c, in);
    bad += Call(c, b, (*call)++, in, /*check=*/true);
    Free(b);
    if (bad) failures_->fetch_add(bad);
    rendezvous_->Arrive();
    if (rank_ == 0)
      std::printf(failures_->load() ? "  -> failures so far: %d\n" : "  -> ok (and right after the reset)\n",
                  failures_->load());
    std::fflush(stdout);
  }

  // Enqueues one call (inputs: set 0, outputs poisoned) and returns its error message ("" if ok).
  std::string CallStatus(const Case& c, Buffers& b) {
    CallOptions o = opts_;
    o.poison_outputs = true;
    const Status st = Launch(c, b, 0, o);
    return st.ok() ? std::string() : st.message();
  }

  Buffers Allocate(const Case& c, const Inputs& in) {
    Buffers b;
    std::vector<std::vector<uint8_t>> staging;  // FP8 operands' bytes, until the sync below
    for (int s = 0; s < kInputSets; ++s) {
      const auto& x = in.x[s][rank_];
      b.x[s] = Alloc(x.size() * OperandSize(c));
      UploadOperands(b.x[s], x, c, stream_, &staging);
    }
    if (!in.w.empty()) {
      b.w = Alloc(in.w[rank_].size() * OperandSize(c));
      UploadOperands(b.w, in.w[rank_], c, stream_, &staging);
    }
    std::vector<float> row_scale[kInputSets];
    if (c.fp8) {  // ag_matmul's overlap path: every rank's rows' scales; otherwise this rank's
      const bool every_rank = c.op == Op::kAgMatmul && c.path != Path::kDecode;
      for (int s = 0; s < kInputSets; ++s) {
        for (int q = 0; q < tp_; ++q) {
          if (every_rank || q == rank_)
            row_scale[s].insert(row_scale[s].end(), in.row_scale[s][q].begin(), in.row_scale[s][q].end());
        }
        b.row_scale[s] = Alloc(row_scale[s].size() * 4);
        Upload(b.row_scale[s], row_scale[s].data(), row_scale[s].size() * 4, stream_);
      }
      b.col_scale = Alloc(in.col_scale[rank_].size() * 4);
      Upload(b.col_scale, in.col_scale[rank_].data(), in.col_scale[rank_].size() * 4, stream_);
    }
    switch (c.op) {
      case Op::kAgMatmul:
        b.out_elems = tp_ * c.m * c.n;
        b.gathered_elems = c.gathered ? tp_ * c.m * c.k : 0;
        break;
      case Op::kMatmulRs: b.out_elems = c.m / tp_ * c.n; break;
      case Op::kAllGather: b.out_elems = tp_ * c.m * c.n; break;
      case Op::kReduceScatter: b.out_elems = c.m / tp_ * c.n; break;
      case Op::kMatmulAr: b.out_elems = c.m * c.n; break;
      case Op::kAllReduce: b.out_elems = c.m * c.n; break;
    }
    b.out = Alloc(b.out_elems * 2);
    if (b.gathered_elems) b.gathered = Alloc(b.gathered_elems * OperandSize(c));
    if (!g_cpu) CHECK_CUDA(cudaStreamSynchronize(stream_));  // never the device: peers may be spinning
    // No rank launches before every rank has allocated: a cudaMalloc may wait for the work already
    // on the device, which includes a faster rank's kernel spinning for this rank (on one GPU only).
    rendezvous_->Arrive();
    return b;
  }

  static void Free(Buffers& b) {
    for (void* p : b.x) Release(p);
    for (void* p : b.row_scale) Release(p);
    Release(b.w), Release(b.out), Release(b.gathered), Release(b.col_scale);
  }

  Status Launch(const Case& c, Buffers& b, int set, const CallOptions& o) {
    const CommConfig cfg = MakeCommConfig(c, o);
    if (c.op == Op::kAgMatmul) {
      AgMatmulParams p;
      p.x = b.x[set], p.w = b.w, p.out = b.out, p.gathered = b.gathered;
      p.m_local = c.m, p.k = c.k, p.n = c.n, p.dtype = c.dtype, p.w_transposed = c.w_transposed;
      p.fp8.on = c.fp8;
      p.fp8.x_e5m2 = c.x_e5m2;
      p.fp8.row_scale = static_cast<const float*>(b.row_scale[set]);
      p.fp8.col_scale = static_cast<const float*>(b.col_scale);
      return g_cpu ? RunAgMatmulCpu(p, group_, cfg) : RunAgMatmulCuda(p, group_, cfg, stream_);
    }
    if (c.op == Op::kMatmulRs) {
      MatmulRsParams p;
      p.x = b.x[set], p.w = b.w, p.out = b.out;
      p.m = c.m, p.k = c.k, p.n = c.n, p.dtype = c.dtype, p.w_transposed = c.w_transposed;
      p.fp8.on = c.fp8;
      p.fp8.x_e5m2 = c.x_e5m2;
      p.fp8.row_scale = static_cast<const float*>(b.row_scale[set]);
      p.fp8.col_scale = static_cast<const float*>(b.col_scale);
      return g_cpu ? RunMatmulRsCpu(p, group_, cfg) : RunMatmulRsCuda(p, group_, cfg, stream_);
    }
    if (c.op == Op::kMatmulAr) {
      MatmulArParams p;
      p.x = b.x[set], p.w = b.w, p.out = b.out;
      p.m = c.m, p.k = c.k, p.n = c.n, p.dtype = c.dtype, p.w_transposed = c.w_transposed;
      p.fp8.on = c.fp8;
      p.fp8.row_scale = static_cast<const float*>(b.row_scale[set]);
      p.fp8.col_scale = static_cast<const float*>(b.col_scale);
      return g_cpu ? RunMatmulArCpu(p, group_, cfg) : RunMatmulArCuda(p, group_, cfg, stream_);
    }
    CollectiveParams p;
    p.x = b.x[set], p.out = b.out, p.rows = c.m, p.cols = c.n, p.dtype = c.dtype;
    if (c.op == Op::kAllGather)
      return g_cpu ? RunAllGatherCpu(p, group_, cfg) : RunAllGatherCuda(p, group_, cfg, stream_);
    if (c.op == Op::kAllReduce)
      return g_cpu ? RunAllReduceCpu(p, group_, cfg) : RunAllReduceCuda(p, group_, cfg, stream_);
    return g_cpu ? RunReduceScatterCpu(p, group_, cfg) : RunReduceScatterCuda(p, group_, cfg, stream_);
  }

  // Enqueues call number `call` (inputs: set call % kInputSets); with `check`, waits and compares.
  // Returns the number of failed properties.
  int Call(const Case& c, Buffers& b, uint64_t call, const Inputs& in, bool check) {
    const int set = static_cast<int>(call % kInputSets);
    CallOptions o = opts_;
    o.poison_outputs = check;
    const int stale = (set + 1) % kInputSets;
    const Status st = Launch(c, b, g_self_test && rank_ == tp_ - 1 ? stale : set, o);
    if (!st.ok()) {
      std::printf("  FAIL rank %d call %llu: %s\n", rank_, static_cast<unsigned long long>(call), st.message().c_str());
      return 1;
    }
    if (!check) return 0;
    if (!g_cpu) CHECK_CUDA(cudaStreamSynchronize(stream_));
    std::vector<uint16_t> out(b.out_elems), gathered;
    Download(out.data(), b.out, out.size() * 2);
    if (b.gathered) gathered = DownloadOperands(b.gathered, b.gathered_elems, c);
    if (c.op != Op::kMatmulAr) return Compare(c, in, set, out, gathered, call);
    // matmul_ar: rank 0 against the reference, the others bit for bit against rank 0, and each
    // takes rank 0's verdict too (the same bits as a wrong output are wrong: a wrong input on one
    // rank makes every rank's output the same wrong sum).
    g_outputs[rank_] = out;
    rendezvous_->Arrive();
    if (rank_ == 0) g_rank0_bad = Compare(c, in, set, out, gathered, call);
    rendezvous_->Arrive();  // rank 0's verdict is out
    int bad = g_rank0_bad;
    if (rank_ != 0 && out != g_outputs[0]) {
      size_t first = 0;
      while (out[first] == g_outputs[0][first]) ++first;
      std::printf("  FAIL rank %d call %llu (%s): output differs from rank 0's (first at %zu: %g, rank 0 %g)\n", rank_,
                  static_cast<unsigned long long>(call), Describe(c, tp_).c_str(), first, ToFloat(out[first], c.dtype),
                  ToFloat(g_outputs[0][first], c.dtype));
      bad = 1;
    }
    rendezvous_->Arrive();  // rank 0's output stays until every rank compared
    return bad;
  }

  // The accumulation term of the tolerance, per unit of sum |x| |w| (file comment).
  static double AccumulationTolerance(const Case& c) { return std::ldexp(1.0, c.fp8 ? -10 : -14); }

  // Failed properties of one call's output (0 or 1); nan_ok: NaN elements pass (a failed call).
  int Compare(const Case& c, const Inputs& in, int set, const std::vector<uint16_t>& out,
              const std::vector<uint16_t>& gathered, uint64_t call, bool nan_ok = false) const {
    const auto& xs = in.x[set];
    const double eps = c.dtype == DType::kF16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
    int64_t bad = 0, first = -1;
    double got_first = 0, want_first = 0;
    auto expect = [&](int64_t i, double got, double want, double tol) {
      if (nan_ok && std::isnan(got)) return;
      if (!(std::fabs(got - want) <= tol)) {  // NaN (poison) fails
        if (first < 0) first = i, got_first = got, want_first = want;
        ++bad;
      }
    };
    const int64_t rpr = c.m / tp_;  // matmul_rs / reduce_scatter rows per rank
    switch (c.op) {
      case Op::kAgMatmul:
        for (int64_t row = 0; row < tp_ * c.m; ++row) {
          for (int64_t col = 0; col < c.n; ++col) {
            const Ref r = ScaledDot(c, in, set, static_cast<int>(row / c.m), row % c.m, rank_, col);
            expect(row * c.n + col, ToFloat(out[row * c.n + col], c.dtype), r.value,
                   eps * (std::fabs(r.value) + r.partials) + AccumulationTolerance(c) * r.magnitude);
          }
        }
        for (size_t i = 0; i < gathered.size(); ++i) {  // the gathered rows: bit for bit
          const int64_t row = static_cast<int64_t>(i) / c.k;
          if (nan_ok && OperandIsNan(gathered[i], c)) continue;
          if (gathered[i] != xs[row / c.m][(row % c.m) * c.k + static_cast<int64_t>(i) % c.k]) {
            if (first < 0) first = static_cast<int64_t>(out.size() + i);
            ++bad;
          }
        }
        break;
      case Op::kMatmulRs:
        for (int64_t row = 0; row < rpr; ++row) {
          for (int64_t col = 0; col < c.n; ++col) {
            Ref sum;
            for (int q = 0; q < tp_; ++q) {
              const Ref r = ScaledDot(c, in, set, q, rank_ * rpr + row, q, col);
              sum.value += r.value, sum.partials += r.partials, sum.magnitude += r.magnitude;
            }
            expect(row * c.n + col, ToFloat(out[row * c.n + col], c.dtype), sum.value,
                   eps * (std::fabs(sum.value) + sum.partials) + AccumulationTolerance(c) * sum.magnitude);
          }
        }
        break;
      case Op::kAllGather:
        for (size_t i = 0; i < out.size(); ++i) {
          const int64_t row = static_cast<int64_t>(i) / c.n;
          const uint16_t want = xs[row / c.m][(row % c.m) * c.n + static_cast<int64_t>(i) % c.n];
          if (nan_ok && std::isnan(ToFloat(out[i], c.dtype))) continue;
          expect(static_cast<int64_t>(i), out[i], want, 0);
        }
        break;
      case Op::kMatmulAr:
        for (int64_t row = 0; row < c.m; ++row) {
          for (int64_t col = 0; col < c.n; ++col) {
            Ref sum;
            for (int q = 0; q < tp_; ++q) {
              const Ref r = ScaledDot(c, in, set, q, row, q, col);
              sum.value += r.value, sum.partials += r.partials, sum.magnitude += r.magnitude;
            }
            expect(row * c.n + col, ToFloat(out[row * c.n + col], c.dtype), sum.value,
                   eps * (std::fabs(sum.value) + sum.partials) + AccumulationTolerance(c) * sum.magnitude);
          }
        }
        break;
      case Op::kAllReduce:
        for (size_t i = 0; i < out.size(); ++i) {
          float sum = 0.f;  // rank order, float32, rounded once: the same bits on every rank
          for (int q = 0; q < tp_; ++q) sum += ToFloat(xs[q][i], c.dtype);
          if (nan_ok && std::isnan(ToFloat(out[i], c.dtype))) continue;
          expect(static_cast<int64_t>(i), out[i], FromFloat(sum, c.dtype), 0);
        }
        break;
      case Op::kReduceScatter:
        for (size_t i = 0; i < out.size(); ++i) {
          float sum = 0.f;
          for (int q = 0; q < tp_; ++q) sum += ToFloat(xs[q][rank_ * rpr * c.n + i], c.dtype);
          if (nan_ok && std::isnan(ToFloat(out[i], c.dtype))) continue;
          expect(static_cast<int64_t>(i), out[i], FromFloat(sum, c.dtype), 0);
        }
        break;
    }
    if (bad && !g_self_test) {
      std::printf("  FAIL rank %d call %llu (%s): %lld of %zu elements off (first at %lld: %g, want %g)\n", rank_,
                  static_cast<unsigned long long>(call), Describe(c, tp_).c_str(), static_cast<long long>(bad),
                  out.size() + gathered.size(), static_cast<long long>(first), got_first, want_first);
    }
    return bad ? 1 : 0;
  }

  int rank_, tp_;
  Rendezvous* rendezvous_;
  std::atomic<int>* failures_;
  TpGroup group_;
  CallOptions opts_;
  cudaStream_t stream_ = nullptr;
};

// Cases (indices into CasesFor) rerun with a silent rank: each path's bounded waits, and the
// gathered output of both ag_matmul paths (4, 7, and FP8 28: NaN or right, never an earlier call's
// rows); 33: matmul_ar's decode path; 37 and 40: the FP8 decode GEMM's exchanges; 44: the FP8
// decode push (rows and their scales, own rows first), gathered rows NaN or right; 46: the decode
// GEMM's 256-row tile.
const std::vector<size_t> kDropCases = {0, 4, 5, 7, 8, 13, 14, 16, 18, 20, 23, 28, 33, 37, 40, 44, 46};
// The case whose first call on a fresh group meets a failing workspace growth.
constexpr size_t kGrowthCase = 8;

std::vector<Case> CasesFor(int tp) {
  // m_local / M per rank count are chosen so that the host references stay under a second.
  const int64_t ag_m = 1024 / tp;  // 1024 gathered rows
  std::vector<Case> cases = {
      {Op::kAgMatmul, Path::kOverlap, ag_m, 512, 768},
      {Op::kAgMatmul, Path::kOverlap, ag_m - 24, 1032, 520},  // rows not whole 128-row tiles, tails
      {Op::kAgMatmul, Path::kOverlap, ag_m, 256, 1024, DType::kF16},
      {Op::kAgMatmul, Path::kOverlap, ag_m, 768, 512, DType::kBF16, /*w_transposed=*/true},
      {Op::kAgMatmul, Path::kOverlap, ag_m, 512, 640, DType::kF16, /*w_transposed=*/true},
      {Op::kAgMatmul, Path::kOverlap, ag_m, 384, 256, DType::kBF16, false, /*gathered=*/true},
      {Op::kAgMatmul, Path::kDecode, 64 / tp, 1024, 2048},
      {Op::kAgMatmul, Path::kDecode, 256 / tp, 2048, 1024},
      {Op::kAgMatmul, Path::kDecode, 8, 776, 1544, DType::kBF16, false, true},
      {Op::kMatmulRs, Path::kOverlap, 1024, 512, 768},
      {Op::kMatmulRs, Path::kOverlap, 1000 / tp * tp, 1032, 520},
      {Op::kMatmulRs, Path::kOverlap, 1024, 256, 1024, DType::kF16},
      {Op::kMatmulRs, Path::kOverlap, 1024, 768, 512, DType::kBF16, /*w_transposed=*/true},
      {Op::kMatmulRs, Path::kOverlap, 1024, 512, 640, DType::kF16, /*w_transposed=*/true},
      {Op::kMatmulRs, Path::kDecode, 16, 2048, 512},
      {Op::kMatmulRs, Path::kDecode, 64, 1024, 2048},
      {Op::kMatmulRs, Path::kDecode, 128, 512, 1024},
      {Op::kMatmulRs, Path::kDecode, 104, 776, 1544},
      {Op::kAllGather, Path::kCollective, 64, 0, 4096},
      {Op::kAllGather, Path::kCollective, 40, 0, 1032, DType::kF16},
      {Op::kReduceScatter, Path::kCollective, 128, 0, 2048},
      {Op::kReduceScatter, Path::kCollective, 8 * tp, 0, 8200, DType::kF16},
      {Op::kAllReduce, Path::kCollective, 16, 0, 4096},
      {Op::kAllReduce, Path::kCollective, 3, 0, 1032, DType::kF16},
      {Op::kAllReduce, Path::kCollective, 256, 0, 8192},  // 4 MiB a rank: many blocks, big slots
      {Op::kMatmulAr, Path::kOverlap, 1, 1024, 2048},
      {Op::kMatmulAr, Path::kOverlap, 64, 512, 1024, DType::kF16},
      {Op::kMatmulAr, Path::kOverlap, 96, 520, 1032},  // a partial row tile, K and N tails
      {Op::kMatmulAr, Path::kOverlap, 128, 768, 512, DType::kBF16, /*w_transposed=*/true},
      // FP8 (e4m3 x and w^T, row and column scales, bf16 out).
      {Op::kAgMatmul, Path::kOverlap, ag_m, 1024, 768, DType::kBF16, true, false, /*fp8=*/true},
      {Op::kAgMatmul, Path::kOverlap, ag_m, 768, 512, DType::kBF16, true, /*gathered=*/true, /*fp8=*/true},
      {Op::kAgMatmul, Path::kOverlap, 200, 512, 520, DType::kBF16, true, false, /*fp8=*/true},  // 200: no 128-row tiles
      {Op::kMatmulRs, Path::kOverlap, 1024, 1024, 1024, DType::kBF16, true, false, /*fp8=*/true},
      // e5m2 x (the backward's dy rows) and e4m3 w^T: the e5m2 x e4m3 instance.
      {Op::kAgMatmul, Path::kOverlap, ag_m, 1024, 768, DType::kBF16, true, /*gathered=*/true, true, /*x_e5m2=*/true},
      {Op::kMatmulRs, Path::kOverlap, 1024, 768, 1024, DType::kBF16, true, false, /*fp8=*/true, /*x_e5m2=*/true},
      // matmul_ar's decode path (bf16, [K, N] weight, <= 128 rows): the epilogue's one-shot all-reduce.
      {Op::kMatmulAr, Path::kDecode, 1, 1024, 2048},  // one row: x staged into a whole row tile
      {Op::kMatmulAr, Path::kDecode, 64, 2048, 1024},
      {Op::kMatmulAr, Path::kDecode, 128, 512, 512},   // two blocks of 64 rows
      {Op::kMatmulAr, Path::kDecode, 100, 776, 1544},  // 64 + 36 rows, K and N tails
      // FP8 decode GEMM (e4m3 x and w^T, w's scales along the tile's M, x's along its N): matmul_rs's
      // reduce-scatter and matmul_ar's all-reduce in its epilogue; x staged where its rows are not
      // whole tiles, the row scales predicated past the last row; ag_matmul's push kernel moves
      // each rank's row scales with its rows.
      {Op::kMatmulRs, Path::kDecode, 64, 1024, 2048, DType::kBF16, true, false, /*fp8=*/true},
      {Op::kMatmulRs, Path::kDecode, 104, 784, 1544, DType::kBF16, true, false, /*fp8=*/true},  // 64 + 40 rows
      {Op::kMatmulAr, Path::kDecode, 1, 1024, 2048, DType::kBF16, true, false, /*fp8=*/true},
      {Op::kMatmulAr, Path::kDecode, 128, 512, 512, DType::kBF16, true, false, /*fp8=*/true},
      {Op::kMatmulAr, Path::kDecode, 100, 784, 1544, DType::kBF16, true, false, /*fp8=*/true},
      // matmul_ar's overlap path on FP8 operands: the FP8 GEMM, then the all_reduce kernel.
      {Op::kMatmulAr, Path::kOverlap, 96, 528, 1032, DType::kBF16, true, false, /*fp8=*/true},
      {Op::kAgMatmul, Path::kDecode, 64 / tp, 1024, 2048, DType::kBF16, true, false, /*fp8=*/true},
      {Op::kAgMatmul, Path::kDecode, 256 / tp, 2048, 1024, DType::kBF16, true, /*gathered=*/true, /*fp8=*/true},
      {Op::kAgMatmul, Path::kDecode, 8, 784, 1544, DType::kBF16, true, false, /*fp8=*/true},
      // 192 gathered rows, 64 weight-column tiles: 128 tiles of 128 rows exceed a rank's SMs at
      // every tp here, so one 256-row tile per column tile runs (UseDecodeRowTile256); a K tail.
      {Op::kAgMatmul, Path::kDecode, 192 / tp, 520, 4096},
  };
  return cases;
}

// CUDA_DEVICE_MAX_CONNECTIONS below 2 * tp with every rank on one GPU: the fused calls must fail
// at once, every rank, with an error that names the setting and the value needed (not deadlock
// into timeouts). Returns the number of ranks that did not.
int CheckQueues(const Case& c, int tp) {
  std::atomic<int> bad{0};
  const Inputs in = MakeInputs(c, tp, 1);
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r) {
    threads.emplace_back([&, r] {
      CHECK_CUDA(cudaSetDevice(0));
      cudaStream_t stream;
      CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      TpGroup group;
      group.rank = r;
      group.size = tp;
      for (int q = 0; q < tp; ++q) {
        group.devices.push_back(1000 * tp + q);
        group.processes.push_back(0);
        group.ordinals.push_back(0);
      }
      CommConfig cfg;
      cfg.timeout_us = kTimeoutUs;
      void *x = nullptr, *w = nullptr, *out = nullptr;
      CHECK_CUDA(cudaMalloc(&x, in.x[0][r].size() * 2));
      CHECK_CUDA(cudaMalloc(&w, in.w[r].size() * 2));
      CHECK_CUDA(cudaMalloc(&out, tp * c.m * c.n * 2));
      AgMatmulParams p;
      p.x = x, p.w = w, p.out = out, p.m_local = c.m, p.k = c.k, p.n = c.n, p.dtype = c.dtype;
      const auto t0 = std::chrono::steady_clock::now();
      const Status st = RunAgMatmulCuda(p, group, cfg, stream);
      CHECK_CUDA(cudaStreamSynchronize(stream));
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const std::string needed = "CUDA_DEVICE_MAX_CONNECTIONS=" + std::to_string(2 * tp);
      if (st.ok() || st.message().find(needed) == std::string::npos || s > 1.0) {
        std::printf("  FAIL rank %d: CUDA_DEVICE_MAX_CONNECTIONS=%s, tp %d: %.2f s, %s\n", r,
                    std::getenv("CUDA_DEVICE_MAX_CONNECTIONS"), tp, s, st.ok() ? "no error" : st.message().c_str());
        bad.fetch_add(1);
      } else if (r == 0) {
        std::printf("tp %d, CUDA_DEVICE_MAX_CONNECTIONS=%s: every call fails at once: %s\n", tp,
                    std::getenv("CUDA_DEVICE_MAX_CONNECTIONS"), st.message().substr(0, 200).c_str());
      }
      cudaFree(x), cudaFree(w), cudaFree(out);
      CHECK_CUDA(cudaStreamDestroy(stream));
    });
  }
  for (auto& t : threads) t.join();
  return bad.load();
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> tps = {2, 4, 8};
  std::string only_op, only_path;  // filters: e.g. --op=matmul_rs --path=decode
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--cpu") == 0) {
      g_cpu = true;
    } else if (std::strcmp(argv[i], "--self-test") == 0) {
      g_self_test = true;
    } else if (std::strncmp(argv[i], "--op=", 5) == 0) {
      only_op = argv[i] + 5;
    } else if (std::strncmp(argv[i], "--path=", 7) == 0) {
      only_path = argv[i] + 7;
    } else if (std::strncmp(argv[i], "--gemm-kernel=", 14) == 0) {
      g_gemm_kernel = ForcedKernel(argv[i] + 14);
      if (g_gemm_kernel == GemmKernel::kAuto) {
        std::fprintf(stderr,
                     "--gemm-kernel: 128x256, 128x224, 128x192, 128x160_c2x1, 128x128_pp_c2x1, 128x320_c2x1, "
                     "128x160_pp_c2x1 or 128x192_pp_c2x1\n");
        return 2;
      }
    } else if (std::strncmp(argv[i], "--rs-tile-signal=", 17) == 0) {
      g_rs_tile_signal = std::atoi(argv[i] + 17);
      if (g_rs_tile_signal < -1 || g_rs_tile_signal > 2) {
        std::fprintf(stderr, "--rs-tile-signal: -1 (by shape), 0, 1 or 2\n");
        return 2;
      }
    } else if (std::strncmp(argv[i], "--tile-group-m=", 15) == 0) {
      g_tile_group_m = std::atoi(argv[i] + 15);
      if (g_tile_group_m < 1 || g_tile_group_m > 64) {
        std::fprintf(stderr, "--tile-group-m: 1 to 64 row tiles\n");
        return 2;
      }
    } else if (std::strncmp(argv[i], "--tile-serpentine=", 18) == 0) {
      g_tile_serpentine = std::atoi(argv[i] + 18);
      if (g_tile_serpentine < 0 || g_tile_serpentine > 1) {
        std::fprintf(stderr, "--tile-serpentine: 0 or 1\n");
        return 2;
      }
    } else if (std::strncmp(argv[i], "--tp=", 5) == 0) {
      tps = {std::atoi(argv[i] + 5)};
      if (tps[0] < 2 || tps[0] > 8) {
        std::fprintf(stderr, "--tp: 2 to 8 ranks\n");
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--cpu] [--self-test] [--tp=N] [--op=ag_matmul|matmul_rs|all_gather|reduce_scatter] "
                   "[--path=overlap|decode|collective] [--gemm-kernel=NAME] [--rs-tile-signal=N] [--tile-group-m=G] "
                   "[--tile-serpentine=S]\n",
                   argv[0]);
      return 2;
    }
  }
  if (!g_cpu) {
    SetUpProcess(*std::max_element(tps.begin(), tps.end()), kStreamsPerRank);  // before any CUDA call
    CHECK_CUDA(cudaSetDevice(0));
  }
  std::atomic<int> failures{0};
  size_t ran = 0;
  for (int tp : tps) {
    const std::vector<Case> all = CasesFor(tp);
    std::vector<size_t> picked = {0, 5, 8, 13, 16, 18, 28, 30};  // --self-test: one case per op and path, FP8
    if (!g_self_test) {
      picked.clear();
      for (size_t i = 0; i < all.size(); ++i) picked.push_back(i);
    }
    if (!g_cpu && std::atoi(std::getenv("CUDA_DEVICE_MAX_CONNECTIONS")) < 2 * tp) {
      failures += CheckQueues(all[0], tp);
      continue;
    }
    std::vector<Case> cases;
    std::vector<size_t> drops;
    int growth = -1;
    for (size_t i : picked) {
      const std::string what = Describe(all[i], tp);
      if (what.find(" " + only_op + " ") == std::string::npos && !only_op.empty()) continue;
      if (what.find(" " + only_path + " ") == std::string::npos && !only_path.empty()) continue;
      if (!HasForcedInstance(all[i], g_gemm_kernel)) continue;
      for (size_t d : kDropCases) {
        if (d == i && !g_self_test) drops.push_back(cases.size());
      }
      if (i == kGrowthCase) growth = static_cast<int>(cases.size());
      cases.push_back(all[i]);
    }
    std::vector<Inputs> inputs;
    for (size_t i = 0; i < cases.size(); ++i) inputs.push_back(MakeInputs(cases[i], tp, 1000 * tp + i));
    Rendezvous rendezvous(tp);
    g_outputs.assign(tp, {});
    std::vector<std::thread> threads;
    for (int r = 0; r < tp; ++r) {
      threads.emplace_back([&, r] {
        RankThread t(r, tp, &rendezvous, &failures);
        t.Run(cases, inputs, drops, growth);
      });
    }
    for (auto& t : threads) t.join();
    ran += cases.size();
  }
  if (ran == 0) {
    std::printf("no case matches --op=%s --path=%s (and the forced GEMM instance)\n", only_op.c_str(),
                only_path.c_str());
    return 2;
  }
  if (g_self_test) {
    std::printf(failures ? "SELF-TEST FAILED: %d rank-cases passed a wrong input\n"
                         : "self-test ok: every checked call on a wrong input failed on every rank\n",
                failures.load());
  } else {
    std::printf(failures ? "FAILED: %d\n" : "all ok\n", failures.load());
  }
  return failures ? 1 : 0;
}
