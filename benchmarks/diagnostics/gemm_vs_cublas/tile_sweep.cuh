// Shared by tile_sweep's translation units (tile_sweep.cu: main; tile_sweep_bf16.cu, tile_sweep_fp8.cu: one section
// each, compiled in parallel since each instantiates several CUTLASS kernels): the sections' entry points and the
// driver that checks and times a reference and plain CUTLASS configurations on each shape.
#pragma once

#include <cmath>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <cuda_profiler_api.h>

#include "cublas_loader.cuh"
#include "nvml_energy.cuh"

// One GEMM of the sweep: M x K x N (a plain struct: cublas_loader.cuh's Shape is internal to each translation unit).
struct SweepShape {
  int m, k, n;
};

// bf16 (cuBLAS) and FP8 (cuBLASLt) sections: print SWEEP lines for every shape.
void SweepBf16(const std::vector<SweepShape>& shapes);
void SweepFp8(const std::vector<SweepShape>& shapes);

namespace {

// A GEMM ready to run on one shape (empty: CUTLASS rejected the problem or the reference is missing).
using Runner = std::function<void()>;

// Scheduler settings tried for every configuration: max swizzle 1 and 8, raster AlongN (our kernel's order) and the
// persistent scheduler's heuristic (AlongM when the problem has more N tiles than M tiles).
struct Variant {
  int swizzle;
  bool heuristic;
  const char* name;
};
constexpr Variant kVariants[] = {{1, false, "sw1,N"}, {8, false, "sw8,N"}, {1, true, "sw1,H"}, {8, true, "sw8,H"}};
constexpr int kNumVariants = 4;

// Plain CUTLASS GEMM I on (m, n, k) over packed a, b, d with variant v, initialized on ws (the persistent scheduler
// needs none, but CUTLASS asks).
template <class I>
Runner MakePlain(int m, int n, int k, const typename I::Kernel::ElementA* a, const typename I::Kernel::ElementB* b,
                 E* d, void* ws, size_t ws_bytes, Variant v) {
  using K = typename I::Kernel;
  auto args = PlainArguments<K>(m, n, k, a, b, d);
  args.scheduler.max_swizzle_size = v.swizzle;
  using R = typename K::TileScheduler::RasterOrderOptions;
  args.scheduler.raster_order = v.heuristic ? R::Heuristic : R::AlongN;
  auto g = std::make_shared<typename I::Gemm>();
  if (g->can_implement(args) != cutlass::Status::kSuccess || I::Gemm::get_workspace_size(args) > ws_bytes ||
      g->initialize(args, ws) != cutlass::Status::kSuccess)
    return {};
  return [g] { g->run(); };
}

// A configuration of a section: its name and its runner for a shape and variant (on the section's buffers, output d).
struct Config {
  const char* name;
  std::function<Runner(const SweepShape&, Variant)> make;
};

// Profile mode (SWEEP_PROFILE=<n> in the environment): instead of the timing loops, each column runs once unprofiled,
// then n times between cudaProfilerStart and cudaProfilerStop, and prints `PROFILED <section> <MxKxN> <column> <n>`,
// columns in order. Under `ncu --profile-from-start off` (or any profiler that honours those calls) the profile then
// holds exactly the timed columns' GEMM kernels, n per column, in the order of the PROFILED lines: a kernel-time
// method for each configuration, the reference included, that needs no kernel names.
inline int ProfileLaunches() {
  const char* v = std::getenv("SWEEP_PROFILE");
  return v == nullptr ? 0 : std::max(0, std::atoi(v));
}

inline void ProfileColumn(const char* section, const char* mkn, const char* ref_name,
                          const std::function<Runner(const SweepShape&, E*)>& make_ref,
                          const std::vector<Config>& configs, const SweepShape& s, E* ref_d, int col, int launches) {
  Runner r;
  std::string name = ref_name;
  if (col == 0) {
    r = make_ref(s, ref_d);
  } else {
    const int c = (col - 1) / kNumVariants;
    const Variant& v = kVariants[(col - 1) % kNumVariants];
    r = configs[c].make(s, v);
    name = std::string(configs[c].name) + "[" + v.name + "]";
  }
  if (!r) return;
  r();
  if (cudaDeviceSynchronize() != cudaSuccess) return;
  cudaProfilerStart();
  for (int i = 0; i < launches; ++i) r();
  const cudaError_t err = cudaDeviceSynchronize();
  cudaProfilerStop();
  printf("PROFILED %s %s %s %d%s\n", section, mkn, name.c_str(), launches,
         err == cudaSuccess ? "" : cudaGetErrorString(err));
  fflush(stdout);
}

// Energy mode (SWEEP_ENERGY=<seconds> in the environment): instead of the timing loops, the reference and each
// configuration in one variant (SWEEP_VARIANT: sw1,N / sw8,N / sw1,H / sw8,H, default sw8,N) run back to back for
// <seconds> each at the power cap (nvml_energy.cuh), in two passes, the second in reverse column order. Prints each
// configuration's check, `CHECK <section> <MxKxN> <config> [REJECTED | FAILED] <max |diff| / max |value|>`, then per
// column `ENERGY <section> <MxKxN> <column> <us> <mJ> <W> <time ratio> <energy ratio> passes <us> <us>`: per call,
// the mean of the two passes, ratios to the reference's, then each pass's time (a spread above ~1% leaves a
// difference that small unresolved).
inline double EnergySeconds() {
  const char* v = std::getenv("SWEEP_ENERGY");
  return v == nullptr ? 0.0 : std::max(0.0, std::atof(v));
}

inline Variant EnergyVariant() {
  const char* v = std::getenv("SWEEP_VARIANT");
  for (const Variant& k : kVariants)
    if (v != nullptr && std::string(v) == k.name) return k;
  return kVariants[1];
}

inline void EnergyColumns(const char* section, const char* mkn, const char* ref_name,
                          const std::function<Runner(const SweepShape&, E*)>& make_ref,
                          const std::vector<Config>& configs, const SweepShape& s, E* ref_d, int iters,
                          double seconds) {
  static NvmlEnergy nvml;
  static const bool have_nvml = nvml.Load();
  if (!have_nvml) {
    printf("ENERGY %s %s: NVML's energy counter is not readable here\n", section, mkn);
    return;
  }
  const Variant v = EnergyVariant();
  const int ncol = 1 + static_cast<int>(configs.size());
  std::vector<std::string> names(ncol, ref_name);
  std::vector<EnergyPerCall> got[2];
  for (int pass = 0; pass < 2; ++pass) {
    got[pass].resize(ncol);
    for (int i = 0; i < ncol; ++i) {
      const int col = pass == 0 ? i : ncol - 1 - i;
      Runner r = col == 0 ? make_ref(s, ref_d) : configs[col - 1].make(s, v);
      if (col > 0) names[col] = std::string(configs[col - 1].name) + "[" + v.name + "]";
      got[pass][col] = r ? SustainedEnergy(r, iters, seconds, nvml) : EnergyPerCall{0, 0, 0, "not implemented"};
    }
  }
  auto mean = [&](int col, double EnergyPerCall::* f) { return (got[0][col].*f + got[1][col].*f) / 2; };
  for (int col = 0; col < ncol; ++col) {
    const char* error = got[0][col].error ? got[0][col].error : got[1][col].error;
    if (error != nullptr) {
      printf("ENERGY %s %s %s: %s\n", section, mkn, names[col].c_str(), error);
      continue;
    }
    const bool ref_ok = got[0][0].error == nullptr && got[1][0].error == nullptr;
    printf("ENERGY %s %s %s %.1f %.2f %.0f %.3f %.3f passes %.1f %.1f\n", section, mkn, names[col].c_str(),
           mean(col, &EnergyPerCall::us), mean(col, &EnergyPerCall::mj), mean(col, &EnergyPerCall::w),
           ref_ok ? mean(col, &EnergyPerCall::us) / mean(0, &EnergyPerCall::us) : 0.0,
           ref_ok ? mean(col, &EnergyPerCall::mj) / mean(0, &EnergyPerCall::mj) : 0.0, got[0][col].us, got[1][col].us);
  }
  fflush(stdout);
}

// The configurations whose names appear in SWEEP_CONFIGS (a comma-separated list of exact names), or all of them.
inline std::vector<Config> SelectedConfigs(const std::vector<Config>& configs) {
  const char* list = std::getenv("SWEEP_CONFIGS");
  if (list == nullptr || *list == '\0') return configs;
  const std::string wanted = std::string(",") + list + ",";
  std::vector<Config> selected;
  for (const Config& c : configs)
    if (wanted.find(std::string(",") + c.name + ",") != std::string::npos) selected.push_back(c);
  return selected;
}

// Checks and times, on every shape, the reference (writes D into its argument) and every configuration in every
// variant. Check: the reference into ref_d and each variant into d, both poisoned first (0xff bytes: NaN), max |diff|
// / max |value| over all variants of a configuration, FAILED above 2e-2. Timing: BestUsPerCall with iterations for
// about 3 ms of GPU work per loop (at tflops, a guess of the reachable rate), two passes, the second in reverse
// column order so that drifting clocks favour no column, the minimum of both per column. Prints per shape the
// reference's line, one SWEEP line per configuration (its best variant in brackets), one SWEEPV line with every
// variant's time and a BEST line.
void RunSweep(const char* section, const char* ref_name, const std::vector<SweepShape>& shapes, double tflops,
              const std::function<Runner(const SweepShape&, E*)>& make_ref, const std::vector<Config>& all_configs,
              E* d, E* ref_d, unsigned* acc) {
  const std::vector<Config> configs = SelectedConfigs(all_configs);
  const int ncfg = static_cast<int>(configs.size());
  const int ncol = 1 + ncfg * kNumVariants;  // column 0: the reference; then configuration-major
  for (const SweepShape& s : shapes) {
    const size_t mn = (size_t)s.m * s.n;
    const double est_us = 2.0 * s.m * s.n * s.k / (tflops * 1e6);
    const int iters = std::max(2, std::min(2000, (int)(3000.0 / est_us)));
    char mkn[48];
    snprintf(mkn, sizeof mkn, "%dx%dx%d", s.m, s.k, s.n);

    // Check on the same inputs, outputs poisoned.
    cudaMemset(ref_d, 0xff, mn * 2);
    Runner ref_check = make_ref(s, ref_d);
    if (ref_check) ref_check();
    bool have_ref = ref_check && cudaDeviceSynchronize() == cudaSuccess;
    std::vector<float> diff(ncfg, 0.f);
    std::vector<int> implemented(ncfg, 0);
    for (int c = 0; c < ncfg; ++c) {
      for (const Variant& v : kVariants) {
        Runner r = configs[c].make(s, v);
        if (!r) continue;
        ++implemented[c];
        cudaMemset(d, 0xff, mn * 2);
        r();
        const cudaError_t err = cudaDeviceSynchronize();
        if (err != cudaSuccess)
          printf("%s %s %s %s: %s\n", section, mkn, configs[c].name, v.name, cudaGetErrorString(err));
        if (have_ref) {
          const float rd = RelativeDiff(d, ref_d, mn, acc);
          diff[c] = std::max(diff[c], std::isnan(rd) ? INFINITY : rd);
        }
      }
    }

    if (const double seconds = EnergySeconds(); seconds > 0) {
      for (int c = 0; c < ncfg; ++c)
        printf("CHECK %s %s %s %s%.1e\n", section, mkn, configs[c].name,
               implemented[c] == 0   ? "REJECTED "
               : !have_ref           ? "no reference "
               : !(diff[c] <= 2e-2f) ? "FAILED "
                                     : "",
               diff[c]);
      EnergyColumns(section, mkn, ref_name, make_ref, configs, s, ref_d, iters, seconds);
      continue;
    }
    if (const int launches = ProfileLaunches(); launches > 0) {
      for (int col = 0; col < ncol; ++col)
        ProfileColumn(section, mkn, ref_name, make_ref, configs, s, ref_d, col, launches);
      continue;
    }

    std::vector<float> t(ncol, 1e30f);
    auto time_column = [&](int col) {
      Runner r;
      if (col == 0) {
        r = make_ref(s, ref_d);
      } else {
        const int c = (col - 1) / kNumVariants;
        r = configs[c].make(s, kVariants[(col - 1) % kNumVariants]);
      }
      if (r) t[col] = std::min(t[col], BestUsPerCall(r, iters, 7));
    };
    for (int pass = 0; pass < 2; ++pass)
      for (int i = 0; i < ncol; ++i) time_column(pass == 0 ? i : ncol - 1 - i);

    auto ran = [](float v) { return v < 1e29f; };
    const float t_ref = ran(t[0]) ? t[0] : -1.f;
    printf("SWEEP %s %s %s %.1f %.3f %s\n", section, mkn, ref_name, t_ref, t_ref > 0 ? 1.f : 0.f,
           have_ref ? "ref" : "MISSING");
    int best_c = -1, best_v = 0;
    for (int c = 0; c < ncfg; ++c) {
      int bv = 0;
      for (int v = 1; v < kNumVariants; ++v)
        if (t[1 + c * kNumVariants + v] < t[1 + c * kNumVariants + bv]) bv = v;
      const float us = t[1 + c * kNumVariants + bv];
      char check[32];
      bool ok = true;
      if (implemented[c] == 0 || !ran(us)) {
        snprintf(check, sizeof check, "REJECTED");
        ok = false;
      } else if (!have_ref) {
        snprintf(check, sizeof check, "-");
      } else if (!(diff[c] <= 2e-2f)) {
        snprintf(check, sizeof check, "FAILED(%.1e)", diff[c]);
        ok = false;
      } else {
        snprintf(check, sizeof check, "%.1e", diff[c]);
      }
      printf("SWEEP %s %s %s[%s] %.1f %.3f %s\n", section, mkn, configs[c].name, kVariants[bv].name,
             ran(us) ? us : -1.f, ran(us) && t_ref > 0 ? us / t_ref : 0.f, check);
      printf("SWEEPV %s %s %s", section, mkn, configs[c].name);
      for (int v = 0; v < kNumVariants; ++v) {
        const float tv = t[1 + c * kNumVariants + v];
        printf(" %s=%.1f", kVariants[v].name, ran(tv) ? tv : -1.f);
      }
      printf("\n");
      if (ok && (best_c < 0 || us < t[1 + best_c * kNumVariants + best_v])) {
        best_c = c;
        best_v = bv;
      }
    }
    if (best_c >= 0) {
      const float us = t[1 + best_c * kNumVariants + best_v];
      printf("BEST %s %s %s[%s] %.1f %.3f\n", section, mkn, configs[best_c].name, kVariants[best_v].name, us,
             t_ref > 0 ? us / t_ref : 0.f);
    } else {
      printf("BEST %s %s none\n", section, mkn);
    }
    fflush(stdout);
  }
}

}  // namespace
