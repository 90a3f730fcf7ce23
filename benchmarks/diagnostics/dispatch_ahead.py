"""Whether a loop of fused calls can be dispatched several runs ahead without stalling (diagnostic).

JAX returns from a call once its work is enqueued, so a training loop runs ahead of the GPU by as
many steps as it dispatches before it blocks. This keeps `--depth` runs of a serialized loop of
`--calls` calls of one op queued (as benchmarks/gpu_energy.py does): when the oldest finishes,
the next is dispatched, until `--runs` have finished. A watchdog thread that sees no run finish
and no dispatch return for `--stall-s` prints a STALL line with every thread's Python stack and
exits with status 3, instead of waiting forever. On one H200 the FP8 overlap loop below stalled at
depth 3 and ran at depths 1 and 2 (benchmarks/fp8_gemm.py keeps two for that reason).

  python benchmarks/diagnostics/dispatch_ahead.py --shape 8192x2048x4096 --fp8 --calls 134 --depth 3

The op is `ag_matmul` at tp = 1 (a mesh axis of size 1) on fresh random bfloat16 operands, forced
to `--path` (default overlap); `--impl xla` runs the twin instead. Prints one line:
`DISPATCH-AHEAD <op> depth=D calls=C: <runs> runs, <ms> ms per run, longest dispatch <ms> ms`.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import threading
import time
from collections import deque

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flux_jax  # noqa: E402
from benchmarks.timing import Built, serialized_loop  # noqa: E402

AXIS = "tp"


def build_loop(m: int, k: int, n: int, calls: int, impl: str, path: str, fp8: bool):
    """(compiled loop, its arguments): `calls` dependent ag_matmul calls over a mesh axis of size 1."""
    mesh = jax.make_mesh((1,), (AXIS,), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    rows = NamedSharding(mesh, P(AXIS, None))
    x = jax.device_put(jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16), rows)
    w = jax.device_put(
        (jax.random.normal(kw, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16), NamedSharding(mesh, P())
    )

    def step(x, w):
        return flux_jax.ag_matmul(x, w, axis_name=AXIS, impl=impl, fp8=fp8)

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(AXIS, None), P()), out_specs=P(AXIS, None)))
    built = Built(fn, (x, w), mesh, P(AXIS, None), P(AXIS, None), check=lambda out: 0.0)
    args = (jnp.float32(0.0), x, w)
    with flux_jax.config(fused_path=path):
        loop = serialized_loop(built, calls).lower(*args).compile()
    return loop, args


def run_ahead(loop, args, depth: int, runs: int, stall_s: float, on_stall) -> dict:
    """Keeps `depth` runs of `loop(*args)` queued until `runs` have finished. `on_stall(what)` is
    called from a watchdog thread if nothing finishes and no dispatch returns for `stall_s`."""
    progress = [time.perf_counter()]
    done = threading.Event()

    def watchdog():
        while not done.wait(min(1.0, stall_s / 4)):
            if time.perf_counter() - progress[0] > stall_s:
                on_stall(f"no run finished and no dispatch returned for {stall_s:.0f} s")
                return

    threading.Thread(target=watchdog, daemon=True).start()
    queue: deque = deque()
    longest_dispatch = 0.0
    finished = 0
    start = time.perf_counter()

    def dispatch():
        nonlocal longest_dispatch
        t = time.perf_counter()
        queue.append(jax.tree.leaves(loop(*args)))
        progress[0] = time.perf_counter()
        longest_dispatch = max(longest_dispatch, progress[0] - t)

    try:
        for _ in range(min(depth, runs)):
            dispatch()
        while queue:
            if all(leaf.is_ready() for leaf in queue[0]):
                queue.popleft()
                finished += 1
                progress[0] = time.perf_counter()
                if finished + len(queue) < runs:
                    dispatch()
    finally:
        done.set()
    return {
        "runs": finished,
        "ms_per_run": (time.perf_counter() - start) * 1e3 / max(finished, 1),
        "longest_dispatch_ms": longest_dispatch * 1e3,
    }


def _stall_and_exit(what: str) -> None:
    print(f"STALL: {what}; every thread's stack:", flush=True)
    faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
    sys.stdout.flush()
    os._exit(3)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8192x2048x4096", help="M x K x N of one call")
    ap.add_argument("--calls", type=int, default=134, help="calls per run of the loop")
    ap.add_argument("--depth", type=int, default=3, help="runs kept queued")
    ap.add_argument("--runs", type=int, default=30, help="runs to finish")
    ap.add_argument("--impl", default="fused", choices=("fused", "xla"))
    ap.add_argument("--path", default="overlap", choices=("overlap", "latency", "decode", "auto"))
    ap.add_argument("--fp8", action="store_true", help="ag_matmul(fp8=True)")
    ap.add_argument("--stall-s", type=float, default=60.0)
    args = ap.parse_args(argv)
    if min(args.calls, args.depth, args.runs) < 1:
        ap.error("--calls, --depth and --runs must be positive")
    m, k, n = (int(v) for v in args.shape.split("x"))
    loop, loop_args = build_loop(m, k, n, args.calls, args.impl, args.path, args.fp8)
    jax.block_until_ready(loop(*loop_args))  # warm-up
    got = run_ahead(loop, loop_args, args.depth, args.runs, args.stall_s, _stall_and_exit)
    op = f"ag_matmul({'fp8, ' if args.fp8 else ''}{args.impl}, {args.path}) {args.shape}"
    print(
        f"DISPATCH-AHEAD {op} depth={args.depth} calls={args.calls}: {got['runs']} runs, "
        f"{got['ms_per_run']:.1f} ms per run, longest dispatch {got['longest_dispatch_ms']:.1f} ms",
        flush=True,
    )
    return got


if __name__ == "__main__":
    main()
