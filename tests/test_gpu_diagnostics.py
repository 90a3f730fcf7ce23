"""The CUDA backend's failure diagnostics and setup checks, run on CPU.

The GPU build formats device-side wait records and checks its setup with these same host
functions (cpp/include/flux_jax/wait_record.h, gpu_checks.h); the kernels and the loopback tests
(tools/loopback/) supply the records on a GPU. Here: each rank's error names the rank it waited
for, a wait that gave up because another one failed says so and names the first failure, the
hardware-queue check, and the CUDA IPC blob check.
"""

import re

import pytest

from flux_jax import _native

SITES = {  # WaitSite -> the words its diagnostic uses
    1: "to reach the op",
    2: "waited for rows of chunk 3, piece 2 from rank 7",
    3: "waited for partial sums, piece 2, from rank 7",
    4: "waited in all_gather for block 2 of the rows of rank 7",
    5: "waited in reduce_scatter for block 2 of the partial sums of rank 7",
    6: "waited in ag_matmul's decode GEMM for push block 2 of the rows of rank 7",
    7: "waited in matmul_rs's decode GEMM for the partial sums of output tile 2 from rank 7",
    8: "waited in all_reduce for block 2 of the partial sums of rank 7",
    9: "waited in matmul_ar's decode GEMM for the partial sums of output tile 2 from rank 7",
}
TIMED_OUT, GAVE_UP = 1, 3
GROUP = "TP group 0 [devices 0,1,2,3,4,5,6,7]"


def ext():
    return _native.extension()


def record(code, rank, peer, site=1, device=0, epoch=12, seen=11, **kw):
    return dict(
        code=code,
        site=site,
        device=device,
        rank=rank,
        peer=peer,
        chunk=kw.pop("chunk", 3),
        piece=kw.pop("piece", 2),
        epoch=epoch,
        seen=seen,
        **kw,
    )


def describe(own, first, device=0, group=GROUP):
    return ext().describe_wait_failure(own, first, device, group)


@pytest.mark.parametrize("site", sorted(SITES))
def test_a_timeout_names_rank_peer_epoch_and_site(site):
    msg = describe(record(TIMED_OUT, 5, 7, site=site), record(TIMED_OUT, 5, 7, site=site))
    assert msg.startswith("flux_jax: a fused op on GPU 0 timed out (rank 5 ")
    assert SITES[site] in msg and "rank 7" in msg and "epoch 12, flag value seen 11" in msg
    assert GROUP in msg and "flux_jax.reset()" in msg


def test_the_presence_timeout_keeps_the_documented_wording():
    # tests/test_gpu_fused.py matches this on a GPU.
    msg = describe(record(TIMED_OUT, 0, 1, epoch=3, seen=2, missing=0b10), {})
    assert re.search(r"timed out \(rank \d waited for rank 1 to reach the op; epoch \d+", msg), msg


def test_a_wait_that_gave_up_names_its_own_peer_and_the_first_failure():
    # Loopback at TP 8, rank 7 silent: rank 3 times out first; rank 5's wait for rank 7 then gives
    # up. Rank 5's error names its own wait (rank 7), never rank 3's, and says what came first.
    own = record(GAVE_UP, 5, 7, epoch=12, seen=11, missing=1 << 7)
    first = record(TIMED_OUT, 3, 7, epoch=12, seen=11, missing=1 << 7)
    msg = describe(own, first)
    mine = msg[: msg.index(" because ")]
    assert "gave up (rank 5 waited for rank 7 to reach the op; epoch 12" in mine
    assert "rank 3" not in mine and "timed out" not in mine
    assert "because a wait on GPU 0 had timed out first (rank 3 waited for rank 7 to reach the op" in msg


def test_every_missing_rank_is_listed():
    msg = describe(record(TIMED_OUT, 2, 0, missing=(1 << 0) | (1 << 7)), {})
    assert "rank 2 waited for rank 0 to reach the op" in msg and "ranks not there: 0, 7" in msg
    one = describe(record(TIMED_OUT, 2, 7, missing=1 << 7), {})
    assert "ranks not there" not in one  # one missing rank: the peer says it all


def test_a_failure_copied_from_another_gpu_says_where_it_happened():
    msg = describe({}, record(TIMED_OUT, 1, 0, device=1), device=0)
    assert "a fused op on GPU 1 timed out (rank 1 waited for rank 0" in msg
    assert "fused ops on GPU 0 of the same group stop too" in msg


def test_no_record_no_error():
    assert describe({}, {}) == ""
    assert describe(record(0, 1, 2), record(2, 1, 2)) == ""  # code 2: reset() draining, not a failure


@pytest.mark.parametrize(
    "env,ranks,ok",
    [
        ("1", 1, True),
        (None, 1, True),
        ("1", 2, False),
        ("3", 2, False),
        ("4", 2, True),
        (None, 4, True),
        (None, 8, False),
        ("16", 8, True),
        ("32", 8, True),
        ("abc", 4, True),
        ("", 8, False),
    ],
)
def test_hardware_queues(env, ranks, ok):
    msg = ext().check_hardware_queues(env, ranks, 0, GROUP)
    if ok:
        assert msg == ""
        return
    assert f"{ranks} ranks of {GROUP} share GPU 0" in msg
    assert f"CUDA_DEVICE_MAX_CONNECTIONS={env if env else '(unset)'}" in msg
    assert f"at least {2 * ranks}" in msg and f"Set CUDA_DEVICE_MAX_CONNECTIONS={2 * ranks}" in msg
    assert "deadlock" in msg and "one rank per GPU" in msg


MIB = 1 << 20
SIZES = [4096, 256 * MIB, 64 * MIB, 64 * MIB]


def test_ipc_peer_sizes_match():
    assert ext().check_ipc_peer(1, 2, 1, 2, SIZES, SIZES, [0, 0, 0, 0], GROUP) == ""
    assert ext().check_ipc_peer(1, 2, 1, 2, SIZES, SIZES, [8192, 256 * MIB, 64 * MIB, 128 * MIB], GROUP) == ""


def test_ipc_peer_with_other_sizes_is_named():
    declared = [4096, 384 * MIB, 64 * MIB, 64 * MIB]
    msg = ext().check_ipc_peer(3, 4, 3, 4, declared, SIZES, [0, 0, 0, 0], GROUP)
    assert f"rank 3 of {GROUP} declares a data area of {384 * MIB} bytes" in msg
    assert f"this process's member has {256 * MIB} bytes" in msg and "gpu_workspace_mib" in msg


def test_ipc_peer_mapping_smaller_than_declared_is_named():
    msg = ext().check_ipc_peer(1, 2, 1, 2, SIZES, SIZES, [4096, 256 * MIB, 32 * MIB, 64 * MIB], GROUP)
    assert f"the slot area mapped from rank 1 of {GROUP}'s CUDA IPC handle holds {32 * MIB} bytes" in msg


def test_ipc_blob_of_another_rank_is_named():
    msg = ext().check_ipc_peer(1, 2, 0, 2, SIZES, SIZES, [0, 0, 0, 0], GROUP)
    assert f"the CUDA IPC blob given for rank 1 of {GROUP} was published by rank 0" in msg
