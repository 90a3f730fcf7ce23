"""Meshes, random data and the float64 oracle with XLA-derived tolerances."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import flux_jax
from flux_jax import _config

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Error floors (relative, max-norm) for when XLA's own error is ~0.
_FLOOR = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}


def cpu_mesh(shape, names, axis_type=AxisType.Explicit, device_order=None):
    devices = np.array(jax.devices("cpu")[: int(np.prod(shape))])
    if device_order is not None:
        devices = devices[list(device_order)]
    return jax.sharding.Mesh(devices.reshape(shape), names, axis_types=(axis_type,) * len(shape))


def random_array(rng: np.random.Generator, shape, dtype, scale: float = 1.0):
    """Fresh normal data with a nonzero mean (never zeros), times `scale`, cast to `dtype`."""
    a = (rng.standard_normal(shape).astype(np.float32) + 0.25) * np.float32(scale)
    return jnp.asarray(a, dtype=dtype)


def to64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), dtype=np.float64)


def rel_max_err(out, ref) -> float:
    out = to64(out)
    assert np.all(np.isfinite(out)), "output has NaN/inf: an element was not written (poisoned) or overflowed"
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def assert_matches(out, ref64, xla_out, dtype_name: str, what: str = "", factor: float = 4.0):
    """|out - ref| within `factor` x XLA's own error on the same inputs (or a floor)."""
    assert out.shape == ref64.shape, f"{what}: shape {out.shape} != {ref64.shape}"
    err = rel_max_err(out, ref64)
    xla_err = rel_max_err(xla_out, ref64)
    bound = _error_bound(xla_err, dtype_name, factor)
    assert err <= bound, f"{what}: relative error {err:.3e} > bound {bound:.3e} (XLA's own error {xla_err:.3e})"


def _error_bound(xla_err: float, dtype_name: str, factor: float) -> float:
    """The relative error a fused result may have: `factor` x XLA's own, or the dtype's floor."""
    return max(factor * xla_err, _FLOOR[dtype_name])


def assert_nan_or_right(out, ref64, xla_out, dtype_name: str, what: str = "", factor: float = 4.0):
    """A failed call's output: every element NaN (poisoned) or within assert_matches' bound of the
    reference, never finite and wrong; and at least one NaN (the failure shows)."""
    out = to64(out)
    assert out.shape == ref64.shape, f"{what}: shape {out.shape} != {ref64.shape}"
    finite = np.isfinite(out)
    assert not finite.all(), f"{what}: a timed-out call must not return plausible numbers"
    scale = max(np.max(np.abs(ref64)), 1e-30)
    bound = _error_bound(rel_max_err(xla_out, ref64), dtype_name, factor)
    wrong = finite & (np.abs(out - ref64) / scale > bound)
    assert not wrong.any(), (
        f"{what}: {int(wrong.sum())} of {out.size} elements finite and wrong "
        f"(relative error up to {np.max(np.abs(out - ref64)[wrong]) / scale:.3e})"
    )


def shard_mapped(fn, mesh, in_specs, out_specs, **kw):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw))


def place(mesh, a, spec):
    return jax.device_put(a, jax.NamedSharding(mesh, spec))


def ag_specs(mesh, tp_axis, ndim):
    """x rows over tp (and batch rows over the other axes), w columns over tp."""
    others = tuple(a for a in mesh.axis_names if a != tp_axis)
    x_spec = P(tp_axis, *([None] * (ndim - 2)), None)
    w_spec = P(None, tp_axis)
    out_spec = P(None, *([None] * (ndim - 2)), tp_axis)
    if others and ndim >= 3:  # shard a middle (batch) dim over the other axes
        x_spec = P(tp_axis, others, *([None] * (ndim - 2)))
        out_spec = P(None, others, *([None] * (ndim - 3)), tp_axis)
    return x_spec, w_spec, out_spec


def rs_specs(mesh, tp_axis, ndim):
    others = tuple(a for a in mesh.axis_names if a != tp_axis)
    x_spec = P(None, *([None] * (ndim - 2)), tp_axis)
    w_spec = P(tp_axis, None)
    out_spec = P(tp_axis, *([None] * (ndim - 1)))
    if others and ndim >= 3:
        x_spec = P(None, others, *([None] * (ndim - 3)), tp_axis)
        out_spec = P(tp_axis, others, *([None] * (ndim - 2)))
    return x_spec, w_spec, out_spec


@functools.cache
def fused_fn(op: str, mesh, tp_axis: str, ndim: int, impl: str):
    """jit(shard_map(op)) for the mesh and spec layout above."""
    if op == "ag":
        x_spec, w_spec, out_spec = ag_specs(mesh, tp_axis, ndim)
        body = functools.partial(flux_jax.ag_matmul, axis_name=tp_axis, impl=impl)
    else:
        x_spec, w_spec, out_spec = rs_specs(mesh, tp_axis, ndim)
        body = functools.partial(flux_jax.matmul_rs, axis_name=tp_axis, impl=impl)
    return shard_mapped(body, mesh, (x_spec, w_spec), out_spec), (x_spec, w_spec)


# ---- GPU tests ------------------------------------------------------------------


def gpu_mesh(gpus, shape=(2,), names=("tp",), axis_type=AxisType.Explicit):
    n = int(np.prod(shape))
    return jax.sharding.Mesh(np.array(gpus[:n]).reshape(shape), names, axis_types=(axis_type,) * len(shape))


def op_fn(op, mesh, impl, tp_axis="tp", transpose_w=False):
    """The op under jit + shard_map, bound to the flux_jax config current HERE (the function
    is traced at its first call, possibly outside the caller's `with flux_jax.config(...)`)."""
    if op == "ag":
        specs, out = (P(tp_axis, None), P(None, tp_axis)), P(None, tp_axis)
        fn = flux_jax.ag_matmul
    else:
        specs, out = (P(None, tp_axis), P(tp_axis, None)), P(tp_axis, None)
        fn = flux_jax.matmul_rs
    cfg = dataclasses.asdict(flux_jax.get_config())
    tuning = dataclasses.asdict(_config.get_gpu_tuning())

    def body(x, w):
        with flux_jax.config(**cfg), _config.gpu_tuning(**tuning):
            return fn(x, w, axis_name=tp_axis, impl=impl)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out)), specs


def missing_peer_times_out_then_reset(gpus, op, path, rows, message):
    """Rank 1 never signals: the call's output is NaN or right, never finite and wrong, and a
    device error names the wait (`message`); after flux_jax.reset() the same op on that path is
    right again."""
    mesh = gpu_mesh(gpus)
    rng = np.random.default_rng()
    x, w = random_array(rng, (rows, 256), "bfloat16"), random_array(rng, (256, 256), "bfloat16")
    with flux_jax.config(timeout_s=0.5, debug_drop_rank=1, fused_path=path):
        f, specs = op_fn(op, mesh, "fused")
        xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
        out = f(xs, ws)
    twin, _ = op_fn(op, mesh, "xla")
    assert_nan_or_right(out, to64(x) @ to64(w), twin(xs, ws), "bfloat16", f"{op} {path}, rank 1 silent")
    errors = flux_jax.device_errors()
    assert errors and any(message in e for e in errors.values()), errors
    flux_jax.reset()
    assert not flux_jax.device_errors()
    with flux_jax.config(fused_path=path):
        good, _ = op_fn(op, mesh, "fused")
    assert_matches(good(xs, ws), to64(x) @ to64(w), twin(xs, ws), "bfloat16", "after reset")
