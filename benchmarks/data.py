"""Benchmark inputs (fresh random normal data, reproducible from a seed) and the output check."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from benchmarks.presets import OPS, Case

# Max |out - twin| / max |twin| above which a variant is WRONG.
# fp8: against the FP8 twin (the same quantization), so bf16's tolerance.
TOLERANCE = {"bfloat16": 2e-2, "float16": 2e-2, "float32": 1e-3, "fp8": 2e-2}


def case_rng(case: Case, seed: int, stream: str = "xw") -> np.random.Generator:
    """A generator that depends only on (seed, shape, stream): the same data in every process."""
    return np.random.default_rng([seed, OPS.index(case.op), case.M, case.K, case.N, len(stream)])


def random_normal(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    """Standard normal data in `dtype` (never zeros; bf16 via ml_dtypes)."""
    return rng.standard_normal(shape, dtype=np.float32).astype(jnp.dtype(dtype))


def make_xw(case: Case, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The global operands x [M, K] and w [K, N] of a case, on the host."""
    rng = case_rng(case, seed)
    dtype = case.operand_dtype
    return random_normal(rng, (case.M, case.K), dtype), random_normal(rng, (case.K, case.N), dtype)


def rel_max_err(out, ref, rows_per_chunk: int = 2048) -> float:
    """max |out - ref| / max |ref| in float32, chunked over rows to bound host memory.

    NaN or inf anywhere in `out` gives inf.
    """
    out, ref = np.asarray(out), np.asarray(ref)
    if out.shape != ref.shape:
        raise ValueError(f"output shape {out.shape} != reference shape {ref.shape}")
    max_diff, max_ref = 0.0, 0.0
    for start in range(0, out.shape[0], rows_per_chunk):
        o = out[start : start + rows_per_chunk].astype(np.float32)
        r = ref[start : start + rows_per_chunk].astype(np.float32)
        if not np.all(np.isfinite(o)):
            return float("inf")
        max_diff = max(max_diff, float(np.max(np.abs(o - r))))
        max_ref = max(max_ref, float(np.max(np.abs(r))))
    return max_diff / max(max_ref, 1e-30)
