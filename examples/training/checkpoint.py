"""Orbax checkpoints of the training state, with the run's settings and loss history.

A checkpoint holds {"params", "opt_state"} (sharded arrays, restored onto the
same shardings) and JSON metadata: the settings that must match to resume and
the losses so far, so the loss curve of a resumed run is complete.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

import flux_jax


class TrainCheckpoints:
    """Save every `every` steps into `directory`; restore the latest one."""

    def __init__(self, directory: str | Path, every: int):
        if every < 1:
            raise ValueError(f"--ckpt-every must be >= 1, got {every}")
        self.every = every
        self.directory = Path(directory).resolve()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def due(self, step: int, last_step: int) -> bool:
        return step % self.every == 0 or step == last_step

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Saves the state, unless a fused op failed on a GPU since the last check: a timed-out
        call poisons its outputs with NaN and the optimizer has applied them, so the state must
        not overwrite a good checkpoint (the error names the rank, the peer and the epoch)."""
        errors = flux_jax.device_errors()
        if errors:
            raise SystemExit(
                "a fused op failed on the GPU; not saving this state:\n"
                + "\n".join(f"  device {d}: {msg}" for d, msg in sorted(errors.items()))
            )
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True
        )

    def restore(self, like_state: dict) -> tuple[int, dict, dict]:
        """(step, state, meta) of the latest checkpoint; `like_state` gives structure and shardings."""
        step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like_state)
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
        return step, restored["state"], restored["meta"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
