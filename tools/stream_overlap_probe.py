"""Does XLA run our fused op on a second stream beside an independent GEMM? (GPU probe)

`jax.experimental.compute_on.compute_on(compute_type="gpu_stream:1")` annotates a called
computation with `_xla_stream_annotation`; XLA then runs it as an async start / done on another
stream. If that works for our custom calls, an op could be split at the XLA level (e.g. RS: the
peer's rows first, pushed while the own rows' GEMM runs) without a new kernel. Four variants per
shape, timed with the harness's loop (dispatch-free, shuffled pre-heated rounds):

  op_alone      y = ag_matmul(x, w)                      (flux_jax, fused_path from --path)
  gemm_alone    z = x @ w2, reshaped to y's shape        (independent of y, as many FLOPs; it
                                                          reads the carried x, so XLA cannot
                                                          hoist it out of the timing loop)
  serial        y + z, both on the compute stream
  streams       y on gpu_stream:1, z on the compute stream, then y + z

Overlap works if `streams` is near max(op_alone, gemm_alone) + the add, not their sum (`serial`).
Our latency collective spins on up to 128 blocks, so it may also show SM contention. Two more
variants time the GEMM on half of x's rows, a static slice and one chosen by rank (what a row
split of RS needs): near half of `gemm_alone` means XLA fed the slice to the GEMM without a
copy; the programs' fusions before the GEMM are printed.

  python tools/stream_overlap_probe.py --shapes 1024x8192x10240,2048x4096x6144 --out probe.json
  python tools/stream_overlap_probe.py --lower-only      # CPU: the annotated StableHLO for CUDA
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.compute_on import compute_on  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flux_jax  # noqa: E402

from benchmarks import timing  # noqa: E402

AXIS = "tp"
X_SPEC, W_SPEC, OUT_SPEC = P(AXIS, None), P(None, AXIS), P(None, AXIS)


def _on_stream(fn):
    """fn run as an async computation on XLA's GPU stream 1."""
    return compute_on(fn, compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)


def _variants(path: str) -> dict:
    def op(x, w):
        with flux_jax.config(fused_path=path):  # read while tracing
            return flux_jax.ag_matmul(x, w, axis_name=AXIS, impl="fused")

    def gemm(x, w, w2):  # [m / tp, k] @ [k, n] -> [m / tp, n], viewed as [m, n / tp] (a bitcast)
        return jnp.dot(x, w2).reshape(-1, w.shape[1])

    def gemm_half(x, w, w2, by_rank):  # half of x's rows (the peer's in a row-split RS)
        half = x.shape[0] // 2
        if by_rank:
            start = (1 - jax.lax.axis_index(AXIS) % 2) * half
            rows = jax.lax.dynamic_slice_in_dim(x, start, half, axis=0)
        else:
            rows = x[:half]
        return jnp.dot(rows, w2).reshape(-1, w.shape[1])

    return {
        "gemm_half_static": lambda x, w, w2: gemm_half(x, w, w2, by_rank=False),
        "gemm_half_by_rank": lambda x, w, w2: gemm_half(x, w, w2, by_rank=True),
        "op_alone": lambda x, w, w2: op(x, w),
        "gemm_alone": lambda x, w, w2: gemm(x, w, w2),
        "serial": lambda x, w, w2: op(x, w) + gemm(x, w, w2),
        "streams": lambda x, w, w2: _on_stream(op)(x, w) + gemm(x, w, w2),
    }


def _build(mesh, per_shard, args) -> timing.Built:
    step = jax.shard_map(per_shard, mesh=mesh, in_specs=(X_SPEC, W_SPEC, W_SPEC),
                         out_specs=OUT_SPEC)
    return timing.Built(step, args, mesh, X_SPEC, OUT_SPEC, check=lambda out: 0.0)


def _arrays(mesh, m: int, k: int, n: int, seed: int):
    """x [m, k] (rows sharded) and w [k, n] (columns sharded) for the op; w2 [k, tp * n]
    (columns sharded), so each shard's x @ w2 is [m / tp, n]: the op's output size."""
    rng = np.random.default_rng(seed)
    tp = mesh.shape[AXIS]

    def put(shape, spec):
        host = rng.standard_normal(shape, dtype=np.float32).astype(jnp.bfloat16)
        return jax.device_put(host, NamedSharding(mesh, spec))

    return put((m, k), X_SPEC), put((k, n), W_SPEC), put((k, tp * n), W_SPEC)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1024x8192x10240,2048x4096x6144,256x8192x10240",
                        help="global MxKxN of the ag_matmul, comma list")
    parser.add_argument("--path", default="latency", choices=("latency", "overlap"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--lower-only", action="store_true",
                        help="print the CUDA lowering's stream annotations (works on CPU) and exit")
    args = parser.parse_args(argv)
    tp = 2
    devices = jax.devices()[:tp]
    mesh = jax.make_mesh((tp,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    built = {}
    for m, k, n in shapes:
        arrays = _arrays(mesh, m, k, n, seed=m + k + n)
        for name, fn in _variants(args.path).items():
            built[(m, k, n, name)] = _build(mesh, fn, arrays)
    if args.lower_only:
        b = built[(*shapes[0], "streams")]
        text = jax.jit(b.step).trace(*b.args).lower(lowering_platforms=("cuda",)).as_text()
        print("\n".join(line for line in text.splitlines()
                        if "_xla_stream_annotation" in line or "flux_jax_" in line))
        return
    params = timing.TimingParams(n1=2, target_ms=20.0, max_calls=10000, repeats=args.rounds)
    timers = {key: timing.LoopTimer(b, params) for key, b in built.items()}
    samples = {key: [] for key in timers}
    order = list(timers)
    for _ in range(args.rounds):
        random.shuffle(order)
        for key in order:
            samples[key].append(timers[key].sample())
    rows = []
    for m, k, n in shapes:
        med = {name: float(np.median(samples[(m, k, n, name)])) * 1e6 for name in _variants(args.path)}
        row = {"M": m, "K": k, "N": n, "path": args.path, **{f"{v}_us": t for v, t in med.items()},
               "samples_us": {v: [s * 1e6 for s in samples[(m, k, n, v)]] for v in med}}
        rows.append(row)
        overlap = med["serial"] - med["streams"]
        hidden = min(med["op_alone"], med["gemm_alone"])
        print(f"{m}x{k}x{n}: op {med['op_alone']:.1f}  gemm {med['gemm_alone']:.1f}  serial "
              f"{med['serial']:.1f}  streams {med['streams']:.1f} us  (streams saved {overlap:.1f} us "
              f"of the {hidden:.1f} a perfect overlap would)")
        text = timers[(m, k, n, "streams")].program_text()
        row["streams_program_has_async"] = "async-start" in text or "call-start" in text
        print(f"  half rows: static {med['gemm_half_static']:.1f}  by rank {med['gemm_half_by_rank']:.1f} "
              f"us (half of gemm_alone: {med['gemm_alone'] / 2:.1f}); streams program async: "
              f"{row['streams_program_has_async']}")
        for name in ("gemm_half_static", "gemm_half_by_rank"):
            body = timers[(m, k, n, name)].program_text()
            row[f"{name}_ops"] = sorted(set(re.findall(r"(?:fusion|custom-call|copy|dynamic-slice)\S*(?= =)", body)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "devices": [str(d) for d in devices]}, f, indent=1)


if __name__ == "__main__":
    main()
