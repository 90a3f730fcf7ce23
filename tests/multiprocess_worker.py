"""One process of a 2-process x 4-CPU-device job (driven by test_multiprocess.py).

    python multiprocess_worker.py <process_id> <port> <scenario> [host_id]

Prints one line `RESULT <json>` with what the scenario measured.
"""

import functools
import json
import os
import sys

process_id, port, scenario = int(sys.argv[1]), sys.argv[2], sys.argv[3]
host_id = sys.argv[4] if len(sys.argv) > 4 else None
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                           initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flux_jax  # noqa: E402

if host_id is not None:
    flux_jax.initialize_distributed(host_id=host_id)
flux_jax.set_config(flux_jax.Config(timeout_s=float(os.environ.get("FLUX_TEST_TIMEOUT", "60")),
                                    debug_poison_outputs=True))


def global_array(mesh, spec, host):
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda idx: host[idx])


def local_values(arr):
    """This process's shards, sorted by their index (comparable across impls)."""
    shards = sorted(arr.addressable_shards, key=lambda s: str(s.index))
    return [np.asarray(s.data, np.float32) for s in shards]


def max_rel_diff(a, b):
    diffs = [np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30) for x, y in zip(local_values(a), local_values(b))]
    finite = all(np.all(np.isfinite(x)) for x in local_values(a))
    return float(max(diffs)), finite


def run_ops(mesh, tp_axis, x_host, w_host, c_host):
    """ag and rs, forward and gradient, fused vs twin on one mesh."""
    out = {}
    for op in ("ag", "rs"):
        if op == "ag":
            fn, specs, out_spec = flux_jax.ag_matmul, (P(tp_axis, None), P(None, tp_axis)), P(None, tp_axis)
        else:
            fn, specs, out_spec = flux_jax.matmul_rs, (P(None, tp_axis), P(tp_axis, None)), P(tp_axis, None)
        x, w = global_array(mesh, specs[0], x_host), global_array(mesh, specs[1], w_host)
        c = global_array(mesh, P(), c_host)
        results = {}
        for impl in ("fused", "xla"):
            f = jax.shard_map(functools.partial(fn, axis_name=tp_axis, impl=impl), mesh=mesh,
                              in_specs=specs, out_specs=out_spec)
            fwd = jax.jit(f)(x, w)
            loss = lambda x, w, c: jnp.sum(f(x, w) * c)
            grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, c)
            results[impl] = (fwd, *grads)
        for name, a, b in zip(("fwd", "dx", "dw"), results["fused"], results["xla"]):
            out[f"{op}_{name}"] = max_rel_diff(a, b)
    return out


rng = np.random.default_rng(7)  # same data in both processes
x_host = (rng.standard_normal((32, 64)) + 0.25).astype(np.float32)
w_host = (rng.standard_normal((64, 48)) / 8).astype(np.float32)
c_host = rng.standard_normal((32, 48)).astype(np.float32)
result = {"process": process_id}

if scenario == "spanning":  # one TP group of 8 devices across both processes: shared memory
    mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Explicit,))
    result.update(run_ops(mesh, "tp", x_host, w_host, c_host))
    result["channels"] = flux_jax._native.extension().cpu_channel_count()
elif scenario == "local_groups":  # dp=2 across processes x tp=4 within each process
    devices = np.array(jax.devices()).reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    result.update(run_ops(mesh, "tp", x_host, w_host, c_host))
elif scenario == "cross_host":  # host ids differ: fused primitive -> twin with a log line, impl="fused" -> error
    from flux_jax import _config, _plan
    from flux_jax.ops import REGISTRY
    from flux_jax.ops._spec import Call, unify_varying

    mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Explicit,))
    x, w = global_array(mesh, P("tp", None), x_host), global_array(mesh, P(None, "tp"), w_host)

    def not_forced(x, w):  # what impl="auto" emits where it picks the fused kernel (GPU)
        plan = _plan.Plan("overlap", "what auto plans on GPU", "test")
        call = Call("tp", 8, False, "auto", False, plan, flux_jax.get_config(), _config.get_gpu_tuning())
        x, w = unify_varying("tp", x, w)
        return REGISTRY["ag_matmul"].core(x, w, call)[0]

    specs = dict(mesh=mesh, in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"))
    auto = jax.jit(jax.shard_map(not_forced, **specs))
    twin = jax.jit(jax.shard_map(functools.partial(flux_jax.ag_matmul, axis_name="tp", impl="xla"), **specs))
    result["auto_hlo_has_custom_call"] = "flux_jax_ag_matmul" in auto.lower(x, w).as_text()
    result["auto_rel_err"] = max_rel_diff(auto(x, w), twin(x, w))[0]
    fused = jax.jit(jax.shard_map(functools.partial(flux_jax.ag_matmul, axis_name="tp", impl="fused"),
                                  mesh=mesh, in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp")))
    try:
        fused.lower(x, w)
        result["fused_error"] = None
    except flux_jax.FusedUnavailableError as e:
        result["fused_error"] = str(e)
elif scenario == "peer_dies":  # process 1 exits before the op: process 0 must fail, not hang
    mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Explicit,))
    x, w = global_array(mesh, P("tp", None), x_host), global_array(mesh, P(None, "tp"), w_host)
    f = jax.jit(jax.shard_map(functools.partial(flux_jax.ag_matmul, axis_name="tp", impl="fused"),
                              mesh=mesh, in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp")))
    compiled = f.lower(x, w).compile()
    if process_id == 1:
        print("RESULT " + json.dumps({"process": 1, "exited": True}), flush=True)
        os._exit(0)
    try:
        np.asarray(compiled(x, w).addressable_shards[0].data)
        result["error"] = None
    except Exception as e:  # noqa: BLE001 - the point is the message
        result["error"] = str(e)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # the coordinator lost a peer; do not wait for a clean shutdown

print("RESULT " + json.dumps(result), flush=True)
jax.distributed.shutdown()
