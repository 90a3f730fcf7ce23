"""Lowering of a fused op's primitive: its plan becomes one custom call with typed attributes,
the latency path's composition, or the twin.

The same HLO runs on every device, so per-device facts cannot be attributes. What is the same
everywhere is the mesh: at lowering time the concrete mesh is known (from the shard_map, or
`jax.set_mesh`), so the attributes carry the global device ids of every TP group
(`tp_devices[g * tp + r]`) and their processes; each device finds itself there at run time. On
CPU it cross-checks its rank against lax.axis_index, passed as an operand; the CUDA lowering
drops that operand (the handlers cannot read device memory, and it cost a kernel per call).

Lowering is also where the topology is known: a TP group the fused kernels cannot serve (it
spans hosts; its GPU processes cannot map each other's memory; no concrete mesh on GPU) takes
the twin (flux_jax/_plan.for_topology decides). GPU groups that span processes of one host get
their CUDA IPC workspace here (flux_jax/_ipc.py), before anything runs.

Call-site ids pair the calls of one custom call across devices and processes (the CPU backend
keys its channels by them). They are derived from the program itself: the module's name, the
op, its shapes and path, and the call's ordinal within the module, so every process computes
the same ids whatever else it lowered, and re-lowering a program reuses its channels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from flux_jax import _distributed, _explain, _ipc, _plan, _region
from flux_jax._config import GEMM_KERNELS
from flux_jax._errors import FusedUnavailableError
from flux_jax._validation import axis_tuple, platform_name

logger = logging.getLogger("flux_jax")
_logged: set[str] = set()

_PATH_ENUM = {"overlap": 0, "decode": 1}  # FusedPath in cpp/include/flux_jax/params.h


def _concrete_mesh(ctx):
    """The concrete mesh of the lowering (shard_map's, or jax.set_mesh's), or None."""
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    try:
        if isinstance(mesh.devices, np.ndarray):
            return mesh
    except (AttributeError, ValueError):  # an AbstractMesh has no devices
        pass
    from jax._src import mesh as mesh_lib  # private: the mesh of jax.set_mesh

    concrete = mesh_lib.get_concrete_mesh()
    if concrete is not None and not concrete.empty and mesh is not None:
        if tuple(concrete.axis_names) == tuple(mesh.axis_names) and tuple(concrete.axis_sizes) == tuple(
            mesh.axis_sizes
        ):
            return concrete
    return None


def tp_groups(mesh, axis_name, tp_size: int) -> np.ndarray:
    """[num_groups, tp] array of the devices of every TP group, in rank order (for several mesh
    axes, row-major over them in the order named, as lax.axis_index counts)."""
    devices = mesh.devices
    names = axis_tuple(axis_name)
    axes = [list(mesh.axis_names).index(a) for a in names]
    size = int(np.prod([devices.shape[a] for a in axes]))
    if size != tp_size:
        raise FusedUnavailableError(f"mesh axes {names} have {size} devices, not {tp_size}")
    return np.moveaxis(devices, axes, list(range(-len(axes), 0))).reshape(-1, tp_size)


def _spans_hosts(groups: np.ndarray) -> str | None:
    if all(len({d.process_index for d in row}) == 1 for row in groups):
        _distributed.set_local_identity()  # no group shares memory between processes: no handshake
        return None
    info = _distributed.process_info()
    for row in groups:
        hosts = sorted({info.hosts[d.process_index] for d in row})
        if len(hosts) > 1:
            return f"TP group of devices {[d.id for d in row]} spans hosts {hosts}; fused ops run within one host"
    return None


class _Device:
    """A device of a TP group as the lowering needs it (id, process)."""

    def __init__(self, id_: int, process_index: int):
        self.id, self.process_index = id_, process_index


def _topology(ctx, platform: str, call):
    """(groups, None) where the fused kernels can serve every TP group, else (None, why)."""
    if call.groups is not None:
        ids, procs = call.groups
        groups = np.array([_Device(i, p) for i, p in zip(ids, procs)], dtype=object).reshape(-1, call.tp)
        return groups, None
    mesh = _concrete_mesh(ctx)
    if mesh is None:
        return None, (
            "the concrete device mesh is unknown at lowering (a shard_map over an abstract "
            "mesh, e.g. nested inside another shard_map); wrap the call in "
            "`with jax.set_mesh(mesh):` or pass mesh= to the shard_map"
        )
    groups = tp_groups(mesh, call.axis_name, call.tp)
    timeout_s = call.config.timeout_s
    _distributed.register_local_devices(platform, groups.ravel())
    reason = _spans_hosts(groups)
    if reason is None and platform != "cpu":
        try:  # GPUs of a group in several processes: CUDA IPC, set up once here
            _ipc.ensure_groups(groups, timeout_s)
        except FusedUnavailableError as err:
            reason = str(err)
    return (groups, None) if reason is None else (None, reason)


def _automatic_axes(ctx) -> tuple[str, ...]:
    """Mesh axes the enclosing shard_map leaves to the partitioner (all of them, size 1 too: XLA
    wants nested manual regions to cover whole runs of axes), or () if none has size > 1."""
    context = ctx.module_context.axis_context
    mesh = getattr(context, "mesh", None)
    manual = getattr(context, "manual_axes", None)
    if mesh is None or manual is None:
        return ()
    auto = tuple(a for a in mesh.axis_names if a not in manual)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return auto if any(sizes[a] > 1 for a in auto) else ()


def _mesh_position(ctx, rank, call):
    """The device's place in the TP device table by the program's own axis indices: group * tp +
    rank, the group counted row-major over the mesh's other axes (as `tp_groups` lays them out).
    The CPU handlers check it against the table, so a program run on its devices in another order
    or grouping (an exported one) is an error, not other ranks' rows."""
    mesh = ctx.module_context.axis_context.mesh
    tp_axes = axis_tuple(call.axis_name)
    others = tuple(a for a, n in zip(mesh.axis_names, mesh.axis_sizes) if a not in tp_axes and n > 1)
    if not others:
        return rank

    def position(rank):
        return rank + np.int32(call.tp) * jax.lax.axis_index(others).astype(rank.dtype)

    aval = ctx.avals_in[-1]
    inner = ctx.replace(avals_in=[aval], avals_out=[aval])
    (out,) = mlir.lower_fun(position, multiple_results=False)(inner, rank)
    return out


def _lower_fun(fn, ctx, x, w_ops, rank, call):
    """mlir.lower_fun of fn(x, w, rank) on the primitive's operands, w rebuilt from its
    operands (one array, or a pre-quantized weight's leaves)."""

    def flat(x, *operands):
        return fn(x, _weight_of(call, operands[:-1]), operands[-1])

    return mlir.lower_fun(flat, multiple_results=True)(ctx, x, *w_ops, rank)


def _lower_in_manual_region(spec, ctx, x, w_ops, rank, call, groups, auto):
    """The custom call inside a manual region over the automatic axes `auto`.

    XLA's partitioner cannot split an opaque custom call: left in a partially manual region it
    would gather every operand over the automatic axes and run the whole op on every device. So
    the call runs in a nested manual region over those axes: x's middle dimension that their
    devices can split evenly (a batch) is split over them, everything else is replicated; the TP
    groups found here on the concrete mesh travel into the region with the call. matmul_ar
    gathers and scatters no rows, so any of its row dimensions may be the split one (the first
    that divides: a batch-first x keeps its layout).
    """
    from jax.sharding import PartitionSpec as P

    x_aval = ctx.avals_in[0]
    mesh = ctx.module_context.axis_context.mesh
    x_spec = _region.x_spec(x_aval.shape, _region.type_spec(x_aval), auto, mesh, spec.name, spec.replicated)
    out_specs = tuple(P(*x_spec[:-1], None) for _ in ctx.avals_out)
    ids = tuple(int(d.id) for d in groups.ravel())
    procs = tuple(int(d.process_index) for d in groups.ravel())
    inner_call = dataclasses.replace(call, groups=(ids, procs))

    def body(x, *operands):  # the weight's leaves, then the rank
        return tuple(spec.primitive.bind(x, *operands, call=inner_call))

    operands = (*w_ops, rank)
    region = jax.shard_map(
        body,
        in_specs=(x_spec, *(P() for _ in operands)),
        out_specs=out_specs,
        axis_names=set(auto),
        check_vma=False,
    )
    return mlir.lower_fun(region, multiple_results=True)(ctx, x, *operands)


def _callsite(ctx, op: str, avals, detail: str, call) -> int:
    """The call site's id, the same in every process: the CPU backend pairs the calls of a TP
    group by it, so two different protocols must never share one. Programs of the same name
    (eager ops, `jit` of functions of one name) count their sites alike, so the key also holds
    everything that shapes the call's messages besides its operands: the weight's layout, the
    direction, the gathered output and the FP8 recipe."""
    ordinal = next(ctx.module_context.channel_iterator)  # per-module counter, same in every process
    attrs = ctx.module_context.module.operation.attributes
    module = str(attrs["sym_name"]) if "sym_name" in attrs else ""
    protocol = f"w_t={call.transpose_w},bwd={call.backward},gathered={call.return_gathered},fp8={call.fp8!r}"
    key = "|".join([module, op, detail, str(ordinal), protocol] + [f"{a.dtype}{list(a.shape)}" for a in avals])
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def _sub_callsite(callsite: int, index: int):
    """The id of the `index`-th collective of one call site (index 0 keeps the site's own id)."""
    if index == 0:
        return np.int64(callsite)
    key = f"{callsite}|{index}".encode()
    return np.int64(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1)


def _common_attrs(groups: np.ndarray, call, callsite: int) -> dict:
    cfg = call.config
    return dict(
        tp_size=np.int64(call.tp),
        tp_devices=np.array([d.id for d in groups.ravel()], dtype=np.int64),
        tp_processes=np.array([d.process_index for d in groups.ravel()], dtype=np.int64),
        callsite=np.int64(callsite),
        timeout_us=np.int64(cfg.timeout_us),
        jitter_us=np.int64(cfg.debug_jitter_us),
        drop_rank=np.int64(cfg.debug_drop_rank),
        poison=bool(cfg.debug_poison_outputs),
    )


def _gemm_attrs(call, path: str) -> dict:
    t = call.tuning
    return dict(
        w_transposed=bool(call.transpose_w),
        path=np.int32(_PATH_ENUM[path]),
        piece_bytes=np.int64(t.piece_bytes),
        tile_group_m=np.int64(t.tile_group_m),
        tile_serpentine=np.int64(t.tile_serpentine),
        rs_stage_launches=np.int64(t.rs_stage_launches),
        rs_tile_signal=np.int64(t.rs_tile_signal),
        tile_n=np.int64(t.tile_n),
        decode_early_launch=bool(t.decode_early_launch),
        gemm_kernel=np.int64(GEMM_KERNELS.index(t.gemm_kernel)),
        gate_probe=bool(t.gate_probe),
    )


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning("flux_jax: using the XLA twin: %s", message)


def register(spec) -> None:
    """Registers the CPU and CUDA lowerings of `spec.primitive`."""

    def rule(ctx, x, *operands, call, platform):
        w_ops, rank = operands[:-1], operands[-1]  # the weight's leaves (one array, or q and scale)
        plan = call.plan
        problem = _lowered_problem(spec, ctx, call, platform)
        auto = _automatic_axes(ctx)
        # Around a nested manual region (`auto`) the operands are the whole batch: the call inside
        # plans for its shard. What explain reports: the plan lowered here, and the operands where
        # it planned again for them.
        replanned = problem if problem != call.problem and not auto else None
        if replanned is not None:
            # Planned again for the operands lowered here: another platform than traced (export),
            # a vmapped batch of rows. Lowered for a GPU on a host without one (export): planned
            # for the GPU the built-in tables describe (Hopper).
            on_hopper = platform == "cuda" and not _plan.local_gpus()
            plan = _plan.plan(problem, call.impl, call.config, backward=call.planned_as_backward, on_hopper=on_hopper)
        groups = None
        if plan.fused:
            groups, reason = _topology(ctx, platform, call)
            plan = _plan.for_topology(plan, spec.name, reason, call.forced)
            if not plan.fused:
                _log_once(reason)
        twin = lambda x, w, rank: spec.twin(x, w, call)  # noqa: E731
        if not plan.fused:
            _explain.amend(call.plan, plan, replanned)
            return _lower_fun(twin, ctx, x, w_ops, rank, call)
        if auto:
            try:
                return _lower_in_manual_region(spec, ctx, x, w_ops, rank, call, groups, auto)
            except FusedUnavailableError as err:
                if call.forced:
                    raise
                _log_once(str(err))  # impl="auto": the twin serves any layout
                _explain.amend(call.plan, _plan.Plan("twin", str(err), "the manual region's layout"), replanned)
                return _lower_fun(twin, ctx, x, w_ops, rank, call)
        _explain.amend(call.plan, plan, replanned)

        # The rank operand (lax.axis_index), made the device's place in the table, is
        # cross-checked by the CPU handlers only.
        pass_rank = platform == "cpu"
        if pass_rank:
            rank = _mesh_position(ctx, rank, call)
        if plan.path == "latency":
            return _lower_latency(spec, ctx, x, w_ops, rank, call, groups, pass_rank)
        if call.fp8 is not None:  # (every pre-quantized weight's call: it comes with a recipe)
            return _lower_fp8_fused(spec, ctx, x, w_ops, rank, call, groups, pass_rank, plan.path)
        (w,) = w_ops
        rows = int(np.prod(ctx.avals_in[0].shape[:-1]))
        if plan.path == "overlap" and _plan.composed_overlap(spec.name, rows, call.tp, platform):
            return _lower_composed_overlap(spec, ctx, x, w, rank, call, groups, pass_rank)
        attrs = _common_attrs(groups, call, _callsite(ctx, spec.name, ctx.avals_in[:2], plan.path, call))
        attrs.update(_gemm_attrs(call, plan.path))
        operands = (x, w, rank)
        if not pass_rank:
            ctx, operands = ctx.replace(avals_in=ctx.avals_in[:2]), operands[:2]
        return jax.ffi.ffi_lowering(spec.target)(ctx, *operands, **attrs)

    def cuda_rule(ctx, *operands, call):
        from flux_jax import _native

        # Without local GPUs this lowers for jax.export: the custom call needs no kernel here, only
        # in the process that runs it (a CUDA build of flux_jax).
        if call.plan.fused and not _native.has_cuda_kernel(spec.name) and _plan.local_gpus():
            raise FusedUnavailableError(
                f"flux_jax: no CUDA kernel for {spec.name} in this build (flux_jax.build_info() says "
                "what was built); use impl='xla' or 'auto'"
            )
        return rule(ctx, *operands, call=call, platform="cuda")

    def lowering(ctx, *operands, call):
        platforms = _lowering_platforms(ctx, call)
        if len(platforms) > 1:
            return _lower_per_platform(spec, ctx, operands, call, platforms)
        if platforms[0] == "cuda":
            return cuda_rule(ctx, *operands, call=call)
        # CPU, or a platform without flux_jax kernels: planned again there (auto: the twin;
        # impl="fused": FusedUnavailableError naming the platform)
        return rule(ctx, *operands, call=call, platform=platforms[0])

    # One rule for every platform, not one per platform: JAX's own dispatch over several lowering
    # platforms (jax.export(..., platforms=("cpu", "cuda"))) fails for rules that are not
    # cacheable (jax 0.11-0.12), so _lower_per_platform does it. Not cacheable: JAX lowers
    # identical equations of a module once and reuses the result, which would give same-shape
    # calls (q, k and v projections) one call-site id; each needs its own.
    mlir.register_lowering(spec.primitive, lowering, cacheable=False)
    _requires_devices(spec.primitive)


def _requires_devices(primitive) -> None:
    """Keys JAX's lowering cache of programs that hold `primitive` on their devices: the lowering
    embeds the concrete mesh's device ids (a shard_map without mesh= takes them from
    jax.set_mesh), so one jitted function called under two meshes of the same shape must lower
    twice. Without this JAX reuses the first mesh's module: on GPU the second mesh's ranks would
    compute with the first mesh's device table. A private JAX registry (jax 0.11-0.12);
    tests/test_drop_in.py fails if it goes away."""
    from jax._src import dispatch

    dispatch.prim_requires_devices_during_lowering.add(primitive)


def _lowering_platforms(ctx, call) -> tuple[str, ...]:
    """The platforms this lowering emits code for: the one a per-platform branch was bound for
    (`call.lowering_platform`), else the module's (several under a multi-platform export)."""
    if call.lowering_platform is not None:
        return (call.lowering_platform,)
    return tuple(platform_name(p) for p in (ctx.platforms or ctx.module_context.platforms))


def _lower_per_platform(spec, ctx, operands, call, platforms):
    """Several lowering platforms (a multi-platform jax.export): the call once per platform, each
    planned and lowered for its own, chosen at run time by lax.platform_dependent."""

    def branch(platform):
        bound = dataclasses.replace(call, lowering_platform=platform)
        return lambda *args: tuple(spec.primitive.bind(*args, call=bound))

    def per_platform(*args):
        return jax.lax.platform_dependent(*args, **{p: branch(p) for p in platforms})

    return mlir.lower_fun(per_platform, multiple_results=True)(ctx, *operands)


def _lowered_problem(spec, ctx, call, platform: str):
    """The planner's view of the call on the operands being lowered (inside the nested manual
    region, x's shard; under vmap, the whole batch)."""
    x_aval, w_aval = ctx.avals_in[0], _weight_of(call, ctx.avals_in[1:-1])
    return spec.problem(x_aval.shape, w_aval.shape, x_aval.dtype, call.tp, platform, call.transpose_w, call.fp8_format)


def _lower_latency(spec, ctx, x, w_ops, rank, call, groups, pass_rank):
    """The latency path: XLA's GEMM next to our one-kernel collective custom call(s)."""
    callsite = _callsite(ctx, spec.name, ctx.avals_in[:-1], "latency", call)
    attrs = tuple(
        (k, tuple(v.tolist()) if isinstance(v, np.ndarray) else v)
        for k, v in _common_attrs(groups, call, callsite).items()
    )
    count = [0]

    def collective(name, operand, shape, rank_operand):
        operands = (operand, rank_operand) if pass_rank else (operand,)
        # A composition may run several collectives (FP8: the rows and their scales); each
        # gets its own call-site id (the CPU backend pairs calls by it), the same in every process.
        site = _sub_callsite(callsite, count[0])
        count[0] += 1
        site_attrs = tuple((k, site if k == "callsite" else v) for k, v in attrs)
        return _collective_p.bind(*operands, name=name, out_shape=tuple(shape), attrs=site_attrs)

    def latency(x, w, rank):
        return spec.latency(x, w, call, lambda name, operand, shape: collective(name, operand, shape, rank))

    return _lower_fun(latency, ctx, x, w_ops, rank, call)


def _hashable_attrs(attrs: dict) -> tuple:
    return tuple((k, tuple(v.tolist()) if isinstance(v, np.ndarray) else v) for k, v in attrs.items())


def _lower_fp8_fused(spec, ctx, x, w_ops, rank, call, groups, pass_rank, path):
    """The FP8 overlap or decode path: quantize (XLA; a pre-quantized weight is used as it is),
    then the op's custom call on the FP8 operands with their scales (cpp Fp8Operands); anything
    moved first (ag_matmul: the row scales) goes through our collectives, each with its own
    call-site id."""
    callsite = _callsite(ctx, spec.name, ctx.avals_in[:-1], f"fp8-{path}", call)
    common = _common_attrs(groups, call, callsite)
    gemm_attrs = _hashable_attrs({**common, **_gemm_attrs(dataclasses.replace(call, transpose_w=True), path)})
    count = [1]  # index 0 is the fused call's own id

    def collective(name, operand, shape, rank_operand):
        operands = (operand, rank_operand) if pass_rank else (operand,)
        site = _sub_callsite(callsite, count[0])
        count[0] += 1
        site_attrs = tuple((k, site if k == "callsite" else v) for k, v in _hashable_attrs(common))
        return _collective_p.bind(*operands, name=name, out_shape=tuple(shape), attrs=site_attrs)

    def lowered(x, w, rank):
        def fused(xq, wq, row_scales, col_scales, op=None):
            # `op`: another op's FP8 overlap call (matmul_ar's two-shot binds matmul_rs's)
            target = spec if op is None else _registry()[op]
            shapes = target.out_shapes(xq.shape, wq.shape, dataclasses.replace(call, transpose_w=True))
            dtypes = [x.dtype] + [xq.dtype] * (len(shapes) - 1)  # out, then the gathered FP8 rows
            operands = (xq, wq, rank) if pass_rank else (xq, wq)
            return _op_call_p.bind(
                *operands,
                row_scales,
                col_scales,
                target=target.target,
                outs=tuple((tuple(s), np.dtype(d)) for s, d in zip(shapes, dtypes)),
                attrs=gemm_attrs,
            )

        body = spec.fp8_decode if path == "decode" else spec.fp8_overlap
        return body(x, w, call, lambda name, a, shape: collective(name, a, shape, rank), fused)

    return _lower_fun(lowered, ctx, x, w_ops, rank, call)


def _weight_of(call, leaves):
    from flux_jax.ops._spec import weight_of  # the ops' module imports this one

    return weight_of(call, leaves)


def _registry() -> dict:
    from flux_jax.ops._spec import REGISTRY  # the ops' module imports this one

    return REGISTRY


def _lower_composed_overlap(spec, ctx, x, w, rank, call, groups, pass_rank):
    """An overlap path composed of other ops' custom calls (`spec.composed_overlap`; matmul_ar:
    matmul_rs's overlap call, then our all_gather), each with its own call-site id."""
    callsite = _callsite(ctx, spec.name, ctx.avals_in[:2], "composed-overlap", call)
    common = _common_attrs(groups, call, callsite)
    count = [0]

    def site_attrs(extra: dict) -> tuple:
        site = _sub_callsite(callsite, count[0])
        count[0] += 1
        return _hashable_attrs({**common, "callsite": site, **extra})

    def lowered(x, w, rank):
        def collective(name, operand, shape):
            operands = (operand, rank) if pass_rank else (operand,)
            return _collective_p.bind(*operands, name=name, out_shape=tuple(shape), attrs=site_attrs({}))

        def fused(op, a, b, shape):
            operands = (a, b, rank) if pass_rank else (a, b)
            (out,) = _op_call_p.bind(
                *operands,
                target=f"flux_jax_{op}",
                outs=((tuple(shape), np.dtype(a.dtype)),),
                attrs=site_attrs(_gemm_attrs(call, "overlap")),
            )
            return out

        return spec.composed_overlap(x, w, call, collective, fused)

    return mlir.lower_fun(lowered, multiple_results=True)(ctx, x, w, rank)


# A fused op's custom call bound inside a composition: the FP8 overlap lowering (x, w[, rank], row
# scales, column scales) and a composed overlap path (x, w[, rank]).
_op_call_p = Primitive("flux_jax_op_call")
_op_call_p.multiple_results = True
_op_call_p.def_abstract_eval(
    lambda x, *operands, target, outs, attrs: [x.update(shape=shape, dtype=dtype) for shape, dtype in outs]
)


def _op_call_lowering(ctx, *operands, target, outs, attrs):
    kw = {k: np.array(v, dtype=np.int64) if isinstance(v, tuple) else v for k, v in attrs}
    return jax.ffi.ffi_lowering(target)(ctx, *operands, **kw)


mlir.register_lowering(_op_call_p, _op_call_lowering)


# One of our collective custom calls (cpp/include/flux_jax/collectives.h), bound inside the
# latency path's lowering only.
_collective_p = Primitive("flux_jax_collective")
_collective_p.def_abstract_eval(lambda x, *rank, name, out_shape, attrs: x.update(shape=out_shape))


def _collective_lowering(ctx, *operands, name, out_shape, attrs):
    kw = {k: np.array(v, dtype=np.int64) if isinstance(v, tuple) else v for k, v in attrs}
    return jax.ffi.ffi_lowering(f"flux_jax_{name}")(ctx, *operands, **kw)


mlir.register_lowering(_collective_p, _collective_lowering)
