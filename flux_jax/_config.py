"""Runtime configuration of the fused ops.

Configuration is a frozen dataclass that travels to the kernels as FFI
attributes; nothing is read from environment variables inside the kernels.
It is read when an op is *traced*: a function that is already compiled keeps
the configuration it was traced with (re-jit to change it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator

FUSED_PATHS = ("auto", "overlap", "latency", "decode")


@dataclasses.dataclass(frozen=True)
class Config:
    """Knobs of the fused ops.

    Attributes:
      timeout_s: bound on every wait of the fused protocol (a peer that never
        arrives becomes an error naming rank, peer, chunk and epoch, never a hang).
      debug_jitter_us: CPU backend only: sleep a random 0..N microseconds before
        every signal, to shake out ordering bugs in tests.
      debug_drop_rank: testing only: this rank never signals its chunks, so its
        peers hit the timeout path. -1 disables it.
      debug_poison_outputs: testing only: the kernels fill their outputs with NaN
        before computing, so an element they fail to write cannot pass a test.
      gpu_piece_bytes: GPU tuning: target size of the pieces a chunk travels in
        (each piece has its own flag); 0 = automatic (~1/8 chunk, >= 8 MiB).
      gpu_tile_group_m: GPU tuning: how many 128-row tiles of the output the
        overlap GEMM sweeps together across N (grouped raster for L2 reuse),
        1..64; 0 = automatic.
      gpu_rs_stage_launches: GPU tuning (experimental): how many GEMM launches
        compute the partial rows a rank pushes first in matmul_rs's overlap ring,
        each launch's pieces travelling as soon as it ends instead of after the
        whole stage: 1 (default) = one launch; 0 = about one wave of output tiles
        per launch (at most 8); 2..16 = that many. Results are bitwise the same.
      gpu_rs_tile_signal: GPU tuning: when a piece of the rows matmul_rs's
        overlap ring pushes first may go to the copy engine: 0 = when the GEMM
        launch that computes it ends (an event); 1 = as soon as its output
        tiles are written (per-piece tile counters the GEMM epilogue raises, a
        stream wait per piece; each tile counted when the CTA's next tile
        reaches its epilogue); 2 = the same, each tile counted right after its
        stores (earlier, but the warp waits for them); -1 (default) = 2 where
        the per-rank K is at most 2048 and the pushed stage at most 16 MiB
        (little GEMM per pushed byte, a short stage: the Llama-8B attention
        output projection at TP=2 and M <= 4096, 3-5% faster on 2x H200), else
        0. Results are bitwise the same.
      gpu_tile_n: GPU tuning (experimental): width of the overlap GEMM's output
        tiles, 256 or 192 (bfloat16 with a row-major weight only; other inputs
        keep 256); 0 = by waves: 192 where the 128x256 tiles fill at least one
        wave and the narrow ones need clearly fewer tile-widths of time (e.g.
        2048 x 3072 per GPU: 256 tiles of 128x192 fill 2 waves, 192 tiles of
        128x256 fill 1.45; 1.19x faster on 2x H200).
      fused_path: which fused implementation runs: "overlap" (one kernel in
        which the GEMM consumes rows as they arrive -- the bandwidth path for
        large M), "latency" (our one-kernel NVLink collective next to XLA's own
        GEMM -- the small-M path, where the collective's latency is the cost),
        "decode" (decode sizes: a GEMM in the weight's orientation streams the
        weight from its first microsecond; for ag_matmul one kernel pushes the
        rows over NVLink meanwhile and the GEMM waits for them, for matmul_rs
        the GEMM's epilogue reduce-scatters each output tile over NVLink;
        bfloat16, the untransposed weight, 2..8 ranks and at most 256 rows in
        all for ag_matmul, 128 for matmul_rs (and n <= 32768); other calls
        take "latency"), or "auto" (on
        GPU the fastest for the shape, from measurements in
        flux_jax/_heuristics.py; on CPU "overlap").
      gpu_decode_early_launch: GPU tuning: 1 (default) = the decode path's GEMM
        launches while the rows are still being pushed (programmatic dependent
        launch; it waits for their flags, not for the push kernel's end);
        0 = after the push kernel.
    """

    timeout_s: float = 60.0
    debug_jitter_us: int = 0
    debug_drop_rank: int = -1
    debug_poison_outputs: bool = False
    gpu_piece_bytes: int = 0
    gpu_tile_group_m: int = 0
    gpu_rs_stage_launches: int = 1
    gpu_rs_tile_signal: int = -1
    gpu_tile_n: int = 0
    fused_path: str = "auto"
    gpu_decode_early_launch: int = 1

    def __post_init__(self):
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s <= 24 * 3600):
            raise ValueError(f"Config.timeout_s must be in (0, 86400] seconds, got {self.timeout_s!r}")
        if not (isinstance(self.debug_jitter_us, int) and self.debug_jitter_us >= 0):
            raise ValueError(f"Config.debug_jitter_us must be an int >= 0, got {self.debug_jitter_us!r}")
        if not (isinstance(self.debug_drop_rank, int) and self.debug_drop_rank >= -1):
            raise ValueError(f"Config.debug_drop_rank must be an int >= -1, got {self.debug_drop_rank!r}")
        if not (isinstance(self.gpu_piece_bytes, int) and self.gpu_piece_bytes >= 0):
            raise ValueError(f"Config.gpu_piece_bytes must be an int >= 0, got {self.gpu_piece_bytes!r}")
        if not (isinstance(self.gpu_tile_group_m, int) and 0 <= self.gpu_tile_group_m <= 64):
            raise ValueError(f"Config.gpu_tile_group_m must be an int in [0, 64], got {self.gpu_tile_group_m!r}")
        if not (isinstance(self.gpu_rs_stage_launches, int) and 0 <= self.gpu_rs_stage_launches <= 16):
            raise ValueError(f"Config.gpu_rs_stage_launches must be an int in [0, 16], got {self.gpu_rs_stage_launches!r}")
        if type(self.gpu_rs_tile_signal) is not int or self.gpu_rs_tile_signal not in (-1, 0, 1, 2):
            raise ValueError("Config.gpu_rs_tile_signal must be -1 (automatic), 0, 1 or 2, "
                             f"got {self.gpu_rs_tile_signal!r}")
        if type(self.gpu_tile_n) is not int or self.gpu_tile_n not in (0, 192, 256):
            raise ValueError(f"Config.gpu_tile_n must be 0 (by waves), 192 or 256, got {self.gpu_tile_n!r}")
        if self.fused_path not in FUSED_PATHS:
            raise ValueError('Config.fused_path must be one of "' + '", "'.join(FUSED_PATHS) +
                             f'", got {self.fused_path!r}')
        if type(self.gpu_decode_early_launch) is not int or self.gpu_decode_early_launch not in (0, 1):
            raise ValueError(f"Config.gpu_decode_early_launch must be 0 or 1, got {self.gpu_decode_early_launch!r}")
        if not isinstance(self.debug_poison_outputs, bool):
            raise ValueError(f"Config.debug_poison_outputs must be a bool, got {self.debug_poison_outputs!r}")

    @property
    def timeout_us(self) -> int:
        return int(round(self.timeout_s * 1e6))


_lock = threading.Lock()
_current = Config()


def get_config() -> Config:
    """The configuration new traces of the fused ops will use."""
    return _current


def set_config(cfg: Config) -> None:
    """Replace the process-wide configuration."""
    global _current
    if not isinstance(cfg, Config):
        raise TypeError(f"set_config expects a flux_jax.Config, got {type(cfg).__name__}")
    with _lock:
        _current = cfg


@contextlib.contextmanager
def config(**overrides) -> Iterator[Config]:
    """Temporarily override fields of the configuration (for tracing inside the block).

    Example:
      with flux_jax.config(timeout_s=5.0):
          f = jax.jit(step)   # traced below with the 5 s timeout
          f(x)
    """
    previous = get_config()
    updated = dataclasses.replace(previous, **overrides)
    set_config(updated)
    try:
        yield updated
    finally:
        set_config(previous)


def parse_overrides(text: str) -> dict:
    """Config fields from "name=value,name=value" (tools and test runs): integers become ints,
    true/false (any case) become bools, anything else stays a string; Config itself validates
    names and values."""
    overrides = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not name:
            raise ValueError(f"expected name=value, got {item!r} in {text!r}")
        if value.lstrip("-").isdigit():
            overrides[name] = int(value)
        elif value.lower() in ("true", "false"):
            overrides[name] = value.lower() == "true"
        else:
            overrides[name] = value
    return overrides
