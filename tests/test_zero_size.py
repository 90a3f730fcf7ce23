"""Zero-size operands (no rows, K = 0 or N = 0): every op and impl returns the exact result, zeros
or empty, typed for its out_specs, with zero gradients and nothing launched.

lax.all_gather and lax.psum_scatter cannot lower a zero-size gathered or scattered dimension, so
the twins build these results without a collective; the plan sends every impl there.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import flux_jax

from helpers import cpu_mesh, place, random_array, shard_mapped, to64

TP = 4
IMPLS = ("xla", "fused", "auto")
FP8 = (None, True)
# Per-rank (rows, k, n): ag's rows are each rank's, the others' the whole x's.
SHAPES = {"no rows": (0, 32, 16), "K = 0": (8, 0, 16), "N = 0": (8, 32, 0)}


def _operands(op, rows, k, n, rng):
    """Global x and w, and the specs of a 2-D (dp, tp) mesh: dp splits x's middle dimension."""
    if op == "ag":
        x, w = random_array(rng, (TP * rows, 2, k), jnp.bfloat16), random_array(rng, (k, TP * n), jnp.bfloat16)
        return x, w, (P("tp", "dp"), P(None, "tp")), P(None, "dp", "tp")
    x, w = random_array(rng, (TP * rows, 2, TP * k), jnp.bfloat16), random_array(rng, (TP * k, n), jnp.bfloat16)
    out = {"rs": P("tp", "dp"), "ar": P(None, "dp"), "column": P(None, "dp", "tp")}[op]
    if op == "column":  # x replicated over tp, w's columns split
        w = random_array(rng, (TP * k, TP * n), jnp.bfloat16)
        return x, w, (P(None, "dp"), P(None, "tp")), out
    return x, w, (P(None, "dp", "tp"), P("tp")), out


def _op(op, impl, fp8):
    kw = dict(axis_name="tp", impl=impl, fp8=fp8)
    return {
        "ag": lambda x, w: flux_jax.ag_matmul(x, w, **kw),
        "rs": lambda x, w: flux_jax.matmul_rs(x, w, **kw),
        "ar": lambda x, w: flux_jax.matmul_ar(x, w, **kw),
        "column": lambda x, w: flux_jax.column_matmul(x, w, **kw),
    }[op]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("op", ["ag", "rs", "ar", "column"])
def test_zero_size_operands_give_the_exact_result_on_every_impl(op, shape):
    rows, k, n = SHAPES[shape]
    rng = np.random.default_rng(0)
    mesh = cpu_mesh((2, TP), ("dp", "tp"))
    x, w, in_specs, out_spec = _operands(op, rows, k, n, rng)
    ref = np.tensordot(to64(x), to64(w), axes=1)  # zeros (K = 0) or empty; every op's global result
    args = (place(mesh, x, in_specs[0]), place(mesh, w, in_specs[1]))
    for impl in IMPLS:
        for fp8 in FP8:
            with flux_jax.config(debug_poison_outputs=True):
                out = shard_mapped(_op(op, impl, fp8), mesh, in_specs, out_spec)(*args)
            what = f"{op} {shape} impl={impl} fp8={fp8}"
            assert out.dtype == jnp.bfloat16, what
            assert out.shape == ref.shape, f"{what}: {out.shape} != {ref.shape}"
            assert np.array_equal(to64(out), ref), what  # exactly zero where K = 0

            def loss(x, w, impl=impl, fp8=fp8):
                y = _op(op, impl, fp8)(x, w)
                return jnp.sum(y.astype(jnp.float32) ** 2)

            with flux_jax.config(debug_poison_outputs=True):  # a gradient left unwritten reads NaN
                grads = shard_mapped(jax.grad(loss, argnums=(0, 1)), mesh, in_specs, in_specs)(*args)
            for g, a in zip(grads, (x, w)):
                assert g.shape == a.shape and g.dtype == a.dtype, what
                assert not np.any(to64(g)), f"{what}: a nonzero gradient of a zero or empty result"


@pytest.mark.parametrize("fp8", FP8, ids=["bf16", "fp8"])
def test_ag_return_gathered_with_no_weight_columns_still_gathers_x(fp8):
    """N = 0: the product is empty, the gathered x is not (with fp8, the rows the FP8 GEMM reads)."""
    rng = np.random.default_rng(1)
    mesh = cpu_mesh((TP,), ("tp",))
    x, w = random_array(rng, (TP * 8, 32), jnp.bfloat16), random_array(rng, (32, 0), jnp.bfloat16)

    def fn(x, w):
        return flux_jax.ag_matmul(x, w, axis_name="tp", impl="fused", return_gathered=True, fp8=fp8)

    out, copies = shard_mapped(fn, mesh, (P("tp"), P(None, "tp")), (P(None, "tp"), P("tp")))(
        place(mesh, x, P("tp")), place(mesh, w, P(None, "tp"))
    )
    assert out.shape == (TP * 8, 0) and copies.shape == (TP * TP * 8, 32)
    copies = to64(copies).reshape(TP, TP * 8, 32)  # every rank's gathered x
    assert all(np.array_equal(c, copies[0]) for c in copies)
    x_full = copies[0]
    if fp8 is None:
        np.testing.assert_array_equal(x_full, to64(x))
    else:  # e4m3 per row: within its rounding, and visibly rounded
        err = np.abs(x_full - to64(x)).max() / np.abs(to64(x)).max()
        assert 0 < err < 2**-3

    def loss(x, w):  # x_full's cotangent reaches x straight through (all_gather's adjoint)
        return jnp.sum(fn(x, w)[1].astype(jnp.float32))

    dx = shard_mapped(jax.grad(loss), mesh, (P("tp"), P(None, "tp")), P("tp"))(
        place(mesh, x, P("tp")), place(mesh, w, P(None, "tp"))
    )
    np.testing.assert_array_equal(to64(dx), np.full(x.shape, TP))  # every rank's sum reads every row


def test_explain_names_the_zero_size_operand():
    mesh = cpu_mesh((TP,), ("tp",))
    x, w = jnp.zeros((0, 32), jnp.bfloat16), jnp.zeros((32, 16), jnp.bfloat16)
    f = jax.shard_map(
        lambda x, w: flux_jax.ag_matmul(x, w, axis_name="tp", impl="fused"),
        mesh=mesh,
        in_specs=(P("tp"), P(None, "tp")),
        out_specs=P(None, "tp"),
    )
    text = str(flux_jax.explain(f, place(mesh, x, P("tp")), place(mesh, w, P(None, "tp"))))
    assert "the XLA twin (a zero-size operand" in text, text
