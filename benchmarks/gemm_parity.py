"""Our GEMM against XLA's on one GPU, every GEMM instance of this build A/B'd in one process.

  python -m benchmarks.gemm_parity --out DIR [--subset quick|full] [--m 2048,8192]
      [--dtypes bfloat16,float16] [--kernels auto,128x256,auto/g16,auto/s1,...] [--no-gate-probe] [--no-decode]
      [--shapes M:K:N[:dx],...] [--repeats R] [--target-ms T] [--preheat-ms P] [--budget-s S]
      [--seed S] [--no-profiler | --profile-all] [--energy-s S] [--git-commit SHA]

Shapes: preset gemm-parity-1gpu (benchmarks/presets.py: the per-GPU GEMMs of the TP=2 layer
presets, forward and in the dx orientation, at M = 2048-16384, and the forward at decode sizes),
or its `quick` subset (QUICK: the shapes with the largest known gaps plus a few controls, about 4
minutes on one H200), or explicit --shapes. Per shape, fresh random x and w are made on the GPU
and a float32 reference (XLA, precision HIGHEST); then one row per variant:

  xla                   XLA's GEMM (jnp.dot; lax.dot_general on the [N, K]-stored weight for dx)
  flux:<kernel>         our overlap GEMM (ag_matmul at tp=1, fused_path="overlap") traced under
                        GpuTuning.gemm_kernel=<kernel>, for every instance this build has for
                        the shape's dtype and weight layout ("auto" is the product's choice and
                        a same-program control of the instance it resolves to)
  flux:<kernel>/g<G>    the same with GpuTuning.tile_group_m=G (G row tiles swept together across
                        N; the default is 16 for 128x256 tiles over 2048 rows or more, else 8): the
                        tile order's cost in L2 and HBM traffic
  flux:<kernel>/s<S>    the same with GpuTuning.tile_serpentine=S (1: odd groups sweep N
                        backwards; 0: forwards); with /g<G> as <kernel>/g<G>/s<S>
  flux:auto+gate_probe  the same as flux:auto with every tile's A loads gated on flags already set
                        (GpuTuning.gate_probe): the gate's cost (at tp=1 no gate runs otherwise)
  flux:decode           the decode path's GEMM alone (bf16, [K, N] weight, M <= 256)
  flux:ar_decode        matmul_ar's decode path at tp=1 (bf16, [K, N] weight, M <= 128): the
                        decode GEMM with its all-reducing epilogue and no peer, the whole call

Every flux variant first runs once with Config(debug_poison_outputs=True) (the kernel fills its
output with NaN first) and XLA once; each output is checked on the GPU against the reference:
max |out - ref| / max |ref| within 4x XLA's own error (floor 1e-2 bf16, 2e-3 f16), like
tests/helpers.py. A variant that fails is WRONG and not timed. Times are the harness's
(benchmarks/timing.py: difference of two serialized loops, median of shuffled, pre-heated
rounds). Also the CUPTI kernel time and kernel names of one call of `xla` (cuBLAS's pick) and
`flux:auto` (every variant with --profile-all), with their kernel time per call in the long loop
(printed as `kernel <ours / XLA's>`), and our FFI handler's host time per call (a loop is
host-bound where it reaches the device time). For an A/B of kernels read the kernel time: on one
H200 it repeated within 0.5% across runs, while the loop time of one kernel read up to 3.6% apart
within a run (docs/decisions/2026-12-05-tile-groups-of-16-wide-tiles.md).
--energy-s S: after the rounds, every variant's long loop for S seconds, reading NVML's energy
counter (benchmarks/gpu_energy.py): time, energy and power per call at the GPU's power cap, where
clocks follow the power a kernel draws.

The run starts no shape it expects to end after --budget-s (default 380 s, from the start,
preflight included; the estimate is the time per variant so far); <out>/gemm_parity.json
and gemm_parity.md are rewritten after every shape, so a stopped run keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flux_jax
from benchmarks import gpu_energy, gpu_state, report
from benchmarks.harness import round_order
from benchmarks.presets import OPS, PRESETS, select_cases
from benchmarks.timing import Built, LoopTimer, TimingParams, params_problem, summarize
from benchmarks.variants import error_summary, flux_ar_decode_fn, flux_gemm_fn, xla_gemm_fn
from flux_jax import _overlap_gemm

PRESET = "gemm-parity-1gpu"
AXIS = "tp"
FORCED_KERNELS = (
    "128x256",
    "128x224",
    "128x192",
    "128x160_c2x1",
    "128x128_pp_c2x1",
    "128x320_c2x1",
    "128x192_pp_c2x1",
)
KERNELS = ("auto", *FORCED_KERNELS)
# Relative max-norm error floors where XLA's own error is ~0 (tests/helpers.py).
ERROR_FLOOR = {"bfloat16": 1e-2, "float16": 2e-3}
ERROR_FACTOR = 4.0
SMS_DEFAULT = 132  # H200 / H100 SXM

# The quick subset, in the order it runs (the budget may stop it): (M, K, N, dx, dtype). The five
# shapes with the largest measured gaps (Qwen-14B out-proj / 70B qkv / Qwen-14B down at 2048
# rows, 8B out-proj at 8192, 8192^3), the dx orientation where 128x256 tiles fill the waves worst,
# one decode size, a wide GEMM (70B gate+up), two shapes the 128x192 rule covers, the other dx
# shapes, float16 controls, two more decode sizes.
QUICK = (
    (2048, 2560, 5120, False, "bfloat16"),
    (2048, 8192, 5120, False, "bfloat16"),
    (2048, 6912, 5120, False, "bfloat16"),
    (8192, 2048, 4096, False, "bfloat16"),
    (8192, 8192, 8192, False, "bfloat16"),
    (2048, 5120, 2560, True, "bfloat16"),
    (2048, 5120, 8192, True, "bfloat16"),
    (64, 8192, 5120, False, "bfloat16"),
    (8192, 8192, 28672, False, "bfloat16"),
    (2048, 4096, 3072, False, "bfloat16"),
    (4096, 3072, 4608, False, "bfloat16"),
    (2048, 3072, 4096, True, "bfloat16"),
    (8192, 8192, 8192, True, "bfloat16"),
    (8192, 8192, 8192, False, "float16"),
    (2048, 2560, 5120, False, "float16"),
    (128, 4096, 3072, False, "bfloat16"),
    (256, 4096, 8192, False, "bfloat16"),
)


def kernel_available(kernel: str, dtype: str, dx: bool, rows: int) -> bool:
    """Whether this build has GpuTuning.gemm_kernel=`kernel` for the input (gemm_plan.h
    HasGemmInstance; ag_matmul_decode.h RunDecodeGemmAlone)."""
    if kernel in ("auto", "128x256", "128x192", "128x128_pp_c2x1", "128x320_c2x1"):
        return True
    if kernel in ("128x160_c2x1", "128x224"):
        return dx
    if kernel == "128x192_pp_c2x1":
        return not dx
    if dtype != "bfloat16":
        return False
    if kernel == "decode":
        return not dx and 1 <= rows <= 256
    if kernel == "ar_decode":
        return not dx and 1 <= rows <= 128
    raise ValueError(f"unknown kernel {kernel!r}")


def auto_plan(
    dtype: str, dx: bool, m: int, k: int, n: int, sms: int, chunk_rows: int | None = None, dram_gbps: int = 0
) -> tuple[str, int]:
    """(instance, tile group) that GpuTuning.gemm_kernel="auto" and tile_group_m=0 run: op_common.h's
    rules (ChooseGemmInstance or ChooseFp8GemmInstance, TileGroupM), asked through the extension (a
    CUDA build). dtype: the rows' (bfloat16, float16, float8_e4m3fn or float8_e5m2); chunk_rows:
    the rows read in order (a rank's chunk; all m at tp = 1, the default); dram_gbps: the GPU's
    peak DRAM bandwidth in GB/s (0: unknown, an H200's rule)."""
    return _overlap_gemm.auto_plan(dtype, dx, m, k, n, m if chunk_rows is None else chunk_rows, sms, dram_gbps)


def auto_kernel(dtype: str, dx: bool, m: int, k: int, n: int, sms: int, dram_gbps: int = 0) -> str:
    """The instance GpuTuning.gemm_kernel="auto" runs at tp = 1 (auto_plan)."""
    return auto_plan(dtype, dx, m, k, n, sms, dram_gbps=dram_gbps)[0]


@dataclasses.dataclass(frozen=True)
class Shape:
    M: int
    K: int
    N: int
    dx: bool  # the weight stored [N, K] and read transposed (dx = dy w^T)
    dtype: str
    layer: str

    @property
    def name(self) -> str:
        return f"{self.M}x{self.K}x{self.N}{' dx' if self.dx else ''} {self.dtype}"


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str  # "xla", "flux:<kernel>", "flux:auto+gate_probe"
    kernel: str | None = None  # GpuTuning.gemm_kernel (flux only)
    gate_probe: bool = False
    tile_group_m: int = 0  # GpuTuning.tile_group_m (0: the default)
    tile_serpentine: int = -1  # GpuTuning.tile_serpentine (-1: the default)

    @property
    def tuning(self) -> dict:
        return {
            "gemm_kernel": self.kernel,
            "gate_probe": int(self.gate_probe),
            "tile_group_m": self.tile_group_m,
            "tile_serpentine": self.tile_serpentine,
        }


def parse_kernel_spec(spec: str, kernels: tuple[str, ...] = KERNELS) -> tuple[str, int, int]:
    """ "128x256" -> ("128x256", 0, -1); "auto/g16" -> ("auto", 16, -1) (GpuTuning.tile_group_m);
    "auto/s1" -> ("auto", 0, 1), "auto/g16/s0" -> ("auto", 16, 0) (GpuTuning.tile_serpentine).
    `kernels`: the GpuTuning.gemm_kernel values allowed (benchmarks/fp8_gemm.py passes FP8's)."""
    kernel, *options = spec.split("/")
    group, serpentine = 0, -1
    ok = kernel in kernels and len(options) <= 2
    for opt in options:
        value = opt[1:]
        if opt[:1] == "g" and value.isdigit() and 1 <= int(value) <= 64 and not group:
            group = int(value)
        elif opt[:1] == "s" and value in ("0", "1") and serpentine == -1:
            serpentine = int(value)
        else:
            ok = False
    if not ok:
        raise ValueError(f"--kernels {spec!r}: KERNEL[/gG][/sS] with KERNEL in {kernels}, G in 1..64 and S 0 or 1")
    return kernel, group, serpentine


def kernel_tuning(spec: str, kernels: tuple[str, ...] = KERNELS) -> dict:
    """The GpuTuning fields of a kernel spec: "auto/g16/s0" -> gemm_kernel, tile_group_m,
    tile_serpentine (the diagnostics and benchmarks/fp8_gemm.py trace their programs under it)."""
    kernel, group, serpentine = parse_kernel_spec(spec, kernels)
    return dict(gemm_kernel=kernel, tile_group_m=group, tile_serpentine=serpentine)


def variants_for(
    shape: Shape, platform: str, kernels: tuple[str, ...], gate_probe: bool, decode: bool
) -> list[Variant]:
    """What one shape runs: XLA, our instances that exist for it, the gate probe, the decode GEMM."""
    out = [Variant("xla")]
    if platform != "gpu":  # the CPU backend ignores the GPU tuning: one flux row
        return out + [Variant("flux:auto", "auto")]
    small = shape.M <= 256
    for spec in kernels:
        kernel, group, serpentine = parse_kernel_spec(spec)
        if small and kernel not in ("auto", "128x256"):
            continue  # decode sizes: one or two row tiles; the overlap instances are controls there
        if kernel_available(kernel, shape.dtype, shape.dx, shape.M):
            out.append(Variant(f"flux:{spec}", kernel, tile_group_m=group, tile_serpentine=serpentine))
    if gate_probe and not small and not shape.dx and "auto" in kernels:
        out.append(Variant("flux:auto+gate_probe", "auto", True))
    if decode and small and kernel_available("decode", shape.dtype, shape.dx, shape.M):
        out.append(Variant("flux:decode", "decode"))
    if decode and small and kernel_available("ar_decode", shape.dtype, shape.dx, shape.M):
        out.append(Variant("flux:ar_decode", "ar_decode"))
    return out


def parse_shape_specs(text: str) -> list[tuple[int, int, int, bool]]:
    """--shapes "M:K:N,M:K:N:dx,..." -> [(M, K, N, dx)]; ValueError naming a bad entry."""
    out = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        fields = item.split(":")
        try:
            m, k, n = (int(v) for v in fields[:3])
        except ValueError:
            m = k = n = 0
        if len(fields) not in (3, 4) or min(m, k, n) < 1 or fields[3:] not in ([], ["dx"]):
            raise ValueError(f"--shapes entry {item!r}: expected M:K:N or M:K:N:dx with positive integers M, K, N")
        out.append((m, k, n, len(fields) == 4))
    if not out:
        raise ValueError(f"--shapes {text!r} names no shape: expected M:K:N or M:K:N:dx, comma separated")
    return out


def shapes_from_args(args, layers: dict) -> list[Shape]:
    if args.shapes:
        return [
            Shape(m, k, n, dx, dt, layers.get((m, k, n, dx), "custom"))
            for m, k, n, dx in parse_shape_specs(args.shapes)
            for dt in args.dtypes
        ]
    if args.subset == "quick":
        return [
            Shape(m, k, n, dx, dt, layers.get((m, k, n, dx), "custom"))
            for m, k, n, dx, dt in QUICK
            if args.m is None or m in args.m
        ]
    cases, _ = select_cases(PRESETS[PRESET], 1, OPS, args.m, None)
    return [Shape(c.M, c.K, c.N, c.transpose_w, dt, c.layer) for dt in args.dtypes for c in cases]


def preset_layers() -> dict:
    cases, _ = select_cases(PRESETS[PRESET], 1, OPS, None, None)
    return {(c.M, c.K, c.N, c.transpose_w): c.layer for c in cases}


# ---- one shape --------------------------------------------------------------------------------


def _mesh():
    return jax.make_mesh((1,), (AXIS,), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])


def make_operands(shape: Shape, seed: int, index: int, mesh):
    """Fresh x [M, K] and the weight (stored [K, N], or [N, K] for dx) on the GPU, the float32
    reference x @ w, placed for the steps (x rows over the size-1 axis, w replicated)."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed), index)
    kx, kw = jax.random.split(key)
    dtype = jnp.dtype(shape.dtype)

    @jax.jit
    def make():
        x = (jax.random.normal(kx, (shape.M, shape.K), jnp.float32) + 0.25).astype(dtype)
        w = ((jax.random.normal(kw, (shape.K, shape.N), jnp.float32) + 0.25) / math.sqrt(shape.K)).astype(dtype)
        ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)
        return x, (w.T if shape.dx else w), ref

    x, w_stored, ref = make()
    x = jax.device_put(x, NamedSharding(mesh, P(AXIS, None)))
    w_stored = jax.device_put(w_stored, NamedSharding(mesh, P()))
    return x, w_stored, ref


@jax.jit
def _rel_err(out, ref):
    o = out.astype(jnp.float32)
    err = jnp.max(jnp.abs(o - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30)
    return jnp.where(jnp.all(jnp.isfinite(o)), err, jnp.inf)


def rel_err(out, ref) -> float:
    return float(_rel_err(out, jax.device_put(ref, out.sharding)))


def build(variant: Variant, shape: Shape, mesh, x, w, poison: bool = False) -> Built:
    if variant.kernel is None:
        fn = xla_gemm_fn(shape.dx)
    elif variant.kernel == "ar_decode":
        fn = flux_ar_decode_fn(AXIS, poison=poison)
    else:
        fn = flux_gemm_fn(AXIS, transpose_w=shape.dx, tuning=variant.tuning, poison=poison)
    step = jax.shard_map(fn, mesh=mesh, in_specs=(P(AXIS, None), P()), out_specs=P(AXIS, None))
    return Built(step, (x, w), mesh, P(AXIS, None), P(AXIS, None), lambda out: float("nan"))


def profile_one_call(built: Built) -> tuple[float | None, list]:
    """CUPTI time (us) and (name, us) of every kernel of one call (from idle: a cross-check)."""
    from jax.experimental.mosaic.gpu import profiler

    _, kernels = profiler.measure(jax.jit(built.step), aggregate=False)(*built.args)
    if not kernels:
        return None, []
    return sum(ms for _, ms in kernels) * 1e3, [(name[:160], round(ms * 1e3, 2)) for name, ms in kernels]


def loop_kernel_us(timer: LoopTimer) -> float | None:
    """CUPTI time (us) of every kernel of one run of the long loop, per call: what the GPU spent in
    kernels under sustained load (the loop's wall time less this is idle gaps). The loop runs
    n2 + 1 steps, each with the same small dependency fusion for every variant."""
    from jax.experimental.mosaic.gpu import profiler

    _, kernels = profiler.measure(timer._f2, aggregate=False)(*timer._args)
    if not kernels:
        return None
    return sum(ms for _, ms in kernels) * 1e3 / (timer.n2 + 1)


def handler_host_us(timer: LoopTimer) -> float | None:
    """Mean host time of our ag_matmul FFI handler per call over one run of the long loop."""
    flux_jax.handler_host_time(reset=True)
    jax.block_until_ready(timer._f2(*timer._args))
    stats = flux_jax.handler_host_time(reset=True).get("ag_matmul")
    return round(stats.mean_us, 2) if stats is not None and stats.calls else None


def run_shape(
    shape: Shape,
    variants: list[Variant],
    mesh,
    params: TimingParams,
    seed: int,
    index: int,
    sms: int,
    profile: bool | str,
    energy_s: float = 0.0,
    meter: gpu_energy.EnergyMeter | None = None,
    dram_gbps: int = 0,
) -> list[dict]:
    x, w, ref = make_operands(shape, seed, index, mesh)
    rows = {v.name: _empty_row(shape, v) for v in variants}
    auto = None  # the GPU rule's instance as a --kernels spec; a CPU-only build has no GPU rule
    if "ag_matmul" in flux_jax.build_info()["cuda_kernels"]:
        auto_instance, auto_group = auto_plan(
            shape.dtype, shape.dx, shape.M, shape.K, shape.N, sms, dram_gbps=dram_gbps
        )
        auto = f"{auto_instance}/g{auto_group}"
    entries = []  # (variant, timer, built)
    xla_err = None
    for v in variants:
        row = rows[v.name]
        if v.kernel == "auto" and auto:
            row["note"] = f"auto = {auto}"
        try:
            checked = build(v, shape, mesh, x, w, poison=v.kernel is not None)
            out = jax.jit(checked.step)(*checked.args)
            row["max_rel_err"] = err = rel_err(out, ref)
            del out
            if v.kernel is None:
                xla_err = err
            bound = max(
                ERROR_FACTOR * (xla_err if xla_err is not None and math.isfinite(xla_err) else 0.0),
                ERROR_FLOOR[shape.dtype],
            )
            row["err_bound"] = bound
            if not err <= bound:
                row["status"] = "WRONG"
                continue
            built = build(v, shape, mesh, x, w)
            timer = LoopTimer(built, params)
            timer.take_output()
            entries.append((v, timer, built))
            row["n1"], row["n2"] = timer.n1, timer.n2
        except Exception as err:  # noqa: BLE001 -- any failure is this variant's status
            row["status"] = f"unavailable: {error_summary(err)}"
    samples = {v.name: [] for v, _, _ in entries}
    # Clock, power and temperature right after each sample of each variant (nvidia-smi averages
    # power over its last window: mostly this variant's preheat and loops), so a variant that runs
    # at lower clocks under its own sustained load shows it.
    readings = {v.name: [] for v, _, _ in entries}
    for round_index in range(params.repeats):
        for i in round_order(len(entries), round_index):
            v, timer, _ = entries[i]
            try:
                samples[v.name].append(timer.sample())
            except Exception as err:  # noqa: BLE001
                rows[v.name]["status"] = f"unavailable: timing failed: {error_summary(err)}"
            readings[v.name].append(gpu_state.read())
    if energy_s > 0 and meter is not None:
        # After the timed rounds, each variant in turn from its own preheat: its time, energy and
        # power per call over energy_s of its long loop at the power cap.
        for i in round_order(len(entries), 0):
            v, timer, _ = entries[i]
            if rows[v.name]["status"] != "ok":
                continue
            try:
                timer.preheat()
                rows[v.name].update(
                    gpu_energy.sustained(timer.dispatch_long, timer.calls_per_long_run, energy_s, meter.read_mj)
                )
            except Exception as err:  # noqa: BLE001 -- a failed reading is no reason to lose the row
                rows[v.name]["note"] = f"{rows[v.name]['note']}; energy: {error_summary(err, 120)}".lstrip("; ")
    for v, timer, built in entries:
        row = rows[v.name]
        if row["status"] != "ok" or not samples[v.name]:
            continue
        s = summarize(samples[v.name])
        row.update(
            us=s["ms"] * 1e3,
            us_min=s["ms_min"] * 1e3,
            us_max=s["ms_max"] * 1e3,
            samples_us=[t * 1e3 for t in s["samples_ms"]],
        )
        if row["us"] <= 0:  # noise above the signal (seen on CPU only), as the harness says it
            row.update(
                status="unavailable: not resolved (median T(n2) - T(n1) <= 0: noise); raise --target-ms", us=None
            )
            continue
        row["tflops"] = 2.0 * shape.M * shape.K * shape.N / (row["us"] * 1e-6) / 1e12
        if profile and (v.name in ("xla", "flux:auto") or profile == "all"):
            try:
                row["profiler_us"], row["kernels"] = profile_one_call(built)
                row["loop_kernel_us"] = loop_kernel_us(timer)
            except Exception as err:  # noqa: BLE001
                row["note"] = f"{row['note']}; profiler: {error_summary(err, 120)}".lstrip("; ")
        if v.kernel is not None:
            try:
                row["host_us"] = handler_host_us(timer)
            except Exception:  # noqa: BLE001 -- a missing counter is no reason to lose the row
                pass
    xla_us = rows["xla"]["us"] if "xla" in rows and rows["xla"]["status"] == "ok" else None
    for row in rows.values():
        if row["us"] is not None and xla_us:
            row["ratio_vs_xla"] = row["us"] / xla_us
        row["gpu_state"] = gpu_state.columns(readings.get(row["variant"], []))
    return list(rows.values())


def _empty_row(shape: Shape, v: Variant) -> dict:
    return {
        "layer": shape.layer,
        "M": shape.M,
        "K": shape.K,
        "N": shape.N,
        "orientation": "dx" if shape.dx else "fwd",
        "dtype": shape.dtype,
        "variant": v.name,
        "gemm_kernel": v.kernel,
        "gate_probe": v.gate_probe,
        "tile_group_m": v.tile_group_m,
        "tile_serpentine": v.tile_serpentine,
        "status": "ok",
        "us": None,
        "us_min": None,
        "us_max": None,
        "samples_us": [],
        "n1": None,
        "n2": None,
        "tflops": None,
        "ratio_vs_xla": None,
        "max_rel_err": None,
        "err_bound": None,
        "profiler_us": None,
        "loop_kernel_us": None,
        "kernels": [],
        "host_us": None,
        "sustained_us": None,  # --energy-s: time, energy and power per call at the power cap
        "energy_mj": None,
        "power_w": None,
        "note": "",
    }


# ---- preflight: each non-default variant once, in a child process ----------------------------

# Small shapes that reach every path of the A/B instances: 9 row tiles (an odd count: one
# cluster of two CTAs half out of bounds), N and K not multiples of the tile, both orientations;
# two decode sizes (one and two row tiles, the first staged).
PREFLIGHT_SHAPES = ((1152, 520, 800, False), (1152, 800, 520, True), (40, 520, 640, False), (200, 520, 640, False))


def preflight_variants(kernels: tuple[str, ...], gate_probe: bool, decode: bool) -> list[str]:
    names = [f"flux:{k}" for k in kernels if k != "auto"]
    names += ["flux:auto+gate_probe"] if gate_probe else []
    return names + (["flux:decode", "flux:ar_decode"] if decode else [])


def _variant_from_name(name: str) -> Variant:
    if name == "flux:auto+gate_probe":
        return Variant(name, "auto", True)
    if name in ("flux:decode", "flux:ar_decode"):
        return Variant(name, name.removeprefix("flux:"))
    kernel, group, serpentine = parse_kernel_spec(name.removeprefix("flux:"))
    return Variant(name, kernel, tile_group_m=group, tile_serpentine=serpentine)


def run_preflight_child(names: list[str]) -> None:
    """The child's side: every variant on PREFLIGHT_SHAPES (bf16) where it exists, poisoned and
    checked; one line per variant on stdout: START <name>, then OK <name> or FAIL <name> <why>."""
    mesh = _mesh()
    for name in names:
        print(f"START {name}", flush=True)
        try:
            v = _variant_from_name(name)
            for i, (m, k, n, dx) in enumerate(PREFLIGHT_SHAPES):
                shape = Shape(m, k, n, dx, "bfloat16", "preflight")
                small = m <= 256
                if (v.kernel in ("decode", "ar_decode")) != small or not kernel_available(v.kernel, shape.dtype, dx, m):
                    continue
                x, w, ref = make_operands(shape, 1, i, mesh)
                xla_err = rel_err(jax.jit(build(Variant("xla"), shape, mesh, x, w).step)(x, w), ref)
                built = build(v, shape, mesh, x, w, poison=True)
                err = rel_err(jax.jit(built.step)(x, w), ref)
                bound = max(ERROR_FACTOR * xla_err, ERROR_FLOOR["bfloat16"])
                if not err <= bound:
                    raise RuntimeError(f"wrong at {shape.name}: relative error {err:.3e} > {bound:.3e}")
            print(f"OK {name}", flush=True)
        except Exception as err:  # noqa: BLE001 -- reported to the parent
            print(f"FAIL {name} {error_summary(err, 200)}", flush=True)


def preflight(names: list[str], timeout_s: float) -> dict[str, str]:
    """Runs the variants once in child processes (before this process takes the GPU): a variant
    that fails, faults (which would break this process's CUDA context) or hangs there (killed
    after `timeout_s`) is left out of the run. Returns {name: why} for those left out."""
    import os
    import selectors
    import subprocess
    import tempfile

    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    failed: dict[str, str] = {}
    todo = list(names)
    while todo:
        errors = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.gemm_parity", "--preflight-child", ",".join(todo)],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parents[1],  # the repository root: `benchmarks` importable
        )
        done, current, timed_out = set(), None, False
        deadline = time.monotonic() + timeout_s
        try:
            sel = selectors.DefaultSelector()
            sel.register(proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(timeout=left):
                    raise TimeoutError
                line = proc.stdout.readline()
                if not line:
                    break
                word, _, rest = line.strip().partition(" ")
                name, _, why = rest.partition(" ")
                if word == "START":
                    current, deadline = name, time.monotonic() + timeout_s
                elif word in ("OK", "FAIL"):
                    done.add(name)
                    current = None
                    if word == "FAIL":
                        failed[name] = f"preflight: {why}"
            proc.wait(timeout=30)
        except (TimeoutError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
            timed_out = True
            if current is not None:
                failed[current] = f"preflight: no answer within {timeout_s:.0f} s (hang?)"
        errors.seek(0)
        last = ([line.strip() for line in errors.read().splitlines() if line.strip()] or [""])[-1][:200]
        errors.close()
        if current is not None and current not in failed:  # the child died in it (a fault)
            failed[current] = f"preflight: the process died (exit {proc.returncode}) while running it: {last}"
        if current is None and not done and todo:  # the child died or hung before any variant
            why = f"no answer within {timeout_s:.0f} s" if timed_out else f"the process exited {proc.returncode}"
            failed.update({n: f"preflight: {why} before it: {last}" for n in todo})
        todo = [n for n in todo if n not in done and n not in failed]
    return failed


# ---- report -----------------------------------------------------------------------------------


def _groups(rows: list[dict]) -> dict:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["M"], r["K"], r["N"], r["orientation"], r["dtype"]), []).append(r)
    return groups


def _cell(row: dict | None) -> str:
    if row is None:
        return ""
    if row["status"] == "WRONG":
        return f"WRONG ({row['max_rel_err']:.1e})"
    if row["status"] != "ok" or row["us"] is None:
        return "n/a"
    ratio = f" ({row['ratio_vs_xla']:.2f})" if row["ratio_vs_xla"] else ""
    return f"{row['us']:.1f}{ratio}"


def _xla_kernel(row: dict | None) -> str:
    if not row or not row.get("kernels"):
        return ""
    name, _ = max(row["kernels"], key=lambda kv: kv[1])  # the GEMM: the longest kernel
    return name[:60]


def summary(rows: list[dict]) -> dict:
    """Per variant: shapes, median and worst ours/XLA; best of ours per shape; the same by the
    loop's kernel time where both were profiled (`loop_kernel_us`)."""
    by_variant: dict[str, list[float]] = {}
    by_kernel: dict[str, list[float]] = {}
    by_energy: dict[str, list[float]] = {}
    by_sustained: dict[str, list[float]] = {}
    best: list[float] = []
    gate: list[float] = []
    for group in _groups(rows).values():
        ratios = {r["variant"]: r["ratio_vs_xla"] for r in group if r["ratio_vs_xla"] and r["status"] == "ok"}
        for name, ratio in ratios.items():
            by_variant.setdefault(name, []).append(ratio)
        kernel_us = {r["variant"]: r.get("loop_kernel_us") for r in group if r["status"] == "ok"}
        if kernel_us.get("xla"):
            for name, us in kernel_us.items():
                if us and name != "xla":
                    by_kernel.setdefault(name, []).append(us / kernel_us["xla"])
        for key, out in (("energy_mj", by_energy), ("sustained_us", by_sustained)):
            value = {r["variant"]: r.get(key) for r in group if r["status"] == "ok"}
            if value.get("xla"):
                for name, v in value.items():
                    if v and name != "xla":
                        out.setdefault(name, []).append(v / value["xla"])
        ours = [v for k, v in ratios.items() if k.startswith("flux:") and k != "flux:auto+gate_probe"]
        if ours:
            best.append(min(ours))
        if "flux:auto+gate_probe" in ratios and "flux:auto" in ratios:
            gate.append(ratios["flux:auto+gate_probe"] / ratios["flux:auto"])

    def stats(values):
        return (
            {"shapes": len(values), "median": statistics.median(values), "worst": max(values), "best": min(values)}
            if values
            else {"shapes": 0}
        )

    return {
        "ours_over_xla": {k: stats(v) for k, v in by_variant.items()},
        "kernel_time_over_xla": {k: stats(v) for k, v in by_kernel.items()},
        "energy_over_xla": {k: stats(v) for k, v in by_energy.items()},
        "sustained_time_over_xla": {k: stats(v) for k, v in by_sustained.items()},
        "best_of_ours_over_xla": stats(best),
        "gate_probe_over_auto": stats(gate),
    }


def _gpu_inputs(meta: dict) -> str:
    """' (132 SMs, 3.4 TB/s DRAM)': what the instance rule read of the GPU, where recorded."""
    sms, dram_gbps = meta.get("sm_count"), meta.get("dram_gbps")
    return f" ({sms} SMs, {dram_gbps / 1000:.1f} TB/s DRAM)" if sms and dram_gbps else ""


def markdown(meta: dict, rows: list[dict]) -> str:
    names = []
    for r in rows:
        if r["variant"] not in names:
            names.append(r["variant"])
    hw = meta["hardware"]
    lines = [
        "# GEMM parity on one GPU: ours / XLA's",
        "",
        f"{meta['date_utc']}, commit {meta['git_commit']}{' (dirty)' if meta['git_dirty'] else ''}, "
        f"{hw['device_kind']}{_gpu_inputs(meta)}, jax {meta['versions']['jax']}, seed {meta['seed']}",
        "",
        "us per call (median of the rounds, on-device loop time) and in brackets ours / XLA's time "
        "(< 1: ours faster); WRONG: failed the float32 check (not timed). XLA kernel: the longest "
        "kernel of one profiled call (cuBLAS's pick).",
        "",
    ]
    header = ["shape", "layer", *names, "XLA kernel"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (m, k, n, orient, dtype), group in _groups(rows).items():
        by = {r["variant"]: r for r in group}
        auto = by.get("flux:auto")
        label = f"{m}x{k}x{n} {orient} {dtype}"
        layer = group[0]["layer"] + (f" ({auto['note']})" if auto and auto["note"].startswith("auto =") else "")
        lines.append(
            "| " + " | ".join([label, layer, *(_cell(by.get(v)) for v in names), _xla_kernel(by.get("xla"))]) + " |"
        )
    s = summary(rows)
    lines += [
        "",
        "## Summary: ours / XLA's time over the shapes each variant ran",
        "",
        "| variant | shapes | median | best | worst |",
        "|---|---|---|---|---|",
    ]
    for name, st in s["ours_over_xla"].items():
        if st["shapes"]:
            lines.append(f"| {name} | {st['shapes']} | {st['median']:.3f} | {st['best']:.3f} | {st['worst']:.3f} |")
    b = s["best_of_ours_over_xla"]
    if b["shapes"]:
        lines.append(
            f"| best of ours per shape | {b['shapes']} | {b['median']:.3f} | {b['best']:.3f} | {b['worst']:.3f} |"
        )
    if s["kernel_time_over_xla"]:
        lines += [
            "",
            "By kernel time under the same load (CUPTI: the long loop's kernels per call, gaps left out):",
            "",
            "| variant | shapes | median | best | worst |",
            "|---|---|---|---|---|",
        ]
        for name, st in s["kernel_time_over_xla"].items():
            lines.append(f"| {name} | {st['shapes']} | {st['median']:.3f} | {st['best']:.3f} | {st['worst']:.3f} |")
    if s["energy_over_xla"]:
        lines += [
            "",
            "At the power cap (--energy-s: each variant's long loop for a fixed time after the rounds), "
            "ours / XLA's energy per call and time per call:",
            "",
            "| variant | shapes | energy: median | best | worst | time: median | best | worst |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, e in s["energy_over_xla"].items():
            t = s["sustained_time_over_xla"].get(name, {"shapes": 0})
            tt = f"{t['median']:.3f} | {t['best']:.3f} | {t['worst']:.3f}" if t["shapes"] else "- | - | -"
            lines.append(f"| {name} | {e['shapes']} | {e['median']:.3f} | {e['best']:.3f} | {e['worst']:.3f} | {tt} |")
        lines += ["", "Per shape: us per call, mJ per call, mean W (the whole GPU) over the window.", ""]
        lines += ["| shape | variant | us | mJ | W |", "|---|---|---|---|---|"]
        for r in rows:
            if r.get("energy_mj") is not None:
                lines.append(
                    f"| {r['M']}x{r['K']}x{r['N']} {r['orientation']} {r['dtype']} | {r['variant']} | "
                    f"{r['sustained_us']:.1f} | {r['energy_mj']:.3f} | {r['power_w']:.0f} |"
                )
    g = s["gate_probe_over_auto"]
    if g["shapes"]:
        lines += [
            "",
            f"Gate probe (every tile's A loads gated on flags already set) / the same instance ungated: "
            f"median {g['median']:.3f}, range {g['best']:.3f}-{g['worst']:.3f} over {g['shapes']} shapes.",
        ]
    host = [
        (r["variant"], r["M"], r["K"], r["N"], r["host_us"], r["us"])
        for r in rows
        if r.get("host_us") and r["us"] and r["host_us"] > 0.5 * r["us"]
    ]
    if host:
        lines += ["", "Host-bound risk (our handler's host time per call above half the loop time per call):"]
        lines += [f"- {v} {m}x{k}x{n}: host {h:.1f} us, loop {u:.1f} us" for v, m, k, n, h, u in host]
    for name, why in (meta.get("left_out_by_preflight") or {}).items():
        lines += ["", f"Left out: {name} ({why})."]
    skipped = meta.get("skipped_for_budget") or []
    if skipped:
        lines += ["", f"Not run (time budget spent): {len(skipped)} shapes."]
    return "\n".join(lines) + "\n"


# ---- command line -----------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gemm_parity", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, required=True, help="output folder (gemm_parity.json, gemm_parity.md, gemm_parity.png)"
    )
    ap.add_argument("--plot", type=Path, default=None, help="only draw <out>/gemm_parity.png from this results JSON")
    ap.add_argument(
        "--subset",
        choices=("quick", "full"),
        default="quick",
        help="quick: QUICK (~4 min on one H200); full: every shape of the preset, per --dtypes",
    )
    ap.add_argument("--m", type=_ints, default=None, help="only these M values")
    ap.add_argument("--dtypes", default="bfloat16,float16", help="full subset / --shapes: dtypes to run")
    ap.add_argument("--shapes", default=None, help="explicit shapes M:K:N or M:K:N:dx, comma separated")
    ap.add_argument(
        "--kernels",
        default=",".join(KERNELS),
        help=f"GpuTuning.gemm_kernel values ({', '.join(KERNELS)}), each optionally /gG: GpuTuning.tile_group_m=G "
        "and /sS: GpuTuning.tile_serpentine=S",
    )
    ap.add_argument("--no-gate-probe", action="store_true", help="skip the gate-probe variant")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode GEMM at M <= 256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n1", type=int, default=2)
    ap.add_argument("--target-ms", type=float, default=10.0)
    ap.add_argument("--max-calls", type=int, default=10000)
    ap.add_argument("--preheat-ms", type=float, default=30.0)
    ap.add_argument(
        "--budget-s",
        type=float,
        default=380.0,
        help="start no shape expected to end after this many seconds (from the start)",
    )
    ap.add_argument("--seed", type=int, default=None, help="data seed (default: fresh, recorded)")
    ap.add_argument("--no-profiler", action="store_true", help="skip the CUPTI kernel names and times")
    ap.add_argument(
        "--profile-all", action="store_true", help="profile every variant (default: xla and flux:auto, ~0.1-0.5 s each)"
    )
    ap.add_argument(
        "--energy-s",
        type=float,
        default=0.0,
        help="after each shape's rounds, every variant's long loop for this many seconds: time, energy "
        "(NVML) and power per call at the power cap (default 0: off)",
    )
    ap.add_argument(
        "--no-preflight",
        action="store_true",
        help="skip the preflight (each non-default variant once on small shapes in a child process)",
    )
    ap.add_argument("--preflight-timeout-s", type=float, default=60.0)
    ap.add_argument("--git-commit", default=None)
    ap.add_argument("--preflight-child", default=None, help=argparse.SUPPRESS)
    if "--preflight-child" in argv:  # the preflight's child process: nothing else is parsed
        return argparse.Namespace(preflight_child=argv[argv.index("--preflight-child") + 1])
    args = ap.parse_args(argv)
    args.dtypes = tuple(d for d in args.dtypes.split(",") if d)
    bad = sorted(set(args.dtypes) - set(ERROR_FLOOR))
    if bad:
        ap.error(f"--dtypes takes bfloat16 and float16, not {bad}")
    args.kernels = tuple(k for k in args.kernels.split(",") if k)
    for spec in args.kernels:
        try:
            parse_kernel_spec(spec)
        except ValueError as err:
            ap.error(str(err))
    if args.shapes is not None:
        try:
            parse_shape_specs(args.shapes)
        except ValueError as err:
            ap.error(str(err))
    problem = params_problem(args.n1, args.repeats, args.target_ms, args.max_calls, args.preheat_ms)
    if problem:
        ap.error(problem)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    return args


def write_plot(rows: list[dict], path: Path, title: str) -> None:
    """ours / XLA's time per shape and variant (benchmarks/plots.py parity_plot)."""
    from benchmarks.plots import parity_plot

    path.parent.mkdir(parents=True, exist_ok=True)
    parity_plot(rows, path, f"Our GEMM against XLA's on one GPU: {title}")


def main(argv: list[str] | None = None) -> list[dict]:
    start = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.preflight_child is not None:
        run_preflight_child(args.preflight_child.split(","))
        return []
    if args.plot is not None:
        rows = json.loads(args.plot.read_text())["rows"]
        write_plot(rows, args.out / "gemm_parity.png", args.plot.stem)
        return rows
    left_out: dict[str, str] = {}
    if not args.no_preflight and flux_jax.build_info()["cuda"]:  # before this process takes the GPU
        names = preflight_variants(args.kernels, not args.no_gate_probe, not args.no_decode)
        left_out = preflight(names, args.preflight_timeout_s)
        print(
            f"preflight ({time.perf_counter() - start:.0f} s): {len(names) - len(left_out)} of {len(names)} "
            f"variants ok" + "".join(f"\n  left out {n}: {why}" for n, why in left_out.items()),
            flush=True,
        )
    platform = "gpu" if jax.devices()[0].platform in ("gpu", "cuda") else jax.devices()[0].platform
    sms, dram_gbps = _overlap_gemm.local_gpu() or (getattr(jax.devices()[0], "core_count", None) or SMS_DEFAULT, 0)
    shapes = shapes_from_args(args, preset_layers())
    params = TimingParams(
        n1=args.n1, target_ms=args.target_ms, max_calls=args.max_calls, repeats=args.repeats, preheat_ms=args.preheat_ms
    )
    meta = report.metadata(PRESET, 1, argv, dataclasses.asdict(params), [], args.git_commit)
    meta.update(
        command="python -m benchmarks.gemm_parity " + " ".join(argv),
        seed=args.seed,
        sm_count=sms,
        dram_gbps=dram_gbps,
        subset=args.shapes and "shapes" or args.subset,
        kernels=list(args.kernels),
        budget_s=args.budget_s,
        error_bound=f"max({ERROR_FACTOR} x XLA's error, floor {ERROR_FLOOR})",
        skipped_for_budget=[],
        left_out_by_preflight=left_out,
    )
    meter = gpu_energy.EnergyMeter.open() if args.energy_s > 0 and platform == "gpu" else None
    if args.energy_s > 0 and meter is None:
        print("--energy-s: no NVML energy counter here (a CPU run, or no driver library): not recorded", flush=True)
    meta["energy_s"] = args.energy_s if meter is not None else 0.0
    if meter is not None:
        meta["energy_counter_step_ms"] = meter.step_ms()
    json_path, md_path = args.out / "gemm_parity.json", args.out / "gemm_parity.md"
    mesh = _mesh()
    rows: list[dict] = []
    spent_s, variants_run = 0.0, 0  # for the estimate of the next shape's time
    print(f"{len(shapes)} shapes, budget {args.budget_s:.0f} s, seed {args.seed}, {sms} SMs", flush=True)
    for i, shape in enumerate(shapes):
        variants = [
            v
            for v in variants_for(shape, platform, args.kernels, not args.no_gate_probe, not args.no_decode)
            if v.name not in left_out
        ]
        elapsed = time.perf_counter() - start
        estimate = spent_s / variants_run * len(variants) if variants_run else 0.0
        if elapsed + estimate > args.budget_s:
            meta["skipped_for_budget"] = [s.name for s in shapes[i:]]
            print(
                f"time budget: {elapsed:.0f} s spent, the next shape needs ~{estimate:.0f} s: "
                f"{len(shapes) - i} shapes not run",
                flush=True,
            )
            break
        t0 = time.perf_counter()
        profile = ("all" if args.profile_all else True) if not args.no_profiler and platform == "gpu" else False
        shape_rows = run_shape(
            shape, variants, mesh, params, args.seed, i, sms, profile, args.energy_s, meter, dram_gbps=dram_gbps
        )
        spent_s += time.perf_counter() - t0
        variants_run += len(variants)
        rows += shape_rows
        print(f"[{i + 1}/{len(shapes)}] {shape.name} ({shape.layer}) {time.perf_counter() - t0:.1f} s", flush=True)
        xla_kernel_us = next((r.get("loop_kernel_us") for r in shape_rows if r["variant"] == "xla"), None)
        for r in shape_rows:
            us = f"{r['us']:9.1f} us" if r["us"] is not None else " " * 12
            ratio = f"{r['ratio_vs_xla']:.3f}" if r["ratio_vs_xla"] else "     "
            # kernel time under load repeats across runs far better than the loop's time from idle
            kernel_us = r.get("loop_kernel_us")
            kernel = f"  kernel {kernel_us / xla_kernel_us:.3f}" if kernel_us and xla_kernel_us else ""
            print(f"    {r['variant']:<24} {us}  {ratio}{kernel}  {r['status']} {r['note']}", flush=True)
        meta["elapsed_s"] = round(time.perf_counter() - start, 1)
        meta["summary"] = summary(rows)
        report.write_json(json_path, meta, rows)
        md_path.write_text(markdown(meta, rows))
    meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    meta["summary"] = summary(rows)
    report.write_json(json_path, meta, rows)
    md_path.write_text(markdown(meta, rows))
    write_plot(rows, args.out / "gemm_parity.png", f"{PRESET}, {meta['date_utc'][:10]}")
    print(f"\nwrote {json_path}, {md_path} ({meta['elapsed_s']} s)\n", flush=True)
    print(md_path.read_text(), flush=True)
    return rows


if __name__ == "__main__":
    main()
