"""Regenerates the per-preset sections of benchmarks/RESULTS.md from results JSON files.

  python -m benchmarks.results_page benchmarks/data/harness_*.json

RESULTS.md has two parts, split by the line `MARKER`:

- above it, hand-written: the headline table and the notes that read the runs (what changed in
  the code since a run, which rule a column reflects). This tool never changes it.
- below it, generated: one section per preset (in `PRESET_BLURBS` order), and in it one
  subsection per file, in the order given: what the file covers (ops, M range), date, commit, hardware, versions,
  timing, the command, the table, and two plots, the speedup over the twin and the time split,
  redrawn into benchmarks/figures/ as `<json stem>_speedup.png` and `<json stem>_time_split.png`.

Give it the newest run of each preset, plus, where a newer run covers only one op or part of the
M range, the newest run covering the rest. A page without the marker (or no page) gets a minimal
header above it. Only GPU results belong on the page: a CPU results file is refused unless
--allow-non-gpu.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from benchmarks import plots, report

HERE = Path(__file__).resolve().parent
PAGE = HERE / "RESULTS.md"
FIGURES = HERE / "figures"
MARKER = "<!-- Generated below by `python -m benchmarks.results_page`; edit above this line only. -->"
PLOT_KINDS = ("speedup", "time_split")

_OPS = {"ag": "AllGather -> GEMM", "rs": "GEMM -> ReduceScatter", "ar": "GEMM -> AllReduce"}
# One line per preset above its runs (presets.py has the shapes).
PRESET_BLURBS = {
    "llama8b-tp2": "LLaMA-3 8B layers (qkv and gate+up AllGather, out-proj and down ReduceScatter), M = 2048-16384.",
    "llama70b-tp2": "LLaMA-3 70B layers, M = 2048-16384.",
    "decode-tp2": "LLaMA-3 8B and 70B layers at decode and chunked-prefill sizes, M = 8-1024.",
    "decode-8192-tp2": "K = N = 8192, both ops, M = 64-1024.",
    "holdout-tp2": "Held-out Qwen2.5-14B-like and Phi-3-mini-like layers at M = 96-12288: shapes no kernel "
    "setting or auto rule was fitted on.",
    "baselines-tp2": "The ten reference shapes of `shared/docs/baselines.md` (K, N = 8192-28672, M = 64-16384).",
    "gemm-8192-tp2": "Our GEMM alone against XLA's at 8192^3 per GPU.",
}


def _coverage(rows: list[dict], meta: dict) -> str:
    ops = sorted({r["op"] for r in rows})
    ms = sorted({r["M"] for r in rows})
    what = _OPS[ops[0]] if len(ops) == 1 else "Both ops" if len(ops) == 2 else "All three ops"
    span = f"M = {ms[0]}" if len(ms) == 1 else f"M = {ms[0]}-{ms[-1]}"
    extra = [meta["rows_dtype"]] if meta.get("rows_dtype", "bfloat16") != "bfloat16" else []
    extra += ["forward + backward (`--grad`)"] if meta.get("grad") else []
    return ", ".join([what, span, *extra])


def _command(meta: dict) -> str:
    """The recorded command without the output folder and commit override (machine details)."""
    return re.sub(r" --(out|git-commit) \S+", "", meta["command"])


def _section(stem: str, meta: dict, rows: list[dict], figure_links: list[str]) -> str:
    hw, versions, build, timing = meta["hardware"], meta["versions"], meta["flux_jax_build_info"], meta["timing"]
    dirty = " (uncommitted changes in the measuring copy)" if meta["git_dirty"] else ""
    order = "shuffled rounds with pre-heat" if "shuffle" in timing["method"] else "fixed round order"
    cuda = f", CUDA {build['cuda_version']}" if build.get("cuda_version") else ""
    lines = [
        f"### {_coverage(rows, meta)} (`{stem}.json`)",
        "",
        f"- {meta['date_utc'][:16].replace('T', ' ')} UTC, commit `{meta['git_commit']}`{dirty}; "
        f"{hw['device_count']}x {hw['device_kind']} ({hw['platform']}); jax {versions['jax']}{cuda}; "
        f"{timing['repeats']} samples per variant, {order}.",
        f"- `{_command(meta)}`",
        "",
        report.markdown_table(rows, legend=False).rstrip("\n"),
        "",
        " ".join(f"![{Path(link).stem}]({link})" for link in figure_links),
    ]
    return "\n".join(lines) + "\n"


def generated_part(
    json_paths: list[Path], page: Path = PAGE, figures: Path = FIGURES, allow_non_gpu: bool = False
) -> str:
    """The text below the marker: sections per preset, plots redrawn into `figures`."""
    by_preset: dict[str, list[str]] = {}
    for json_path in json_paths:
        data = json.loads(Path(json_path).read_text())
        meta, rows = data["metadata"], data["rows"]
        if meta["hardware"]["platform"] not in ("gpu", "cuda") and not allow_non_gpu:
            raise SystemExit(f"{json_path} was measured on {meta['hardware']['platform']}; RESULTS.md is for GPU runs")
        dtypes = {r["dtype"] for r in rows}
        meta = {**meta, "rows_dtype": dtypes.pop() if len(dtypes) == 1 else "mixed dtypes"}
        stem = Path(json_path).stem
        paths = plots.write_plots(rows, figures, stem, kinds=PLOT_KINDS)
        links = [Path(os.path.relpath(p, page.parent)).as_posix() for p in paths]
        by_preset.setdefault(meta["preset"], []).append(_section(stem, meta, rows, links))
    parts = [
        "Tables: ms per call (median of the samples, on-device loop time); speedup = xla_shard_map ms / "
        "variant ms, within one run; `flux_auto` is the rule of the run's commit; WRONG = failed the "
        "check against the twin. Plots: speedup over the twin against M, and each M's time split into "
        "GEMM alone and exposed communication.",
    ]
    known = list(PRESET_BLURBS)  # page order; presets not listed there follow in the order given
    for preset, sections in sorted(
        by_preset.items(), key=lambda item: known.index(item[0]) if item[0] in known else len(known)
    ):
        blurb = PRESET_BLURBS.get(preset)
        parts.append(f"## Preset `{preset}`" + (f"\n\n{blurb}" if blurb else ""))
        parts += sections
    return "\n".join(part.rstrip("\n") + "\n" for part in parts)


def write_results_page(
    json_paths: list[Path], page: Path = PAGE, figures: Path = FIGURES, allow_non_gpu: bool = False
) -> Path:
    """Rewrites the generated part of `page` (and its plots) from the given results files."""
    generated = generated_part(json_paths, page, figures, allow_non_gpu)
    text = page.read_text() if page.exists() else ""
    if MARKER in text:
        head = text[: text.index(MARKER)]
    else:
        head = "# Benchmark results\n\nHow the numbers are taken: [benchmarks/README.md](README.md).\n\n"
    page.write_text(head + MARKER + "\n\n" + generated)
    return page


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.results_page", description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", type=Path, help="results files written by benchmarks.run")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page to update (default: benchmarks/RESULTS.md)")
    parser.add_argument("--allow-non-gpu", action="store_true", help="accept CPU results (for testing)")
    args = parser.parse_args(argv)
    page = write_results_page(
        args.json, page=args.page, figures=args.page.parent / "figures", allow_non_gpu=args.allow_non_gpu
    )
    print(f"wrote {page}")


if __name__ == "__main__":
    main()
