"""Cross-process TP groups on GPUs: CUDA IPC workspaces exchanged through jax.distributed.

With one process per GPU (jax.distributed), the GPUs of a TP group on one host live in different
processes. Each process allocates its member of the group's workspace once (fixed capacity:
`initialize_distributed(gpu_workspace_mib=...)`), exports CUDA IPC handles, publishes them in
jax.distributed's key-value store, and opens its peers' handles. This runs when a program with
fused ops is lowered (every process lowers the same program), before anything executes; the
kernels then use the peers' memory exactly as in one process. No files, sockets or launchers.
"""

from __future__ import annotations

import atexit

import jax
import numpy as np

from flux_jax import _distributed, _native
from flux_jax._errors import FusedUnavailableError

_KEY = "flux_jax/v1/ipc/{session}/{generation}/{group}/{rank}"
# 256 MiB for the overlap kernels' buffers + 64 MiB of latency / decode slots + 64 MiB of
# low-latency slots (matmul_rs's decode path)
DEFAULT_WORKSPACE_MIB = 384

_workspace_mib = DEFAULT_WORKSPACE_MIB
_ready: set[tuple[int, ...]] = set()
_failed: dict[tuple[int, ...], str] = {}  # groups whose setup failed (in any process): why


def set_workspace_mib(mib: int) -> None:
    global _workspace_mib
    if not (isinstance(mib, int) and mib >= 192):
        raise ValueError(
            f"gpu_workspace_mib must be an int >= 192 (128 MiB of slots and >= 64 for the overlap buffers), got {mib!r}"
        )
    if _ready:
        raise RuntimeError("gpu_workspace_mib must be set before the first fused op")
    _workspace_mib = mib


def forget() -> None:
    """After reset(): the workspaces are gone; the next lowering sets them up again, under keys of
    the new reset generation (collective: the same in every process, whatever each had set up)."""
    _ready.clear()
    _failed.clear()


def ensure_groups(groups: np.ndarray, timeout_s: float) -> None:
    """Sets up every cross-process TP group (rows of `groups`) that has a device of this process."""
    me = jax.process_index()  # no handshake for groups within this process
    for row in groups:
        procs = {d.process_index for d in row}
        key = tuple(int(d.id) for d in row)
        if len(procs) == 1 or me not in procs or key in _ready:
            continue
        if key in _failed:
            raise FusedUnavailableError(_failed[key])
        try:
            _setup(row, key, timeout_s)
        except FusedUnavailableError as err:
            _failed[key] = str(err)
            raise
        if not _ready:
            atexit.register(_close_at_exit)
        _ready.add(key)


def _close_at_exit() -> None:
    """Close the peers' IPC mappings and free our workspaces before JAX shuts down."""
    if not _ready:
        return
    try:
        _native.extension().reset_cuda_workspaces()
    except Exception:  # noqa: BLE001 - never fail an interpreter exit
        pass


def _setup(row, key: tuple[int, ...], timeout_s: float) -> None:
    ext = _native.extension()
    info = _distributed.process_info()
    client = _distributed._client()
    ids = [int(d.id) for d in row]
    procs = [int(d.process_index) for d in row]
    slot_bytes = 64 << 20  # the slot area, and as much again for the low-latency area
    data_bytes = (_workspace_mib << 20) - 2 * slot_bytes
    name = lambda rank: _KEY.format(
        session=info.session,
        generation=_distributed.reset_generation(),  # noqa: E731
        group="-".join(map(str, key)),
        rank=rank,
    )
    local = [(r, int(d.local_hardware_id)) for r, d in enumerate(row) if d.process_index == info.index]

    def fetch(key: str, rank: int, what: str) -> str:
        try:
            return client.blocking_key_value_get(key, int(timeout_s * 1000))
        except Exception as err:  # the coordination service raises on timeout
            d = row[rank]
            raise FusedUnavailableError(
                f"flux_jax: rank {rank} (device {d.id}, process {d.process_index}) of the TP group "
                f"{ids} did not publish its {what} within {timeout_s:g} s; every process must "
                f"lower the same program ({err})"
            ) from err

    for rank, ordinal in local:
        blob = ext.cuda_ipc_export(ids, procs, ordinal, data_bytes, slot_bytes)
        client.key_value_set(name(rank), bytes(blob).hex())
    status = "ok"
    try:
        for rank, d in enumerate(row):
            if d.process_index == info.index:
                continue
            blob = bytes.fromhex(fetch(name(rank), rank, "GPU workspace"))
            for _, ordinal in local:
                ext.cuda_ipc_import(ids, procs, ordinal, rank, blob)
    except RuntimeError as err:  # e.g. the peer GPU is not visible to this process
        status = f"process {info.index} could not map its peers' workspaces: {err}"
    # Every process must take the same decision (fused or not), so they compare notes.
    for rank, _ in local:
        client.key_value_set(name(rank) + "/status", status)
    failures = sorted(
        {s for s in (fetch(name(r) + "/status", r, "setup status") for r in range(len(row))) if s != "ok"}
    )
    if failures:
        raise FusedUnavailableError(
            f"flux_jax: no CUDA IPC between the processes of TP group {ids}: " + "; ".join(failures)
        )
