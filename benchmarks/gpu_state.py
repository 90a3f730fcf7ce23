"""SM clock, power and temperature right after each timing sample (nvidia-smi).

Identical programs have measured up to ~10% apart in one harness run (benchmarks/README.md, step 4):
recording the clocks next to every sample tells clock or power drift from other noise. Costs one
nvidia-smi call (~30-50 ms) per sample; on machines without nvidia-smi it records nothing.
"""

from __future__ import annotations

import shutil
import subprocess

QUERY = "clocks.sm,power.draw,temperature.gpu"
_unavailable = False


def parse(text: str) -> dict | None:
    """One reading from nvidia-smi's csv (one line per GPU): the lowest SM clock of the GPUs
    (the slowest one paces a TP group), the highest power and temperature; None if unparsable."""
    clocks, powers, temps = [], [], []
    for line in text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3:
            return None
        try:
            clocks.append(float(fields[0]))
            powers.append(float(fields[1]))
            temps.append(float(fields[2]))
        except ValueError:  # "[N/A]" and the like
            return None
    if not clocks:
        return None
    return {"sm_mhz": min(clocks), "power_w": max(powers), "temp_c": max(temps)}


def read() -> dict | None:
    """The current reading, or None (no nvidia-smi, or it failed once: then never again)."""
    global _unavailable
    if _unavailable or shutil.which("nvidia-smi") is None:
        _unavailable = True
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        _unavailable = True
        return None
    reading = parse(out)
    if reading is None:
        _unavailable = True
    return reading


def columns(readings: list) -> dict:
    """Per-sample lists for a result row (None where a reading is missing); empty if none."""
    if not any(readings):
        return {}
    return {key: [r[key] if r else None for r in readings] for key in ("sm_mhz", "power_w", "temp_c")}
