"""XLA windowed einsum: the auto-sharded jit, compiled with XLA:GPU windowed-einsum flags.

XLA flags are read once per process, so this variant runs in a persistent worker subprocess
(`python -m benchmarks.windowed`) whose XLA_FLAGS get WINDOWED_FLAGS appended. The parent
sends one JSON request per line: "prepare" (build the case from the same seed -> same inputs,
check, compile the loops), then one "sample" per round-robin repeat, so this variant is
interleaved with the in-process ones. If compilation fails with multi-streamed windowed
einsum (jax#39200) the case is retried in a second worker with it off; the row's note says
which one ran. The worker is checked against a single-device jnp.dot on the same inputs (the
twin's math without communication), computed in its own process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

WINDOWED_FLAGS = "--xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum="
MULTI_STREAMED = ("true", "false")  # tried in this order
PREPARE_TIMEOUT_S = 1800.0
SAMPLE_TIMEOUT_S = 600.0


class WorkerError(RuntimeError):
    """The worker failed a request (its message), died, or timed out."""


class _Worker:
    """One subprocess with one flag setting, spoken to in JSON lines."""

    def __init__(self, multi_streamed: str):
        self.multi_streamed = multi_streamed
        env = dict(os.environ)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {WINDOWED_FLAGS}{multi_streamed}".strip()
        # The parent holds most GPU memory already: allocate on demand only.
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.windowed"],
            cwd=Path(__file__).resolve().parent.parent,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # EOF

    def alive(self) -> bool:
        return self._proc.poll() is None

    def request(self, message: dict, timeout_s: float) -> dict:
        try:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
            line = self._lines.get(timeout=timeout_s)
        except (BrokenPipeError, queue.Empty) as err:
            self.close()
            raise WorkerError(f"windowed-einsum worker did not answer ({type(err).__name__})") from err
        if line is None:
            raise WorkerError(f"windowed-einsum worker exited with code {self._proc.wait()} (its stderr is above)")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise WorkerError(reply.get("error", "unknown error"))
        return reply

    def close(self):
        if self.alive():
            self._proc.kill()
        self._proc.wait()


@dataclasses.dataclass
class RemoteTimer:
    """A prepared case in a worker: sample() is one measurement, like LoopTimer.sample()."""

    worker: _Worker
    n1: int
    n2: int

    def sample(self) -> float:
        return self.worker.request({"cmd": "sample"}, SAMPLE_TIMEOUT_S)["s"]

    def describe(self) -> dict:
        return {"n1": self.n1, "n2": self.n2}


class WindowedEinsum:
    """Parent side: the workers (started lazily, one per flag setting) and the fallback."""

    def __init__(self):
        self._workers: dict[str, _Worker] = {}

    def _worker(self, multi_streamed: str) -> _Worker:
        worker = self._workers.get(multi_streamed)
        if worker is None or not worker.alive():
            worker = self._workers[multi_streamed] = _Worker(multi_streamed)
        return worker

    def prepare(self, case, seed: int, params) -> tuple[RemoteTimer, float, str]:
        """(timer, max_rel_err, note); raises WorkerError if no flag setting works."""
        request = {
            "cmd": "prepare",
            "case": dataclasses.asdict(case),
            "seed": seed,
            "timing": dataclasses.asdict(params),
        }
        failures = []
        for multi_streamed in MULTI_STREAMED:
            worker = self._worker(multi_streamed)
            try:
                reply = worker.request(request, PREPARE_TIMEOUT_S)
            except WorkerError as err:
                failures.append(f"multi_streamed={multi_streamed} failed: {err}")
                continue
            note = "; ".join([f"ran with multi_streamed={multi_streamed}", *failures])
            return RemoteTimer(worker, reply["n1"], reply["n2"]), reply["max_rel_err"], note
        raise WorkerError("; ".join(failures))

    def close(self):
        for worker in self._workers.values():
            worker.close()
        self._workers.clear()


def _serve():
    """Worker main loop: protocol on the original stdout, everything else printed to stderr."""
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import variants
    from benchmarks.data import make_xw
    from benchmarks.presets import Case
    from benchmarks.timing import LoopTimer, TimingParams

    timer = None
    for line in sys.stdin:
        message = json.loads(line)
        try:
            if message["cmd"] == "prepare":
                timer = None
                case = Case(**message["case"])
                mesh, auto_mesh = variants.make_meshes(case.tp)
                x, w = make_xw(case, message["seed"])
                ctx = variants.CaseContext(case, "gpu", mesh, auto_mesh, x, w, message["seed"])
                device = jax.devices()[0]
                ctx.twin_out = np.asarray(jax.jit(jnp.dot)(jax.device_put(x, device), jax.device_put(w, device)))
                built = variants.xla_jit(ctx)
                err = built.check(np.asarray(jax.jit(built.step)(*built.args)))
                timer = LoopTimer(built, TimingParams(**message["timing"]))
                reply = {"max_rel_err": err, **timer.describe()}
            elif message["cmd"] == "sample":
                reply = {"s": timer.sample()}
            else:
                raise ValueError(f"unknown command {message['cmd']!r}")
            reply["ok"] = True
        except Exception as err:  # reported to the parent, which records it in the row
            reply = {"ok": False, "error": variants.error_summary(err)}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()


if __name__ == "__main__":
    _serve()
