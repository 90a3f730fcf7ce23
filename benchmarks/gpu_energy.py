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
from collections import deque
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
    dispatch: Callable[[], Callable[[], bool]],
    calls_per_run: int,
    seconds: float,
    read_mj: Callable[[], float],
    warmup_s: float = 0.2,
    depth: int = 3,
    stall_s: float = 15.0,
) -> dict:
    """Time per call (us), energy per call (mJ) and mean power (W) of a loop kept running for at
    least `seconds` after `warmup_s` (the power cap's clocks settle).

    `dispatch()` enqueues one run of `calls_per_run` calls without waiting and returns a function
    that tells whether that run has finished. `depth` runs stay queued, so the GPU never idles
    while the host reads the counter (one read can take milliseconds; reading between blocking
    runs made the window up to 1.8x longer than the runs themselves, its power an average with
    idle gaps). The counter advances in steps: the window runs from one step to the first step
    after `seconds`, both seen while runs were queued; power is its energy over its length. Time
    per call is taken from the runs that finished inside the window (first to last finish), and
    energy per call is the two's product.

    A RuntimeError, not a hang, where no run finishes or the counter does not step for `stall_s`:
    it says which, with the runs finished and the host time spent dispatching them."""
    queue: deque[Callable[[], bool]] = deque()
    finished: list[float] = []
    dispatch_s = 0.0
    last_finish = time.perf_counter()

    def enqueue() -> None:
        nonlocal dispatch_s
        start = time.perf_counter()
        queue.append(dispatch())
        dispatch_s += time.perf_counter() - start

    def check_stall(what: str, since: float) -> None:
        if time.perf_counter() - since > stall_s:
            raise RuntimeError(
                f"{what} for {stall_s:.0f} s ({len(finished)} runs of {calls_per_run} calls finished, "
                f"{dispatch_s:.1f} s spent dispatching {len(finished) + len(queue)} runs)"
            )

    def pump() -> None:
        # One finished run per call, not all that are done: where each dispatch waits inside until
        # a run's worth of work drains, the oldest run is always done when the next dispatch
        # returns, and "while done: replace it" would never return.
        nonlocal last_finish
        if queue and queue[0]():
            queue.popleft()
            finished.append(last_finish := time.perf_counter())
            enqueue()
        check_stall("no run finished", last_finish)

    def next_step() -> tuple[float, float, int]:
        since, last = time.perf_counter(), read_mj()
        while True:
            pump()
            value = read_mj()
            if value != last:
                return value, time.perf_counter(), len(finished)
            check_stall("the energy counter did not step", since)

    for _ in range(max(depth, 1)):
        enqueue()
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        pump()
    e0, t0, n0 = next_step()
    while time.perf_counter() - t0 < seconds:
        pump()
    e1, t1, n1 = next_step()
    while queue:  # drain: the next measurement starts from an idle queue
        if queue[0]():
            queue.popleft()
            last_finish = time.perf_counter()
        check_stall("no run finished", last_finish)
    if n1 - n0 < 2:
        raise RuntimeError(f"energy window of {t1 - t0:.3f} s saw {n1 - n0} runs finish; lengthen it")
    per_call_s = (finished[n1 - 1] - finished[n0]) / ((n1 - 1 - n0) * calls_per_run)
    power_w = (e1 - e0) / 1e3 / (t1 - t0)
    return {"sustained_us": per_call_s * 1e6, "energy_mj": power_w * per_call_s * 1e3, "power_w": power_w}
