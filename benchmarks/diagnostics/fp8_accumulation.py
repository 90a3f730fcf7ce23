"""How exactly our FP8 GEMMs accumulate: matmul_ar(fp8=...) at tp = 1 against the exact product of
the same quantized operands, next to the FP8 twin (XLA's FP8 GEMM, cuBLASLt), as K grows.

    python benchmarks/diagnostics/fp8_accumulation.py [--shapes MxKxN:path,...] [--seed 0] [--out FILE]

Per shape, x [M, K] and w [K, N] (bfloat16, positive mean so that long sums cancel little) are
quantized as the fused ops do (x per row, w per column, e4m3); the reference is the float64 product
of those FP8 values times their scales. Each variant's error is max |out - ref| / max |ref|: the
twin's is cuBLASLt's accumulation and the bfloat16 output's rounding, ours the same for our kernel
(`path`: "decode", the FP8 decode GEMM; "overlap", matmul_rs's FP8 overlap GEMM of the two-shot).
Hopper's FP8 tensor cores accumulate with reduced precision; a GEMM that never promotes its
accumulator to float32 loses accuracy as K grows, which this shows as a ratio that grows with K.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flux_jax  # noqa: E402
from flux_jax import fp8  # noqa: E402

SHAPES = (
    "64x2048x4096:decode,64x7168x8192:decode,64x14336x4096:decode,16x28672x4096:decode,"
    "1024x7168x1024:overlap,1024x14336x1024:overlap,1024x28672x1024:overlap"
)
RECIPE = flux_jax.Fp8(weight_scaling="column")


def _program(mesh, impl: str, path: str):
    body = functools.partial(flux_jax.matmul_ar, axis_name="tp", impl=impl, fp8=RECIPE)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P()))

    def call(*args):
        with flux_jax.config(fused_path=path):
            return fn(*args)

    return call


def run(m: int, k: int, n: int, path: str, rng, mesh) -> dict:
    x = jnp.asarray(rng.standard_normal((m, k)) + 0.25, jnp.bfloat16)
    w = jnp.asarray((rng.standard_normal((k, n)) + 0.25) / np.sqrt(k), jnp.bfloat16)
    xq, xs = fp8.quantize_rows(x, RECIPE)
    wq, ws = fp8.quantize_weight(w, RECIPE)
    exact = np.asarray(xq, np.float64) @ np.asarray(wq, np.float64)
    exact *= np.asarray(xs, np.float64) * np.asarray(ws, np.float64)
    args = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((x, P(None, "tp")), (w, P("tp", None))))
    row = dict(M=m, K=k, N=n, path=path)
    for name, impl, p in (("twin", "xla", "auto"), ("ours", "fused", path)):
        out = np.asarray(_program(mesh, impl, p)(*args), np.float64)
        row[f"{name}_err"] = float(np.max(np.abs(out - exact)) / np.max(np.abs(exact)))
    row["ratio"] = row["ours_err"] / row["twin_err"]
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="MxKxN:path,... (path: decode or overlap)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    mesh = jax.make_mesh((1,), ("tp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
    rng = np.random.default_rng(args.seed)
    rows = []
    for spec in args.shapes.split(","):
        dims, path = spec.split(":")
        m, k, n = (int(v) for v in dims.split("x"))
        row = run(m, k, n, path, rng, mesh)
        rows.append(row)
        print(f"{m}x{k}x{n} {path}: twin {row['twin_err']:.2e}, ours {row['ours_err']:.2e} ({row['ratio']:.2f}x)")
    if args.out:
        args.out.write_text(json.dumps(dict(device=jax.devices()[0].device_kind, rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
