"""One process of a 2-process x 4-CPU-device job (driven by test_multiprocess.py).

    python multiprocess_worker.py <process_id> <port> <scenario> [host_id]

Prints one line `RESULT <json>` with what the scenario measured.
"""

import functools
import json
import os
import re
import signal
import sys
import time

process_id, port, scenario = int(sys.argv[1]), sys.argv[2], sys.argv[3]
host_id = sys.argv[4] if len(sys.argv) > 4 else None
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flux_jax  # noqa: E402

if host_id is not None:
    flux_jax.initialize_distributed(host_id=host_id)
flux_jax.set_config(
    flux_jax.Config(timeout_s=float(os.environ.get("FLUX_TEST_TIMEOUT", "60")), debug_poison_outputs=True)
)


def callsites(lowered_text):
    """The call-site ids of a lowered program's fused custom calls (derived from the program)."""
    return [int(v) for v in re.findall(r"callsite = (-?\d+)", lowered_text)]


def sync(client, step):
    """Both processes reach `step` (through jax.distributed's key-value store)."""
    client.key_value_set(f"test/{step}/{process_id}", "1")
    client.blocking_key_value_get(f"test/{step}/{1 - process_id}", 60_000)


def ag_matmul_fn(mesh, impl):
    """jit(shard_map(ag_matmul)) over the mesh's tp axis: x rows and w columns sharded."""
    body = functools.partial(flux_jax.ag_matmul, axis_name="tp", impl=impl)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp")))


def timed_error(call):
    """(the message of what `call()` raised, or None; its seconds)."""
    t0 = time.time()
    try:
        call()
        error = None
    except Exception as e:  # noqa: BLE001 - the point is the message
        error = str(e)
    return error, time.time() - t0


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
            f = jax.shard_map(
                functools.partial(fn, axis_name=tp_axis, impl=impl), mesh=mesh, in_specs=specs, out_specs=out_spec
            )
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
        problem = REGISTRY["ag_matmul"].problem(x.shape, w.shape, x.dtype, 8, "cpu", False)
        cfg, tuning = flux_jax.get_config(), _config.get_gpu_tuning()
        call = Call("tp", 8, False, "auto", False, plan, cfg, tuning, problem=problem)
        x, w = unify_varying("tp", x, w)
        return REGISTRY["ag_matmul"].core(x, w, call)[0]

    specs = dict(mesh=mesh, in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"))
    auto = jax.jit(jax.shard_map(not_forced, **specs))
    twin = ag_matmul_fn(mesh, "xla")
    result["auto_hlo_has_custom_call"] = "flux_jax_ag_matmul" in auto.lower(x, w).as_text()
    result["auto_rel_err"] = max_rel_diff(auto(x, w), twin(x, w))[0]
    fused = ag_matmul_fn(mesh, "fused")
    try:
        fused.lower(x, w)
        result["fused_error"] = None
    except flux_jax.FusedUnavailableError as e:
        result["fused_error"] = str(e)
elif scenario in ("peer_dies", "peer_killed"):
    # peer_dies: process 1 exits before the op; peer_killed: it is SIGKILLed after one good call.
    # Either way process 0 must fail (not hang) and no segment of the job may stay in /dev/shm.
    mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Explicit,))
    x, w = global_array(mesh, P("tp", None), x_host), global_array(mesh, P(None, "tp"), w_host)
    f = ag_matmul_fn(mesh, "fused")
    compiled = f.lower(x, w).compile()
    result["session"] = flux_jax._distributed.process_info().session
    if scenario == "peer_killed":
        np.asarray(compiled(x, w).addressable_shards[0].data)
    if process_id == 1:
        print("RESULT " + json.dumps(result | {"exited": True}), flush=True)
        if scenario == "peer_killed":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0)
    try:
        np.asarray(compiled(x, w).addressable_shards[0].data)
        result["error"] = None
    except Exception as e:  # noqa: BLE001 - the point is the message
        result["error"] = str(e)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # the coordinator lost a peer; do not wait for a clean shutdown
elif scenario == "peer_throws":
    # Process 1 caps its address space after a good call, so its ranks' protocol threads throw
    # std::bad_alloc on the float copy of w (64 MiB each); process 0's ranks are waiting for them.
    # Both processes must survive with an error, process 0's well before its timeout.
    import resource

    mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Explicit,))
    k, n = 4096, 8 * 4096  # per rank w [4096, 4096] float32: 64 MiB, its float copy as much
    x = global_array(mesh, P("tp", None), np.ones((64, k), np.float32))
    w = jax.jit(lambda: jnp.ones((k, n), jnp.float32), out_shardings=NamedSharding(mesh, P(None, "tp")))()
    compiled = ag_matmul_fn(mesh, "fused").lower(x, w).compile()
    result["session"] = flux_jax._distributed.process_info().session
    jax.block_until_ready(compiled(x, w))
    sync(flux_jax._distributed._client(), "warm")
    if process_id == 1:
        with open("/proc/self/status") as f:
            vm = int(next(line for line in f if line.startswith("VmSize")).split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), resource.RLIM_INFINITY))
    result["error"], result["failing_call_s"] = timed_error(lambda: jax.block_until_ready(compiled(x, w)))
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)
elif scenario in ("squat_legacy", "squat_exact"):
    # Another local user pre-creates segment names. squat_legacy: the names the channel used to
    # take (job token + call-site counter, mode 0666, never sized); the ops must not notice.
    # squat_exact: the real names (as if the secret had leaked): a clear error, never a pairing.
    import shm_names

    mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Explicit,))
    session = flux_jax._distributed.process_info().session
    result["session"] = session
    client = flux_jax._distributed._client()
    squatted = []

    def squat(name, mode, uid=None):
        fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
        os.fchmod(fd, mode)
        if uid is not None:
            os.fchown(fd, uid, uid)
        os.close(fd)
        squatted.append("/dev/shm" + name)

    if scenario == "squat_legacy":
        if process_id == 0:  # the old scheme numbered call sites 1, 2, 3, ...
            for c in range(1, 65):
                squat(shm_names.legacy_name(session, c, [d.id for d in mesh.devices.ravel()]), 0o666)
        sync(client, "squatted")
        try:
            result.update(run_ops(mesh, "tp", x_host, w_host, c_host))
        finally:
            for path in squatted:
                os.unlink(path)
    else:
        x, w = global_array(mesh, P("tp", None), x_host), global_array(mesh, P(None, "tp"), w_host)
        programs = []

        def first_program(a, b):
            return flux_jax.ag_matmul(a, b, axis_name="tp", impl="fused")

        def second_program(a, b):  # another module name: other call-site ids
            return flux_jax.ag_matmul(a, b, axis_name="tp", impl="fused")

        for body in (first_program, second_program):
            f = jax.jit(
                jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp"))
            )
            lowered = f.lower(x, w)
            programs.append((lowered.compile(), callsites(lowered.as_text())))
        secret = flux_jax._distributed._shm_secret
        result["secret_bits"] = len(secret) * 4
        result["owner_tested"] = os.geteuid() == 0
        if process_id == 0:
            for (_, sites), (mode, uid) in zip(programs, ((0o666, None), (0o600, 65534))):
                if uid is not None and os.geteuid() != 0:
                    continue  # only root can give a file away
                for c in sites:
                    name = shm_names.segment_name(session, secret, c, 0, [d.id for d in mesh.devices.ravel()])
                    squat(name, mode, uid)
                    result.setdefault("names", []).append(name)
        sync(client, "squatted")
        try:
            for i, (compiled, _) in enumerate(programs):
                try:
                    np.asarray(compiled(x, w).addressable_shards[0].data)
                    result[f"error{i}"] = None
                except Exception as e:  # noqa: BLE001 - the point is the message
                    result[f"error{i}"] = str(e)
        finally:
            sync(client, "ran")
            for path in squatted:
                os.unlink(path)
elif scenario == "small_shm":
    # Run inside a private mount namespace whose /dev/shm is a few MiB (test_multiprocess.py):
    # one ag_matmul with 256 KiB per chunk needs 8 receivers x 7 senders x 2 parities of it.
    mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Explicit,))
    big_x = rng.standard_normal((1024, 512)).astype(np.float32)
    big_w = (rng.standard_normal((512, 128)) / 16).astype(np.float32)
    x, w = global_array(mesh, P("tp", None), big_x), global_array(mesh, P(None, "tp"), big_w)
    f = ag_matmul_fn(mesh, "fused")
    twin = ag_matmul_fn(mesh, "xla")
    compiled = f.lower(x, w).compile()
    result["error"], result["seconds"] = timed_error(
        lambda: result.update(diff=max_rel_diff(compiled(x, w), twin(x, w)))
    )
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)
elif scenario == "reset":
    # flux_jax.reset() in both processes without any barrier of the caller's, one process late;
    # then in one process only; then a process on another reset generation.
    mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Explicit,))
    x, w = global_array(mesh, P("tp", None), x_host), global_array(mesh, P(None, "tp"), w_host)
    compiled = ag_matmul_fn(mesh, "fused").lower(x, w).compile()
    expected = ag_matmul_fn(mesh, "xla")(x, w)
    client = flux_jax._distributed._client()
    result["session"] = flux_jax._distributed.process_info().session

    def attempt(key):
        t0 = time.time()
        try:
            diff, finite = max_rel_diff(compiled(x, w), expected)
            result[key] = None if finite and diff < 1e-4 else f"wrong result: diff {diff}, finite {finite}"
        except Exception as e:  # noqa: BLE001 - the point is the message
            result[key] = str(e)
        result[key + "_s"] = time.time() - t0

    # 1. Process 1 comes first, so it creates the segments.
    if process_id == 0:
        time.sleep(1.5)
    attempt("first")
    # 2. Both reset, process 1 1.5 s late; process 0 runs again at once.
    if process_id == 1:
        time.sleep(1.5)
    flux_jax.reset()
    attempt("after_reset")
    sync(client, "step2")
    # 3. Only process 0 resets: it must say that process 1 did not, within the timeout.
    if process_id == 0:
        t0 = time.time()
        try:
            flux_jax.reset()
            result["lonely_reset"] = None
        except Exception as e:  # noqa: BLE001 - the point is the message
            result["lonely_reset"] = str(e)
        result["lonely_reset_s"] = time.time() - t0
    sync(client, "step3")
    # 4. Process 0 drops its channels behind the barrier's back (what a process that missed a
    # reset looks like to its peers): process 1 must get a clear error, not pair stale state.
    if process_id == 0:
        flux_jax._native.extension().reset_cpu_channels()
    sync(client, "step4")
    attempt("stale")
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)
elif scenario == "peer_stopped":
    # Both processes call a small fused op in a loop; the test SIGSTOPs process 1 at a random
    # moment (perhaps inside the channel protocol). Process 0 must fail within the timeout.
    mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Explicit,))
    xr, wr = global_array(mesh, P(None, "tp"), x_host), global_array(mesh, P("tp", None), w_host)
    compiled = (
        jax.jit(
            jax.shard_map(
                functools.partial(flux_jax.matmul_rs, axis_name="tp", impl="fused"),
                mesh=mesh,
                in_specs=(P(None, "tp"), P("tp", None)),
                out_specs=P("tp", None),
            )
        )
        .lower(xr, wr)
        .compile()
    )
    result["session"] = flux_jax._distributed.process_info().session
    np.asarray(compiled(xr, wr).addressable_shards[0].data)
    print("LOOPING", flush=True)
    calls, start = 0, time.time()
    while time.time() - start < 120:
        t0 = time.time()
        try:
            jax.block_until_ready(compiled(xr, wr))
            calls += 1
        except Exception as e:  # noqa: BLE001 - the point is the message
            result.update(error=str(e), failing_call_s=time.time() - t0, calls=calls)
            break
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)

print("RESULT " + json.dumps(result), flush=True)
jax.distributed.shutdown()
