"""A small progress bar on stderr (no dependencies): step, loss, tokens/s, elapsed and ETA."""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 60}:{seconds % 60:02d}"


class ProgressBar:
    """Redraws one line in a terminal; elsewhere (logs, CI) prints about 10 lines in all."""

    def __init__(self, total: int, *, start: int = 0, desc: str = "", width: int = 24, stream=None):
        self.total, self.start, self.desc, self.width = total, start, desc, width
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self._last_printed = start

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Report that `step` of `total` steps is done."""
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (self.total - step) if done else 0.0
        filled = int(self.width * step / max(self.total, 1))
        bar = "#" * filled + "." * (self.width - filled)
        line = (
            f"{self.desc}[{bar}] {step}/{self.total}  loss {loss:.4f}  "
            f"{tokens_per_s / 1e3:,.1f}k tok/s  {_clock(elapsed)}<{_clock(eta)}"
        )
        if self.interactive:
            self.stream.write("\r" + line)
        elif step == self.total or step - self._last_printed >= max(self.total // 10, 1):
            self.stream.write(line + "\n")
            self._last_printed = step
        self.stream.flush()

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()
