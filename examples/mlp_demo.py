"""A tensor-parallel two-layer MLP with flux_jax, fused vs the XLA twin.

    python examples/mlp_demo.py            # 8 CPU devices, TP=8
    python examples/mlp_demo.py --tp 2     # on a 2-GPU host: the GPUs

Megatron-style sequence parallelism: activations are sharded by rows over the
TP axis; the first layer gathers them inside its GEMM (ag_matmul), the second
reduce-scatters its output (matmul_rs). The script checks that forward values
and gradients of impl="fused" match impl="xla", and prints both step times.
"""

from __future__ import annotations

import argparse
import os
import time

# 8 CPU devices when there is no accelerator (harmless on a GPU host).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import flux_jax


def mlp(x, w1, w2, impl):
    h = flux_jax.ag_matmul(x, w1, axis_name="tp", impl=impl)  # [S, F/tp]: all rows, my columns
    h = jax.nn.gelu(h)
    return flux_jax.matmul_rs(h, w2, axis_name="tp", impl=impl)  # [S/tp, D]: my rows, summed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=None, help="TP degree (default: all devices)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()

    devices = jax.devices()
    tp = args.tp or len(devices)
    if not 1 <= tp <= len(devices):
        parser.error(f"--tp must be between 1 and the {len(devices)} visible devices, got {tp}")
    for name in ("seq", "ffn"):
        if getattr(args, name) < 1 or getattr(args, name) % tp:
            parser.error(f"--{name} must be a positive multiple of tp = {tp}, got {getattr(args, name)}")
    mesh = jax.make_mesh((tp,), ("tp",), devices=devices[:tp], axis_types=(jax.sharding.AxisType.Explicit,))
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (args.seq, args.hidden), dtype)
    w1 = (jax.random.normal(keys[1], (args.hidden, args.ffn)) / np.sqrt(args.hidden)).astype(dtype)
    w2 = (jax.random.normal(keys[2], (args.ffn, args.hidden)) / np.sqrt(args.ffn)).astype(dtype)
    specs = (P("tp", None), P(None, "tp"), P("tp", None))
    x, w1, w2 = (jax.device_put(a, jax.NamedSharding(mesh, s)) for a, s in zip((x, w1, w2), specs))

    print(
        f"flux_jax {flux_jax.__version__} on {tp} x {devices[0].platform}: "
        f"x[{args.seq},{args.hidden}] -> ffn {args.ffn}, {args.dtype}"
    )
    results = {}
    for impl in ("fused", "xla"):
        fwd = jax.shard_map(functools.partial(mlp, impl=impl), mesh=mesh, in_specs=specs, out_specs=P("tp", None))
        loss = lambda x, w1, w2, fwd=fwd: jnp.mean(fwd(x, w1, w2).astype(jnp.float32) ** 2)
        step = jax.jit(jax.value_and_grad(loss, argnums=(1, 2)))
        value, grads = step(x, w1, w2)
        jax.block_until_ready(grads)
        t0 = time.perf_counter()
        for _ in range(5):
            value, grads = step(x, w1, w2)
        jax.block_until_ready(grads)
        results[impl] = (value, grads, (time.perf_counter() - t0) / 5)
        print(f"  impl={impl:5s}  loss={float(value):.6f}  step={results[impl][2] * 1e3:.2f} ms")

    (lf, gf, _), (lx, gx, _) = results["fused"], results["xla"]
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    loss_diff = abs(float(lf) - float(lx)) / abs(float(lx))
    grad_diff = max(
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.max(jnp.abs(b.astype(jnp.float32))))
        for a, b in zip(gf, gx)
    )
    ok = loss_diff < tol and grad_diff < tol
    print(
        f"fused vs xla: loss rel diff {loss_diff:.2e}, grad rel diff {grad_diff:.2e} -> {'MATCH' if ok else 'MISMATCH'}"
    )
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
