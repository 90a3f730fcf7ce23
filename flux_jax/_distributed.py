"""Process identity for fused ops in multi-process jobs (jax.distributed).

Every process of a job needs the same job token (it groups the job's
shared-memory segments in /dev/shm for people), the same secret (>= 128 bits;
the extension derives the segments' names from it with a keyed hash, so other
local users cannot predict them) and the host of every process (a TP group that
spans hosts cannot use the fused kernels). All travel through jax.distributed's
key-value store: no files, no sockets of our own; whoever can read that store is
trusted (docs/trust.md). The store has no public wrapper in jax 0.11.2, so this
module (with _ipc.py) is what touches it. `reset_barrier` makes flux_jax.reset()
collective across the processes.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import socket
import time

import jax

from flux_jax import _native
from flux_jax._config import get_config
from flux_jax._errors import FusedUnavailableError

_SESSION_KEY = "flux_jax/v1/session"
_SECRET_KEY = "flux_jax/v1/shm_secret"
_HOST_KEY = "flux_jax/v1/host/{}"
_RESET_KEY = "flux_jax/v1/reset/{generation}/{process}"
_SECRET_BYTES = 16  # 128 bits

_shm_secret = ""  # hex; deliberately not in ProcessInfo (whose repr may end up in logs)
_reset_generation = 0  # completed collective resets


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    index: int
    count: int
    session: str  # "" for a single-process job
    hosts: tuple[str, ...]  # host id of every process


_host_override: str | None = None


def initialize(host_id: str | None = None, gpu_workspace_mib: int | None = None) -> ProcessInfo:
    """Set up flux_jax for a multi-process job (call after jax.distributed.initialize).

    Optional: the first fused op does it with the defaults. `host_id` names this
    process's host (default: socket.gethostname()); processes with equal host ids
    may share fused TP groups, others fall back to the XLA twin. `gpu_workspace_mib`
    sizes the GPU workspace of a TP group that spans processes (allocated once, it
    cannot grow; default 384 MiB per GPU, outside XLA's memory pool).
    """
    global _host_override
    if gpu_workspace_mib is not None:
        from flux_jax import _ipc

        _ipc.set_workspace_mib(gpu_workspace_mib)
    if host_id is not None:
        if process_info.cache_info().currsize:
            raise RuntimeError("flux_jax.initialize_distributed(host_id=...) must come before the first fused op")
        _host_override = host_id
    return process_info()


def _client():
    from jax._src import distributed  # private: the key-value store's only handle in 0.11.2

    client = distributed.global_state.client
    if client is None:
        raise FusedUnavailableError(
            "flux_jax: this job has several JAX processes but jax.distributed is not initialized; "
            "call jax.distributed.initialize(...) first"
        )
    return client


@functools.cache
def process_info() -> ProcessInfo:
    """This process, the job's session and every process's host: a handshake through the
    key-value store that every process of the job joins (at its first fused op whose TP group
    spans processes, or at initialize()); each wait is bounded by Config.timeout_s."""
    index, count = jax.process_index(), jax.process_count()
    host = _host_override or socket.gethostname()
    if count == 1:
        info = ProcessInfo(index, count, "", (host,))
    else:
        client = _client()
        deadline = time.monotonic() + get_config().timeout_s
        if index == 0:  # the same values if an earlier handshake timed out: peers may hold them
            client.key_value_set(_SECRET_KEY, _job_tokens()[0], allow_overwrite=True)
            client.key_value_set(_SESSION_KEY, _job_tokens()[1], allow_overwrite=True)
        client.key_value_set(_HOST_KEY.format(index), host, allow_overwrite=True)
        global _shm_secret
        session, _shm_secret = _await(client, [(0, _SESSION_KEY), (0, _SECRET_KEY)], deadline)
        hosts = tuple(_await(client, [(p, _HOST_KEY.format(p)) for p in range(count)], deadline))
        info = ProcessInfo(index, count, session, hosts)
    # one string: the binding takes (index, identity); cpp/include/flux_jax/process.h
    _native.extension().set_process_identity(info.index, f"{info.session}/{_shm_secret}" if info.session else "")
    return info


def set_local_identity() -> None:
    """Tell the extension which process this is, without the handshake: enough for TP groups
    whose devices are all this process's (they share no memory with other processes)."""
    if not process_info.cache_info().currsize:
        _native.extension().set_process_identity(jax.process_index(), "")


@functools.cache
def _job_tokens() -> tuple[str, str]:
    """Process 0's (secret, session), drawn once."""
    return secrets.token_hex(_SECRET_BYTES), secrets.token_hex(6)


def _gather(client, keys: list[tuple[int, str]], deadline: float) -> tuple[list[str], list[int]]:
    """(the values of `keys`, (publishing process, key) pairs, in order; the processes whose key
    was not published by `deadline`, each once)."""
    values, missing = [], []
    for p, key in keys:
        try:
            values.append(client.blocking_key_value_get(key, max(1, int((deadline - time.monotonic()) * 1000))))
        except Exception:  # noqa: BLE001 - the coordination service raises on timeout
            if p not in missing:
                missing.append(p)
    return values, missing


def _await(client, keys: list[tuple[int, str]], deadline: float) -> list[str]:
    """_gather's values; a clear error naming the processes that did not publish theirs."""
    values, missing = _gather(client, keys, deadline)
    if missing:
        who = ", ".join(map(str, missing))
        raise FusedUnavailableError(
            f"flux_jax: process{'es' if len(missing) > 1 else ''} {who} did not join flux_jax's handshake within "
            f"{get_config().timeout_s:g} s (flux_jax.Config.timeout_s). Every process of the job joins it at its first "
            "fused op whose TP group spans processes; call flux_jax.initialize_distributed() in every process right "
            "after jax.distributed.initialize() so that slow starts (loading, compiling) do not count against an op."
        )
    return values


def register_local_devices(platform: str, devices) -> None:
    """Tell the extension which global device id each local ordinal has."""
    me = jax.process_index()
    pairs = [
        (int(d.local_hardware_id), int(d.id))
        for d in devices
        if d.process_index == me and d.local_hardware_id is not None
    ]
    _native.extension().register_local_devices(platform, pairs)


def reset_generation() -> int:
    """Collective resets completed so far: the same in every process of the job."""
    return _reset_generation


def reset_barrier(timeout_s: float) -> None:
    """flux_jax.reset()'s agreement: every process of a multi-process job calls reset().

    Each process announces its next reset generation in the key-value store and waits
    (at most `timeout_s`) until every process announced the same one; only then does the
    caller drop its state. If a process does not come, this raises and nothing is reset
    here; calling reset() again waits for the same generation. A single process returns
    at once.
    """
    global _reset_generation
    if jax.process_count() == 1:
        return
    info = process_info()
    client = _client()
    generation = _reset_generation + 1

    def key(p: int) -> str:
        return _RESET_KEY.format(generation=generation, process=p)

    client.key_value_set(key(info.index), "1", allow_overwrite=True)
    others = [(p, key(p)) for p in range(info.count) if p != info.index]
    _, missing = _gather(client, others, time.monotonic() + timeout_s)
    if missing:
        who = ", ".join(map(str, missing))
        raise RuntimeError(
            f"flux_jax.reset(): process{'es' if len(missing) > 1 else ''} {who} did not call flux_jax.reset() "
            f"within {timeout_s:g} s (flux_jax.Config.timeout_s). In a multi-process job reset() is collective: "
            f"every process must call it (when no fused op runs in any process). Nothing was reset in process "
            f"{info.index}; call reset() again here once every process calls it (it waits for reset generation "
            f"{generation})."
        )
    _reset_generation = generation
