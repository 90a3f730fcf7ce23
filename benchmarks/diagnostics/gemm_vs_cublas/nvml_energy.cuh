// Time, energy and power per call of a GEMM kept running at the GPU's power cap: NVML's total-energy counter loaded
// with dlopen (no NVML headers or libraries at build time), read around a loop that keeps launches queued. The C++
// counterpart of benchmarks/gpu_energy.py, for the diagnostics that compare kernels no JAX program runs (plain CUTLASS
// configurations). Under a long GEMM loop an H200 runs at its 700 W limit, where a kernel's time follows the energy it
// spends per call (docs/decisions/2026-12-04-serpentine-tile-order.md).
#pragma once

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <chrono>
#include <cstdio>
#include <deque>
#include <functional>
#include <vector>

namespace {

// NVML's energy counters of every GPU it sees, summed (millijoules since the driver loaded).
class NvmlEnergy {
 public:
  bool Load() {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (lib == nullptr) return false;
    using InitFn = int (*)();
    using CountFn = int (*)(unsigned*);
    using HandleFn = int (*)(unsigned, void**);
    auto init = reinterpret_cast<InitFn>(dlsym(lib, "nvmlInit_v2"));
    auto count = reinterpret_cast<CountFn>(dlsym(lib, "nvmlDeviceGetCount_v2"));
    auto handle = reinterpret_cast<HandleFn>(dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
    read_ = reinterpret_cast<ReadFn>(dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption"));
    unsigned n = 0;
    if (!init || !count || !handle || !read_ || init() != 0 || count(&n) != 0 || n == 0) return false;
    handles_.assign(n, nullptr);
    for (unsigned i = 0; i < n; ++i)
      if (handle(i, &handles_[i]) != 0) return false;
    double mj;
    return ReadMj(&mj);
  }
  bool ReadMj(double* mj) const {
    unsigned long long total = 0;
    for (void* h : handles_) {
      unsigned long long v = 0;
      if (read_(h, &v) != 0) return false;
      total += v;
    }
    *mj = static_cast<double>(total);
    return true;
  }

 private:
  using ReadFn = int (*)(void*, unsigned long long*);
  ReadFn read_ = nullptr;
  std::vector<void*> handles_;
};

struct EnergyPerCall {
  double us = 0, mj = 0, w = 0;
  const char* error = nullptr;  // set where no reading was taken
};

// `run` (one GEMM launch on the default stream) in runs of `iters` launches, three runs queued at all times, for
// warmup_s and then at least `seconds`. The window runs from one step of the energy counter to the first step after
// `seconds`, both seen while runs were queued; power is its energy over its length, time per call the span of the runs
// that finished inside it over their calls, energy per call their product. An error, not a hang, where no run finishes
// or the counter does not step for 15 s.
inline EnergyPerCall SustainedEnergy(const std::function<void()>& run, int iters, double seconds,
                                     const NvmlEnergy& nvml, double warmup_s = 0.5) {
  using Clock = std::chrono::steady_clock;
  auto now = [] { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); };
  constexpr int kDepth = 3;
  constexpr double kStallS = 15.0;
  std::deque<cudaEvent_t> queue;
  std::vector<double> finished;
  EnergyPerCall out;
  double progress = now();  // the last run's finish
  auto enqueue = [&] {
    for (int i = 0; i < iters; ++i) run();
    cudaEvent_t e;
    cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    cudaEventRecord(e);
    queue.push_back(e);
  };
  auto pump = [&] {
    while (!queue.empty() && cudaEventQuery(queue.front()) == cudaSuccess) {
      cudaEventDestroy(queue.front());
      queue.pop_front();
      finished.push_back(progress = now());
      enqueue();
    }
    if (now() - progress > kStallS) out.error = "no run finished for 15 s";
  };
  // The counter's next step while runs stay queued: (its value, when it was seen, runs finished by then).
  auto next_step = [&](double* mj, double* t, size_t* n) {
    const double since = now();
    double last = 0, value = 0;
    if (!nvml.ReadMj(&last)) out.error = "NVML: energy counter unreadable";
    while (out.error == nullptr) {
      pump();
      if (!nvml.ReadMj(&value)) out.error = "NVML: energy counter unreadable";
      if (value != last) {
        *mj = value;
        *t = now();
        *n = finished.size();
        return;
      }
      if (now() - since > kStallS) out.error = "the energy counter did not step for 15 s";
    }
  };
  for (int i = 0; i < kDepth; ++i) enqueue();
  const double start = now();
  while (out.error == nullptr && now() - start < warmup_s) pump();
  double e0 = 0, t0 = 0, e1 = 0, t1 = 0;
  size_t n0 = 0, n1 = 0;
  next_step(&e0, &t0, &n0);
  while (out.error == nullptr && now() - t0 < seconds) pump();
  if (out.error == nullptr) next_step(&e1, &t1, &n1);
  cudaDeviceSynchronize();  // drain: the next measurement starts from an idle queue
  for (cudaEvent_t e : queue) cudaEventDestroy(e);
  if (out.error != nullptr) return out;
  if (n1 < n0 + 2) {
    out.error = "too few runs finished inside the window";
    return out;
  }
  const double per_call_s = (finished[n1 - 1] - finished[n0]) / (static_cast<double>(n1 - 1 - n0) * iters);
  out.w = (e1 - e0) / 1e3 / (t1 - t0);
  out.us = per_call_s * 1e6;
  out.mj = out.w * per_call_s * 1e3;
  return out;
}

}  // namespace
