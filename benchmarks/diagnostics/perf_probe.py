"""Quick on-device timing of fused vs twin for a few TP=2 shapes (dev tool).

Per-call device time from a serialized loop inside one jit, measured at two
loop lengths and differenced, so dispatch and fixed costs cancel. The full
harness is `python -m benchmarks.run`; this is the smoke version for a kernel
change.

    python benchmarks/diagnostics/perf_probe.py --shapes 4096x8192x8192,8192x8192x28672
    python benchmarks/diagnostics/perf_probe.py --grad ...   # forward + backward (the training step's ops)

With --grad every variant is timed as one forward and backward step (dx and dw of
the vjp of op at (x, w) with a fixed random cotangent ct, and y kept live; a cotangent
of ones would let XLA turn the twin's backward GEMMs into reductions, and an unused y
would drop the twin's forward GEMM): the backward of ag_matmul runs matmul_rs on the transposed weight and
vice versa (the K-major GEMM instances), which the forward-only harness never times.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import flux_jax  # noqa: E402
from benchmarks.variants import with_grad  # noqa: E402  (the harness's --grad step)
from flux_jax._config import parse_overrides  # noqa: E402


def _loop(fn, n):
    # The global x.at[0, 0] update below is a cross-device collective in a sharded program (an
    # in-process Triton collective on one host, NCCL across processes): a few us per call that
    # benchmarks/timing.py's shard-local dependency avoids. Use the harness for small-M figures.
    def run(x, *rest):
        def body(i, carry):
            x, acc = carry
            y = fn(x, *rest)
            # Carry a dependency: x picks up one element of the previous output.
            x = x.at[0, 0].add((y[0, 0] * 0).astype(x.dtype))
            return x, acc + y[0, 0].astype(jnp.float32)

        return jax.lax.fori_loop(0, n, body, (x, jnp.float32(0)))[1]

    return jax.jit(run)


def time_per_call(fn, *args, n1=10, n2=40, repeats=5):
    f1, f2 = _loop(fn, n1), _loop(fn, n2)
    f1(*args).block_until_ready()
    f2(*args).block_until_ready()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f1(*args).block_until_ready()
        t1 = time.perf_counter()
        f2(*args).block_until_ready()
        t2 = time.perf_counter()
        samples.append(((t2 - t1) - (t1 - t0)) / (n2 - n1))
    return float(np.median(samples)) * 1e3, float(np.min(samples)) * 1e3, float(np.max(samples)) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x8192x8192,8192x8192x28672,16384x8192x8192,2048x8192x8192,512x8192x8192")
    ap.add_argument("--ops", default="ag,rs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default="", help="extra fused variants, e.g. 'gpu_tile_group_m=16;fused_path=latency'")
    ap.add_argument("--grad", action="store_true", help="time forward + backward (dx, dw) instead of the forward alone")
    ap.add_argument(
        "--gemm-alone", action="store_true", help="also time flux_jax's GEMM kernel alone (size-1 axis) per config"
    )
    args = ap.parse_args()
    gpus = [d for d in jax.devices() if d.platform == "gpu"][:2] or jax.devices()[:2]  # CPU: dry run
    mesh = jax.sharding.Mesh(np.array(gpus), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = []
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        M, K, N = map(int, shape.split("x"))
        x = jnp.asarray(rng.standard_normal((M, K), np.float32), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((K, N), np.float32) / np.sqrt(K), jnp.bfloat16)
        for op in args.ops.split(","):
            if op == "ag":
                specs, out, fn = (P("tp", None), P(None, "tp")), P(None, "tp"), flux_jax.ag_matmul
                local = lambda x, w: jnp.dot(x, w)
                lshape = ((M, K), (K, N // 2))
            else:
                specs, out, fn = (P(None, "tp"), P("tp", None)), P("tp", None), flux_jax.matmul_rs
                local = lambda x, w: jnp.dot(x, w)
                lshape = ((M, K // 2), (K // 2, N))
            xs = jax.device_put(x, jax.NamedSharding(mesh, specs[0]))
            ws = jax.device_put(w, jax.NamedSharding(mesh, specs[1]))
            # --grad: a random cotangent, sharded like the output (f32, as the loss sees it).
            ct = jax.device_put(jnp.asarray(rng.standard_normal((M, N), np.float32)), jax.NamedSharding(mesh, out))
            args_in = (xs, ws, ct) if args.grad else (xs, ws)
            res = {}
            variants = [("fused", "fused", {}), ("xla", "xla", {})]
            for spec_text in filter(None, args.configs.split(";")):
                kw = parse_overrides(spec_text)
                variants.append((f"fused[{spec_text}]", "fused", kw))
            for name, impl, kw in variants:
                with flux_jax.config(**kw):
                    f = jax.shard_map(
                        functools.partial(fn, axis_name="tp", impl=impl), mesh=mesh, in_specs=specs, out_specs=out
                    )
                    f = with_grad(f) if args.grad else f
                    res[name] = time_per_call(f, *args_in)
                    res[name + "_out"] = f(*args_in)
            ref = res["xla_out"].astype(jnp.float32)
            errs = {
                name: float(jnp.max(jnp.abs(res[name + "_out"].astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
                for name, _, _ in variants
                if name != "xla"
            }
            err = max(errs.values())  # every fused variant against the twin
            g = jax.device_put(jnp.asarray(rng.standard_normal(lshape[0]), jnp.bfloat16), gpus[0])
            gw = jax.device_put(jnp.asarray(rng.standard_normal(lshape[1]) / 64, jnp.bfloat16), gpus[0])
            gemm = time_per_call(local, g, gw)
            if args.gemm_alone:
                # flux_jax's GEMM kernel alone: the fused op over a size-1 axis on one GPU.
                one = jax.sharding.Mesh(np.array(gpus[:1]), ("one",), axis_types=(jax.sharding.AxisType.Auto,))
                alone = jax.shard_map(
                    functools.partial(fn, axis_name="one", impl="fused"),
                    mesh=one,
                    in_specs=(P(), P()),
                    out_specs=P(),
                    check_vma=False,
                )
                for name, _, kw in variants:
                    if name == "xla":
                        continue
                    with flux_jax.config(**{"fused_path": "overlap", **kw}):
                        res["gemm_alone_" + name] = time_per_call(alone, g, gw)
            row = dict(
                op=op,
                M=M,
                K=K,
                N=N,
                grad=args.grad,
                fused_ms=res["fused"][0],
                xla_ms=res["xla"][0],
                gemm_ms=gemm[0],
                speedup=res["xla"][0] / res["fused"][0],
                max_rel_err=err,
                fused_spread=res["fused"][1:],
                xla_spread=res["xla"][1:],
                variants={k: v[0] for k, v in res.items() if not k.endswith("_out")},
                errors=errs,
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"{'op':3} {'M':>6} {'K':>6} {'N':>6} {'fused':>8} {'xla':>8} {'gemm':>8} {'x':>6} {'err':>8}")
    for r in rows:
        print(
            f"{r['op']:3} {r['M']:6d} {r['K']:6d} {r['N']:6d} {r['fused_ms']:8.3f} {r['xla_ms']:8.3f} "
            f"{r['gemm_ms']:8.3f} {r['speedup']:6.2f} {r['max_rel_err']:8.1e}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
