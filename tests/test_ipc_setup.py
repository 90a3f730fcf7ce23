"""flux_jax/_ipc.py, the Python half of cross-process GPU groups, with the extension and the
jax.distributed key-value store replaced by fakes (the GPU half runs in test_gpu_multiprocess)."""

import dataclasses

import numpy as np
import pytest

import flux_jax
from flux_jax import _distributed, _ipc


@dataclasses.dataclass
class FakeDevice:
    id: int
    process_index: int
    local_hardware_id: int


class FakeStore:
    def __init__(self, preset=None):
        self.data = dict(preset or {})

    def key_value_set(self, key, value):
        assert key not in self.data, f"key {key} written twice"
        self.data[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        if key not in self.data:
            raise RuntimeError(f"DEADLINE_EXCEEDED after {timeout_ms} ms: {key}")
        return self.data[key]


class FakeExtension:
    def __init__(self):
        self.exports, self.imports = [], []

    def cuda_ipc_export(self, devices, processes, ordinal, data_bytes, slot_bytes):
        self.exports.append((tuple(devices), tuple(processes), ordinal, data_bytes, slot_bytes))
        return bytes([ordinal]) * 8

    def cuda_ipc_import(self, devices, processes, ordinal, peer_rank, blob):
        if blob == b"bad":
            raise RuntimeError("cudaIpcOpenMemHandle: invalid device context")
        self.imports.append((tuple(devices), ordinal, peer_rank, blob))


@pytest.fixture
def fakes(monkeypatch):
    ext, store = FakeExtension(), FakeStore()
    info = _distributed.ProcessInfo(index=0, count=2, session="s3ss10n", hosts=("h", "h"))
    monkeypatch.setattr(_ipc._native, "extension", lambda: ext)
    monkeypatch.setattr(_ipc._distributed, "process_info", lambda: info)
    monkeypatch.setattr(_ipc._distributed, "_client", lambda: store)
    monkeypatch.setattr(_ipc, "_ready", set())
    monkeypatch.setattr(_ipc, "_failed", {})
    monkeypatch.setattr(_distributed, "_reset_generation", 0)
    return ext, store


def test_exports_publishes_then_imports_every_remote_rank(fakes):
    ext, store = fakes
    # Process 1 already published rank 1 of group (0, 1); the group (2, 3) is local to process 1.
    store.data["flux_jax/v1/ipc/s3ss10n/0/0-1/1"] = (b"\x05" * 8).hex()
    store.data["flux_jax/v1/ipc/s3ss10n/0/0-1/1/status"] = "ok"
    groups = np.array([[FakeDevice(0, 0, 0), FakeDevice(1, 1, 0)], [FakeDevice(2, 1, 1), FakeDevice(3, 1, 2)]])
    _ipc.ensure_groups(groups, timeout_s=1.0)
    # data, then the slot area; the low-latency area (allocated by the extension) is as large again
    assert ext.exports == [((0, 1), (0, 1), 0, (_ipc.DEFAULT_WORKSPACE_MIB - 128) << 20, 64 << 20)]
    assert store.data["flux_jax/v1/ipc/s3ss10n/0/0-1/0"] == (b"\x00" * 8).hex()
    assert ext.imports == [((0, 1), 0, 1, b"\x05" * 8)]
    _ipc.ensure_groups(groups, timeout_s=1.0)  # once per group
    assert len(ext.exports) == 1


def test_a_peer_that_never_publishes_is_a_clear_error(fakes):
    groups = np.array([[FakeDevice(0, 0, 0), FakeDevice(1, 1, 0)]])
    with pytest.raises(flux_jax.FusedUnavailableError, match=r"rank 1 \(device 1, process 1\).*within 0.5 s"):
        _ipc.ensure_groups(groups, timeout_s=0.5)


@pytest.mark.parametrize("who", ["this process", "the peer"])
def test_a_failed_mapping_anywhere_makes_every_process_fall_back(fakes, who):
    ext, store = fakes
    key = "flux_jax/v1/ipc/s3ss10n/0/0-1/1"
    store.data[key] = b"bad".hex() if who == "this process" else (b"\x05" * 8).hex()
    store.data[key + "/status"] = "ok" if who == "this process" else "process 1 could not map: boom"
    groups = np.array([[FakeDevice(0, 0, 0), FakeDevice(1, 1, 0)]])
    with pytest.raises(flux_jax.FusedUnavailableError, match="no CUDA IPC between the processes"):
        _ipc.ensure_groups(groups, timeout_s=1.0)
    # Our own verdict was published for the peer to read, and a second lowering fails the same way.
    mine = store.data["flux_jax/v1/ipc/s3ss10n/0/0-1/0/status"]
    assert (mine != "ok") == (who == "this process"), mine
    with pytest.raises(flux_jax.FusedUnavailableError, match="no CUDA IPC"):
        _ipc.ensure_groups(groups, timeout_s=1.0)
    assert len(ext.exports) == 1


@pytest.mark.parametrize("set_up_before", [True, False])
def test_reset_uses_the_collective_generations_keys(fakes, monkeypatch, set_up_before):
    """Keys carry the job's reset generation (reset_barrier's count, the same in every process),
    also in a process that had set nothing up when it reset: a local count would differ there and
    read the peer's handles to freed workspaces."""
    ext, store = fakes
    for generation, blob in ((0, "aa"), (1, "bb")):
        store.data[f"flux_jax/v1/ipc/s3ss10n/{generation}/0-1/1"] = blob
        store.data[f"flux_jax/v1/ipc/s3ss10n/{generation}/0-1/1/status"] = "ok"
    groups = np.array([[FakeDevice(0, 0, 0), FakeDevice(1, 1, 0)]])
    if set_up_before:
        _ipc.ensure_groups(groups, timeout_s=1.0)
    monkeypatch.setattr(_distributed, "_reset_generation", 1)  # what reset()'s barrier does
    _ipc.forget()
    _ipc.ensure_groups(groups, timeout_s=1.0)  # would raise "written twice" with the old keys
    assert [blob for *_, blob in ext.imports] == ([b"\xaa"] if set_up_before else []) + [b"\xbb"]
    assert "flux_jax/v1/ipc/s3ss10n/1/0-1/0" in store.data


def test_workspace_size_is_checked_and_fixed_before_first_use(fakes):
    with pytest.raises(ValueError, match="gpu_workspace_mib"):
        _ipc.set_workspace_mib(16)
    _ipc._ready.add((0, 1))
    with pytest.raises(RuntimeError, match="before the first fused op"):
        _ipc.set_workspace_mib(512)


def test_groups_within_this_process_need_no_handshake(fakes, monkeypatch):
    """GPUs of one process share no IPC: no waiting for the other processes' handshake."""
    ext, _ = fakes
    monkeypatch.setattr(_ipc._distributed, "process_info", lambda: pytest.fail("waited for the other processes"))
    _ipc.ensure_groups(np.array([[FakeDevice(0, 0, 0), FakeDevice(1, 0, 1)]]), timeout_s=1.0)
    assert ext.exports == []
