"""The README's main command runs end to end (reduced size)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mlp_demo_runs_and_matches():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "mlp_demo.py"), "--seq", "256"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MATCH" in out.stdout and "MISMATCH" not in out.stdout


def test_decode_example_fused_equals_twin():
    """examples/decode.py: KV-cache decoding without sequence parallelism (matmul_ar), fused vs twin."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "decode.py"), "--tokens", "6"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MATCH" in out.stdout and "MISMATCH" not in out.stdout
    assert "matmul_ar: overlap" in out.stdout  # the fused CPU kernel ran
    assert out.stdout.count("logits the same bits on every TP rank: True") == 2
