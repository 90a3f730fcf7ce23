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


def test_example_usage_errors_name_the_bad_value():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    for script, flags, message in [
        ("mlp_demo.py", ["--tp", "3"], "--seq must be a positive multiple of tp = 3, got 1024"),
        ("decode.py", ["--tp", "3"], "heads=8 is not divisible by tp=3"),
        ("decode.py", ["--tp", "0"], "--tp must be >= 1, got 0"),
        ("decode.py", ["--dtype", "float16"], "--dtype float16 needs a GPU"),
    ]:
        cmd = [sys.executable, str(ROOT / "examples" / script), *flags]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 2 and message in out.stderr, (cmd, out.stderr)
