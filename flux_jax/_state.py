"""Process-wide state controls."""

from flux_jax import _native


def reset() -> None:
    """Drop every communication channel and workspace of the fused ops.

    Use after a fused op failed (a timeout leaves its TP group in a failed
    state, and later calls of the same compiled program fail fast until this is
    called). Only call it when no fused op is running.
    """
    ext = _native.extension()
    ext.reset_cpu_channels()
    if hasattr(ext, "reset_cuda_workspaces"):
        ext.reset_cuda_workspaces()
        from flux_jax import _ipc

        _ipc.forget()


def device_errors() -> dict[int, str]:
    """Device-side timeouts recorded on local GPUs, {device ordinal: diagnostic}.

    A GPU wait that times out cannot fail the call that is already running:
    it poisons that call's outputs with NaN and records what it waited for; the
    next fused call on that GPU raises the diagnostic. This reports it without
    making another call. Always empty on CPU.
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

    return {d.local_hardware_id: ext.cuda_workspace_bytes(d.local_hardware_id)
            for d in jax.local_devices() if d.platform == "gpu"}
