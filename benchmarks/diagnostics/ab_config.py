"""A/B of flux_jax.Config settings in one process (GPU diagnostic).

For each case, builds one variant once per setting (each traced under its own
`flux_jax.config(...)`), checks that the compiled programs differ where the settings differ
(a cached trace would silently time the same program twice), then times all of them in
shuffled, pre-heated rounds with the harness's loop timer (benchmarks/timing.py). Prints the
median per setting and its ratio to the first (and, where the variant calls our ops, the host
time per handler call, `flux_jax.handler_host_time`); one process keeps the GPU's clock and power
state comparable across settings, which separate processes did not (up to 5-8% drift).

  python benchmarks/diagnostics/ab_config.py --cases rs:2048x4096x4096,ag:2048x4096x6144 \
      --configs "gpu_flag_op=0|gpu_flag_op=1" --variant flux_overlap --rounds 5 --out ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import flux_jax  # noqa: E402
from benchmarks import timing, variants  # noqa: E402
from benchmarks.presets import Case, case_from_text  # noqa: E402
from flux_jax._config import parse_overrides  # noqa: E402


def fused_attributes(hlo: str) -> list[str]:
    """The attributes of every flux_jax custom call in a compiled program, less the callsite id
    (each trace numbers its own call sites)."""
    return [
        re.sub(r"callsite = \d+ : i64, ", "", m)
        for m in re.findall(r'custom_call_target="flux_jax_[^"]*".*?backend_config=(\{[^}]*\})', hlo)
    ]


def ab_case(case: Case, variant: str, settings: list[str], rounds: int, grad: bool, seed: int) -> dict:
    ctx = variants.case_context(case, seed, grad)
    params = timing.TimingParams(n1=2, target_ms=10.0, max_calls=400, repeats=rounds)
    # The reference of every check: XLA's own sharded twin, run once.
    ctx.twin_out = timing.LoopTimer(variants.BUILDERS["xla_shard_map"](ctx), params).take_output()
    timers, programs, errors = {}, {}, {}
    for text in settings:
        try:
            with flux_jax.config(**parse_overrides(text)):
                built = variants.BUILDERS[variant](ctx)
                built = built[0] if isinstance(built, list) else built
                timers[text] = timing.LoopTimer(built, params)
            error = built.check(timers[text].take_output())
            errors[text] = float(error)
            programs[text] = fused_attributes(timers[text].program_text())
        except Exception as err:  # a diagnostic: report the setting and go on
            errors[text] = variants.error_summary(err)
    same = [
        t for t in timers if t != settings[0] and settings[0] in programs and programs.get(t) == programs[settings[0]]
    ]
    samples = {t: [] for t in timers}
    host_us = {t: [] for t in timers}  # mean host time per fused-op handler call, per sample
    order = list(timers)
    for _ in range(rounds):
        random.shuffle(order)
        for t in order:
            flux_jax.handler_host_time(reset=True)
            samples[t].append(timers[t].sample())
            stats = flux_jax.handler_host_time(reset=True).values()
            calls = sum(s.calls for s in stats)
            if calls:
                host_us[t].append(sum(s.total_us for s in stats) / calls)
    row = {
        "case": f"{case.op}:{case.M}x{case.K}x{case.N}",
        "variant": variant,
        "grad": grad,
        "errors": errors,
        "same_program_as_first": same,
        "settings": {},
    }
    base = float(np.median(samples[settings[0]])) if settings[0] in samples else None
    for t in settings:
        if t not in samples:
            print(f"AB {row['case']:>20} {t:<36} FAILED {errors[t]}", flush=True)
            continue
        med = float(np.median(samples[t]))
        host = float(np.median(host_us[t])) if host_us[t] else None
        row["settings"][t] = {
            "median_us": med * 1e6,
            "samples_us": [s * 1e6 for s in samples[t]],
            "handler_host_us_per_call": host,
        }
        ratio = f"{med / base:.3f}" if base else "-"
        flag = " SAME-PROGRAM" if t in same else ""
        print(
            f"AB {row['case']:>20} {t:<36} {med * 1e6:9.1f} us  x{ratio}  "
            f"spread {1e6 * (max(samples[t]) - min(samples[t])):.1f}  err {errors[t]:.2e}"
            f"{f'  host {host:.1f} us/call' if host is not None else ''}{flag}",
            flush=True,
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", required=True, help="op:MxKxN,... (global shapes, as loop_anatomy)")
    ap.add_argument(
        "--configs",
        required=True,
        help="settings separated by '|', each 'field=value,...'; the first is the reference ('' = the defaults)",
    )
    ap.add_argument("--variant", default="flux_overlap")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grad", action="store_true", help="forward + backward steps (the harness's --grad)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    settings = [s.strip() for s in args.configs.split("|")]
    rows = [
        ab_case(case_from_text(c, jax.device_count(), "ab"), args.variant, settings, args.rounds, args.grad, args.seed)
        for c in args.cases.split(",")
    ]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
