"""Test setup: 8 CPU devices (set before jax is imported) and shared helpers.

CPU tests build their meshes from jax.devices("cpu"), so they also run on a
GPU host. GPU tests live in tests/gpu and skip without GPUs, unless
FLUX_JAX_REQUIRE_GPU=1 turns the skip into a failure. FLUX_JAX_TEST_TUNING runs
every test under extra Config fields, e.g. "gpu_tile_group_m=16,gpu_piece_bytes=4194304"
or "fused_path=latency" (to run the GPU suite against a non-default kernel
configuration); integer values become ints, anything else stays a string.
"""

import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

# The repository root, last on sys.path: `benchmarks` becomes importable while
# `flux_jax` still resolves to the installed package first.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import pytest  # noqa: E402

import flux_jax  # noqa: E402
from flux_jax._config import parse_overrides  # noqa: E402


@pytest.fixture(autouse=True)
def _poisoned_outputs():
    """Every fused kernel poisons its outputs with NaN first (unwritten => test fails)."""
    previous = flux_jax.get_config()
    tuning = parse_overrides(os.environ.get("FLUX_JAX_TEST_TUNING", ""))
    flux_jax.set_config(flux_jax.Config(timeout_s=30.0, debug_poison_outputs=True, **tuning))
    yield
    flux_jax.set_config(previous)


def pytest_report_header(config):
    info = flux_jax.build_info()
    return [f"flux_jax {info['version']}: cuda={info['cuda']} jax={info['jax']} cpu devices={len(jax.devices('cpu'))}"]
