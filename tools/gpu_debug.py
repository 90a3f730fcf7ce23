"""Isolate GPU failures: run each scenario in a fresh process with a short timeout (dev tool)."""
import functools
import subprocess
import sys

SCENARIOS = ["ag_gathered", "rs_transposed", "ag_transposed", "grad_ag", "grad_rs"]

BODY = r'''
import functools, jax, jax.numpy as jnp, numpy as np, sys
from jax.sharding import PartitionSpec as P
import flux_jax
flux_jax.set_config(flux_jax.Config(timeout_s=5.0, debug_poison_outputs=True))
gpus = jax.devices()[:2]
mesh = jax.sharding.Mesh(np.array(gpus), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
rng = np.random.default_rng(0)
M, K, N = 2048, 1024, 1536
x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((K, N)) / 32, jnp.bfloat16)
name = sys.argv[1]
def run(body, in_specs, out_specs, *args):
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))
    return f(*args)
if name == "ag_gathered":
    out, g = run(functools.partial(flux_jax.ag_matmul, axis_name="tp", impl="fused", return_gathered=True),
                 (P("tp"), P(None, "tp")), (P(None, "tp"), P("tp")), x, w)
    ref = jnp.dot(x, w, preferred_element_type=jnp.float32)
    print("max err", float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))), "gathered ok", bool(jnp.all(g[:M] == x)))
elif name == "rs_transposed":
    from flux_jax import _autodiff, _dispatch, _validation
    def body(x, wt):
        info = _validation.AxisInfo("tp", 2, "cuda", True)
        spec = _dispatch.FusedSpec("tp", 2, True, flux_jax.get_config(), True)
        return _autodiff.rs_core(x, wt, spec)
    # out = RS(y @ w.T): the weight is stored [n_out=K, k=N], sharded on its k dim.
    y = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
    out = run(body, (P(None, "tp"), P(None, "tp")), P("tp"), y, w)
    ref = jnp.dot(y, w.T, preferred_element_type=jnp.float32)
    print("max rel err", float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref))))
elif name == "ag_transposed":
    from flux_jax import _autodiff, _dispatch
    def body(x, wt):
        spec = _dispatch.FusedSpec("tp", 2, True, flux_jax.get_config(), True)
        return _autodiff.ag_core(x, wt, spec, False)[0]
    out = run(body, (P("tp"), P("tp")), P(None, "tp"), x, w.T)
    ref = jnp.dot(x, w, preferred_element_type=jnp.float32)
    print("max rel err", float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref))))
else:
    op = flux_jax.ag_matmul if name == "grad_ag" else flux_jax.matmul_rs
    specs = (P("tp", None), P(None, "tp")) if name == "grad_ag" else (P(None, "tp"), P("tp", None))
    outs = P(None, "tp") if name == "grad_ag" else P("tp", None)
    f = jax.shard_map(functools.partial(op, axis_name="tp", impl="fused"), mesh=mesh, in_specs=specs, out_specs=outs)
    g = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2), argnums=(0, 1)))(x, w)
    print("grad finite", [bool(jnp.all(jnp.isfinite(a))) for a in g])
print("device errors", flux_jax.device_errors())
'''

import os

names = sys.argv[1].split(",") if len(sys.argv) > 1 else SCENARIOS
envs = sys.argv[2].split(",") if len(sys.argv) > 2 else ["default"]
for env_name in envs:
    env = dict(os.environ)
    if env_name != "default":
        key, value = env_name.split("=")
        env[key] = value
    for name in names:
        r = subprocess.run([sys.executable, "-c", BODY, name], capture_output=True, text=True,
                           timeout=120, env=env)
        tail = (r.stdout + r.stderr).strip().splitlines()
        print(f"--- {name} [{env_name}]: rc={r.returncode}")
        for line in tail[-3:]:
            print("   ", line[:300])
