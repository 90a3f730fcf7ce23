"""Our GEMM and XLA's under Nsight Compute: each variant's GEMM calls, and nothing else, inside
cudaProfilerStart / cudaProfilerStop, for `ncu --profile-from-start off`.

    ncu --profile-from-start off --clock-control none -k regex:"nvjet|device_kernel" \\
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \\
        --csv --page details \\
        python benchmarks/diagnostics/ncu_gemm.py --shapes 16384:3072:8192,8192:2560:5120 \\
            --variants xla,auto,128x128_pp_c2x1/g16 [--dtype bfloat16] [--calls 2]

Per shape (M:K:N, or M:K:N:dx for the transposed weight: x [M, K] @ (w stored [N, K])^T) and
variant, over a mesh axis of size 1 on the first GPU: the program is jitted, run twice (compile,
XLA's autotuning, our workspace) and its output checked against XLA's GEMM; then `--calls` calls
run inside the profiled range. A line `RANGE <shape> <variant> <calls>` on stdout precedes each
range, so the ncu report's kernels (in launch order) map to variants.

Variants: `xla` (XLA's GEMM, cuBLAS's nvjet kernels on Hopper) or a gemm_parity kernel spec,
KERNEL[/gG][/sS] (`python -m benchmarks.gemm_parity --help`): our overlap GEMM with that
instance, tile group and serpentine order. With `--clock-control none` the clocks stay the GPU's:
compare kernels per cycle by `Elapsed Cycles`, and their times next to the `SM Frequency` each ran at.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks.gemm_parity import kernel_tuning  # noqa: E402
from benchmarks.variants import flux_gemm_fn, xla_gemm_fn  # noqa: E402

AXIS = "tp"
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
ERROR_BOUND = 2e-2  # relative max-norm difference from XLA's GEMM (both round to 16 bits)


def parse_shape(text: str) -> tuple[int, int, int, bool]:
    """ "16384:3072:8192" -> (16384, 3072, 8192, False); a trailing ":dx" reads w transposed."""
    parts = text.split(":")
    dx = parts[3:] == ["dx"]
    if len(parts) not in (3, 4) or (len(parts) == 4 and not dx) or not all(p.isdigit() and int(p) for p in parts[:3]):
        raise ValueError(f"--shapes {text!r}: M:K:N or M:K:N:dx with positive M, K and N")
    m, k, n = map(int, parts[:3])
    return m, k, n, dx


def tuning_of(variant: str) -> dict | None:
    """None for "xla", else the GPU tuning fields of a kernel spec (ValueError if malformed)."""
    return None if variant == "xla" else kernel_tuning(variant)


def cuda_runtime():
    """libcudart, for cudaProfilerStart / Stop (JAX's CUDA plugin ships one in its nvidia wheels)."""
    site = Path(jax.__file__).resolve().parents[1]
    candidates = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    candidates += sorted(glob.glob(str(site / "nvidia" / "**" / "libcudart.so*"), recursive=True))
    candidates += sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*"))
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise RuntimeError(f"no libcudart found (tried {candidates})")


def _operands(m, k, n, dx, dtype, mesh):
    kx, kw = jax.random.split(jax.random.key(0))
    x = (jax.random.normal(kx, (m, k), jnp.float32) + 0.25).astype(dtype)
    w_shape = (n, k) if dx else (k, n)
    w = ((jax.random.normal(kw, w_shape, jnp.float32) + 0.25) / math.sqrt(k)).astype(dtype)
    rows = NamedSharding(mesh, P(AXIS, None))
    return jax.device_put(x, rows), jax.device_put(w, rows)


def _program(variant: str, dx: bool, mesh):
    tuning = tuning_of(variant)
    fn = xla_gemm_fn(dx) if tuning is None else flux_gemm_fn(AXIS, transpose_w=dx, tuning=tuning)
    spec = P(AXIS, None)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec), out_specs=spec))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", required=True, help="M:K:N[:dx],...")
    ap.add_argument("--variants", default="xla,auto", help="xla and / or KERNEL[/gG][/sS] specs, comma-separated")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--calls", type=int, default=2, help="profiled calls per variant")
    args = ap.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in args.shapes.split(",")]
        variants = args.variants.split(",")
        for v in variants:
            tuning_of(v)
    except ValueError as e:
        ap.error(str(e))
    if args.calls < 1:
        ap.error("--calls takes a positive count")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        print("ncu_gemm: needs a CUDA GPU (JAX sees none)", file=sys.stderr)
        return 2
    runtime = cuda_runtime()
    mesh = jax.make_mesh((1,), (AXIS,), axis_types=(AxisType.Explicit,), devices=gpus[:1])
    dtype = DTYPES[args.dtype]
    failed = 0
    for m, k, n, dx in shapes:
        name = f"{m}:{k}:{n}" + (":dx" if dx else "")
        x, w = _operands(m, k, n, dx, dtype, mesh)
        reference = None
        for variant in ["xla"] + [v for v in variants if v != "xla"]:
            program = _program(variant, dx, mesh)
            out = jax.block_until_ready(program(x, w))
            jax.block_until_ready(program(x, w))
            if reference is None:
                reference = out.astype(jnp.float32)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference)) / jnp.max(jnp.abs(reference)))
            if not err <= ERROR_BOUND:
                print(f"WRONG {name} {variant}: relative difference from XLA's GEMM {err:.3e}", flush=True)
                failed += 1
                continue
            if variant not in variants:  # the reference only
                continue
            print(f"RANGE {name} {variant} {args.calls}", flush=True)
            runtime.cudaProfilerStart()
            for _ in range(args.calls):
                jax.block_until_ready(program(x, w))
            runtime.cudaProfilerStop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
