"""Test setup: 8 CPU devices (set before jax is imported) and shared helpers.

CPU tests build their meshes from jax.devices("cpu"), so they also run on a
GPU host. GPU tests (test_gpu_*.py) take the `gpus` / `one_gpu` fixtures and skip
without GPUs, unless FLUX_JAX_REQUIRE_GPU=1 turns the skip into a failure.
FLUX_JAX_TEST_TUNING runs every test under extra Config or GPU tuning fields,
e.g. "gpu_tile_group_m=16,gpu_piece_bytes=4194304" or "fused_path=latency" (to
run the GPU suite against a non-default kernel configuration).
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
from flux_jax import _config  # noqa: E402


@pytest.fixture(autouse=True)
def _poisoned_outputs():
    """Every fused kernel poisons its outputs with NaN first (unwritten => test fails)."""
    previous, previous_tuning = flux_jax.get_config(), _config.get_gpu_tuning()
    public, tuning = _config.parse_overrides(os.environ.get("FLUX_JAX_TEST_TUNING", ""))
    flux_jax.set_config(flux_jax.Config(timeout_s=30.0, debug_poison_outputs=True, **public))
    _config.set_gpu_tuning(_config.GpuTuning(**tuning))
    yield
    flux_jax.set_config(previous)
    _config.set_gpu_tuning(previous_tuning)


def _gpus():
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


def _require_gpus(count: int):
    devs = _gpus()
    if len(devs) < count or "ag_matmul" not in flux_jax.build_info()["cuda_kernels"]:
        why = f"needs {count} GPU(s) and a CUDA build (found {len(devs)} GPUs, build {flux_jax.build_info()})"
        if os.environ.get("FLUX_JAX_REQUIRE_GPU") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return devs


@pytest.fixture(scope="module")
def gpus():
    """At least two GPUs and a CUDA build (TP=2 tests)."""
    return _require_gpus(2)


@pytest.fixture(scope="module")
def one_gpu():
    """One GPU and a CUDA build (the fused ops over a mesh axis of size 1)."""
    return _require_gpus(1)[:1]


def pytest_report_header(config):
    info = flux_jax.build_info()
    return [f"flux_jax {info['version']}: cuda={info['cuda']} jax={info['jax']} cpu devices={len(jax.devices('cpu'))}"]
