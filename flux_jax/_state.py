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
