"""jax.export of functions that call the fused ops: for one platform and for several, serialized,
deserialized and run here, against the float64 oracle, the twin and the call itself."""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flux_jax

from helpers import assert_matches, cpu_mesh, random_array, to64

TP, S, D, F = 4, 32, 48, 64


def _block(mesh, impl, fp8=None):
    """ag_matmul -> tanh -> matmul_rs, a Megatron MLP with sequence parallelism."""

    def body(x, w1, w2):
        h = flux_jax.ag_matmul(x, w1, axis_name="tp", impl=impl, fp8=fp8)
        return flux_jax.matmul_rs(jnp.tanh(h), w2, axis_name="tp", impl=impl, fp8=fp8)

    specs = (P("tp"), P(None, "tp"), P("tp"))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("tp"))), specs


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = random_array(rng, (S, D), jnp.bfloat16)
    w1 = random_array(rng, (D, F), jnp.bfloat16, scale=D**-0.5)
    w2 = random_array(rng, (F, D), jnp.bfloat16, scale=F**-0.5)
    return x, w1, w2


def _reference(x, w1, w2):
    return np.tanh(to64(x) @ to64(w1)) @ to64(w2)


def _targets(module: str) -> list:
    return re.findall(r"custom_call @(flux_jax_\w+)", module)


def _run_restored(exported, mesh, specs, *args):
    restored = export.deserialize(exported.serialize())
    return jax.jit(restored.call, in_shardings=tuple(NamedSharding(mesh, s) for s in specs))(*args)


@pytest.mark.parametrize("platforms", [("cpu",), ("cpu", "cuda"), ("cuda", "cpu")])
def test_exported_block_runs_the_fused_ops_and_equals_the_call(platforms):
    mesh = cpu_mesh((TP,), ("tp",), AxisType.Auto)
    fused, specs = _block(mesh, "fused")
    x, w1, w2 = _data()
    exported = export.export(fused, platforms=platforms, disabled_checks=flux_jax.export_disabled_checks())(x, w1, w2)
    targets = _targets(exported.mlir_module())
    # CPU plans the overlap path for these shapes; a CUDA branch plans its own (on this host without
    # a GPU: for the Hopper GPUs the built-in tables describe), here the latency path's collectives
    assert targets.count("flux_jax_ag_matmul") == 1 and targets.count("flux_jax_matmul_rs") == 1, targets
    several = len(platforms) > 1
    assert ("flux_jax_all_gather" in targets and "flux_jax_reduce_scatter" in targets) == several, targets
    assert ("stablehlo.case" in exported.mlir_module()) == several

    out = _run_restored(exported, mesh, specs, x, w1, w2)
    np.testing.assert_array_equal(to64(out), to64(fused(x, w1, w2)))  # the CPU branch is the call itself
    twin, _ = _block(mesh, "xla")
    assert_matches(out, _reference(x, w1, w2), twin(x, w1, w2), "bfloat16", f"export {platforms}")


@pytest.mark.parametrize("platforms", [("cpu",), ("cpu", "cuda")])
def test_exported_fp8_block_and_its_gradients(platforms):
    mesh = cpu_mesh((TP,), ("tp",), AxisType.Auto)
    fused, specs = _block(mesh, "fused", fp8=True)
    twin, _ = _block(mesh, "xla", fp8=True)
    x, w1, w2 = _data(1)
    checks = flux_jax.export_disabled_checks()

    out = _run_restored(
        export.export(fused, platforms=platforms, disabled_checks=checks)(x, w1, w2), mesh, specs, x, w1, w2
    )
    ref = _reference(x, w1, w2)
    # Within the FP8 roundings (e4m3: 2^-4 per operand, four on the path) of the float64 result and
    # close to the FP8 twin: XLA may fuse the quantization differently around a multi-platform
    # program's branches, which moves some roundings (measured 0.7% relative)
    for got, bound in ((out, 0.15), (twin(x, w1, w2), 0.15)):
        assert np.linalg.norm(to64(got) - ref) / np.linalg.norm(ref) < bound
    assert np.linalg.norm(to64(out) - to64(twin(x, w1, w2))) / np.linalg.norm(ref) < 0.03

    def loss(f):
        return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))

    exported = export.export(loss(fused), platforms=platforms, disabled_checks=checks)(x, w1, w2)
    assert "flux_jax_matmul_rs" in _targets(exported.mlir_module())
    grads = _run_restored(exported, mesh, specs, x, w1, w2)
    for got, want in zip(grads, loss(twin)(x, w1, w2)):
        got, want = to64(got), to64(want)
        assert np.all(np.isfinite(got))
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05


def test_export_without_the_checks_names_the_custom_call():
    mesh = cpu_mesh((TP,), ("tp",), AxisType.Auto)
    fused, _ = _block(mesh, "fused")
    with pytest.raises(ValueError, match="flux_jax_ag_matmul"):
        export.export(fused)(*_data())
    assert {str(c) for c in flux_jax.export_disabled_checks()} >= {
        f"custom_call:flux_jax_{op}" for op in ("ag_matmul", "matmul_rs", "matmul_ar", "all_gather", "reduce_scatter")
    }


def test_a_platform_without_flux_jax_kernels_gets_the_twin_or_an_error_naming_it():
    mesh = cpu_mesh((TP,), ("tp",), AxisType.Auto)
    checks = flux_jax.export_disabled_checks()
    fused, _ = _block(mesh, "fused")
    with pytest.raises(flux_jax.FusedUnavailableError, match=r"no fused kernel for platform 'tpu'"):
        export.export(fused, platforms=("cpu", "tpu"), disabled_checks=checks)(*_data())
    # impl="auto" where it planned a fused path when traced (here forced by Config.fused_path): the
    # CPU branch holds the fused calls, the TPU branch the twin's XLA collectives
    with flux_jax.config(fused_path="overlap"):
        auto, _ = _block(mesh, "auto")
        module = export.export(auto, platforms=("cpu", "tpu"), disabled_checks=checks)(*_data()).mlir_module()
    assert _targets(module) == ["flux_jax_ag_matmul", "flux_jax_matmul_rs"]
    assert "stablehlo.all_gather" in module and "stablehlo.reduce_scatter" in module


@pytest.mark.parametrize("impl", ["fused", "xla", "auto"])
def test_symbolic_shapes_are_refused_by_name(impl):
    """Shape polymorphism: every impl plans from concrete dimensions, so a symbolic one is a
    clear error (JAX's own was an InconclusiveDimensionOperation from deep in the planner)."""
    mesh = cpu_mesh((TP,), ("tp",), AxisType.Auto)
    block, _ = _block(mesh, impl)
    x, w1, w2 = _data()
    rows = jax.ShapeDtypeStruct(export.symbolic_shape(f"{TP}*b, {D}"), x.dtype)
    with pytest.raises(NotImplementedError, match=r"ag_matmul: x has the symbolic dimension 'b'.*concrete shapes"):
        export.export(block, disabled_checks=flux_jax.export_disabled_checks())(rows, w1, w2)


@pytest.mark.parametrize("order", [(1, 0, 2, 3), (0, 1, 3, 2), (3, 2, 1, 0)])
def test_exported_program_on_its_devices_in_another_order_fails_at_once_naming_the_rank(order):
    """Run on the exported devices in another order, a rank's lax.axis_index disagrees with the
    mesh table it carries: an error naming the device and both ranks, from every rank at once
    (the ranks whose place did not change used to wait out Config.timeout_s), never wrong rows."""
    fused, specs = _block(cpu_mesh((TP,), ("tp",), AxisType.Auto), "fused")
    x, w1, w2 = _data()
    exported = export.export(fused, disabled_checks=flux_jax.export_disabled_checks())(x, w1, w2)
    flux_jax.reset()
    try:
        start = time.monotonic()
        with pytest.raises(Exception, match=r"lax.axis_index says rank \d but device \d sits at rank \d"):
            jax.block_until_ready(
                _run_restored(exported, cpu_mesh((TP,), ("tp",), AxisType.Auto, order), specs, x, w1, w2)
            )
        assert time.monotonic() - start < 10  # the exported calls' timeout is Config's default, 60 s
    finally:
        flux_jax.reset()


@pytest.mark.parametrize("order", [(0, 5, 2, 7, 4, 1, 6, 3), (4, 5, 6, 7, 0, 1, 2, 3)])
def test_exported_program_on_regrouped_devices_fails_naming_the_group(order):
    """On a (dp, tp) mesh every device may keep its tp rank while the TP groups change (device 5
    now sits in dp row 0): its lax.axis_index over dp disagrees with the group the table puts it
    in, so the call fails naming the device and both groups, never mixing two batches' rows."""
    dp = 2
    specs = (P("dp", "tp", None), P(None, "tp"))

    def body(x, w):  # this dp row's rows of this tp rank
        return flux_jax.ag_matmul(x[0], w, axis_name="tp", impl="fused")[None]

    def fn(mesh):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("dp", None, "tp")))

    rng = np.random.default_rng()
    x, w = random_array(rng, (dp, S, D), jnp.float32), random_array(rng, (D, F), jnp.float32)
    ref = np.einsum("bsd,df->bsf", to64(x), to64(w))
    exported_on = cpu_mesh((dp, TP), ("dp", "tp"), AxisType.Auto)
    exported = export.export(fn(exported_on), disabled_checks=flux_jax.export_disabled_checks())(x, w)
    flux_jax.reset()
    try:
        same = _run_restored(exported, exported_on, specs, x, w)
        np.testing.assert_allclose(to64(same), ref, rtol=1e-5, atol=1e-5)
        regrouped = cpu_mesh((dp, TP), ("dp", "tp"), AxisType.Auto, order)
        with pytest.raises(Exception, match=r"puts device \d in TP group \d but the mesh table has it in TP group \d"):
            jax.block_until_ready(_run_restored(exported, regrouped, specs, x, w))
    finally:
        flux_jax.reset()
