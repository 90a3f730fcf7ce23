"""Whether a loop of fused calls can be dispatched several runs ahead without stalling (diagnostic).

JAX returns from a call once its work is enqueued, so a training loop runs ahead of the GPU by as
many steps as it dispatches before it blocks. This keeps `--depth` runs of a serialized loop of
`--calls` calls of one op queued (as benchmarks/gpu_energy.py does): when the oldest finishes,
the next is dispatched, until `--runs` have finished. A watchdog thread that sees no run finish
and no dispatch return for `--stall-s` prints a STALL line, the GPU's utilization and power,
every thread's Python stack and (where gdb is installed) native stack, and exits with status 3,
instead of waiting forever. On one H200 the FP8 overlap loop below runs at depth 3, but each
dispatch waits about as long as a run takes: see the README.

  python benchmarks/diagnostics/dispatch_ahead.py --shape 8192x2048x4096 --fp8 --calls 134 --depth 3

The op is `ag_matmul` at tp = 1 (a mesh axis of size 1) on fresh random bfloat16 operands
(normal + 0.25, as gemm_parity's), forced to `--path` (default overlap); `--impl xla` runs the
twin instead. Prints one line:
`DISPATCH-AHEAD <op> depth=D calls=C: <runs> runs, <ms> ms per run, longest dispatch <ms> ms`.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import os
import shutil
import subprocess
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
    # As benchmarks/gemm_parity.py makes them: the offset keeps the GEMM at the power cap's draw.
    x = jax.device_put((jax.random.normal(kx, (m, k), jnp.float32) + 0.25).astype(jnp.bfloat16), rows)
    w = jax.device_put(
        ((jax.random.normal(kw, (k, n), jnp.float32) + 0.25) / k**0.5).astype(jnp.bfloat16), NamedSharding(mesh, P())
    )

    def step(x, w):
        return flux_jax.ag_matmul(x, w, axis_name=AXIS, impl=impl, fp8=fp8)

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(AXIS, None), P()), out_specs=P(AXIS, None)))
    built = Built(fn, (x, w), mesh, P(AXIS, None), P(AXIS, None), check=lambda out: 0.0)
    args = (jnp.float32(0.0), x, w)
    with flux_jax.config(fused_path=path):
        loop = serialized_loop(built, calls).lower(*args).compile()
    return loop, args


def run_ahead(loop, args, depth: int, runs: int, stall_s: float, on_stall, poll=None) -> dict:
    """Keeps `depth` runs of `loop(*args)` queued until `runs` have finished. `on_stall(what)` is
    called from a watchdog thread if nothing finishes and no dispatch returns for `stall_s`;
    `poll()`, if given, runs between two looks at the oldest run (e.g. an energy-counter read)."""
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
            if poll is not None:
                poll()
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


def _native_stacks() -> str:
    """Every thread's native stack from gdb (where a dispatch blocks inside the runtime), or why
    not. The process allows its child to attach (Yama's ptrace scope 1 forbids it otherwise)."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no gdb on this machine) " + _kernel_waits()
    try:
        pr_set_ptracer, ptracer_any = 0x59616D61, ctypes.c_ulong(-1).value
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_ptracer, ptracer_any, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    cmd = [gdb, "-p", str(os.getpid()), "-batch", "-nx", "-ex", "set pagination off", "-ex", "thread apply all bt 25"]
    try:
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "(gdb did not finish in 120 s)"
    return got.stdout + got.stderr


def _kernel_waits() -> str:
    """Where each thread sits in the kernel (/proc: its wait channel and system call number; 202
    is futex, 16 ioctl into the driver on x86-64), where gdb is missing."""
    lines = ["threads' kernel waits (name: wchan / syscall):"]
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        fields = []
        for name in ("comm", "wchan", "syscall"):
            try:
                with open(f"/proc/self/task/{tid}/{name}") as f:
                    fields.append(f.read().strip().split(" ")[0] or "-")
            except OSError:
                fields.append("?")
        lines.append(f"  {tid} {fields[0]}: {fields[1]} / {fields[2]}")
    return "\n".join(lines)


def _gpu_state() -> str:
    """Utilization, power and clocks while stalled: a busy GPU spins in a kernel, an idle one waits
    for the host."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "(no nvidia-smi)"
    fields = "utilization.gpu,power.draw,clocks.sm,memory.used"
    rows = []
    for _ in range(3):
        got = subprocess.run([smi, f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True, text=True)
        rows.append(got.stdout.strip() or got.stderr.strip())
        time.sleep(0.5)
    return f"{fields}: " + " | ".join(rows)


def _stall_and_exit(what: str) -> None:
    print(f"STALL: {what}", flush=True)
    print(f"GPU while stalled: {_gpu_state()}", flush=True)
    print("Every thread's Python stack:", flush=True)
    faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
    print("Every thread's native stack:", flush=True)
    print(_native_stacks(), flush=True)
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
    ap.add_argument(
        "--energy", action="store_true", help="read NVML's energy counter while polling, as gpu_energy.sustained does"
    )
    ap.add_argument("--hlo", default=None, help="write the compiled loop's HLO text to this file")
    args = ap.parse_args(argv)
    if min(args.calls, args.depth, args.runs) < 1:
        ap.error("--calls, --depth and --runs must be positive")
    m, k, n = (int(v) for v in args.shape.split("x"))
    loop, loop_args = build_loop(m, k, n, args.calls, args.impl, args.path, args.fp8)
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(loop.as_text())
    jax.block_until_ready(loop(*loop_args))  # warm-up
    poll = None
    if args.energy:
        from benchmarks import gpu_energy

        meter = gpu_energy.EnergyMeter.open()
        if meter is None:
            ap.error("--energy: NVML's energy counter is not available here")
        poll = meter.read_mj
    got = run_ahead(loop, loop_args, args.depth, args.runs, args.stall_s, _stall_and_exit, poll)
    op = f"ag_matmul({'fp8, ' if args.fp8 else ''}{args.impl}, {args.path}) {args.shape}"
    op += " with energy reads" if args.energy else ""
    print(
        f"DISPATCH-AHEAD {op} depth={args.depth} calls={args.calls}: {got['runs']} runs, "
        f"{got['ms_per_run']:.1f} ms per run, longest dispatch {got['longest_dispatch_ms']:.1f} ms",
        flush=True,
    )
    return got


if __name__ == "__main__":
    main()
