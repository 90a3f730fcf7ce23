"""Lowering of the fused primitives to XLA FFI custom calls.

The same HLO runs on every device, so per-device facts cannot be attributes.
What *is* the same everywhere is the mesh: at lowering time the shard_map's
concrete mesh is known, so we pass the table of device ordinals of every TP
group (`tp_devices[g * tp + r]`); each device finds itself in it at run time and
cross-checks its rank against lax.axis_index, passed as an operand.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
from jax.interpreters import mlir

from flux_jax._config import Config
from flux_jax._errors import FusedUnavailableError

# Unique per emitted custom call; the CPU backend pairs calls across devices by
# it (XLA:CPU may run independent calls concurrently, in any order).
_callsite_ids = itertools.count(1)


def _device_ordinal(device) -> int:
    local_id = getattr(device, "local_hardware_id", None)
    return int(device.id if local_id is None else local_id)


def tp_device_table(ctx, axis_name: str, tp_size: int) -> np.ndarray:
    """int64 [num_groups * tp] table of device ordinals, rank-major within a group."""
    axis_context = ctx.module_context.axis_context
    mesh = getattr(axis_context, "mesh", None)
    devices = getattr(mesh, "devices", None)
    if devices is None or not isinstance(devices, np.ndarray):
        raise FusedUnavailableError(
            "flux_jax fused ops need the concrete device mesh at lowering time: call them inside "
            "jax.shard_map(..., mesh=<jax.sharding.Mesh>) or under jax.set_mesh(mesh), not with "
            f"an abstract mesh (got {type(axis_context).__name__} with mesh {mesh!r})"
        )
    manual = getattr(axis_context, "manual_axes", frozenset(mesh.axis_names))
    auto = [a for a, s in zip(mesh.axis_names, devices.shape) if s > 1 and a not in manual]
    if auto:
        raise FusedUnavailableError(
            f"flux_jax fused ops need a fully manual shard_map, but mesh axes {auto} are left to "
            "the automatic partitioner (shard_map axis_names=...). Map every mesh axis, or use "
            'impl="xla".'
        )
    axis = list(mesh.axis_names).index(axis_name)
    if devices.shape[axis] != tp_size:
        raise FusedUnavailableError(f"mesh axis {axis_name!r} has size {devices.shape[axis]}, not {tp_size}")
    groups = np.moveaxis(devices, axis, -1).reshape(-1, tp_size)
    return np.array([[_device_ordinal(d) for d in row] for row in groups], dtype=np.int64).ravel()


def register_fused_lowering(prim, target: str, cuda_available) -> None:
    """Registers CPU and CUDA lowerings of `prim` to the FFI target `target`."""

    def rule(ctx, *operands, axis_name, tp_size, transpose_w, config: Config, **op_attrs):
        table = tp_device_table(ctx, axis_name, tp_size)
        return jax.ffi.ffi_lowering(target)(
            ctx,
            *operands,
            tp_size=np.int64(tp_size),
            tp_devices=table,
            w_transposed=bool(transpose_w),
            callsite=np.int64(next(_callsite_ids)),
            timeout_us=np.int64(config.timeout_us),
            jitter_us=np.int64(config.debug_jitter_us),
            drop_rank=np.int64(config.debug_drop_rank),
            poison=bool(config.debug_poison_outputs),
        )

    def cuda_rule(ctx, *operands, **params):
        if not cuda_available():
            raise FusedUnavailableError(
                f"flux_jax: no CUDA kernel for {prim.name} in this build "
                f"(flux_jax.build_info() says what was built); use impl='xla' or 'auto'"
            )
        return rule(ctx, *operands, **params)

    mlir.register_lowering(prim, rule, platform="cpu")
    mlir.register_lowering(prim, cuda_rule, platform="cuda")
