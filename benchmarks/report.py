"""Run metadata, the results JSON and the markdown table (one line per shape, ms per variant)."""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
from pathlib import Path

import jax
import jaxlib

import flux_jax
from benchmarks.variants import VARIANTS

REPO = Path(__file__).resolve().parent.parent
# Keys every row has (None where not applicable); the smoke test checks them.
ROW_KEYS = (
    "op",
    "layer",
    "M",
    "K",
    "N",
    "tp",
    "dtype",
    "variant",
    "status",
    "ms",
    "ms_min",
    "ms_max",
    "ms_spread",
    "samples_ms",
    "n1",
    "n2",
    "tflops",
    "speedup_vs_xla_shard_map",
    "overlap_efficiency",
    "ratio_to_limit",
    "max_rel_err",
    "profiler_ms",
    "note",
)


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def provenance(git_commit: str | None) -> dict:
    """The commit the numbers were taken at, whether the tree differed from it, and when.

    `git_commit` overrides `git rev-parse HEAD` (for a copy of the tree without .git).
    """
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain") if head else None
    return {
        "git_commit": git_commit or head,
        "git_dirty": bool(status) if status is not None else None,
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def metadata(preset: str, tp: int, argv: list[str], timing: dict, skipped: list[dict], git_commit: str | None) -> dict:
    """Everything needed to tell where and how the numbers were taken (`git_commit`: see `provenance`)."""
    devices = jax.devices()
    return {
        "preset": preset,
        "tp": tp,
        "command": "python -m benchmarks.run " + " ".join(argv),
        **provenance(git_commit),
        "hardware": {
            "platform": devices[0].platform,
            "device_kind": devices[0].device_kind,
            "device_count": len(devices),
            "host": platform.node(),
        },
        "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": platform.python_version()},
        "flux_jax_build_info": flux_jax.build_info(),
        "timing": timing,
        "skipped_shapes": skipped,
    }


def write_json(path: Path, meta: dict, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"metadata": meta, "rows": rows}, indent=1, default=list) + "\n")


def shape_groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows grouped by (op, M, K, N, transpose_w), in first-seen order."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["op"], row["M"], row["K"], row["N"], row.get("transpose_w", False)), []).append(row)
    return groups


def _cell(row: dict | None) -> str:
    if row is None:
        return ""
    if row["status"].startswith("unavailable"):
        return "n/a"
    text = f"{row['ms']:.4g}"
    return f"{text} WRONG" if row["status"] == "WRONG" else text


def _speedup(row: dict | None) -> str:
    value = row and row["speedup_vs_xla_shard_map"]
    return f"{value:.2f}x" if value else "-"


TABLE_LEGEND = (
    "ms per call (median of the repeats, on-device loop time); speedup = xla_shard_map ms / "
    "variant ms; WRONG = failed the check against the twin (no speedup claimed)."
)


def markdown_table(rows: list[dict], legend: bool = True) -> str:
    """ms per variant for each shape, speedups of every flux_jax variant present, and footnotes
    (`legend=False` leaves out the one-line legend, for pages that state it once)."""
    present = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    fused = [v for v in present if v.startswith("flux") and not v.startswith("flux_gemm_only")]
    header = ["op", "layer", "M", "K", "N", *present, *(f"{v} speedup" for v in fused)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    reasons: dict[tuple[str, str], int] = {}
    for (op, m, k, n, _), group in shape_groups(rows).items():
        by_variant = {r["variant"]: r for r in group}
        cells = [op, group[0]["layer"], str(m), str(k), str(n)]
        cells += [_cell(by_variant.get(v)) for v in present]
        cells += [_speedup(by_variant.get(v)) for v in fused]
        lines.append("| " + " | ".join(cells) + " |")
        for r in group:
            if r["status"].startswith("unavailable"):
                key = (r["variant"], r["status"].removeprefix("unavailable: "))
                reasons[key] = reasons.get(key, 0) + 1
    if legend:
        lines.append("")
        lines.append(TABLE_LEGEND)
    if reasons:
        lines.append("")
        lines.append("n/a (unavailable):")
        lines += [f"- {variant} ({count} shapes): {reason}" for (variant, reason), count in reasons.items()]
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    hw = meta["hardware"]
    head = (
        f"# {meta['preset']} (tp={meta['tp']})\n\n"
        f"{meta['date_utc']}, commit {meta['git_commit']}{' (dirty)' if meta['git_dirty'] else ''}, "
        f"{hw['device_count']}x {hw['device_kind']}, jax {meta['versions']['jax']}\n\n"
    )
    notes = "".join(f"{note}\n\n" for note in meta.get("notes", ()))
    path.write_text(head + notes + markdown_table(rows))
