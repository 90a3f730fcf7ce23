"""Our FP8 GEMM against XLA's on one GPU: the fused ops' FP8 overlap kernel at tp = 1.

    python -m benchmarks.fp8_gemm [--out FILE] [--rounds 10] [--shapes MxKxN,...] [--backward | --decode]
        [--energy-s S] [--kernels auto/g16,128x256,...] [--git-commit SHA]

Per shape (bfloat16 x [M, K] and w [K, N], the recipe `flux_jax.Fp8()`: e4m3, x per row, w per
tensor), two programs over a mesh axis of size 1:

  xla   the FP8 twin: quantize (XLA), XLA's FP8 GEMM (cuBLASLt) with the scales
  flux  ag_matmul(impl="fused", fp8=True) pinned to the overlap path: the same quantization,
        then our CUTLASS FP8 GEMM (e4m3 x e4m3, the scales in its epilogue) with no peer
        (its rule: ping-pong 128x128 tiles in 2x1 clusters below 8192 x 8192 outputs, except at
        K >= 8192 where 128x256 tiles' waves tie, and at K <= 4096 on GPUs with 4 TB/s of DRAM or
        more; else 128x256 tiles; below 4 TB/s, above 2048 rows, ping-pong 128x192 where its
        waves are at most 5% longer than 128x256's, and at 2048 rows or fewer where they are no
        longer than ping-pong 128x128's). On a GPU its line and row name the instance the rule runs
        there ("flux (auto = 128x256/g8)", `auto_instance`)
  flux:128x256, flux:128x128_pp_c2x1  the same with one FP8 instance forced through the private
        GpuTuning.gemm_kernel (`--no-forced` leaves them out)

`--kernels SPEC,...` replaces the forced instances: `flux:<SPEC>` per spec, SPEC =
KERNEL[/gG][/sS] as in benchmarks/gemm_parity.py (KERNEL: auto or an FP8 instance, FP8_KERNELS;
/gG: GpuTuning.tile_group_m = G row tiles swept together; /sS: GpuTuning.tile_serpentine = S),
e.g. `--kernels auto/g8,auto/g16,auto/g16/s0` for the tile order of the rule's instance.

`--backward` times the input gradient instead, dx = dy @ w^T (an M x K output, N deep): dy
quantized per row to float8_e5m2, so ours is the e5m2 x e4m3 GEMM inside matmul_rs at tp = 1 (its
rule: ping-pong 2x1 with 128x160 tiles where they make fewer waves, else 128x128, on an H100 also
128x192 and 128x160 where op_common.h says; forced as flux:128x128_pp_c2x1 and
flux:128x160_pp_c2x1), the twin XLA's FP8 GEMM of the same formats. The
programs take dx alone (the weight gradient and the forward are dead code).

`--decode` times matmul_ar at decode sizes (M = 16-256 rows) instead, the whole call:

  xla           the FP8 twin: quantize, XLA's FP8 GEMM, psum (nothing to sum at tp = 1)
  flux:latency  matmul_ar(fp8=True) on the latency path: XLA's FP8 GEMM, then our all_reduce
  flux:decode   the FP8 decode path: one launch of our FP8 decode GEMM (swap-AB, the scales and
                the all-reduce in its epilogue, with no peer)
  bf16:decode   the bfloat16 decode path on the same operands, unquantized (for scale)
  xla:prequantized, flux:decode:prequantized
                the twin and the decode path with w quantized once, outside the timed call
                (`flux_jax.Fp8Weight.quantize`): what a generation loop with weights
                quantized at load time runs

With `--steps S` each program is a generation loop instead: S calls in a lax.fori_loop, each fed
the last one's output, w the same every step (whether XLA hoists w's quantization out of the
loop shows in the kernel list: on one H200 it did not). `step_us` (every kernel of the program /
S) is what a decode step costs: the FP8 twin and decode
path against the bfloat16 twin (bf16:xla) and decode path. Checked against the loop in float32.

`--energy-s S` (forward and backward): after each shape's rounds, every variant's whole call in a
serialized loop (benchmarks/timing.py) kept running for S seconds at the power cap, where a
GEMM's time follows the energy it spends (benchmarks/gpu_energy.py): `sustained_us`, `energy_mj`
and `power_w` per call, and `sustained_gemm_us`, the GEMM there estimated as the whole call less
its other kernels' CUPTI time from the rounds (the quantization: the same XLA code in every
variant). Ratios to the twin: `sustained_ratio_vs_xla`, `energy_ratio_vs_xla`,
`sustained_gemm_ratio_vs_xla`.

Both are checked first against a float32 GEMM of the unquantized operands, so the error is mostly
FP8's rounding (outputs poisoned for ours; bound: 4x the twin's own error, at least 1e-2; the
exact check against the quantized operands is tests/test_gpu_one.py). Times are device times from CUPTI, one
profiled call per round, variants interleaved in shuffled order: `gemm_us` is the GEMM kernel
alone (the costliest kernel named like a GEMM), `total_us` every kernel of the call (the quantize
fusions are the same XLA code in both). Medians over the rounds.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flux_jax
from benchmarks import report
from benchmarks.gemm_parity import kernel_tuning, parse_kernel_spec
from flux_jax import _config, _overlap_gemm

AXIS = "tp"
# The forward GEMMs of the GEMM-parity preset at M >= 2048 (benchmarks/gemm_parity.py QUICK),
# and 4096 x 8192 x 8192 (the FP8 target shape at TP = 2).
SHAPES = (
    (2048, 2560, 5120),
    (2048, 8192, 5120),
    (2048, 6912, 5120),
    (8192, 2048, 4096),
    (8192, 8192, 8192),
    (8192, 8192, 28672),
    (2048, 4096, 3072),
    (4096, 3072, 4608),
    (4096, 8192, 8192),
)
ERROR_FACTOR, ERROR_FLOOR = 4.0, 1e-2


def _mesh():
    return jax.make_mesh((1,), (AXIS,), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])


# GpuTuning.gemm_kernel values with FP8 instances (cpp/kernels/cuda/gemm_fp8.cu): e4m3 rows take
# all, a backward's e5m2 rows the ping-pong 128x128, 128x160 and 128x192.
FP8_KERNELS = ("auto", "128x256", "128x128_pp_c2x1", "128x160_pp_c2x1", "128x192_pp_c2x1")
# (name, impl, kernel spec: KERNEL[/gG][/sS], parse_kernel_spec): the twin first (its error bounds
# the others').
VARIANTS = (
    ("xla", "xla", "auto"),
    ("flux", "fused", "auto"),
    ("flux:128x256", "fused", "128x256"),
    ("flux:128x128_pp_c2x1", "fused", "128x128_pp_c2x1"),
)
# --backward: the e5m2 x e4m3 GEMM's instances.
BACKWARD_VARIANTS = (
    *VARIANTS[:2],
    ("flux:128x128_pp_c2x1", "fused", "128x128_pp_c2x1"),
    ("flux:128x160_pp_c2x1", "fused", "128x160_pp_c2x1"),
)


def kernel_variants(specs: str) -> tuple:
    """--kernels "auto/g16,128x256": the twin, the rule, then flux:<spec> per spec (a bad spec
    raises ValueError)."""
    out = list(VARIANTS[:2])
    for spec in filter(None, (s.strip() for s in specs.split(","))):
        parse_kernel_spec(spec, FP8_KERNELS)
        if spec != "auto" and all(name != f"flux:{spec}" for name, *_ in out):
            out.append((f"flux:{spec}", "fused", spec))
    return tuple(out)


def auto_instance(m: int, k: int, n: int, backward: bool, gpu: tuple[int, int] | None) -> str | None:
    """What GpuTuning.gemm_kernel="auto" runs for the shape's FP8 GEMM at tp = 1 on a GPU with
    `gpu` = (SMs, peak DRAM GB/s) (op_common.h, through _overlap_gemm), as a --kernels spec
    ("128x256/g8"); None without a GPU or a CUDA build. backward: dx = dy @ w^T, e5m2 rows, K and
    N swapped."""
    if gpu is None:
        return None
    rows, gemm_k, gemm_n = ("float8_e5m2", n, k) if backward else ("float8_e4m3fn", k, n)
    kernel, group = _overlap_gemm.auto_plan(rows, True, m, gemm_k, gemm_n, m, *gpu)
    return f"{kernel}/g{group}"


def _program(impl: str, mesh, kernel: str = "auto", backward: bool = False):
    """The jitted variant; the GPU tuning is part of the jit key, so every call sets it. Forward:
    (x, w) -> x @ w; backward: (x, w, dy) -> dx. kernel: a spec, KERNEL[/gG][/sS]."""
    tuning = kernel_tuning(kernel, FP8_KERNELS)

    def forward(x, w):
        return flux_jax.ag_matmul(x, w, axis_name=AXIS, impl=impl, fp8=True)

    def input_grad(x, w, dy):
        return jax.vjp(lambda a: forward(a, w), x)[1](dy)[0]

    rows = P(AXIS, None)
    if backward:
        fn = jax.jit(jax.shard_map(input_grad, mesh=mesh, in_specs=(rows, P(), rows), out_specs=rows))
    else:
        fn = jax.jit(jax.shard_map(forward, mesh=mesh, in_specs=(rows, P()), out_specs=rows))

    def call(*args):
        with _config.gpu_tuning(**tuning):
            return fn(*args)

    call.fn, call.tuning, call.backward = fn, tuning, backward
    return call


def _sustained(program, args, mesh, seconds: float, meter, per_call_us: float, target_ms: float = 20.0) -> dict:
    """The program's whole call in a serialized loop (benchmarks/timing.py) kept running for
    `seconds` at the power cap: time, energy and mean power per call (benchmarks/gpu_energy.py).
    The loop carries the operand the output depends on: x forward, dy backward. One loop of about
    `target_ms` (sized from `per_call_us`, the rounds' CUPTI time of the call) is compiled, not
    LoopTimer's two: every compile of the twin autotunes XLA's FP8 GEMM again."""
    import time

    from benchmarks import gpu_energy
    from benchmarks.timing import Built, serialized_loop

    fn = program.fn
    if program.backward:  # carry dy: dx does not depend on x
        carried = (args[2], args[0], args[1])

        def step(dy, x, w):
            return fn(x, w, dy)
    else:
        carried, step = args, fn
    built = Built(step, carried, mesh, P(AXIS, None), P(AXIS, None), check=lambda out: 0.0)
    calls = max(4, math.ceil(target_ms * 1e3 / max(per_call_us, 1.0)))
    loop_args = (jnp.float32(0.0), *carried)
    start = time.perf_counter()
    with flux_jax.config(fused_path="overlap"), _config.gpu_tuning(**program.tuning):
        loop = serialized_loop(built, calls).lower(*loop_args).compile()
    compiled = time.perf_counter()
    jax.block_until_ready(loop(*loop_args))  # warm-up

    def dispatch():
        leaves = jax.tree.leaves(loop(*loop_args))
        return lambda: all(leaf.is_ready() for leaf in leaves)

    got = gpu_energy.sustained(dispatch, calls + 1, seconds, meter.read_mj)
    print(
        f"  power cap: {calls} calls per run, compiled in {compiled - start:.1f} s, measured in "
        f"{time.perf_counter() - compiled:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return got


# The twin and the decode path with w quantized once, outside the timed call (both --decode modes).
PREQUANTIZED_VARIANTS = (
    ("xla:prequantized", "xla", "auto", "prequantized"),
    ("flux:decode:prequantized", "fused", "decode", "prequantized"),
)
# (name, impl, fused_path, fp8) of --decode: the twin first.
DECODE_VARIANTS = (
    ("xla", "xla", "auto", True),
    ("flux:latency", "fused", "latency", True),
    ("flux:decode", "fused", "decode", True),
    ("bf16:decode", "fused", "decode", False),
    *PREQUANTIZED_VARIANTS,
)
# matmul_ar's decode GEMMs of the TP = 2 presets' row-parallel layers at decode sizes.
DECODE_SHAPES = tuple((m, k, n) for m in (16, 64, 128, 256) for k, n in ((2048, 4096), (7168, 8192), (14336, 4096)))


# --decode --steps S: the variants of a decode loop (the bfloat16 twin too: the baseline FP8 must beat).
DECODE_LOOP_VARIANTS = (
    ("xla", "xla", "auto", True),
    ("flux:decode", "fused", "decode", True),
    ("bf16:xla", "xla", "auto", False),
    ("bf16:decode", "fused", "decode", False),
    *PREQUANTIZED_VARIANTS,
)


def _next_rows(y, k: int):
    """A decode loop's next input from this step's output: [M, N] -> [M, k] (tiled, tanh-bounded)."""
    reps = -(-k // y.shape[-1])
    return jnp.tanh(jnp.tile(y, (1, reps))[:, :k].astype(jnp.float32)).astype(y.dtype)


def _decode_program(impl: str, path: str, fp8, mesh, steps: int = 1):
    """matmul_ar over a mesh axis of size 1: x [M, K] and w [K, N] -> x @ w, on `path`; with
    steps > 1 a lax.fori_loop of that many calls, each fed the last one's output (w the same
    every step, as in a generation loop). fp8: True (w quantized in the call), False (bfloat16)
    or "prequantized" (w quantized once, before the first call, and reused)."""
    prequantized = fp8 == "prequantized"
    one = functools.partial(flux_jax.matmul_ar, axis_name=AXIS, impl=impl, fp8=True if fp8 else None)

    def body(x, w):
        if steps == 1:
            return one(x, w)

        def step(_, h):
            return lax.pcast(_next_rows(one(h, w), h.shape[-1]), (AXIS,), to="varying")

        return one(lax.fori_loop(0, steps - 1, step, x), w)

    w_spec = flux_jax.fp8.weight_spec(P(AXIS, None)) if prequantized else P(AXIS, None)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, AXIS), w_spec), out_specs=P()))

    def call(x, w):
        with flux_jax.config(fused_path=path):
            return fn(x, w)

    if prequantized:  # w quantized here, outside every timed (and possibly traced) call
        call.prepare = lambda args: (args[0], jax.block_until_ready(jax.jit(flux_jax.Fp8Weight.quantize)(args[1])))
    return call


@functools.partial(jax.jit, static_argnums=2)
def _decode_loop_reference(x, w, steps: int):
    """The decode loop in float32 (HIGHEST precision)."""
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    for _ in range(steps - 1):
        x32 = _next_rows(jnp.dot(x32, w32, precision=lax.Precision.HIGHEST), x.shape[-1])
    return jnp.dot(x32, w32, precision=lax.Precision.HIGHEST)


def _operands(m, k, n, seed, mesh, backward: bool = False):
    """(args, float32 reference): (x, w) and x @ w, or (x, w, dy) and dy @ w^T."""
    kx, kw, kd = jax.random.split(jax.random.PRNGKey(seed), 3)

    @jax.jit
    def make():
        x = (jax.random.normal(kx, (m, k), jnp.float32) + 0.25).astype(jnp.bfloat16)
        w = ((jax.random.normal(kw, (k, n), jnp.float32) + 0.25) / math.sqrt(k)).astype(jnp.bfloat16)
        dy = (jax.random.normal(kd, (m, n), jnp.float32) / math.sqrt(n)).astype(jnp.bfloat16)
        if backward:
            ref = jnp.dot(dy.astype(jnp.float32), w.astype(jnp.float32).T, precision=lax.Precision.HIGHEST)
        else:
            ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)
        return x, w, dy, ref

    x, w, dy, ref = make()
    rows, whole = NamedSharding(mesh, P(AXIS, None)), NamedSharding(mesh, P())
    args = (jax.device_put(x, rows), jax.device_put(w, whole))
    if backward:
        args += (jax.device_put(dy, rows),)
    return args, ref


@jax.jit
def _rel_err(out, ref):
    o = out.astype(jnp.float32)
    err = jnp.max(jnp.abs(o - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30)
    return jnp.where(jnp.all(jnp.isfinite(o)), err, jnp.inf)


def _kernels(fn, args) -> list[tuple[str, float]]:
    from jax.experimental.mosaic.gpu import profiler

    _, kernels = profiler.measure(fn, aggregate=False)(*args)
    return [(name, ms * 1e3) for name, ms in kernels]


# Kernel names of GEMMs: cuBLASLt's nvjet, CUTLASS (ours, mangled), XLA's Triton GEMM fusions.
_GEMM_NAMES = ("nvjet", "cutlass", "gemm", "xmma")


def _gemm_kernel(kernels: list[tuple[str, float]]) -> tuple[str, float]:
    """The call's GEMM: its costliest kernel named like one (at decode sizes the weight's
    quantization costs more than the GEMM), else its costliest kernel."""
    gemms = [kv for kv in kernels if any(g in kv[0].lower() for g in _GEMM_NAMES)]
    return max(gemms or kernels, key=lambda kv: kv[1])


def run_shape(
    m,
    k,
    n,
    rounds: int,
    seed: int,
    mesh,
    variants=VARIANTS,
    backward: bool = False,
    decode_steps: int = 0,
    energy_s: float = 0.0,
    meter=None,
) -> list[dict]:
    """One shape's rows. decode_steps: 0 for the overlap GEMM, else matmul_ar at decode sizes,
    that many calls in a loop (1: one call). energy_s > 0 (with an NVML meter): after the rounds,
    each variant's whole call at the power cap (_sustained)."""
    args, ref = _operands(m, k, n, seed, mesh, backward)
    if decode_steps:  # matmul_ar's operands: x split along K, w along its rows (one shard each at tp = 1)
        args = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, (P(None, AXIS), P(AXIS, None))))
    if decode_steps > 1:
        ref = _decode_loop_reference(*(jax.device_put(a, NamedSharding(mesh, P())) for a in args), decode_steps)
    rows, programs = {}, {}
    variant_args = {}  # name -> its operands (a pre-quantized variant's w is its Fp8Weight)
    gemm = "dx" if backward else f"matmul_ar x{decode_steps}" if decode_steps else "forward"

    def make(variant):
        if decode_steps:
            return _decode_program(*variant[1:], mesh, decode_steps)
        _, impl, kernel = variant
        return _program(impl, mesh, kernel, backward)

    with flux_jax.config(fused_path="overlap"):
        for variant in variants:
            name, impl = variant[:2]
            row = rows[name] = dict(M=m, K=k, N=n, gemm=gemm, variant=name, status="ok", gemm_us=None, total_us=None)
            try:
                program = make(variant)
                variant_args[name] = program.prepare(args) if hasattr(program, "prepare") else args
                with flux_jax.config(debug_poison_outputs=impl == "fused"):
                    err = float(_rel_err(program(*variant_args[name]), ref))
                row["max_rel_err"] = err
                bound = max(ERROR_FACTOR * rows["xla"].get("max_rel_err", 0.0), ERROR_FLOOR)
                if not err <= bound:
                    row["status"] = f"WRONG: relative error {err:.3e} > {bound:.3e}"
                    continue
                programs[name] = make(variant)
                _kernels(programs[name], variant_args[name])  # warm: compiled, workspace allocated
            except Exception as e:  # noqa: BLE001 -- any failure is this variant's status
                row["status"] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        samples = {name: [] for name in programs}
        for r in range(rounds):
            order = list(programs)
            random.Random(seed * 1000 + r).shuffle(order)
            for name in order:
                samples[name].append(_kernels(programs[name], variant_args[name]))
    if energy_s > 0 and meter is not None and not decode_steps:
        for name in random.Random(seed).sample(list(programs), len(programs)):
            per_call_us = statistics.median(sum(us for _, us in kernels) for kernels in samples[name])
            try:
                rows[name].update(_sustained(programs[name], variant_args[name], mesh, energy_s, meter, per_call_us))
            except Exception as e:  # noqa: BLE001 -- a failed reading is no reason to lose the row
                rows[name]["energy_note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    for name, runs in samples.items():
        row = rows[name]
        gemm = [_gemm_kernel(kernels)[1] for kernels in runs]
        total = [sum(us for _, us in kernels) for kernels in runs]
        row.update(
            gemm_us=statistics.median(gemm),
            gemm_us_min=min(gemm),
            gemm_us_max=max(gemm),
            total_us=statistics.median(total),
            step_us=statistics.median(total) / max(decode_steps, 1),
            gemm_kernel=_gemm_kernel(runs[-1])[0][:160],
            kernels=[(name[:100], round(us, 2)) for name, us in runs[-1]],
            tflops=2.0 * m * k * n / (statistics.median(gemm) * 1e-6) / 1e12,
        )
    for row in rows.values():
        if row.get("sustained_us") and row["gemm_us"]:
            # The GEMM at the power cap, estimated: the whole call's time there less what its other
            # kernels (the quantization, the same XLA code in every variant) took in the rounds.
            row["sustained_gemm_us"] = row["sustained_us"] - (row["total_us"] - row["gemm_us"])
    xla = rows["xla"]
    for row in rows.values():
        if row["variant"] != "xla" and xla["gemm_us"] and row["gemm_us"]:
            row["gemm_ratio_vs_xla"] = row["gemm_us"] / xla["gemm_us"]
            row["total_ratio_vs_xla"] = row["total_us"] / xla["total_us"]
        if row["variant"] != "xla" and row.get("sustained_us") and xla.get("sustained_us"):
            row["sustained_ratio_vs_xla"] = row["sustained_us"] / xla["sustained_us"]
            row["energy_ratio_vs_xla"] = row["energy_mj"] / xla["energy_mj"]
            if row["sustained_gemm_us"] > 0 and xla["sustained_gemm_us"] > 0:
                row["sustained_gemm_ratio_vs_xla"] = row["sustained_gemm_us"] / xla["sustained_gemm_us"]
    return list(rows.values())


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shapes", help="MxKxN,... (default: the preset's forward GEMMs at M >= 2048)")
    ap.add_argument("--no-forced", action="store_true", help="only the rule's instance (no forced flux:<instance>)")
    ap.add_argument(
        "--kernels",
        help="instead of the forced instances: KERNEL[/gG][/sS],... (KERNEL in "
        f"{', '.join(FP8_KERNELS)}; /gG: GpuTuning.tile_group_m=G, /sS: GpuTuning.tile_serpentine=S)",
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--backward", action="store_true", help="time dx = dy @ w^T (dy in e5m2: our e5m2 x e4m3 GEMM)")
    mode.add_argument("--decode", action="store_true", help="time matmul_ar's FP8 decode path at M = 16-256")
    ap.add_argument("--steps", type=int, default=1, help="--decode: calls per program, in a lax.fori_loop if > 1")
    ap.add_argument("--git-commit", help="commit to record when the tree has no .git (a copy)")
    ap.add_argument(
        "--energy-s",
        type=float,
        default=0.0,
        help="after each shape's rounds, every variant's whole call in a loop for this many seconds at the power "
        "cap: time, energy and power per call (GPU with NVML only; not with --decode)",
    )
    args = ap.parse_args(argv)
    if args.steps < 1 or (args.steps > 1 and not args.decode):
        ap.error("--steps takes a positive count, and only with --decode")
    if args.kernels and (args.decode or args.no_forced):
        ap.error("--kernels times the overlap GEMM's instances: not with --decode or --no-forced")
    shapes = DECODE_SHAPES if args.decode else SHAPES
    if args.shapes:
        shapes = tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
    variants = BACKWARD_VARIANTS if args.backward else VARIANTS
    if args.no_forced:
        variants = variants[:2]
    if args.kernels:
        try:
            variants = kernel_variants(args.kernels)
        except ValueError as e:
            ap.error(str(e))
    if args.decode:
        variants = DECODE_LOOP_VARIANTS if args.steps > 1 else DECODE_VARIANTS
    mesh = _mesh()
    gpu = _overlap_gemm.local_gpu()
    meter = None
    if args.energy_s > 0:
        from benchmarks import gpu_energy

        meter = gpu_energy.EnergyMeter.open() if jax.devices()[0].platform == "gpu" else None
        if meter is None:
            print("--energy-s: no NVML energy counter here: not recorded", flush=True)
    rows = []
    meta = dict(
        command=" ".join(["python -m benchmarks.fp8_gemm", *(sys.argv[1:] if argv is None else argv)]),
        **report.provenance(args.git_commit),
        energy_s=args.energy_s if meter is not None else 0.0,
        device=jax.devices()[0].device_kind,
        gpu_rule_inputs=gpu and dict(sm_count=gpu[0], dram_gbps=gpu[1]),
        jax=jax.__version__,
        flux_jax=flux_jax.build_info(),
        gemm="dx = dy @ w^T (dy e5m2)"
        if args.backward
        else f"matmul_ar, decode sizes, {args.steps} calls"
        if args.decode
        else "forward",
    )
    print("shape, then per variant: GEMM us (ours / XLA's), whole call ours / twin, status")
    for i, (m, k, n) in enumerate(shapes):
        decode_steps = args.steps if args.decode else 0
        got = run_shape(
            m, k, n, args.rounds, args.seed + i, mesh, variants, args.backward, decode_steps, args.energy_s, meter
        )
        auto = None if args.decode else auto_instance(m, k, n, args.backward, gpu)
        for r in got:
            if r["variant"] == "flux" and auto:
                r["auto_instance"] = auto
        rows += got
        if args.out:  # after every shape: a stopped run keeps what it measured
            args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))
        cells = []
        for r in got:
            us = f"{r['gemm_us']:.1f}" if r["gemm_us"] else "-"
            ratio = (
                f" ({r['gemm_ratio_vs_xla']:.3f}, whole {r['total_ratio_vs_xla']:.3f})"
                if "gemm_ratio_vs_xla" in r
                else ""
            )
            if "sustained_ratio_vs_xla" in r:
                ratio += (
                    f" cap: whole {r['sustained_ratio_vs_xla']:.3f}, energy {r['energy_ratio_vs_xla']:.3f}, GEMM "
                    f"{r.get('sustained_gemm_ratio_vs_xla', float('nan')):.3f}"
                )
            name = f"{r['variant']} (auto = {r['auto_instance']})" if "auto_instance" in r else r["variant"]
            cells.append(f"{name} {us}{ratio} {r['status']} [{r.get('gemm_kernel', '-')[:40]}]")
        print(f"{m}x{k}x{n}: " + "; ".join(cells), flush=True)
    if args.decode:
        keys = {"total_ratio_vs_xla": "whole call / the twin's"}
    else:
        keys = {"gemm_ratio_vs_xla": "FP8 GEMM alone / XLA's"}
    if meter is not None and not args.decode:
        keys.update(
            sustained_ratio_vs_xla="at the power cap, whole call / the twin's",
            energy_ratio_vs_xla="at the power cap, energy per call / the twin's",
            sustained_gemm_ratio_vs_xla="at the power cap, FP8 GEMM (estimated) / XLA's",
        )
    for name, *_ in variants[1:]:
        for key, what in keys.items():
            ratios = [r[key] for r in rows if r["variant"] == name and r.get(key)]
            if ratios:
                median, low, high = statistics.median(ratios), min(ratios), max(ratios)
                print(f"{name}: {what}: median {median:.3f}, range {low:.3f}-{high:.3f}")
    return rows


if __name__ == "__main__":
    main()
