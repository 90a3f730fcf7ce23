"""Lowering of the fused primitives to XLA FFI custom calls.

The same HLO runs on every device, so per-device facts cannot be attributes.
What *is* the same everywhere is the mesh: at lowering time the shard_map's
concrete mesh is known, so we pass the global device ids of every TP group
(`tp_devices[g * tp + r]`) and their processes; each device finds itself in it
at run time (its local ordinal mapped to a global id, registered here). On CPU
it cross-checks its rank against lax.axis_index, passed as an operand; the CUDA
lowering drops that operand (unread there, and it cost a kernel per call).

Lowering is also where the mesh's topology is known: a TP group the fused
kernels cannot serve (spanning hosts; GPU processes that cannot map each
other's memory) lowers to the XLA twin instead, with one log line, or an error
for impl="fused". GPU groups that span processes of one host get their CUDA IPC
workspace here (flux_jax/_ipc.py), before anything runs.

And it is where the fused *path* is picked (Config.fused_path): "overlap", the
one custom call whose GEMM consumes rows as they arrive, "latency", our
one-kernel NVLink collective custom call next to XLA's own GEMM (small M), or
"decode", one custom call whose weight-streaming GEMM moves the rows itself
(AG at most 256 rows, RS 128; other calls take "latency").
"""

from __future__ import annotations

import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from flux_jax import _distributed, _heuristics, _ipc, _native
from flux_jax._config import Config
from flux_jax._errors import FusedUnavailableError

logger = logging.getLogger("flux_jax")
_logged: set[str] = set()

# Unique per emitted custom call; the CPU backend pairs calls across devices by
# it (XLA:CPU may run independent calls concurrently, in any order).
_callsite_ids = itertools.count(1)


def _mesh_of(ctx):
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
    return mesh


def tp_groups(mesh, axis_name: str, tp_size: int) -> np.ndarray:
    """[num_groups, tp] array of the devices of every TP group, rank order."""
    devices = mesh.devices
    axis = list(mesh.axis_names).index(axis_name)
    if devices.shape[axis] != tp_size:
        raise FusedUnavailableError(f"mesh axis {axis_name!r} has size {devices.shape[axis]}, not {tp_size}")
    return np.moveaxis(devices, axis, -1).reshape(-1, tp_size)


def _why_not_fused(groups: np.ndarray, platform: str) -> str | None:
    """None if every TP group can run fused; else the reason (groups across hosts, ...)."""
    info = _distributed.process_info()
    for row in groups:
        procs = sorted({d.process_index for d in row})
        hosts = sorted({info.hosts[p] for p in procs})
        if len(hosts) > 1:
            return (f"TP group of devices {[d.id for d in row]} spans hosts {hosts}; fused ops run "
                    "within one host")
    return None


def _twin_lowering(prim_name, transpose_w, axis_name, outs):
    """The XLA twin of the primitive, for groups the fused kernels cannot serve."""

    def twin(x, w, rank):
        del rank
        w = w.T if transpose_w else w
        if prim_name == "flux_jax_ag_matmul":
            x_full = jax.lax.all_gather(x, axis_name, axis=0, tiled=True)
            return [jnp.dot(x_full, w), x_full][:outs]
        return [jax.lax.psum_scatter(jnp.dot(x, w), axis_name, scatter_dimension=0, tiled=True)]

    return mlir.lower_fun(twin, multiple_results=True)


def _latency_lowering(prim_name, transpose_w, tp_size, outs, attrs, pass_rank):
    """The latency path: our NVLink collective (one custom call) and XLA's GEMM."""

    def collective(target, x, rank, shape):
        result = jax.typeof(x).update(shape=shape)  # keeps the manual-axis type of x
        return jax.ffi.ffi_call(target, result)(*((x, rank) if pass_rank else (x,)), **attrs)

    def latency(x, w, rank):
        w = w.T if transpose_w else w
        if prim_name == "flux_jax_ag_matmul":
            x_full = collective(_native.ALL_GATHER_TARGET, x, rank, (tp_size * x.shape[0], x.shape[1]))
            return [jnp.dot(x_full, w), x_full][:outs]
        partial = jnp.dot(x, w)
        shape = (x.shape[0] // tp_size, partial.shape[1])
        return [collective(_native.REDUCE_SCATTER_TARGET, partial, rank, shape)]

    return mlir.lower_fun(latency, multiple_results=True)


def choose_path(prim_name: str, platform: str, config: Config, x_shape, w_shape, tp_size: int,
                transpose_w: bool, dtype) -> str:
    """"overlap", "latency" or "decode" for one fused call (Config.fused_path, else measurements)."""
    if config.fused_path != "auto":
        return config.fused_path
    if platform == "cpu":
        return "overlap"
    op = "ag_matmul" if prim_name == "flux_jax_ag_matmul" else "matmul_rs"
    rows = tp_size * x_shape[0] if op == "ag_matmul" else x_shape[0]
    n = w_shape[0] if transpose_w else w_shape[1]
    return _heuristics.best_fused_path(op, tp_size, rows, x_shape[1], n, np.dtype(dtype))


# What the decode paths' kernels take (cpp/kernels/cuda/decode_gemm.h, {ag_matmul,matmul_rs}_decode.cu).
DECODE_AG_MAX_ROWS = 256  # the GEMM: one 64-row tile or up to two 128-row tiles
DECODE_RS_MAX_ROWS = 128  # the exchanging epilogue: one tile holds all rows
DECODE_MAX_TP = 8
DECODE_RS_MAX_N = 512 * 64  # matmul_rs: one flag per 64-column output tile, 512 per sender


def decode_supported(prim_name: str, tp_size: int, x_shape, w_shape, transpose_w: bool, dtype) -> bool:
    """Whether Config.fused_path="decode" runs the decode kernels for this call (else "latency")."""
    if not (2 <= tp_size <= DECODE_MAX_TP and not transpose_w and np.dtype(dtype) == jnp.bfloat16):
        return False
    if prim_name == "flux_jax_ag_matmul":
        return 1 <= tp_size * x_shape[0] <= DECODE_AG_MAX_ROWS
    rows, n = x_shape[0], w_shape[1]
    return 1 <= rows <= DECODE_RS_MAX_ROWS and rows % tp_size == 0 and n <= DECODE_RS_MAX_N


def register_fused_lowering(prim, target: str, cuda_available) -> None:
    """Registers CPU and CUDA lowerings of `prim` to the FFI target `target`."""

    def rule(ctx, *operands, axis_name, tp_size, transpose_w, config: Config, forced: bool, **op_attrs):
        platform = ctx.module_context.platforms[0]
        groups = tp_groups(_mesh_of(ctx), axis_name, tp_size)
        _distributed.register_local_devices(platform, groups.ravel())
        reason = _why_not_fused(groups, platform)
        if reason is None and platform != "cpu":
            try:  # GPUs of a group in several processes: CUDA IPC, set up once here
                _ipc.ensure_groups(groups, config.timeout_s)
            except FusedUnavailableError as err:
                reason = str(err)
        if reason is not None:
            if forced:
                raise FusedUnavailableError(f'{prim.name}(impl="fused") cannot run here: {reason}')
            if reason not in _logged:
                _logged.add(reason)
                logger.warning("flux_jax: using the XLA twin: %s", reason)
            return _twin_lowering(prim.name, transpose_w, axis_name, len(ctx.avals_out))(ctx, *operands)
        attrs = dict(
            tp_size=np.int64(tp_size),
            tp_devices=np.array([d.id for d in groups.ravel()], dtype=np.int64),
            tp_processes=np.array([d.process_index for d in groups.ravel()], dtype=np.int64),
            w_transposed=bool(transpose_w),
            callsite=np.int64(next(_callsite_ids)),
            timeout_us=np.int64(config.timeout_us),
            jitter_us=np.int64(config.debug_jitter_us),
            drop_rank=np.int64(config.debug_drop_rank),
            poison=bool(config.debug_poison_outputs),
            piece_bytes=np.int64(config.gpu_piece_bytes),
            tile_group_m=np.int64(config.gpu_tile_group_m),
            rs_stage_launches=np.int64(config.gpu_rs_stage_launches),
            rs_tile_signal=np.int64(config.gpu_rs_tile_signal),
            tile_n=np.int64(config.gpu_tile_n),
            decode_path=False,
            decode_early_launch=np.int64(config.gpu_decode_early_launch),
        )
        x_aval, w_aval = ctx.avals_in[0], ctx.avals_in[1]
        path = choose_path(prim.name, platform, config, x_aval.shape, w_aval.shape, tp_size,
                           transpose_w, x_aval.dtype)
        # The rank operand (lax.axis_index) is cross-checked by the CPU handlers only: on GPU it
        # would sit in device memory, so the CUDA handlers take none, and XLA drops the unused
        # axis_index (a ~1 us convert kernel per call, measured in the decode loop).
        pass_rank = platform == "cpu"
        if path == "decode":
            if decode_supported(prim.name, tp_size, x_aval.shape, w_aval.shape, transpose_w, x_aval.dtype):
                attrs["decode_path"] = True
            else:
                path = "latency"
        if path == "latency":
            lower = _latency_lowering(prim.name, transpose_w, tp_size, len(ctx.avals_out), attrs, pass_rank)
            return lower(ctx, *operands)
        if not pass_rank:
            ctx, operands = ctx.replace(avals_in=ctx.avals_in[:2]), operands[:2]
        return jax.ffi.ffi_lowering(target)(ctx, *operands, **attrs)

    def cuda_rule(ctx, *operands, **params):
        if not cuda_available():
            raise FusedUnavailableError(
                f"flux_jax: no CUDA kernel for {prim.name} in this build "
                f"(flux_jax.build_info() says what was built); use impl='xla' or 'auto'"
            )
        return rule(ctx, *operands, **params)

    mlir.register_lowering(prim, rule, platform="cpu")
    mlir.register_lowering(prim, cuda_rule, platform="cuda")
