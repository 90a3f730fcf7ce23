"""Fused ops across processes: 2 processes x 4 CPU devices under jax.distributed
(localhost, gloo collectives). TP groups that span the processes talk through
POSIX shared memory named by a session token from jax.distributed's key-value
store; groups inside one process keep private memory; groups that span hosts
fall back to the twin (or fail clearly with impl="fused"); a peer process that
dies makes the survivor fail with a diagnostic, never hang."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "multiprocess_worker.py"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(scenario, host_ids=(None, None), timeout_s="60", wall=240):
    port = str(_free_port())
    env = dict(os.environ, FLUX_TEST_TIMEOUT=timeout_s)
    env.pop("XLA_FLAGS", None)
    procs = []
    for pid in (0, 1):
        args = [sys.executable, str(WORKER), str(pid), port, scenario]
        if host_ids[pid]:
            args.append(host_ids[pid])
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    results, logs = {}, {}
    for pid, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=wall)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{scenario}: process {pid} hung")
        logs[pid] = out + err
        for line in out.splitlines():
            if line.startswith("RESULT "):
                results[pid] = json.loads(line[len("RESULT "):])
    for pid in (0, 1):
        assert pid in results, f"{scenario}: process {pid} gave no result:\n{logs[pid][-3000:]}"
    return results, logs


def _assert_ops_match(result):
    for key in ("ag_fwd", "ag_dx", "ag_dw", "rs_fwd", "rs_dx", "rs_dw"):
        diff, finite = result[key]
        assert finite, f"{key}: NaN in the fused result (an element was not written)"
        assert diff < 1e-4, f"{key}: fused differs from the twin by {diff}"


@pytest.mark.slow
def test_tp_group_spanning_two_processes_uses_shared_memory():
    results, _ = _run("spanning")
    for pid in (0, 1):
        _assert_ops_match(results[pid])
        assert results[pid]["channels"] >= 4  # fused call sites that ran (XLA drops unused ones)


@pytest.mark.slow
def test_tp_groups_inside_each_process():
    results, _ = _run("local_groups")
    for pid in (0, 1):
        _assert_ops_match(results[pid])


@pytest.mark.slow
def test_group_across_hosts_falls_back_to_the_twin_and_fused_refuses():
    results, logs = _run("cross_host", host_ids=("host-a", "host-b"))
    for pid in (0, 1):
        r = results[pid]
        assert r["auto_hlo_has_custom_call"] is False
        assert r["auto_rel_err"] == 0.0
        assert "spans hosts ['host-a', 'host-b']" in r["fused_error"]
        assert "using the XLA twin: TP group of devices" in logs[pid]


@pytest.mark.slow
def test_dead_peer_process_is_an_error_naming_the_missing_rank():
    results, _ = _run("peer_dies", timeout_s="3")
    error = results[0]["error"]
    assert error is not None, "the survivor returned a result although its peer died"
    assert "timed out after 3 s waiting for chunk" in error and "from rank 4" in error, error
    assert "in processes 0,0,0,0,1,1,1,1" in error, error
