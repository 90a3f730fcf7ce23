"""Configuration of the fused ops: the public `Config` and the private GPU tuning.

Both are part of the traced program. They are registered as JAX configuration
states that belong to the jit cache key, so a setting always takes effect where
it is set: `with flux_jax.config(timeout_s=5): f(x)` retraces `f` when its
compiled version was traced under another configuration, and a jitted `f` called
outside the block runs under the configuration there (traced once per
configuration). A program compiled inside the block (`f.lower(x).compile()`)
keeps its configuration wherever it is called: it holds the values as custom-call
attributes. Nothing is read from environment variables inside the kernels.

The process-wide values start from the environment variables FLUX_JAX_CONFIG and
FLUX_JAX_GPU_TUNING where they are set: a JSON object of the dataclass's fields, e.g.
FLUX_JAX_CONFIG='{"timeout_s": 5.0}', checked as the constructor checks them when flux_jax is
imported (an empty value counts as unset).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import numbers
import os
from collections.abc import Iterator

from jax._src import config as _jax_config  # private: the only jit-key-aware configuration state

from flux_jax import _tuning

FUSED_PATHS = ("auto", "overlap", "latency", "decode")
# GpuTuning.gemm_kernel values, in the order of cpp/include/flux_jax/params.h GemmKernel (the
# attribute carries the index).
GEMM_KERNELS = (
    "auto",
    "128x256",
    "128x192",
    "128x160_c2x1",
    "decode",
    "128x128_pp_c2x1",
    "128x320_c2x1",
    "128x160_pp_c2x1",
    "128x224",
    "128x192_pp_c2x1",
)


def _check_int(name: str, value, lo: int, hi: int) -> None:
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of the fused ops.

    The process-wide value (`set_config`) starts from the environment variable FLUX_JAX_CONFIG
    where it is set: a JSON object of these fields, e.g. FLUX_JAX_CONFIG='{"timeout_s": 5.0}'
    (docs/design.md, "Configuration").

    Attributes:
      timeout_s: bound on every wait, lock and rendezvous of the fused protocol, in seconds
        (at least 1 ms). A peer that never arrives becomes an error naming the rank, the peer,
        the chunk and the epoch, never a hang.
      fused_path: which fused implementation runs where a fused op runs: "overlap" (one kernel
        whose GEMM consumes rows as they arrive: large M), "latency" (our one-kernel NVLink
        collective next to XLA's GEMM: small and mid M), "decode" (one weight-streaming GEMM
        that moves the rows itself: decode sizes; FP8 calls of every op too;
        calls its kernels cannot serve take "latency"), or "auto" (the planner's choice, flux_jax/_plan.py; see
        `flux_jax.explain`).
      tuning: the path (a str or os.PathLike such as pathlib.Path; kept as an absolute str) of a tuning
        table (written by `python -m flux_jax.tune`; docs/tuning.md) that impl="auto" follows
        before this GPU kind's table in the user cache and the built-in one; e.g. one file on a
        shared file system for a whole cluster. None: those two only. CPU calls follow a table
        only when it is given here.
      debug_drop_rank: tests only: this TP rank never signals its peers, so they hit the
        timeout path. -1 disables it; must be below the TP size of every fused call.
      debug_jitter_us: tests only, CPU backend: sleep a random 0..N microseconds before every
        signal, to shake out ordering bugs.
      debug_poison_outputs: tests only: the kernels fill their outputs with NaN before
        computing, so an element they fail to write cannot pass a test.
    """

    timeout_s: float = 60.0
    fused_path: str = "auto"
    tuning: str | None = None
    debug_drop_rank: int = -1
    debug_jitter_us: int = 0
    debug_poison_outputs: bool = False

    def __post_init__(self):
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t):
            raise ValueError(f"Config.timeout_s must be a number of seconds, got {t!r}")
        if not 1e-3 <= t <= 24 * 3600:
            raise ValueError(f"Config.timeout_s must be in [0.001, 86400] seconds, got {t!r}")
        if self.fused_path not in FUSED_PATHS:
            raise ValueError(
                'Config.fused_path must be one of "' + '", "'.join(FUSED_PATHS) + f'", got {self.fused_path!r}'
            )
        object.__setattr__(self, "tuning", _tuning.checked_path(self.tuning))
        _check_int("Config.debug_drop_rank", self.debug_drop_rank, -1, 1 << 20)
        _check_int("Config.debug_jitter_us", self.debug_jitter_us, 0, 10_000_000)
        if not isinstance(self.debug_poison_outputs, bool):
            raise ValueError(f"Config.debug_poison_outputs must be a bool, got {self.debug_poison_outputs!r}")

    @property
    def timeout_us(self) -> int:
        return int(round(self.timeout_s * 1e6))


@dataclasses.dataclass(frozen=True)
class GpuTuning:
    """Private GPU tuning of the overlap and decode kernels (A/B measurements only).

    Every default is what the product runs; the kernels' automatic choices are described in
    docs/kernels.md and docs/decisions/.

    Attributes:
      piece_bytes: target size of the pieces a chunk travels in (0: ~1/8 chunk, >= 8 MiB).
      tile_group_m: 128-row tiles the overlap GEMM sweeps together across N, 1..64 (0: by
        instance: 16 over chunks of >= 2048 rows for the bf16 / f16 cooperative tiles 192 or
        more columns wide and for FP8 e4m3 ping-pong 128x128 tiles with a weight of >= 16 MiB,
        else 8).
      tile_serpentine: 1: every odd group of row tiles sweeps N backwards, starting on the
        columns of the weight the group before it read last; 0: every group sweeps forwards;
        -1: the product's choice (serpentine).
      rs_stage_launches: GEMM launches of matmul_rs's pushed stage (1: one; 0: about a wave
        each; 2..16: that many).
      rs_tile_signal: when matmul_rs's pushed pieces go: 0 at the launch's end, 1 / 2 by tile
        counters (at the next tile / right after the stores), -1 by shape.
      tile_n: output tile width of the overlap GEMM's cooperative tiles, 192 or 256 (0: by
        waves); bfloat16 / float16 rows only: FP8 rows keep their rule (gemm_kernel forces
        their instances).
      decode_early_launch: 1: the decode GEMM launches while the rows are pushed; 0: after.
      gemm_kernel: the overlap path's GEMM instance: "auto" (by shape: cpp/kernels/cuda/
        op_common.h), or one forced: "128x256", "128x192", "128x224" (the transposed weight),
        "128x160_c2x1" (the transposed weight; 2-CTA clusters along M sharing B by TMA
        multicast), "128x128_pp_c2x1" (ping-pong
        128x128 tiles in 2-CTA clusters; also FP8), "128x320_c2x1" (cooperative 128x320 tiles in
        2-CTA clusters), each for bfloat16 and float16; "128x160_pp_c2x1" (ping-pong 128x160
        tiles in 2-CTA clusters: FP8 e4m3 and e5m2 rows; bfloat16 and float16 have no such
        instance);
        "128x192_pp_c2x1" (ping-pong 128x192 tiles in 2-CTA clusters: bfloat16 and float16 with
        the [K, N] weight, FP8 e4m3 and e5m2 rows); "decode": the
        decode path's GEMM alone, ag_matmul at tp = 1 on bfloat16 / float16 rows only. A forced
        instance the build lacks for the call is an error.
      gate_probe: 1: at tp = 1 ag_matmul's GEMM waits before every tile's A loads on flags that
        are already set: the gate's cost without peers (at tp = 1 no gate runs otherwise).
    """

    piece_bytes: int = 0
    tile_group_m: int = 0
    tile_serpentine: int = -1
    rs_stage_launches: int = 1
    rs_tile_signal: int = -1
    tile_n: int = 0
    decode_early_launch: int = 1
    gemm_kernel: str = "auto"
    gate_probe: int = 0

    def __post_init__(self):
        _check_int("GpuTuning.piece_bytes", self.piece_bytes, 0, 1 << 40)
        _check_int("GpuTuning.tile_group_m", self.tile_group_m, 0, 64)
        if type(self.tile_serpentine) is not int or self.tile_serpentine not in (-1, 0, 1):
            raise ValueError(f"GpuTuning.tile_serpentine must be -1, 0 or 1, got {self.tile_serpentine!r}")
        _check_int("GpuTuning.rs_stage_launches", self.rs_stage_launches, 0, 16)
        if type(self.rs_tile_signal) is not int or self.rs_tile_signal not in (-1, 0, 1, 2):
            raise ValueError(f"GpuTuning.rs_tile_signal must be -1, 0, 1 or 2, got {self.rs_tile_signal!r}")
        if type(self.tile_n) is not int or self.tile_n not in (0, 192, 256):
            raise ValueError(f"GpuTuning.tile_n must be 0 (by waves), 192 or 256, got {self.tile_n!r}")
        if type(self.decode_early_launch) is not int or self.decode_early_launch not in (0, 1):
            raise ValueError(f"GpuTuning.decode_early_launch must be 0 or 1, got {self.decode_early_launch!r}")
        if self.gemm_kernel not in GEMM_KERNELS:
            raise ValueError(f"GpuTuning.gemm_kernel must be one of {GEMM_KERNELS}, got {self.gemm_kernel!r}")
        if type(self.gate_probe) is not int or self.gate_probe not in (0, 1):
            raise ValueError(f"GpuTuning.gate_probe must be 0 or 1, got {self.gate_probe!r}")


def _from_environment(variable: str, text: str, kind: type):
    """The `kind` instance that environment variable `variable` (its value `text`: a JSON object
    of `kind`'s fields) describes; ValueError naming the variable and what is wrong."""
    fields = [f.name for f in dataclasses.fields(kind)]
    example = f"e.g. {variable}='{json.dumps({fields[0]: getattr(kind(), fields[0])})}'"
    expected = f"a JSON object of flux_jax {kind.__name__} fields ({', '.join(fields)}), {example}"
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{variable} is not JSON ({err}): expected {expected}, got {text!r}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{variable} must be {expected}, got {text!r}")
    unknown = [name for name in values if name not in fields]
    if unknown:
        raise ValueError(f"{variable}: unknown field {unknown[0]!r}: expected {expected}")
    try:
        return kind(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{variable}: {err}") from None


def _state(name: str, kind: type):
    """A configuration state holding a `kind` instance: `kind()`, or what the environment
    variable of the state's name (upper case) describes."""
    variable = name.upper()
    text = os.environ.get(variable, "")
    initial = _from_environment(variable, text, kind) if text.strip() else kind()
    registering = True

    def validate(value):
        if registering and isinstance(value, str):
            return  # JAX hands the variable's raw text over at registration; `initial` replaces it
        if not isinstance(value, kind):
            raise TypeError(f"{name} must be a {kind.__qualname__}, got {type(value).__name__}")

    state = _jax_config.string_or_object_state(
        name,
        initial,
        f"flux_jax {kind.__name__} (part of the jit cache key; environment variable {variable}: "
        "a JSON object of its fields)",
        validator=validate,
        include_in_jit_key=True,
        include_in_trace_context=True,
    )
    registering = False
    state.set_global(initial)
    return state


_CONFIG = _state("flux_jax_config", Config)
_TUNING = _state("flux_jax_gpu_tuning", GpuTuning)


def get_config() -> Config:
    """The configuration that fused ops traced now use (the innermost `config` block's, else the
    process-wide one)."""
    return _CONFIG.value


def _checked_config(cfg) -> Config:
    """`cfg` with its fields checked as Config(...) checks them (a frozen instance can still be
    altered with object.__setattr__)."""
    if not isinstance(cfg, Config):
        raise TypeError(f"set_config expects a flux_jax.Config, got {type(cfg).__name__}")
    return dataclasses.replace(cfg)


def set_config(cfg: Config) -> None:
    """Replace the process-wide configuration (functions traced under another one retrace). A
    value Config(...) would refuse is an error here, not in a later lowering."""
    _CONFIG.set_global(_checked_config(cfg))


@contextlib.contextmanager
def config(**overrides) -> Iterator[Config]:
    """Override fields of the configuration inside a `with` block (this thread only).

    Calls inside the block run with the overrides; a function compiled under other settings is
    retraced (the configuration is part of the jit cache key). Example:

      with flux_jax.config(timeout_s=5.0):
          step(state, batch)
    """
    updated = dataclasses.replace(get_config(), **overrides)
    with _CONFIG(updated):
        yield updated


def get_gpu_tuning() -> GpuTuning:
    return _TUNING.value


def _checked_tuning(tuning) -> GpuTuning:
    """`tuning` with its fields checked as GpuTuning(...) checks them (a frozen instance can
    still be altered with object.__setattr__)."""
    if not isinstance(tuning, GpuTuning):
        raise TypeError(f"set_gpu_tuning expects a flux_jax._config.GpuTuning, got {type(tuning).__name__} {tuning!r}")
    return dataclasses.replace(tuning)


def set_gpu_tuning(tuning: GpuTuning) -> None:
    """Private: replace the process-wide GPU tuning (functions traced under another one
    retrace). A value GpuTuning(...) would refuse is an error here, not in a later lowering."""
    _TUNING.set_global(_checked_tuning(tuning))


@contextlib.contextmanager
def gpu_tuning(**overrides) -> Iterator[GpuTuning]:
    """Private: override GPU tuning fields inside a `with` block (A/B measurements)."""
    updated = dataclasses.replace(get_gpu_tuning(), **overrides)
    with _TUNING(updated):
        yield updated


_TUNING_PREFIX = "gpu_"


def _parse_value(value: str):
    """An override's value: int, float, bool, None, else the string itself."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    if value.lower() == "none":
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def parse_overrides(text: str) -> tuple[dict, dict]:
    """(Config fields, GpuTuning fields) from "name=value,name=value" (tools and test runs).

    GPU tuning fields are spelled with a `gpu_` prefix (`gpu_tile_n=192`). Integers become ints,
    other numbers floats, true/false (any case) bools, none (any case) None, anything else stays a
    string; the dataclasses validate names and values.
    """
    public, tuning = {}, {}
    tuning_fields = {f.name for f in dataclasses.fields(GpuTuning)}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not name:
            raise ValueError(f"expected name=value, got {item!r} in {text!r}")
        parsed = _parse_value(value)
        bare = name[len(_TUNING_PREFIX) :] if name.startswith(_TUNING_PREFIX) else None
        if bare in tuning_fields:
            tuning[bare] = parsed
        else:
            public[name] = parsed
    return public, tuning


@contextlib.contextmanager
def overriding(text: str) -> Iterator[tuple[Config, GpuTuning]]:
    """Apply `parse_overrides(text)` to both the Config and the GPU tuning inside the block."""
    public, tuning = parse_overrides(text)
    with config(**public) as cfg, gpu_tuning(**tuning) as tun:
        yield cfg, tun
