"""Energy per call under sustained load, from NVML's total-energy counter.

Under a long GEMM loop an H200 runs at its software power cap (`clocks_event_reasons` 0x4): its
clocks then follow the power a kernel draws, so two kernels of equal cycles can differ in speed
by the energy each spends per call (docs/decisions/2026-12-03-pingpong-short-k.md). `sustained`
runs a loop for a fixed wall time and reads the counter (millijoules since the driver loaded,
summed over the host's GPUs) before and after: energy per call, mean power and time per call in
the same window. The counter is read through the driver's own libnvidia-ml (ctypes; no Python
package); where it or the counter is missing (CPU machines, old GPUs) `EnergyMeter.open()` is None
and nothing is recorded.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

_NVML_SUCCESS = 0


class EnergyMeter:
    """Reads the energy counter of every GPU NVML sees, summed (one process drives them all)."""

    def __init__(self, lib, handles: list):
        self._lib = lib
        self._handles = handles

    @classmethod
    def open(cls) -> EnergyMeter | None:
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return None
        try:
            if lib.nvmlInit_v2() != _NVML_SUCCESS:
                return None
            count = ctypes.c_uint(0)
            if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != _NVML_SUCCESS or count.value == 0:
                return None
            handles = []
            for i in range(count.value):
                handle = ctypes.c_void_p()
                if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(handle)) != _NVML_SUCCESS:
                    return None
                handles.append(handle)
            meter = cls(lib, handles)
            meter.read_mj()  # the counter exists on every GPU (Volta and newer), or no meter
            return meter
        except (AttributeError, RuntimeError):
            return None

    def step_ms(self) -> float | None:
        """The time between two steps of the counter (its resolution in time), or None if it
        did not step within ~1 s."""
        _next_update(self.read_mj)
        start = time.perf_counter()
        first = self.read_mj()
        while time.perf_counter() - start < 1.0:
            if self.read_mj() != first:
                return (time.perf_counter() - start) * 1e3
        return None

    def read_mj(self) -> float:
        total = 0
        for handle in self._handles:
            mj = ctypes.c_ulonglong(0)
            if self._lib.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(mj)) != _NVML_SUCCESS:
                raise RuntimeError("NVML: no total energy counter on this GPU")
            total += mj.value
        return float(total)


def _next_update(read_mj: Callable[[], float], max_reads: int = 200_000) -> float:
    """The counter's value right after it next changes (it advances in steps of the driver's
    sampling period, not continuously), or its value after max_reads reads without a change."""
    first = read_mj()
    for _ in range(max_reads):
        value = read_mj()
        if value != first:
            return value
    return first


def sustained(
    run: Callable[[], None],
    calls_per_run: int,
    seconds: float,
    read_mj: Callable[[], float],
    warmup_s: float = 0.2,
) -> dict:
    """Runs `run` (blocking, `calls_per_run` calls each) back to back for at least `seconds` after
    `warmup_s` of untimed runs (the power cap's clocks settle): time per call (us), energy per call
    (mJ) and mean power (W) over that window.

    The counter advances in steps, so the window starts right after a step and ends after the run
    during which the next step after `seconds` came: the energy read then misses at most part of
    one run (~10 ms of a window of seconds). The host's gaps between runs count in all three (a
    few us per run)."""
    start = time.perf_counter()
    run()
    while time.perf_counter() - start < warmup_s:
        run()
    e0 = _next_update(read_mj)
    t0, runs = time.perf_counter(), 0
    while True:
        before = read_mj()
        run()
        runs += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            e1 = read_mj()
            if e1 != before:
                break
    energy_mj = e1 - e0
    calls = runs * calls_per_run
    return {
        "sustained_us": elapsed / calls * 1e6,
        "energy_mj": energy_mj / calls,
        "power_w": energy_mj / 1e3 / elapsed,
    }
