"""Call-site ids come from the program itself: re-jitting a function reuses its channels, and
lowering another program first does not shift them (processes that lower different sets of
programs still agree)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import flux_jax

from helpers import cpu_mesh, random_array, rel_max_err, to64


def _step(mesh):
    def block(x, w1, w2):
        h = flux_jax.ag_matmul(x, w1, axis_name="tp", impl="fused")
        return flux_jax.matmul_rs(jnp.tanh(h), w2, axis_name="tp", impl="fused")

    return jax.shard_map(block, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp"))


def _args():
    return jnp.ones((16, 8)), jnp.ones((8, 16)), jnp.ones((16, 8))


def _callsites(text):
    return re.findall(r"callsite = (-?\d+)", text)


def test_ids_do_not_depend_on_other_programs_lowered_first():
    mesh = cpu_mesh((8,), ("tp",), AxisType.Auto)
    first = _callsites(jax.jit(_step(mesh)).lower(*_args()).as_text())
    other = jax.jit(
        jax.shard_map(
            functools.partial(flux_jax.ag_matmul, axis_name="tp", impl="fused"),
            mesh=mesh,
            in_specs=(P("tp"), P(None, "tp")),
            out_specs=P(None, "tp"),
        )
    )
    other.lower(jnp.ones((16, 8)), jnp.ones((8, 16))).as_text()  # e.g. printing another program's HLO
    again = _callsites(jax.jit(_step(mesh)).lower(*_args()).as_text())
    assert len(first) == 2 and first == again and len(set(first)) == 2


def test_rejitting_a_dropped_function_reuses_its_channels():
    mesh = cpu_mesh((8,), ("tp",), AxisType.Auto)
    flux_jax.reset()
    ext = flux_jax._native.extension()
    counts = []
    for _ in range(12):
        f = jax.jit(_step(mesh))  # a new function object each time: a new trace and compile
        f(*_args()).block_until_ready()
        counts.append(ext.cpu_channel_count())
        del f
    assert counts == [counts[0]] * 12, counts


def test_one_program_on_two_sets_of_devices_keeps_its_groups_apart():
    """The same program on devices 0-3 and on devices 4-7 has the same call-site ids; its TP
    groups still get a channel each (the CPU backend keys channels by the group's devices too),
    so a call site failed on one set of devices leaves the other's usable, and right."""
    flux_jax.reset()
    devices = np.array(jax.devices("cpu"))
    meshes = [jax.sharding.Mesh(devices[s], ("tp",), axis_types=(AxisType.Auto,)) for s in (slice(0, 4), slice(4, 8))]
    rng = np.random.default_rng()
    x, w1, w2 = (random_array(rng, shape, "float32", scale=0.25) for shape in ((16, 8), (8, 16), (16, 8)))
    texts = [jax.jit(_step(m)).lower(x, w1, w2).as_text() for m in meshes]
    assert _callsites(texts[0]) == _callsites(texts[1]) and len(_callsites(texts[0])) == 2
    with flux_jax.config(timeout_s=0.5, debug_drop_rank=1):
        with pytest.raises(Exception, match="rank 1"):
            jax.block_until_ready(jax.jit(_step(meshes[0]))(x, w1, w2))
    out = jax.jit(_step(meshes[1]))(x, w1, w2)
    assert rel_max_err(out, np.tanh(to64(x) @ to64(w1)) @ to64(w2)) < 1e-5
    flux_jax.reset()
