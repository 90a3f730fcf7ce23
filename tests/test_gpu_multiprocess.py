"""Fused ops with one process per GPU (jax.distributed) on a 2-GPU host: workspaces mapped
through CUDA IPC, handles exchanged through jax.distributed's key-value store. Skipped without
2 GPUs (FLUX_JAX_REQUIRE_GPU=1 turns the skip into a failure)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import flux_jax

WORKER = Path(__file__).resolve().parent / "gpu_multiprocess_worker.py"


def _gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


@pytest.fixture(scope="module", autouse=True)
def two_gpus():
    if _gpu_count() < 2 or not flux_jax.build_info()["cuda"]:
        why = f"needs 2 GPUs and a CUDA build ({_gpu_count()} GPUs, cuda={flux_jax.build_info()['cuda']})"
        if os.environ.get("FLUX_JAX_REQUIRE_GPU") == "1":
            pytest.fail(why)
        pytest.skip(why)


def run_workers(scenario, timeout_s="30", wall=300):
    """Both processes of `scenario`; {process id: result dict} and their logs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, FLUX_TEST_TIMEOUT=timeout_s)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(pid), port, scenario],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for pid in (0, 1)
    ]
    results, logs = {}, {}
    for pid, p in enumerate(procs):
        try:
            logs[pid] = p.communicate(timeout=wall)[0]
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{scenario}: process {pid} hung")
        for line in logs[pid].splitlines():
            if line.startswith("RESULT "):
                results[pid] = json.loads(line[len("RESULT ") :])
    for pid in (0, 1):
        assert pid in results, f"{scenario}: process {pid} gave no result:\n{logs[pid][-4000:]}"
    return results, logs


def test_both_ops_both_paths_forward_and_backward_match_the_twin():
    results, _ = run_workers("ops")
    for pid in (0, 1):
        r = results[pid]
        for path in ("overlap", "latency", "decode"):
            for key in ("ag_fwd", "ag_dx", "ag_dw", "rs_fwd", "rs_dx", "rs_dw"):
                diff, finite = r[f"{path}_{key}"]
                assert finite, f"process {pid} {path} {key}: NaN (an element was not written)"
                assert diff < 2e-2, f"process {pid} {path} {key}: differs from the twin by {diff}"
        assert not r["device_errors"], r["device_errors"]
        assert sum(r["workspace_bytes"].values()) >= 384 << 20


def test_dead_peer_process_is_an_error_naming_the_missing_rank():
    results, _ = run_workers("peer_dies", timeout_s="3")
    r = results[0]
    assert r["nan"], "the survivor's output must be NaN-poisoned, not plausible numbers"
    message = " ".join(r["device_errors"].values()) + " " + str(r["second_call_error"])
    assert "waited for rank 1 to reach the op" in message, message
