"""One case end to end: build every variant, check it against the twin, time them in shuffled rounds.

Per case: the twin (xla_shard_map) runs first and its output is the reference; every other
variant is built, its loops compiled (LoopTimer), its output checked; then `repeats` rounds
sample every variant once per round, in a new shuffled order each round (seeded), so clock and
power drift hit all variants alike and no variant always follows the same neighbour; each
sample starts after an untimed pre-heat of the variant's own loop (TimingParams.preheat_ms).
Any exception of a variant becomes its status "unavailable: <reason>"; the run goes on.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import statistics

from benchmarks import gpu_state, timing, variants
from benchmarks.data import TOLERANCE
from benchmarks.metrics import REFERENCE, add_metrics
from benchmarks.presets import Case
from benchmarks.timing import LoopTimer, TimingParams
from benchmarks.variants import CaseContext, Unavailable, error_summary
from benchmarks.windowed import WindowedEinsum


@dataclasses.dataclass
class Candidate:
    """One runnable form of a variant (pallas_mgpu has one per tile config)."""

    timer: object  # LoopTimer or windowed.RemoteTimer
    max_rel_err: float
    note: str
    built: timing.Built | None  # None when it runs in a subprocess
    samples: list = dataclasses.field(default_factory=list)
    gpu_readings: list = dataclasses.field(default_factory=list)  # gpu_state.read() after each sample

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples) if self.samples else math.inf


@dataclasses.dataclass
class Entry:
    """One variant of one case: its candidates, or why it has none."""

    variant: str
    candidates: list
    status: str = "ok"
    failed_forms: list = dataclasses.field(default_factory=list)  # "<config>: <reason>"


def _prepare_built(built: timing.Built, params: TimingParams) -> Candidate:
    timer = LoopTimer(built, params)
    return Candidate(timer, built.check(timer.take_output()), built.note, built)


def _prepare(name: str, ctx: CaseContext, params: TimingParams, windowed: WindowedEinsum) -> Entry:
    """Build and check one variant; failures become an unavailable entry."""
    if ctx.case.transpose_w and name not in variants.TRANSPOSED_WEIGHT_VARIANTS:
        return Entry(name, [], "unavailable: not built for a transposed-weight (dx) case")
    try:
        if name == "xla_windowed_einsum":
            ctx.require_gpu("XLA:GPU windowed-einsum flags")
            ctx.require_forward("the windowed-einsum subprocess times the forward")
            ctx.require_unquantized("XLA's windowed einsum on the unquantized dot")
            timer, err, note = windowed.prepare(ctx.case, ctx.seed, params)
            return Entry(name, [Candidate(timer, err, note, None)])
        built = variants.BUILDERS[name](ctx)
        if not isinstance(built, list):
            return Entry(name, [_prepare_built(built, params)])
        candidates, failures = [], []
        for form in built:  # keep the forms that compile and run
            try:
                candidates.append(_prepare_built(form, params))
            except Exception as err:
                failures.append(f"{form.note}: {error_summary(err, 200)}")
        if not candidates:
            raise Unavailable("; ".join(failures))
        return Entry(name, candidates, failed_forms=failures)
    except Exception as err:
        return Entry(name, [], f"unavailable: {error_summary(err)}")


def round_order(count: int, round_index: int) -> list[int]:
    """The order of one round: a seeded shuffle, so runs repeat and neighbours change (a
    rotation keeps every variant behind the same neighbour, and a variant behind a light one
    measured up to 10% faster: benchmarks/README.md, step 4)."""
    order = list(range(count))
    random.Random(7919 * (round_index + 1)).shuffle(order)
    return order


def _sample_round(entries: list[Entry], round_index: int, record_gpu_state: bool = False) -> None:
    """One sample of every variant, in round_order."""
    for entry in (entries[i] for i in round_order(len(entries), round_index)):
        if entry.status != "ok":
            continue
        try:
            for candidate in entry.candidates:
                candidate.samples.append(candidate.timer.sample())
                if record_gpu_state:
                    candidate.gpu_readings.append(gpu_state.read())
        except Exception as err:
            entry.status = f"unavailable: timing failed: {error_summary(err)}"


def _best(entry: Entry, tolerance: float) -> Candidate:
    """The fastest correct candidate (else the fastest); its note lists the others."""
    correct = [c for c in entry.candidates if c.max_rel_err <= tolerance]
    best = min(correct or entry.candidates, key=lambda c: c.median_s)
    if len(entry.candidates) > 1:
        others = ", ".join(f"[{c.note}] {c.median_s * 1e3:.4f} ms" for c in entry.candidates if c is not best)
        best.note = f"best of {len(entry.candidates)}: [{best.note}]; others: {others}"
    return best


def _row(case: Case, entry: Entry, tolerance: float, profile: bool) -> dict:
    row = {
        "op": case.op,
        "layer": case.layer,
        "M": case.M,
        "K": case.K,
        "N": case.N,
        "tp": case.tp,
        "dtype": case.dtype,
        "transpose_w": case.transpose_w,
        "variant": entry.variant,
        "status": entry.status,
        "ms": None,
        "ms_min": None,
        "ms_max": None,
        "ms_spread": None,
        "samples_ms": [],
        "n1": None,
        "n2": None,
        "max_rel_err": None,
        "profiler_ms": None,
        "note": "",
    }
    if entry.status != "ok":
        return row
    best = _best(entry, tolerance)
    row.update(timing.summarize(best.samples), **best.timer.describe())
    row.update(gpu_state.columns(best.gpu_readings))  # sm_mhz / power_w / temp_c per sample
    row.update(max_rel_err=best.max_rel_err, note=best.note)
    if entry.failed_forms:
        row["note"] += "; failed: " + "; ".join(f"[{failure}]" for failure in entry.failed_forms)
    if not best.max_rel_err <= tolerance:  # also catches NaN
        row["status"] = "WRONG"
    elif row["ms"] <= 0:
        row["status"] = "unavailable: not resolved (median T(n2) - T(n1) <= 0: noise); raise --target-ms"
    if profile and best.built is not None:
        try:
            row["profiler_ms"] = timing.profiler_ms(best.built, case.tp)
        except Exception as err:
            row["note"] = f"{row['note']}; profiler: {error_summary(err, 150)}".lstrip("; ")
    return row


def run_case(
    case: Case,
    names: list[str],
    *,
    seed: int,
    params: TimingParams,
    windowed: WindowedEinsum,
    profile: bool = False,
    grad: bool = False,
) -> list[dict]:
    """All rows of one case (one per requested variant, in `names` order).

    grad: time forward + backward with a random cotangent (variants.with_grad); rows get
    "pass": "fwd+bwd" and TFLOP/s count the three GEMMs.
    """
    ctx = variants.case_context(case, seed, grad)
    tolerance = TOLERANCE[case.dtype]
    finish = functools.partial(_finish, case, grad)

    try:
        twin = variants.xla_shard_map(ctx)
        twin_timer = LoopTimer(twin, params)
        ctx.twin_out = twin_timer.take_output()
    except Exception as err:  # no reference: nothing of this case can be checked
        status = f"unavailable: the reference {REFERENCE} failed: {error_summary(err)}"
        return finish([_row(case, Entry(name, [], status), tolerance, profile) for name in names])
    entries = []
    for name in names:
        if name == REFERENCE:
            entry = Entry(name, [Candidate(twin_timer, twin.check(ctx.twin_out), "", twin)])
        else:
            entry = _prepare(name, ctx, params, windowed)
        detail = entry.status if entry.status != "ok" else f"max_rel_err {entry.candidates[0].max_rel_err:.2e}"
        print(f"  prepared {name}: {detail}", flush=True)
        entries.append(entry)

    for round_index in range(params.repeats):
        _sample_round(entries, round_index, record_gpu_state=ctx.platform == "gpu")
    return finish([_row(case, entry, tolerance, profile) for entry in entries])


def _finish(case: Case, grad: bool, rows: list[dict]) -> list[dict]:
    for row in rows:
        row["pass"] = "fwd+bwd" if grad else "fwd"
    add_metrics(case, rows, gemms=3 if grad else 1)
    return rows
