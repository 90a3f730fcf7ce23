"""The run's outputs: a JSON summary and a PNG loss curve."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402


def write_summary(path: Path, summary: dict) -> None:
    path.write_text(json.dumps(summary, indent=2) + "\n")


def plot_losses(path: Path, curves: dict[str, list[float]], title: str) -> None:
    """One line per run (e.g. {"fused": [...], "xla": [...]}), loss against step."""
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for (label, losses), style in zip(curves.items(), ("-", "--", ":")):
        ax.plot(range(1, len(losses) + 1), losses, style, label=f"impl={label}", linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / character)")
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
