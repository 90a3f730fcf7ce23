"""ppermute ring collective matmuls (the algorithms of the JAX shard_map docs), per shard.

Our own implementations of "matmul_allgather_overlapped(_bidi)" and
"matmul_psumscatter_overlapped(_bidi)": at each of the tp steps a block is sent to the
neighbour with lax.ppermute while the block already here is multiplied, so XLA can overlap the
transfer with the GEMM. The loop over the tp steps is unrolled (tp <= 8). The bidirectional
versions split every block in two halves that travel in opposite directions (using both
directions of each link); they need an even row count per block.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def _shift(x, axis_name: str, tp: int, step: int):
    """Send x to device (i + step) % tp, receive from (i - step) % tp."""
    return lax.ppermute(x, axis_name, [(i, (i + step) % tp) for i in range(tp)])


def _put_rows(out, block, row_block):
    """out[row_block * rows : (row_block + 1) * rows] = block (row_block traced)."""
    return lax.dynamic_update_slice(out, block, (row_block * block.shape[0], 0))


def ag_ring(x, w, *, axis_name: str, tp: int):
    """all_gather(x) @ w: x [m, K] rides the ring i -> i+1, each block multiplied on arrival."""
    idx = lax.axis_index(axis_name)
    m = x.shape[0]
    out = jnp.zeros((tp * m, w.shape[1]), x.dtype)
    block = x
    for step in range(tp):
        incoming = _shift(block, axis_name, tp, 1) if step < tp - 1 else None
        out = _put_rows(out, jnp.dot(block, w), (idx - step) % tp)
        block = incoming
    return out


def ag_ring_bidi(x, w, *, axis_name: str, tp: int):
    """all_gather(x) @ w with x's top half going i -> i+1 and its bottom half i -> i-1."""
    idx = lax.axis_index(axis_name)
    half = x.shape[0] // 2
    out = jnp.zeros((2 * tp * half, w.shape[1]), x.dtype)
    lo, hi = x[:half], x[half:]
    for step in range(tp):
        if step < tp - 1:
            next_lo, next_hi = _shift(lo, axis_name, tp, 1), _shift(hi, axis_name, tp, -1)
        out = _put_rows(out, jnp.dot(lo, w), 2 * ((idx - step) % tp))
        out = _put_rows(out, jnp.dot(hi, w), 2 * ((idx + step) % tp) + 1)
        if step < tp - 1:
            lo, hi = next_lo, next_hi
    return out


def _row_block(x, index, rows: int):
    """x[index * rows : (index + 1) * rows] (index traced)."""
    return lax.dynamic_slice_in_dim(x, index * rows, rows, axis=0)


def rs_ring(x, w, *, axis_name: str, tp: int):
    """psum_scatter(x @ w): the partial sum of block b travels i -> i-1, growing on the way.

    Device i starts with block i+1; after tp-1 shifts it holds the full sum of block i.
    """
    idx = lax.axis_index(axis_name)
    rows = x.shape[0] // tp
    acc = jnp.dot(_row_block(x, (idx + 1) % tp, rows), w)
    for step in range(1, tp):
        acc = _shift(acc, axis_name, tp, -1)
        acc = acc + jnp.dot(_row_block(x, (idx + step + 1) % tp, rows), w)
    return acc


def rs_ring_bidi(x, w, *, axis_name: str, tp: int):
    """psum_scatter(x @ w) with the top half of each block going i -> i+1, the bottom i -> i-1."""
    idx = lax.axis_index(axis_name)
    half = x.shape[0] // (2 * tp)
    acc_lo = jnp.dot(_row_block(x, 2 * ((idx - 1) % tp), half), w)
    acc_hi = jnp.dot(_row_block(x, 2 * ((idx + 1) % tp) + 1, half), w)
    for step in range(1, tp):
        acc_lo = _shift(acc_lo, axis_name, tp, 1)
        acc_hi = _shift(acc_hi, axis_name, tp, -1)
        acc_lo = acc_lo + jnp.dot(_row_block(x, 2 * ((idx - step - 1) % tp), half), w)
        acc_hi = acc_hi + jnp.dot(_row_block(x, 2 * ((idx + step + 1) % tp) + 1, half), w)
    return jnp.concatenate([acc_lo, acc_hi], axis=0)
