"""Device time per call without host dispatch: the difference of two serialized loops.

The method of benchmarks/timing.py (benchmarks/README.md), small enough to ship: a step
`out = step(x, *rest)` runs n times inside ONE jit (lax.fori_loop, static trip count); each
call's x depends on the previous call's output (x[0, 0] = corner + eps * out[0, 0] with eps a
runtime zero, written in place per shard), so XLA cannot hoist, merge or overlap the calls, and
the output is carried so none of it is dead. Per call = (T(n2) - T(n1)) / (n2 - n1) of the wall
times of the two programs: dispatch, launch and the carry's copy cancel. Each sample runs after
an untimed pre-heat of the same loop (clocks settle at that variant's load); a caller samples
its variants in shuffled rounds and takes the median.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Params:
    """How long the loops are and how often they are sampled."""

    n1: int  # calls in the short loop
    target_ms: float  # the long loop is sized so T(n2) - T(n1) is at least this
    max_calls: int  # cap on n2
    repeats: int  # samples per variant, one per round
    preheat_ms: float  # untimed run of the long loop before each sample


GPU = Params(n1=2, target_ms=20.0, max_calls=10000, repeats=5, preheat_ms=50.0)
CPU = Params(n1=1, target_ms=2.0, max_calls=40, repeats=3, preheat_ms=0.0)


def _loop(step, mesh, carry_spec: P, out_spec: P, n: int):
    """jit(eps, x, *rest) -> (x, out) after n dependent calls (plus one that makes out)."""

    def update(x, out, eps, corner):
        value = corner + (eps * out[:1, :1].astype(jnp.float32)).astype(x.dtype)
        return lax.dynamic_update_slice(x, value, (0, 0))

    dep = jax.shard_map(update, mesh=mesh, in_specs=(carry_spec, out_spec, P(), carry_spec), out_specs=carry_spec)
    corner_of = jax.shard_map(lambda x: x[:1, :1], mesh=mesh, in_specs=carry_spec, out_specs=carry_spec)

    def run(eps, x, *rest):
        corner = corner_of(x)

        def body(_, carry):
            x, _ = carry
            out = step(x, *rest)
            return dep(x, out, eps, corner), out

        return lax.fori_loop(0, n, body, (x, step(x, *rest)))

    return jax.jit(run)


def _wall(fn, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


class LoopTimer:
    """The two loops of one variant, compiled; n2 sized from the short loop, refined once."""

    def __init__(self, step, args: tuple, mesh, carry_spec: P, out_spec: P, params: Params):
        self._make = lambda n: _loop(step, mesh, carry_spec, out_spec, n).lower(*self._args).compile()
        self._args = (jnp.float32(0.0), *args)
        self._params = params
        self.n1 = params.n1
        self._f1 = self._make(self.n1)
        _wall(self._f1, self._args)  # warm-up
        t1 = min(_wall(self._f1, self._args) for _ in range(2))
        self._size(t1 / self.n1)
        diff = _wall(self._f2, self._args) - t1
        if 0 < diff < 0.5 * params.target_ms * 1e-3 and self.n2 < params.max_calls:
            self._size(diff / (self.n2 - self.n1))

    def _size(self, per_call_s: float) -> None:
        p = self._params
        extra = max(math.ceil(p.target_ms * 1e-3 / max(per_call_s, 1e-7)), 4 * self.n1)
        self.n2 = max(self.n1 + 1, min(self.n1 + extra, p.max_calls))
        self._f2 = self._make(self.n2)
        _wall(self._f2, self._args)  # warm-up

    def sample(self) -> float:
        """Seconds per call: after the pre-heat, each loop runs twice and the faster run counts."""
        spent = 0.0
        while spent < self._params.preheat_ms * 1e-3:
            spent += _wall(self._f2, self._args)
        t2 = min(_wall(self._f2, self._args) for _ in range(2))
        t1 = min(_wall(self._f1, self._args) for _ in range(2))
        return (t2 - t1) / (self.n2 - self.n1)
