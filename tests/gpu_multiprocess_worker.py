"""One process of a 2-process x 1-GPU job on a 2-GPU host (driven by test_gpu_multiprocess.py
and benchmarks/diagnostics/multiprocess_bench.py).

    python gpu_multiprocess_worker.py <process_id> <port> <scenario>

process_id -1 runs the scenario in a single process that drives both GPUs (the reference).
Prints one line `RESULT <json>`.
"""

import json
import os
import re
import statistics
import sys

process_id, port, scenario = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402

if process_id >= 0:
    jax.distributed.initialize(
        f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        local_device_ids=[process_id],
        initialization_timeout=120,
    )

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flux_jax  # noqa: E402

flux_jax.set_config(flux_jax.Config(timeout_s=float(os.environ.get("FLUX_TEST_TIMEOUT", "30"))))
_axis_type = AxisType.Auto if scenario == "timing" else AxisType.Explicit  # the probe loop needs Auto
mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",), axis_types=(_axis_type,))
SPECS = {
    "ag": ((P("tp", None), P(None, "tp")), P(None, "tp"), flux_jax.ag_matmul),
    "rs": ((P(None, "tp"), P("tp", None)), P("tp", None), flux_jax.matmul_rs),
}


def global_array(spec, host):
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda idx: host[idx])


def local_values(arr):
    return [np.asarray(s.data, np.float32) for s in sorted(arr.addressable_shards, key=lambda s: str(s.index))]


def max_rel_diff(a, b):
    diffs = [np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30) for x, y in zip(local_values(a), local_values(b))]
    return float(max(diffs)), all(bool(np.all(np.isfinite(x))) for x in local_values(a))


def op_fn(op, impl, path="auto"):
    (in_specs, out_spec, fn) = SPECS[op]

    def body(x, w):
        with flux_jax.config(fused_path=path):  # read while tracing
            return fn(x, w, axis_name="tp", impl=impl)

    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec), in_specs


def operands(op, M, K, N, seed=7):
    rng = np.random.default_rng(seed)  # same data in both processes
    x = rng.standard_normal((M, K)).astype(jnp.bfloat16)
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(jnp.bfloat16)
    (xs, ws), _, _ = SPECS[op]
    return global_array(xs, x), global_array(ws, w)


result = {"process": process_id}
if scenario == "ops":  # both paths, both ops, forward and gradients, against the twin
    for path in ("overlap", "latency", "decode"):
        M = 64 if path == "decode" else 1024  # decode: the kernels take <= 128 rows
        for op in ("ag", "rs"):
            x, w = operands(op, M, 1024, 2048)
            c = global_array(P(), np.random.default_rng(3).standard_normal((M, 2048)).astype(np.float32))
            outs = {}
            for impl in ("fused", "xla"):
                f, _ = op_fn(op, impl, path)
                loss = lambda x, w, c, f=f: jnp.sum(f(x, w).astype(jnp.float32) * c)  # noqa: E731
                outs[impl] = (jax.jit(f)(x, w), *jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, c))
            for name, a, b in zip(("fwd", "dx", "dw"), outs["fused"], outs["xla"]):
                result[f"{path}_{op}_{name}"] = max_rel_diff(a, b)
    result["device_errors"] = flux_jax.device_errors()
    result["workspace_bytes"] = {str(k): v for k, v in flux_jax.workspace_bytes().items()}
elif scenario == "timing":  # fused (auto path) per-call device time, the harness's loop
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchmarks import timing

    def gemm_picks(hlo):
        """XLA's GEMM choices in the timed program (cuBLAS algorithm / Triton tiling), and any
        collective XLA added: what differs between the single- and two-process programs."""
        return sorted(
            set(
                re.findall(r'"selected_algorithm":"?(-?\d+)', hlo)
                + re.findall(r'"kind":"(__[a-z_]+)"', hlo)
                + re.findall(r'custom_call_target="(__cu[a-z$]+)', hlo)
                + re.findall(r"\b(all-reduce|all-gather|collective-permute|reduce-scatter|all-to-all)-start", hlo)
            )
        )

    # The harness's serialized loop: each call's x depends on the previous output through a
    # shard-local update, so the program has no collective besides the op's own. (The probe's
    # global x.at[0, 0] update needed one, and XLA lowered it to an in-process Triton collective
    # in one process but to NCCL across processes: ~10 us per call, 5-15% at M = 256.)
    # Both processes must run every loop the same number of times: n2 is fixed (target_ms is
    # out of reach, max_calls caps it) and there is no time-based pre-heat.
    for op in ("ag", "rs"):
        for M, calls in ((4096, 200), (256, 1000)):
            if str(M) not in os.environ.get("FLUX_JAX_MP_BENCH_M", "4096,256").split(","):
                continue
            kn = int(os.environ.get("FLUX_JAX_MP_BENCH_KN", "8192"))  # smaller for a CPU smoke run
            x, w = operands(op, M, kn, kn)
            f, (x_spec, _) = op_fn(op, "fused")
            built = timing.Built(
                step=f, args=(x, w), mesh=mesh, carry_spec=x_spec, out_spec=SPECS[op][1], check=lambda _: 0.0
            )
            params = timing.TimingParams(n1=20, target_ms=1e9, max_calls=20 + calls, repeats=9, preheat_ms=0)
            timer = timing.LoopTimer(built, params)
            assert timer.n2 == 20 + calls, timer.n2
            result[f"{op}_{M}_ms"] = statistics.median([timer.sample() for _ in range(params.repeats)]) * 1e3
            result[f"{op}_{M}_gemm"] = gemm_picks(timer.program_text())
elif scenario == "peer_dies":  # process 1 exits before the op: process 0 must fail, not hang
    x, w = operands("ag", 1024, 1024, 2048)
    f, _ = op_fn("ag", "fused", "overlap")
    compiled = jax.jit(f).lower(x, w).compile()
    if process_id == 1:
        print("RESULT " + json.dumps({"process": 1, "exited": True}), flush=True)
        os._exit(0)
    out = compiled(x, w)
    result["nan"] = bool(np.isnan(local_values(out)[0]).any())
    result["device_errors"] = flux_jax.device_errors()
    try:
        np.asarray(compiled(x, w).addressable_shards[0].data)
        result["second_call_error"] = None
    except Exception as e:  # noqa: BLE001 - the point is the message
        result["second_call_error"] = str(e)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # the coordinator lost a peer; do not wait for a clean shutdown

print("RESULT " + json.dumps(result), flush=True)
if process_id >= 0:
    jax.distributed.shutdown()
