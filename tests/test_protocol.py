"""The chunk / flag / epoch protocol under load: many interleaved calls in one
program, injected jitter, independent calls XLA may run concurrently,
bitwise determinism, and bounded waits that fail clearly instead of hanging."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import flux_jax

from helpers import cpu_mesh, place, random_array


def _scan_program(mesh, impl, steps):
    """`steps` iterations of h -> rs(tanh(ag(h, w1)), w2): 2 * steps fused calls."""

    def body(h, w1, w2):
        def step(h, _):
            y = flux_jax.ag_matmul(h, w1, axis_name="tp", impl=impl)
            h = flux_jax.matmul_rs(jnp.tanh(y), w2, axis_name="tp", impl=impl)
            return jnp.tanh(h), None

        return jax.lax.scan(step, h, None, length=steps)[0]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp")))


def _scan_inputs(mesh, rng):
    x = random_array(rng, (16, 32), "float32")
    w1 = random_array(rng, (32, 64), "float32") / 8
    w2 = random_array(rng, (64, 32), "float32") / 8
    return place(mesh, x, P("tp")), place(mesh, w1, P(None, "tp")), place(mesh, w2, P("tp"))


def test_120_interleaved_calls_in_scan_match_twin_and_are_bitwise_deterministic():
    mesh = cpu_mesh((8,), ("tp",))
    args = _scan_inputs(mesh, np.random.default_rng())
    fused = _scan_program(mesh, "fused", 60)
    a, b = fused(*args), fused(*args)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # same program, same bits
    twin = _scan_program(mesh, "xla", 60)(*args)
    np.testing.assert_allclose(np.asarray(a), np.asarray(twin), rtol=2e-4, atol=2e-5)


def test_jitter_at_every_signal_keeps_results_exact():
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    rng = np.random.default_rng()
    x = place(mesh, random_array(rng, (8, 2, 24), "bfloat16"), P("tp", "dp"))
    w = place(mesh, random_array(rng, (24, 32), "bfloat16"), P(None, "tp"))
    body = functools.partial(flux_jax.ag_matmul, axis_name="tp", impl="fused")
    reference = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("tp", "dp"), P(None, "tp")), out_specs=P(None, "dp", "tp"))
    )(x, w)
    with flux_jax.config(debug_jitter_us=300):
        f = jax.jit(
            jax.shard_map(
                lambda x, w: body(x, w) + 0,
                mesh=mesh,
                in_specs=(P("tp", "dp"), P(None, "tp")),
                out_specs=P(None, "dp", "tp"),
            )
        )
        for _ in range(5):
            np.testing.assert_array_equal(np.asarray(f(x, w)), np.asarray(reference))


def test_independent_calls_that_xla_may_run_concurrently():
    """q/k/v-style projections of one input: no data dependency between the calls."""
    mesh = cpu_mesh((8,), ("tp",))
    rng = np.random.default_rng()
    x = random_array(rng, (64, 128), "float32")
    ws = [random_array(rng, (128, 256), "float32") / 16 for _ in range(4)]

    def body(x, *ws):
        outs = [flux_jax.ag_matmul(x, w, axis_name="tp", impl=impl) for w in ws]
        back = [flux_jax.matmul_rs(o, w.T, axis_name="tp", impl=impl) for o, w in zip(outs, ws)]
        return sum(outs), sum(back)

    results = {}
    for impl in ("fused", "xla"):
        f = jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(P("tp"),) + (P(None, "tp"),) * 4, out_specs=(P(None, "tp"), P("tp"))
            )
        )
        xs = place(mesh, x, P("tp"))
        wss = [place(mesh, w, P(None, "tp")) for w in ws]
        results[impl] = [f(xs, *wss) for _ in range(3)]
    for got in results["fused"]:
        for a, b in zip(got, results["xla"][0]):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_many_independent_calls_hold_no_xla_thread_while_they_wait():
    """64 independent fused calls at TP 8 on CI's 2 cores: each call waits for its peers on a
    thread of its own (cpp/ffi/cpu_async.h). While the waits held XLA:CPU's threads, 32 such
    calls timed out: a device waited in one call while its peers' threads waited in others."""
    mesh = cpu_mesh((8,), ("tp",))
    rng = np.random.default_rng()
    x = random_array(rng, (64, 32), "float32")
    ws = [random_array(rng, (32, 64), "float32") / 8 for _ in range(64)]

    def body(x, *ws):
        return [flux_jax.ag_matmul(x, w, axis_name="tp", impl="fused") for w in ws]

    specs = (P("tp"),) + (P(None, "tp"),) * 64
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=[P(None, "tp")] * 64))
    with flux_jax.config(timeout_s=20.0):
        got = f(place(mesh, x, P("tp")), *[place(mesh, w, P(None, "tp")) for w in ws])
    for w, out in zip(ws, got):
        np.testing.assert_allclose(
            np.asarray(out), np.asarray(x, np.float64) @ np.asarray(w, np.float64), rtol=1e-5, atol=1e-5
        )


# Runs in a child: caps its address space after a warm run, so that no thread can be started.
_NO_THREADS = """
import os, resource
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
from jax.sharding import PartitionSpec as P
import flux_jax
from helpers import cpu_mesh, place, random_array
mesh = cpu_mesh((8,), ("tp",))
rng = np.random.default_rng(0)
x = place(mesh, random_array(rng, (64, 32), "float32"), P("tp"))
ws = [place(mesh, random_array(rng, (32, 64), "float32") / 8, P(None, "tp")) for _ in range(16)]
body = lambda x, *ws: [flux_jax.ag_matmul(x, w, axis_name="tp", impl="fused") for w in ws]
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) + (P(None, "tp"),) * 16, out_specs=[P(None, "tp")] * 16))
with flux_jax.config(timeout_s=5.0):
    c = f.lower(x, *ws).compile()
    jax.block_until_ready(c(x, *ws))
    with open("/proc/self/status") as fh:
        vm = int(next(line for line in fh if line.startswith("VmSize")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), resource.RLIM_INFINITY))
    try:
        jax.block_until_ready(c(x, *ws))
        print("ERROR: none")
    except Exception as e:
        print("ERROR:", e)
"""


def test_a_call_with_no_thread_to_run_on_fails_naming_the_cause():
    """When no thread can be started for a call (here: an address-space cap), its rank fails at
    once with the cause, and does not run the protocol on XLA's thread (which brought back the
    deadlock of many independent calls: the error read as a peer that never came)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent), *sys.path]))
    out = subprocess.run([sys.executable, "-c", _NO_THREADS], capture_output=True, text=True, timeout=240, env=env)
    error = next((line for line in out.stdout.splitlines() if line.startswith("ERROR:")), None)
    assert error is not None, out.stdout[-2000:] + out.stderr[-3000:]
    assert "could not start a thread for the call" in error and "(cpu backend): rank" in error, error


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_bitwise_deterministic_across_runs(op):
    mesh = cpu_mesh((8,), ("tp",))
    rng = np.random.default_rng()
    if op == "ag":
        fn, specs, out = flux_jax.ag_matmul, (P("tp"), P(None, "tp")), P(None, "tp")
        x, w = random_array(rng, (32, 64), "bfloat16"), random_array(rng, (64, 64), "bfloat16")
    else:
        fn, specs, out = flux_jax.matmul_rs, (P(None, "tp"), P("tp")), P("tp")
        x, w = random_array(rng, (32, 64), "bfloat16"), random_array(rng, (64, 64), "bfloat16")
    f = jax.jit(
        jax.shard_map(functools.partial(fn, axis_name="tp", impl="fused"), mesh=mesh, in_specs=specs, out_specs=out)
    )
    xs, ws = place(mesh, x, specs[0]), place(mesh, w, specs[1])
    first = np.asarray(f(xs, ws))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(xs, ws)), first)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_missing_peer_times_out_with_diagnostic_then_reset_recovers(op):
    mesh = cpu_mesh((8,), ("tp",))
    rng = np.random.default_rng()
    if op == "ag":
        fn, specs, out = flux_jax.ag_matmul, (P("tp"), P(None, "tp")), P(None, "tp")
    else:
        fn, specs, out = flux_jax.matmul_rs, (P(None, "tp"), P("tp")), P("tp")
    x = place(mesh, random_array(rng, (16, 16), "float32"), specs[0])
    w = place(mesh, random_array(rng, (16, 16), "float32"), specs[1])
    with flux_jax.config(timeout_s=0.3, debug_drop_rank=3):
        f = jax.jit(
            jax.shard_map(functools.partial(fn, axis_name="tp", impl="fused"), mesh=mesh, in_specs=specs, out_specs=out)
        )
        with pytest.raises(
            Exception, match=r"timed out after 0.3 s waiting for chunk \d+ from rank 3 \(epoch 1"
        ) as err:
            np.asarray(f(x, w))
        assert "TP group 0 [devices 0,1,2,3,4,5,6,7]" in str(err.value)
        # The channel is now failed: the same program fails fast, without waiting again.
        with pytest.raises(Exception, match="failed earlier"):
            np.asarray(f(x, w))
    flux_jax.reset()
    good = jax.jit(
        jax.shard_map(functools.partial(fn, axis_name="tp", impl="fused"), mesh=mesh, in_specs=specs, out_specs=out)
    )
    twin = jax.jit(
        jax.shard_map(functools.partial(fn, axis_name="tp", impl="xla"), mesh=mesh, in_specs=specs, out_specs=out)
    )
    np.testing.assert_allclose(np.asarray(good(x, w)), np.asarray(twin(x, w)), rtol=1e-5, atol=1e-5)


def _mlp(fp8=None):
    """ag_matmul -> tanh -> matmul_rs over tp: the forward's ag and the backward's ag (dy, w2^T)
    have operands of the same shapes when F / tp == D."""

    def body(x, w1, w2):
        h = flux_jax.ag_matmul(x, w1, axis_name="tp", impl="fused", fp8=fp8)
        return flux_jax.matmul_rs(jnp.tanh(h), w2, axis_name="tp", impl="fused", fp8=fp8)

    return body


def test_same_named_programs_with_different_protocols_get_their_own_call_sites():
    """Call sites count alike in programs of one name (eager ops; jit of functions named alike),
    so their ids also hold the weight's layout, the direction and the FP8 recipe: an eager
    gradient (the backward's ag_matmul reads w2 transposed, with the forward's shapes) and two
    jitted gradients that differ only in the recipe run, each right, one after the other."""
    tp = 4
    mesh = cpu_mesh((tp,), ("tp",), AxisType.Auto)
    rng = np.random.default_rng()
    d, f = 32, 4 * 32
    x = random_array(rng, (16, d), jnp.bfloat16)
    w1, w2 = random_array(rng, (d, f), jnp.bfloat16, d**-0.5), random_array(rng, (f, d), jnp.bfloat16, f**-0.5)
    specs = (P("tp", None), P(None, "tp"), P("tp", None))
    args = tuple(place(mesh, a, s) for a, s in zip((x, w1, w2), specs))

    def grad(body, jit=True):
        f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("tp", None))
        g = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
        return jax.jit(g) if jit else g

    eager, twin = grad(_mlp(), jit=False)(*args), grad(_twin_mlp)(*args)
    for g, t in zip(eager, twin):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(t, np.float32), rtol=2e-2, atol=2e-2)
    default, e4m3 = grad(_mlp(flux_jax.Fp8())), grad(_mlp(flux_jax.Fp8(backward_format="e4m3")))
    first = default(*args)
    e4m3(*args)
    again = default(*args)  # the first program's call sites are still usable
    for a, b in zip(first, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not flux_jax.device_errors()


def _twin_mlp(x, w1, w2):
    h = flux_jax.ag_matmul(x, w1, axis_name="tp", impl="xla")
    return flux_jax.matmul_rs(jnp.tanh(h), w2, axis_name="tp", impl="xla")


def test_same_shape_calls_in_one_program_get_their_own_call_sites():
    """Twelve independent ag_matmul calls of one shape in one program (q, k, v, ... projections):
    JAX lowers identical equations once and reuses the result unless told not to; each call must
    keep its own call-site id, or calls that XLA:CPU runs at once would meet on one channel."""
    import re

    tp, n = 4, 12
    mesh = cpu_mesh((tp,), ("tp",), AxisType.Auto)
    rng = np.random.default_rng()
    xs = [random_array(rng, (4 * tp, 32), jnp.float32) for _ in range(n)]
    ws = [random_array(rng, (32, 64), jnp.float32) for _ in range(n)]

    def body(*a):
        return [flux_jax.ag_matmul(a[i], a[n + i], axis_name="tp", impl="fused") for i in range(n)]

    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * n + (P(None, "tp"),) * n, out_specs=[P(None, "tp")] * n)
    )
    args = [place(mesh, x, P("tp")) for x in xs] + [place(mesh, w, P(None, "tp")) for w in ws]
    ids = re.findall(r"callsite = (\d+)", f.lower(*args).as_text())
    assert len(ids) == n and len(set(ids)) == n, ids
    for _ in range(3):
        for out, x, w in zip(f(*args), xs, ws):
            np.testing.assert_allclose(np.asarray(out), np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-4)


def test_a_failed_call_fails_every_rank_before_the_next_xla_collective():
    """A silent rank: the ranks that got their rows must fail too (each call ends with an
    agreement), or they would wait in the following lax.psum for the failed ones until XLA aborts
    the process. Then flux_jax.reset() and the same program runs right."""
    mesh = cpu_mesh((4,), ("tp",), AxisType.Auto)
    rng = np.random.default_rng()
    x, w = random_array(rng, (8, 16), jnp.float32), random_array(rng, (16, 8), jnp.float32)

    def fn(impl):
        def body(x, w):
            return jax.lax.psum(flux_jax.ag_matmul(x, w, axis_name="tp", impl=impl), "tp")

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))

    f = fn("fused")
    with flux_jax.config(timeout_s=0.3, debug_drop_rank=1):
        with pytest.raises(Exception, match=r"timed out after 0.3 s waiting for chunk 1 from rank 1"):
            np.asarray(f(x, w))
    flux_jax.reset()
    np.testing.assert_allclose(np.asarray(f(x, w)), np.asarray(fn("xla")(x, w)), rtol=1e-5, atol=1e-4)


def test_reset_waits_for_fused_calls_still_queued():
    """JAX dispatches asynchronously: calls queued before flux_jax.reset() complete on the state
    they started with (reset dropped it under them: about half of such runs failed, and the call
    site stayed failed until the next reset)."""
    mesh = cpu_mesh((8,), ("tp",))
    rng = np.random.default_rng()
    x, w1, w2 = (random_array(rng, (256, 256), "float32") / 16 for _ in range(3))

    def mlp(x, w1, w2):
        h = flux_jax.ag_matmul(x, w1, axis_name="tp", impl="fused")
        return flux_jax.matmul_rs(jnp.tanh(h), w2, axis_name="tp", impl="fused")

    specs = (P("tp"), P(None, "tp"), P("tp"))
    f = jax.jit(jax.shard_map(mlp, mesh=mesh, in_specs=specs, out_specs=P("tp")))
    args = [place(mesh, a, s) for a, s in zip((x, w1, w2), specs)]
    with flux_jax.config(timeout_s=5.0):
        want = np.asarray(f(*args))
        for _ in range(5):
            queued = [f(*args) for _ in range(32)]
            flux_jax.reset()
            for y in queued:
                np.testing.assert_array_equal(np.asarray(y), want)
        np.testing.assert_array_equal(np.asarray(f(*args)), want)
