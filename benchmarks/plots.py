"""PNG plots of a results file: speedup over the twin vs M, and the GEMM / exposed-comm time split.

One subplot per layer shape (op, K, N), M on the x axis. Only "ok" rows are drawn: WRONG and
unavailable variants are left out (the table lists them).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from benchmarks.metrics import REFERENCE  # noqa: E402
from benchmarks.variants import LIMIT_VARIANTS, VARIANTS  # noqa: E402

_OP_NAME = {"ag": "AllGather -> GEMM", "rs": "GEMM -> ReduceScatter", "ar": "GEMM -> AllReduce"}
# One color per variant in every subplot and every file.
_COLOR = {variant: plt.get_cmap("tab20")(i % 20) for i, variant in enumerate(VARIANTS)}
_NOTHING_TIMED = "no variant was timed here (the table says why)"


def _layer_shapes(rows: list[dict]) -> dict[tuple, dict[int, dict[str, dict]]]:
    """(op, K, N) -> M -> variant -> row, in first-seen order."""
    shapes: dict[tuple, dict[int, dict[str, dict]]] = {}
    for row in rows:
        shapes.setdefault((row["op"], row["K"], row["N"]), {}).setdefault(row["M"], {})[row["variant"]] = row
    return shapes


def _ok_ms(by_variant: dict, variant: str) -> float | None:
    row = by_variant.get(variant)
    return row["ms"] if row and row["status"] == "ok" and row["ms"] and row["ms"] > 0 else None


def _grid(count: int, title: str):
    cols = min(2, count)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.6 * rows + 0.8), squeeze=False)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=14)
    return fig, axes.flat


def _save(fig, path: Path, handles: list) -> None:
    """One legend for the whole figure, below the subplots (it never hides data); none where
    nothing was drawn (no variant timed)."""
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), fontsize=9, frameon=False)
    top = 1 - 0.5 / fig.get_figheight()  # room for the suptitle
    fig.tight_layout(rect=(0, 0.09 if len(handles) > 5 else 0.05 if handles else 0, 1, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _title(shape: tuple, ms: dict) -> str:
    op, k, n = shape
    layer = next(iter(next(iter(ms.values())).values()))["layer"]
    return f"{_OP_NAME[op]}: {layer}, K={k}, N={n}"


def speedup_plot(rows: list[dict], path: Path, title: str) -> None:
    """Speedup over xla_shard_map vs M, one line per variant, plus the limit."""
    shapes = _layer_shapes(rows)
    fig, axes = _grid(len(shapes), f"{title}: speedup over the XLA twin (xla_shard_map); higher is better")
    handles: dict[str, object] = {}
    for ax, (shape, by_m) in zip(axes, shapes.items()):
        ms_sorted = sorted(by_m)
        for variant in VARIANTS:
            if variant in LIMIT_VARIANTS or variant == REFERENCE:
                continue
            points = [
                (m, by_m[m][variant]["speedup_vs_xla_shard_map"])
                for m in ms_sorted
                if variant in by_m[m] and by_m[m][variant]["speedup_vs_xla_shard_map"]
            ]
            if points:
                bold = variant.startswith("flux")
                (handles[variant],) = ax.plot(
                    *zip(*points), marker="o", color=_COLOR[variant], label=variant, linewidth=2.5 if bold else 1.2
                )
        limit = []
        for m in ms_sorted:
            twin, gemm, comm = (_ok_ms(by_m[m], v) for v in (REFERENCE, "gemm_only", "comm_only"))
            if twin and gemm and comm:
                limit.append((m, twin / max(gemm, comm)))
        if limit:
            (handles["limit"],) = ax.plot(*zip(*limit), "k:", marker="^", label="limit: twin / max(T_gemm, T_comm)")
        handles["twin"] = ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="xla_shard_map (1.0)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms_sorted, [str(m) for m in ms_sorted])
        ax.set_xlabel("M (global rows = tokens)")
        ax.set_ylabel("speedup over xla_shard_map (x)")
        ax.set_title(_title(shape, by_m))
        ax.grid(True, alpha=0.3)
    _save(fig, path, list(handles.values()))


def _split(by_variant: dict, variant: str, gemm_ms: float) -> tuple[float, float, float] | None:
    """(total ms, GEMM part, exposed communication) of a variant, or None."""
    total = _ok_ms(by_variant, variant)
    if total is None:
        return None
    return total, min(gemm_ms, total), max(total - gemm_ms, 0.0)


def time_split_plot(rows: list[dict], path: Path, title: str, variant: str = "flux_fused") -> None:
    """Stacked bars per M: GEMM alone + exposed communication, twin (left) next to `variant` (right).

    Heights are relative to the twin's time so every M reads on one scale; labels give ms.
    """
    shapes = _layer_shapes(rows)
    fig, axes = _grid(len(shapes), f"{title}: time split, XLA twin (left, hatched) vs {variant} (right)")
    width = 0.38
    for ax, (shape, by_m) in zip(axes, shapes.items()):
        ms_sorted = sorted(by_m)
        missing, tallest = [], 1.0
        for i, m in enumerate(ms_sorted):
            twin, gemm = _ok_ms(by_m[m], REFERENCE), _ok_ms(by_m[m], "gemm_only")
            if not (twin and gemm):
                continue
            for offset, name, hatch in ((-width / 2, REFERENCE, "//"), (width / 2, variant, None)):
                split = _split(by_m[m], name, gemm)
                if split is None:
                    missing.append(m)
                    continue
                total, gemm_part, exposed = (v / twin for v in split)
                tallest = max(tallest, total)
                ax.bar(i + offset, gemm_part, width, color="tab:blue", hatch=hatch, edgecolor="white")
                ax.bar(i + offset, exposed, width, bottom=gemm_part, color="tab:orange", hatch=hatch, edgecolor="white")
                ax.text(i + offset, total + 0.02, f"{split[0]:.3g}", ha="center", va="bottom", fontsize=7)
        if not ax.patches:
            ax.text(0.5, 0.5, "no ok xla_shard_map + gemm_only pair to split", transform=ax.transAxes, ha="center")
        ax.set_xticks(range(len(ms_sorted)), [str(m) for m in ms_sorted])
        ax.set_xlim(-0.75, len(ms_sorted) - 0.25)
        ax.set_xlabel("M (global rows = tokens); bar labels: ms per call")
        ax.set_ylabel("time / XLA twin time")
        ax.set_ylim(0, 1.15 * tallest)
        note = f"\n({variant} n/a at M={sorted(set(missing))})" if missing else ""
        ax.set_title(_title(shape, by_m) + note, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    handles = [
        Patch(color="tab:blue", label="GEMM alone (gemm_only)"),
        Patch(color="tab:orange", label="exposed communication (T - T_gemm, >= 0)"),
        Patch(facecolor="white", edgecolor="gray", hatch="//", label="left bar: XLA twin"),
        Patch(facecolor="gray", edgecolor="gray", label=f"right bar: {variant}"),
    ]
    _save(fig, path, handles)


def time_plot(rows: list[dict], path: Path, title: str) -> None:
    """Time per call vs M (log-log), one line per variant: the fused ones next to twin and GEMM alone."""
    shapes = _layer_shapes(rows)
    fig, axes = _grid(len(shapes), f"{title}: time per call; lower is better")
    handles: dict[str, object] = {}
    for ax, (shape, by_m) in zip(axes, shapes.items()):
        ms_sorted = sorted(by_m)
        for variant in VARIANTS:
            points = [(m, _ok_ms(by_m[m], variant) * 1e3) for m in ms_sorted if _ok_ms(by_m[m], variant)]
            if points:
                style = "-" if variant.startswith("flux") else "--"
                (handles[variant],) = ax.plot(
                    *zip(*points),
                    style,
                    marker="o",
                    color=_COLOR[variant],
                    label=variant,
                    linewidth=2.2 if variant.startswith("flux") else 1.2,
                )
        if not ax.lines:
            ax.text(0.5, 0.5, _NOTHING_TIMED, transform=ax.transAxes, ha="center")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ms_sorted, [str(m) for m in ms_sorted])
        ax.set_xlabel("M (global rows = tokens)")
        ax.set_ylabel("us per call (dispatch-free)")
        ax.set_title(_title(shape, by_m))
        ax.grid(True, which="both", alpha=0.3)
    _save(fig, path, list(handles.values()))


PLOT_KINDS = ("speedup", "time", "time_split")


def write_plots(rows: list[dict], out_dir: Path, stem: str, kinds: tuple[str, ...] = PLOT_KINDS) -> list[Path]:
    """<stem>_<kind>.png for each of `kinds` (speedup, time, time_split); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind in kinds:
        path = out_dir / f"{stem}_{kind}.png"
        if kind == "speedup":
            speedup_plot(rows, path, stem)
        elif kind == "time":
            time_plot(rows, path, stem)
        elif kind == "time_split":
            present = {row["variant"] for row in rows}
            fused = next(
                (v for v in ("flux_fused", "flux_auto", "flux_decode", "flux_latency", "flux_overlap") if v in present),
                "flux_fused",
            )
            time_split_plot(rows, path, stem, fused)
        else:
            raise ValueError(f"unknown plot kind {kind!r}; expected one of {PLOT_KINDS}")
        paths.append(path)
    return paths


def parity_plot(rows: list[dict], path: Path, title: str) -> None:
    """One-GPU GEMM parity (benchmarks/gemm_parity.py rows): per shape, ours / XLA's time for every
    flux variant that ran there, horizontal bars, with the 1.00 and 1.02 lines (the target)."""
    shapes: dict[str, dict[str, float]] = {}
    for row in rows:
        if row["variant"] == "xla" or row["status"] != "ok" or not row.get("ratio_vs_xla"):
            continue
        name = f"{row['M']}x{row['K']}x{row['N']} {row['orientation']} {row['dtype']}"
        shapes.setdefault(name, {})[row["variant"]] = row["ratio_vs_xla"]
    variants = sorted({v for by in shapes.values() for v in by}, key=lambda v: (v != "flux:auto", v))
    colors = {v: plt.get_cmap("tab10")(i % 10) for i, v in enumerate(variants)}
    height = 0.8 / max(1, len(variants))
    fig, ax = plt.subplots(figsize=(9, (0.15 * len(shapes) * max(2, len(variants)) if shapes else 1.2) + 1.6))
    for i, by in enumerate(shapes.values()):
        for j, variant in enumerate(variants):
            if variant in by:
                ax.barh(i + (j - (len(variants) - 1) / 2) * height, by[variant], height, color=colors[variant])
    if not shapes:
        ax.text(0.5, 0.5, _NOTHING_TIMED, transform=ax.transAxes, ha="center")
    ax.set_yticks(range(len(shapes)), list(shapes), fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=1)
    ax.axvline(1.02, color="gray", linewidth=1, linestyle="--")
    low = min([min(by.values()) for by in shapes.values()] + [1.0])
    ax.set_xlim(max(0.0, low - 0.1), None)
    ax.set_xlabel("ours / XLA's time (< 1: ours faster; dashed: 1.02)")
    ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=12)
    _save(fig, path, [Patch(color=colors[v], label=v) for v in variants])
