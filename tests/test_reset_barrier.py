"""flux_jax.reset()'s agreement across processes (flux_jax/_distributed.py, reset_barrier) with
jax.distributed's key-value store replaced by a fake; the real thing runs in
test_multiprocess.py::test_reset_is_collective_and_generations_never_pair."""

import pytest

from flux_jax import _distributed


class FakeStore:
    def __init__(self):
        self.data = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.data, f"key {key} written twice"
        self.data[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        assert timeout_ms >= 1
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
