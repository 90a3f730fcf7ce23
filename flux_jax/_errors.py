"""Exceptions raised by flux_jax before anything is traced or launched."""


class FusedUnavailableError(RuntimeError):
    """impl="fused" was requested where the fused kernel cannot run (and why)."""
