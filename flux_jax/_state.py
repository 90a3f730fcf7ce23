"""Process-wide state controls."""

import dataclasses

from flux_jax import _native


def reset() -> None:
    """Drop every communication channel and workspace of the fused ops.

    Use after a fused op failed (a timeout leaves its TP group in a failed
    state, and later calls of the same compiled program fail fast until this is
    called). It first waits for every computation this process has dispatched (JAX
    dispatches asynchronously, so fused calls may still be queued; their errors are
    left to their results), so call it from one thread with no other fused calls in
    flight. On the CPU backend it then
    waits, at most 5 s, for every rank of each channel to reach the same call (a
    failed program can leave ranks one call apart, e.g. a rank-dependent branch),
    so that no rank opens a fresh channel and waits there for peers that left.

    In a multi-process job (jax.distributed) reset() is collective: every process
    must call it, and each waits (at most flux_jax.Config.timeout_s) until all
    have, through jax.distributed's key-value store; no barrier of your own is
    needed. If a process does not come, reset() raises and resets nothing in the
    caller. After a reset, channels are named for the new reset generation, so a
    process that missed one cannot pair with fresh state: its fused calls fail
    with an error saying which process reset.
    """
    import jax

    from flux_jax import _config, _distributed

    for array in jax.live_arrays():  # a queued fused call would run on the state dropped below
        try:
            array.block_until_ready()
        except Exception:  # noqa: BLE001 - a failed call's error belongs to its result, not to reset()
            pass
    _distributed.reset_barrier(_config.get_config().timeout_s)
    ext = _native.extension()
    ext.reset_cpu_channels()
    if hasattr(ext, "reset_cuda_workspaces"):
        ext.reset_cuda_workspaces()
        from flux_jax import _ipc

        _ipc.forget()


def device_errors() -> dict[int, str]:
    """Device-side waits that gave up on local GPUs, {device ordinal: diagnostic}.

    A GPU wait that times out cannot fail the call that is already running: it
    makes that call's outputs NaN where they depend on the missing data (every
    element is NaN or right, never finite and wrong) and records what it waited
    for; the next fused call on that GPU raises the diagnostic. This reports it
    without making another call. Each rank of a TP group on the GPU whose wait
    gave up has its own line, naming the rank it waited for and the epoch; a wait
    that gave up because another wait on the GPU timed out first says so and
    names that one. Without such a line, the GPU's first timeout (possibly copied
    from another GPU of its group). Cleared by `reset()`. Always empty on CPU.
    """
    ext = _native.extension()
    if not hasattr(ext, "cuda_device_error"):
        return {}
    import jax

    out = {}
    for d in jax.local_devices():
        if d.platform == "gpu":
            msg = ext.cuda_device_error(d.local_hardware_id)
            if msg:
                out[d.local_hardware_id] = msg
    return out


def workspace_bytes() -> dict[int, int]:
    """Bytes of fused-op workspace held on each local GPU (outside XLA's pool)."""
    ext = _native.extension()
    if not hasattr(ext, "cuda_workspace_bytes"):
        return {}
    import jax

    return {
        d.local_hardware_id: ext.cuda_workspace_bytes(d.local_hardware_id)
        for d in jax.local_devices()
        if d.platform == "gpu"
    }


@dataclasses.dataclass(frozen=True)
class HandlerHostTime:
    """Host time spent inside one op's FFI handler (all devices' threads together)."""

    calls: int
    total_us: float
    max_us: float

    @property
    def mean_us(self) -> float:
        return self.total_us / self.calls if self.calls else 0.0


def handler_host_time(reset: bool = False) -> dict[str, HandlerHostTime]:
    """Host time the fused ops' FFI handlers have taken since the last reset, per op.

    On GPU a handler decodes its attributes, plans and enqueues the launches and copies; the
    kernels run later, so this is what a call costs the host thread that drives the device, not
    the GPU. XLA drives each device from one thread: when that thread needs longer per call than
    the GPU (small shapes), the GPU idles between calls. On CPU the handler does the whole
    computation. Counters are process-wide and always on; `reset=True` zeroes them after reading.
    """
    ext = _native.extension()
    stats = {
        op: HandlerHostTime(calls, total_ns / 1e3, max_ns / 1e3)
        for op, (calls, total_ns, max_ns) in ext.handler_host_stats().items()
    }
    if reset:
        ext.reset_handler_host_stats()
    return stats
