"""On-device time per call, host dispatch excluded: the difference of two serialized loops.

A variant's step `out = step(x, *rest)` runs n times inside ONE jit (lax.fori_loop with a static
trip count). Each call's x depends on the previous call's output: x[0, 0] = x0[0, 0] + eps *
out[0, 0] with eps a runtime zero, written in place per shard with a dynamic_update_slice, so
XLA cannot hoist, CSE or overlap calls. The output is carried through the loop too (so every
element of it is live and nothing can be sliced away). Wall times T(n1) and T(n2) of the whole
program (after warm-up, block_until_ready) give per call (T(n2) - T(n1)) / (n2 - n1):
dispatch, launch of the program and the copy of the carry cancel. See benchmarks/README.md.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class TimingParams:
    """How long the loops are and how often they are measured."""

    n1: int  # calls in the short loop (also the calibration loop)
    target_ms: float  # the long loop is sized so T(n2) - T(n1) is at least this (and n2 >= 5 n1)
    max_calls: int  # cap on n2
    repeats: int  # samples per variant (one per round; rounds shuffle the variants)
    # Before each sample the variant's own long loop runs for at least this long (untimed), so
    # every sample starts from the clock / power state of that variant's sustained load instead
    # of whatever ran before it (a light variant left boost clocks for the next one: up to 10%).
    preheat_ms: float = 50.0


def params_problem(n1, repeats, target_ms, max_calls, preheat_ms) -> str | None:
    """What is wrong with loop settings given on a command line (--n1, --repeats, --target-ms,
    --max-calls, --preheat-ms), or None."""
    if n1 < 1:
        return f"--n1 must be >= 1, got {n1}"
    if repeats < 1:
        return f"--repeats must be >= 1, got {repeats}"
    if max_calls <= n1:
        return f"--max-calls must be greater than --n1 ({n1}), got {max_calls}"
    if not 0 < target_ms < math.inf:
        return f"--target-ms must be a positive finite number, got {target_ms}"
    if not 0 <= preheat_ms < math.inf:
        return f"--preheat-ms must be a finite number >= 0, got {preheat_ms}"
    return None


@dataclasses.dataclass
class Built:
    """A variant ready to run: `step(*args)` on global (sharded) arrays.

    args[0] (sharded as carry_spec on `mesh`) is the carried input of the loop; out_spec is
    the step's output sharding; `check(host_out) -> max relative error` against the reference.
    """

    step: Callable
    args: tuple
    mesh: jax.sharding.Mesh
    carry_spec: P
    out_spec: P
    check: Callable[[np.ndarray], float]
    note: str = ""


def _corner(mesh, carry_spec: P):
    """x -> every shard's x[:1, :1] (laid out like x, one element per shard)."""
    return jax.shard_map(lambda x: x[:1, :1], mesh=mesh, in_specs=carry_spec, out_specs=carry_spec)


def _dependency(mesh, carry_spec: P, out_spec: P):
    """x, out, eps, corner -> x with x[0, 0] = corner + eps * out[0, 0] on every shard.

    `corner` is x[0, 0] taken before the loop: the update reads nothing else of x, so XLA
    writes the one element in place instead of copying x every call (reading x[0, 0] here
    made it copy all of x: 40 us per call for a 64 MiB x on an H200).
    """

    def local(x, out, eps, corner):
        update = corner + (eps * out[:1, :1].astype(jnp.float32)).astype(x.dtype)
        return lax.dynamic_update_slice(x, update, (0, 0))

    return jax.shard_map(local, mesh=mesh, in_specs=(carry_spec, out_spec, P(), carry_spec), out_specs=carry_spec)


def serialized_loop(built: Built, n: int):
    """jit(eps, *args) -> (x, out) after n dependent calls (plus one call that makes out)."""
    dep = _dependency(built.mesh, built.carry_spec, built.out_spec)
    corner_of = _corner(built.mesh, built.carry_spec)

    def run(eps, x, *rest):
        corner = corner_of(x)

        def body(_, carry):
            x, _ = carry
            out = built.step(x, *rest)
            return dep(x, out, eps, corner), out

        return lax.fori_loop(0, n, body, (x, built.step(x, *rest)))

    return jax.jit(run)


def _wall(fn, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


class LoopTimer:
    """Compiles the two loops of one variant; n2 is sized from T(n1), then refined once from
    T(n2) - T(n1) if that fell short of half the target (dispatch made the first guess small).

    take_output() gives the step's output from the first run of the short loop: step(x, *rest)
    on the original inputs (x stays unchanged since eps = 0), what the correctness check reads.
    """

    def __init__(self, built: Built, params: TimingParams):
        self._args = (jnp.float32(0.0), *built.args)
        self.n1 = params.n1
        self._f1 = serialized_loop(built, self.n1).lower(*self._args).compile()
        self._output = self._f1(*self._args)[1]  # also the warm-up; eps = 0 keeps x unchanged
        jax.block_until_ready(self._output)
        self._built, self._params = built, params
        t1 = min(_wall(self._f1, self._args) for _ in range(3))
        self._compile_n2(t1 / self.n1)  # an over-estimate per call: includes dispatch / n1
        diff = min(_wall(self._f2, self._args) for _ in range(2)) - t1
        if 0 < diff < 0.5 * params.target_ms * 1e-3 and self.n2 < params.max_calls:
            self._compile_n2(diff / (self.n2 - self.n1))  # refined from the loops themselves

    def _compile_n2(self, per_call_s: float) -> None:
        extra = max(math.ceil(self._params.target_ms * 1e-3 / max(per_call_s, 1e-7)), 4 * self.n1)
        self.n2 = max(self.n1 + 1, min(self.n1 + extra, self._params.max_calls))
        self._f2 = serialized_loop(self._built, self.n2).lower(*self._args).compile()
        _wall(self._f2, self._args)  # warm-up

    def take_output(self) -> np.ndarray:
        """The output as a host array (the device copy is released)."""
        output, self._output = self._output, None
        return np.asarray(output)

    def sample(self) -> float:
        """One measurement of seconds per call, after the pre-heat (TimingParams.preheat_ms);
        each loop runs twice and the faster run counts (host hiccups only ever add time)."""
        self.preheat()
        t2 = min(_wall(self._f2, self._args) for _ in range(2))
        t1 = min(_wall(self._f1, self._args) for _ in range(2))
        return (t2 - t1) / (self.n2 - self.n1)

    @property
    def calls_per_long_run(self) -> int:
        """Steps of one run of the long loop (n2 dependent calls and the one that makes out)."""
        return self.n2 + 1

    def dispatch_long(self) -> Callable[[], bool]:
        """Enqueues one run of the long loop without waiting; returns whether it has finished."""
        leaves = jax.tree.leaves(self._f2(*self._args))
        return lambda: all(leaf.is_ready() for leaf in leaves)

    def preheat(self) -> int:
        """Runs the long loop, untimed, until preheat_ms have passed; returns the runs."""
        runs, spent, budget = 0, 0.0, self._params.preheat_ms * 1e-3
        while spent < budget:
            spent += _wall(self._f2, self._args)
            runs += 1
        return runs

    def program_text(self) -> str:
        """The long loop's compiled HLO (which GEMMs and collectives XLA picked)."""
        return self._f2.as_text()

    def describe(self) -> dict:
        return {"n1": self.n1, "n2": self.n2}


def summarize(samples_s: list[float]) -> dict:
    """Median, min, max and IQR (ms_spread) of per-call samples, in ms; samples in taken order."""
    ms = [s * 1e3 for s in samples_s]
    q25, q75 = np.percentile(ms, [25, 75])
    return {
        "ms": statistics.median(ms),
        "ms_min": min(ms),
        "ms_max": max(ms),
        "ms_spread": float(q75 - q25),
        "samples_ms": ms,
    }


def profiler_ms(built: Built, tp: int) -> float | None:
    """Cross-check on GPU: kernel time per device from CUPTI (mosaic.gpu.profiler), or None.

    Sum of all kernel durations of one call over the devices / tp: kernels that overlap on
    one device count twice, gaps not at all; compare with the loop time, do not replace it.
    """
    from jax.experimental.mosaic.gpu import profiler

    _, kernels = profiler.measure(jax.jit(built.step), aggregate=False)(*built.args)
    if not kernels:
        return None
    return sum(ms for _, ms in kernels) / tp
