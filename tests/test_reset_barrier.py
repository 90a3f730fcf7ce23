"""flux_jax's agreements across processes (flux_jax/_distributed.py: the first-use handshake and
reset()'s barrier) with jax.distributed's key-value store replaced by a fake; the real thing runs in
test_multiprocess.py (e.g. test_reset_is_collective_and_generations_never_pair)."""

import socket

import numpy as np
import pytest

import flux_jax
from flux_jax import _distributed, _lowering


class FakeStore:
    def __init__(self):
        self.data = {}
        self.waits_ms = []

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.data, f"key {key} written twice"
        self.data[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        assert timeout_ms >= 1
        self.waits_ms.append(timeout_ms)
        if key not in self.data:
            raise RuntimeError(f"DEADLINE_EXCEEDED after {timeout_ms} ms: {key}")
        return self.data[key]


@pytest.fixture
def store(monkeypatch):
    store = FakeStore()
    info = _distributed.ProcessInfo(index=0, count=3, session="s", hosts=("h",) * 3)
    monkeypatch.setattr(_distributed.jax, "process_count", lambda: 3)
    monkeypatch.setattr(_distributed, "process_info", lambda: info)
    monkeypatch.setattr(_distributed, "_client", lambda: store)
    monkeypatch.setattr(_distributed, "_reset_generation", 0)
    return store


def test_waits_for_every_process_then_moves_to_the_next_generation(store):
    store.data["flux_jax/v1/reset/1/1"] = store.data["flux_jax/v1/reset/1/2"] = "1"
    _distributed.reset_barrier(1.0)
    assert store.data["flux_jax/v1/reset/1/0"] == "1"
    assert _distributed._reset_generation == 1


def test_a_missing_process_is_named_and_nothing_moves_until_it_comes(store):
    store.data["flux_jax/v1/reset/1/1"] = "1"
    with pytest.raises(
        RuntimeError,
        match=r"process 2 did not call flux_jax.reset\(\) within 0.2 s.*"
        r"every process must call it.*generation 1",
    ):
        _distributed.reset_barrier(0.2)
    assert _distributed._reset_generation == 0
    store.data["flux_jax/v1/reset/1/2"] = "1"  # process 2 arrives; this process calls reset() again
    _distributed.reset_barrier(0.2)
    assert _distributed._reset_generation == 1


def test_single_process_needs_no_store(monkeypatch):
    monkeypatch.setattr(_distributed.jax, "process_count", lambda: 1)
    monkeypatch.setattr(_distributed, "_client", lambda: pytest.fail("touched the store"))
    _distributed.reset_barrier(1.0)


class FakeIdentity:
    """The extension's process identity (cpp/include/flux_jax/process.h)."""

    identity = None

    def set_process_identity(self, index, identity):
        self.identity = (index, identity)


@pytest.fixture
def handshake(monkeypatch):
    store, ext = FakeStore(), FakeIdentity()
    monkeypatch.setattr(_distributed.jax, "process_index", lambda: 0)
    monkeypatch.setattr(_distributed.jax, "process_count", lambda: 2)
    monkeypatch.setattr(_distributed, "_client", lambda: store)
    monkeypatch.setattr(_distributed._native, "extension", lambda: ext)
    _distributed.process_info.cache_clear()
    _distributed._job_tokens.cache_clear()
    yield store, ext
    _distributed.process_info.cache_clear()
    _distributed._job_tokens.cache_clear()


def test_the_handshake_is_bounded_by_timeout_s_names_the_late_process_and_can_be_retried(handshake):
    store, ext = handshake
    with flux_jax.config(timeout_s=0.25):
        with pytest.raises(
            flux_jax.FusedUnavailableError,
            match=r"process 1 did not join flux_jax's handshake within 0.25 s.*initialize_distributed\(\) in every",
        ):
            _distributed.process_info()
        assert store.waits_ms and max(store.waits_ms) <= 250  # was a fixed 120 s
        secret = store.data["flux_jax/v1/shm_secret"]
        store.data["flux_jax/v1/host/1"] = "peer-host"  # the late process arrives
        info = _distributed.process_info()  # no key written twice (the store would raise)
    assert store.data["flux_jax/v1/shm_secret"] == secret  # what the peer may have read already
    assert info.hosts == (socket.gethostname(), "peer-host") and len(secret) == 32
    assert ext.identity == (0, f"{info.session}/{secret}")


def test_groups_within_one_process_need_no_handshake(handshake, monkeypatch):
    """A TP group whose devices are all this process's (e.g. an evaluation on process 1's own
    devices) shares no memory with other processes: no waiting for them, only the process index."""
    store, ext = handshake
    monkeypatch.setattr(_distributed.jax, "process_index", lambda: 1)
    groups = np.array([[_lowering._Device(2, 1), _lowering._Device(3, 1)]], dtype=object)
    assert _lowering._spans_hosts(groups) is None
    assert ext.identity == (1, "") and not store.waits_ms
    groups = np.array([[_lowering._Device(0, 0), _lowering._Device(2, 1)]], dtype=object)
    with flux_jax.config(timeout_s=0.1), pytest.raises(flux_jax.FusedUnavailableError, match="process 0 did not join"):
        _lowering._spans_hosts(groups)  # a group across processes does wait for them
