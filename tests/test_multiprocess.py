"""Fused ops across processes: 2 processes x 4 CPU devices under jax.distributed
(localhost, gloo collectives). TP groups that span the processes talk through
POSIX shared memory whose names are keyed by a secret from jax.distributed's
key-value store; groups inside one process keep private memory; groups that span
hosts fall back to the twin (or fail clearly with impl="fused"); a peer process
that dies or is stopped makes the survivor fail with a diagnostic, never hang.
Also: squatted names, a small /dev/shm, no segment left behind, and reset()
across processes (docs/trust.md)."""

import glob
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "multiprocess_worker.py"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(timeout_s):
    env = dict(os.environ, FLUX_TEST_TIMEOUT=timeout_s)
    env.pop("XLA_FLAGS", None)
    return env


def _spawn(scenario, host_ids=(None, None), timeout_s="60", extra_env=None):
    port = str(_free_port())
    procs = []
    for pid in (0, 1):
        args = [sys.executable, str(WORKER), str(pid), port, scenario]
        if host_ids[pid]:
            args.append(host_ids[pid])
        env = _env(timeout_s) | (extra_env or {}).get(pid, {})
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    return procs


def _parse(scenario, logs):
    results = {}
    for pid, log in logs.items():
        for line in log.splitlines():
            if line.startswith("RESULT "):
                results[pid] = json.loads(line[len("RESULT ") :])
    for pid in (0, 1):
        assert pid in results, f"{scenario}: process {pid} gave no result:\n{logs[pid][-3000:]}"
    return results


def _assert_no_segments_left(results):
    """No shared-memory segment of this job is left in /dev/shm (names carry the session)."""
    session = results[0].get("session")
    if session:
        left = glob.glob(f"/dev/shm/fluxjax-{session}-*")
        assert not left, f"segments of the job left behind: {left}"


def _run(scenario, host_ids=(None, None), timeout_s="60", wall=240):
    procs = _spawn(scenario, host_ids, timeout_s)
    logs = {}
    for pid, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=wall)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{scenario}: process {pid} hung")
        logs[pid] = out + err
    results = _parse(scenario, logs)
    _assert_no_segments_left(results)
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


@pytest.mark.slow
def test_exception_in_a_peer_fails_its_call_and_the_survivor_at_once():
    """Process 1's protocol threads throw (std::bad_alloc under an address-space cap): its call
    fails with the exception named, the process lives on, and process 0's ranks, waiting for it,
    fail at once with the rank that left the call, not at their 30 s timeout."""
    results, _ = _run("peer_throws", timeout_s="30")
    thrower, survivor = results[1], results[0]
    # its error: one of its ranks' std::bad_alloc, or a sibling rank's report of a rank that left
    assert thrower["error"] is not None and "(cpu backend): rank" in thrower["error"], thrower
    assert "bad_alloc" in thrower["error"] or "before finishing it" in thrower["error"], thrower
    assert survivor["error"] is not None, "process 0 returned a result although its peers threw"
    assert "before finishing it" in survivor["error"] and "of TP group 0" in survivor["error"], survivor
    assert survivor["failing_call_s"] < 15, survivor


@pytest.mark.slow
def test_killed_peer_leaves_no_segment_in_dev_shm():
    """Process 1 is SIGKILLed after a good call: process 0 fails with the diagnostic, and
    neither process leaves a segment behind (they are unlinked once every process mapped them)."""
    results, _ = _run("peer_killed", timeout_s="3")
    error = results[0]["error"]
    assert error is not None and "timed out after 3 s" in error, error


@pytest.mark.slow
def test_segments_orphaned_by_killed_jobs_are_swept():
    """A job SIGKILLed before every process mapped a segment leaves its name in /dev/shm (no
    atexit runs). The next job removes this user's sized segments that no process holds a lock
    on; one still held (a live job's) and one not yet sized (being created) stay."""
    import fcntl

    def segment(name, size):
        path = f"/dev/shm/{name}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, size)
        return path, fd

    tag = f"{os.getpid():x}{random.getrandbits(32):08x}"
    orphan, fd_orphan = segment(f"fluxjax-dead{tag}-00", 4096)
    held, fd_held = segment(f"fluxjax-live{tag}-00", 4096)
    unsized, fd_unsized = segment(f"fluxjax-new{tag}-00", 0)
    fcntl.flock(fd_held, fcntl.LOCK_SH)
    os.close(fd_orphan)
    try:
        results, _ = _run("spanning")
        _assert_ops_match(results[0])
        assert not os.path.exists(orphan)
        assert os.path.exists(held) and os.path.exists(unsized)
    finally:
        for path, fd in ((held, fd_held), (unsized, fd_unsized)):
            os.close(fd)
            if os.path.exists(path):
                os.unlink(path)
        if os.path.exists(orphan):
            os.unlink(orphan)


def test_segment_names_match_the_reference_siphash():
    from shm_names import siphash24

    # SipHash-2-4 test vector: key 00..0f, message 00..0e
    assert siphash24(bytes(range(16)), bytes(range(15))) == 0xA129CA6149BE45E5


@pytest.mark.slow
def test_squatted_predictable_names_do_not_matter():
    """A local user pre-creating the names the channel used to take (job token + call-site
    counter, world-writable, never sized) made every later fused op time out."""
    results, _ = _run("squat_legacy", timeout_s="5")
    for pid in (0, 1):
        _assert_ops_match(results[pid])


@pytest.mark.slow
def test_squatted_segment_of_another_mode_or_owner_is_refused():
    """If the real name were known, a segment not created by this job (mode other than 0600,
    or another owner) is a clear error naming the segment, in every process, not a pairing."""
    results, _ = _run("squat_exact", timeout_s="5")
    for pid in (0, 1):
        r = results[pid]
        assert r["secret_bits"] >= 128
        names = results[0]["names"]
        e0 = r["error0"]
        assert e0 is not None and "mode is 0666, not 0600" in e0, e0
        assert any(n in e0 for n in names), e0
        if r["owner_tested"]:
            e1 = r["error1"]
            assert e1 is not None and "uid 65534" in e1, e1
            assert any(n in e1 for n in names), e1


def _run_with_small_dev_shm(scenario, size, timeout_s="30", wall=240):
    """Both processes in a private mount namespace whose /dev/shm is a tmpfs of `size`."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to give the job a small private /dev/shm")
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm (user namespaces off?): {probe.stderr.strip()}")
    script = """mount -t tmpfs -o size="$1" tmpfs /dev/shm || exit 97
"$2" "$3" 0 "$4" "$5" >"$6/log0" 2>&1 & a=$!
"$2" "$3" 1 "$4" "$5" >"$6/log1" 2>&1 & b=$!
wait $a; echo $? >"$6/rc0"; wait $b; echo $? >"$6/rc1"
"""
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(
            [
                "unshare",
                "-rm",
                "sh",
                "-c",
                script,
                "sh",
                size,
                sys.executable,
                str(WORKER),
                str(_free_port()),
                scenario,
                d,
            ],
            env=_env(timeout_s),
            timeout=wall,
            check=True,
        )
        logs = {pid: Path(d, f"log{pid}").read_text() for pid in (0, 1)}
        rcs = {pid: int(Path(d, f"rc{pid}").read_text()) for pid in (0, 1)}
    for pid in (0, 1):
        assert rcs[pid] == 0, f"process {pid} exited with {rcs[pid]}:\n{logs[pid][-3000:]}"
    return _parse(scenario, logs)


@pytest.mark.slow
def test_full_dev_shm_is_a_clear_error_not_sigbus():
    """The channel needs 28 MiB; /dev/shm has 8: both processes get an error that names the
    bytes and how to get them, at once (was: SIGBUS in one process, the other waited out its
    timeout)."""
    results = _run_with_small_dev_shm("small_shm", "8m")
    for pid in (0, 1):
        r = results[pid]
        assert r["error"] is not None, r
        assert "/dev/shm" in r["error"] and "--shm-size" in r["error"], r["error"]
        assert r["seconds"] < 15, r


@pytest.mark.slow
def test_channel_region_holds_only_the_slots_the_protocol_uses():
    """Reserved up front, tp x (tp-1) x 2 slots (28 MiB here) fit in a 30 MiB /dev/shm; tp x tp x 2
    (32 MiB) would not."""
    results = _run_with_small_dev_shm("small_shm", "30m")
    for pid in (0, 1):
        r = results[pid]
        assert r["error"] is None, r["error"]
        diff, finite = r["diff"]
        assert finite and diff < 1e-4, r


@pytest.mark.slow
def test_reset_is_collective_and_generations_never_pair():
    """reset() in both processes, one 1.5 s late, with no barrier of the caller's: both run
    again correctly (before: the early one reopened the late one's stale segment and both
    timed out). reset() in one process only: a clear error after the timeout. A process
    that dropped its channels behind the barrier's back: its peer is told at once."""
    results, _ = _run("reset", timeout_s="5")
    for pid in (0, 1):
        r = results[pid]
        assert r["first"] is None, r["first"]
        # no barrier of the caller's: reset() agrees on a generation with the peer itself
        assert r["after_reset"] is None, r["after_reset"]
    lonely = results[0]["lonely_reset"]
    assert lonely is not None and "process 1" in lonely and "every process" in lonely, lonely
    assert results[0]["lonely_reset_s"] < 5 + 5
    # process 0 is on another generation: process 1 is told so at once, process 0 times out
    stale = results[1]["stale"]
    assert stale is not None and "generation" in stale and "process 0" in stale, stale
    assert results[1]["stale_s"] < 3, results[1]
    stale0 = results[0]["stale"]
    assert stale0 is not None and "never opened" in stale0 and "generation" in stale0, stale0


def _stopped(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow
def test_stopped_peer_fails_the_survivor_within_the_timeout(tmp_path):
    """Process 1 stops (SIGSTOP) while holding a lock in the channel's shared memory, if the
    channel has any (an LD_PRELOAD shim stops it right after its 2000th process-shared mutex
    lock), else at a random moment of its loop of fused calls. Process 0's call must end in
    the timeout diagnostic, not block on the stopped peer's lock."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler for the LD_PRELOAD shim")
    shim = tmp_path / "stop_holding_lock.so"
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-O2",
            "-o",
            str(shim),
            str(Path(__file__).resolve().parent / "stop_holding_lock.c"),
            "-ldl",
        ],
        check=True,
    )
    extra = {1: {"LD_PRELOAD": str(shim), "FLUX_TEST_STOP_AFTER_SHARED_LOCKS": "2000"}}
    procs = _spawn("peer_stopped", timeout_s="3", extra_env=extra)
    p0, p1 = procs
    try:
        deadline = time.time() + 180
        seen = ""
        while "LOOPING" not in seen and not _stopped(p1.pid):
            assert time.time() < deadline and p1.poll() is None, f"process 1 never looped:\n{seen}"
            ready, _, _ = select.select([p1.stdout], [], [], 1.0)
            if ready:
                seen += p1.stdout.readline()
        time.sleep(random.uniform(0.2, 1.0))
        if not _stopped(p1.pid):
            os.kill(p1.pid, signal.SIGSTOP)
        try:
            out, err = p0.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("process 0 hung after its peer was stopped")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    results = {0: json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])}
    r = results[0]
    assert r.get("error") is not None, f"no error:\n{(out + err)[-3000:]}"
    # Stopped inside a call's data wait: the call's timeout; inside its closing agreement (the
    # peers' "done"), which waits twice the timeout so that a peer's own failure is reported first.
    assert re.search(r"timed out after (3|6) s", r["error"]), r["error"]
    assert r["failing_call_s"] < 2 * 3 + 5, r
    _assert_no_segments_left(results)
