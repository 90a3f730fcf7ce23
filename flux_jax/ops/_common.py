"""The steps every op's public function shares: plan the call, fold the operands to 2-D, bind."""

from __future__ import annotations

import logging

import jax

from flux_jax import _explain, _plan, _region
from flux_jax._config import get_config, get_gpu_tuning
from flux_jax._errors import FusedUnavailableError
from flux_jax._validation import AxisInfo
from flux_jax.ops._spec import Call, OpSpec, unify_varying

logger = logging.getLogger("flux_jax")


def device_shape(spec: OpSpec, x) -> tuple:
    """x's shape where the kernel runs: in a shard_map that leaves mesh axes automatic, the
    lowering's nested manual region splits x over them (flux_jax/_region.py), so a call is
    planned for one device's shard, not the automatic axes' whole batch."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = frozenset(getattr(mesh, "manual_axes", ()))
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    auto = tuple(a for a in mesh.axis_names if a not in manual)
    if not any(sizes[a] > 1 for a in auto):
        return tuple(x.shape)
    try:
        split = _region.x_spec(x.shape, _region.type_spec(jax.typeof(x)), auto, mesh, spec.name, spec.replicated)
    except FusedUnavailableError:
        return tuple(x.shape)  # the lowering raises it (impl="fused") or takes the twin
    return _region.shard_shape(x.shape, split, mesh)


def plan_call(spec: OpSpec, x_front, w, info: AxisInfo, impl: str, fp8=None, **params) -> Call | None:
    """The Call for a fused run of `spec` on x (the split dimension first), or None for the twin
    (`fp8`: the FP8 recipe, or None)."""
    fp8_format = None if fp8 is None else fp8.x_dtype(False).name
    problem = spec.problem(
        device_shape(spec, x_front), w.shape, x_front.dtype, info.tp_size, info.platform, False, fp8_format
    )
    config = get_config()
    plan = _plan.plan(problem, impl, config)
    logger.debug("flux_jax.%s: %s -> %s", spec.name, problem.describe(), plan.describe())
    _explain.record(spec.name, problem, plan, backward=False)
    if not plan.fused:
        return None
    return Call(
        info.axis_name,
        info.tp_size,
        False,
        impl,
        False,
        plan,
        config,
        get_gpu_tuning(),
        platform=info.platform,
        fp8=fp8,
        problem=problem,
        **params,
    )


def run(spec: OpSpec, x_front, w, call: Call) -> list:
    """Runs the fused core on x with its gathered / scattered dimension first."""
    x_front, w = unify_varying(call.axis_name, x_front, w)
    return spec.core(x_front, w, call)


def backward_call(spec: OpSpec, dy, w, call: Call) -> Call:
    """The Call of `spec` (the paired op) in the backward pass of `call`: the weight read
    transposed, a fused path wherever one can run (impl="fused" stays strict)."""
    transpose_w = not call.transpose_w
    fp8_format = None if call.fp8 is None else call.fp8.x_dtype(True).name
    problem = spec.problem(device_shape(spec, dy), w.shape, dy.dtype, call.tp, call.platform, transpose_w, fp8_format)
    plan = _plan.plan(problem, "fused" if call.forced else "auto", call.config, backward=True)
    logger.debug("flux_jax.%s (backward): %s -> %s", spec.name, problem.describe(), plan.describe())
    _explain.record(spec.name, problem, plan, backward=True)
    return Call(
        call.axis_name,
        call.tp,
        transpose_w,
        call.impl,
        True,
        plan,
        call.config,
        call.tuning,
        platform=call.platform,
        return_gathered=spec.name == "ag_matmul",
        fp8=call.fp8,
        problem=problem,
        planned_as_backward=True,
    )
