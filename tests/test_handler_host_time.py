"""flux_jax.handler_host_time: per-op call counts and host time of the FFI handlers."""

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import flux_jax

from helpers import cpu_mesh, place, random_array


def _program(mesh, impl):
    def body(x, w1, w2):
        y = flux_jax.ag_matmul(x, w1, axis_name="tp", impl=impl)
        return flux_jax.matmul_rs(y, w2, axis_name="tp", impl=impl), flux_jax.matmul_ar(
            y, w2, axis_name="tp", impl=impl
        )

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=(P("tp"), P())))


def test_counts_every_handler_call_per_device_and_resets():
    mesh = cpu_mesh((8,), ("tp",))
    rng = np.random.default_rng()
    args = (
        place(mesh, random_array(rng, (16, 32), "float32"), P("tp")),
        place(mesh, random_array(rng, (32, 64), "float32"), P(None, "tp")),
        place(mesh, random_array(rng, (64, 32), "float32"), P("tp")),
    )
    fused, twin = _program(mesh, "fused"), _program(mesh, "xla")
    jax.block_until_ready((fused(*args), twin(*args)))  # compile outside the window
    flux_jax.handler_host_time(reset=True)

    for _ in range(3):
        jax.block_until_ready(fused(*args))
    jax.block_until_ready(twin(*args))  # XLA's collectives: no handler calls
    stats = flux_jax.handler_host_time(reset=True)

    assert set(stats) == {"ag_matmul", "matmul_rs", "matmul_ar", "all_gather", "reduce_scatter", "all_reduce"}
    for op in ("ag_matmul", "matmul_rs", "matmul_ar"):
        s = stats[op]
        assert s.calls == 3 * 8, (op, s)  # one call per device per run
        assert 0 < s.max_us <= s.total_us, (op, s)
        assert s.max_us >= s.mean_us == s.total_us / s.calls
    assert stats["all_gather"].calls == stats["reduce_scatter"].calls == stats["all_reduce"].calls == 0
    after = flux_jax.handler_host_time()
    assert all(s.calls == 0 and s.total_us == 0 and s.mean_us == 0 for s in after.values()), after
