"""The process-wide configuration: FLUX_JAX_CONFIG and FLUX_JAX_GPU_TUNING (read when flux_jax
is imported, so each case runs in a fresh interpreter) and the checks of set_config."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

import flux_jax
from flux_jax import _config

# Traces f under the configuration from the environment, then inside a config block, then again
# outside it: the jit cache key holds the Config instance, so f traces once per configuration.
_PROBE = """
import jax
import flux_jax
from flux_jax import _config

traces = []

@jax.jit
def f(x):
    traces.append(flux_jax.get_config().timeout_s)
    return x + 1

f(1.0)
with flux_jax.config(timeout_s=7.0):
    f(1.0)
f(1.0)
print(repr(flux_jax.get_config()), repr(_config.get_gpu_tuning()), traces, sep="\\n")
"""


def _import(**variables) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("FLUX_JAX_CONFIG", "FLUX_JAX_GPU_TUNING")}
    env.update(variables, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)


def test_environment_variables_set_the_process_wide_values():
    out = _import(FLUX_JAX_CONFIG='{"timeout_s": 5.0, "fused_path": "latency"}', FLUX_JAX_GPU_TUNING='{"tile_n": 192}')
    assert out.returncode == 0, out.stderr
    config, tuning, traces = out.stdout.splitlines()
    assert config == repr(flux_jax.Config(timeout_s=5.0, fused_path="latency"))
    assert tuning == repr(_config.GpuTuning(tile_n=192))
    assert traces == "[5.0, 7.0]"  # one trace per configuration: the key holds Config instances


@pytest.mark.parametrize("value", ["", "  ", "{}"])
def test_empty_environment_values_are_the_defaults(value):
    out = _import(FLUX_JAX_CONFIG=value, FLUX_JAX_GPU_TUNING=value)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[:2] == [repr(flux_jax.Config()), repr(_config.GpuTuning())]


@pytest.mark.parametrize(
    "variable, value, message",
    [
        (
            "FLUX_JAX_CONFIG",
            "timeout_s=5",
            "ValueError: FLUX_JAX_CONFIG is not JSON (Expecting value: line 1 column 1 (char 0)): expected a "
            "JSON object of flux_jax Config fields (timeout_s, fused_path, tuning, debug_drop_rank, "
            """debug_jitter_us, debug_poison_outputs), e.g. FLUX_JAX_CONFIG='{"timeout_s": 60.0}', got 'timeout_s=5'""",
        ),
        ("FLUX_JAX_CONFIG", "[5]", "ValueError: FLUX_JAX_CONFIG must be a JSON object of flux_jax Config fields ("),
        (
            "FLUX_JAX_CONFIG",
            '{"timeout": 5}',
            "ValueError: FLUX_JAX_CONFIG: unknown field 'timeout': expected a JSON object of flux_jax Config fields (",
        ),
        (
            "FLUX_JAX_CONFIG",
            '{"timeout_s": -1}',
            "ValueError: FLUX_JAX_CONFIG: Config.timeout_s must be in [0.001, 86400] seconds, got -1",
        ),
        (
            "FLUX_JAX_CONFIG",
            '{"tuning": "/no/such/table.json"}',
            "ValueError: FLUX_JAX_CONFIG: flux_jax tuning table /no/such/table.json: cannot be read",
        ),
        (
            "FLUX_JAX_GPU_TUNING",
            '{"tile_n": 100}',
            "ValueError: FLUX_JAX_GPU_TUNING: GpuTuning.tile_n must be 0 (by waves), 192 or 256, got 100",
        ),
        (
            "FLUX_JAX_GPU_TUNING",
            '{"piece_bytes": 4096.0}',
            "ValueError: FLUX_JAX_GPU_TUNING: GpuTuning.piece_bytes must be an int in [0, 1099511627776], got 4096.0",
        ),
    ],
    ids=["not-json", "not-an-object", "unknown-field", "bad-value", "bad-table", "bad-tuning", "float-for-int"],
)
def test_a_bad_environment_value_fails_the_import_naming_the_variable(variable, value, message):
    out = _import(**{variable: value})
    assert out.returncode != 0
    assert message in out.stderr.strip().splitlines()[-1], out.stderr


def test_set_config_checks_what_it_installs():
    """A Config altered after it was made (frozen, yet alterable with object.__setattr__) gets
    the checks of Config(...) when it is set; what is installed is a copy, which later changes to
    the caller's instance do not reach."""
    before = flux_jax.get_config()
    altered = flux_jax.Config()
    object.__setattr__(altered, "timeout_s", -1.0)
    with pytest.raises(ValueError, match=r"Config.timeout_s must be in \[0.001, 86400\] seconds, got -1.0"):
        flux_jax.set_config(altered)
    object.__setattr__(altered, "timeout_s", 5.0)
    object.__setattr__(altered, "fused_path", "fastest")
    with pytest.raises(ValueError, match=r'Config.fused_path must be one of "auto", .*, got \'fastest\''):
        flux_jax.set_config(altered)
    assert flux_jax.get_config() == before  # nothing was installed
    cfg = flux_jax.Config(timeout_s=5.0)
    flux_jax.set_config(cfg)
    object.__setattr__(cfg, "timeout_s", -1.0)
    assert flux_jax.get_config() == flux_jax.Config(timeout_s=5.0)
    # The config block builds its value with Config's checks too.
    object.__setattr__(flux_jax.get_config(), "debug_jitter_us", -1)
    with pytest.raises(ValueError, match=r"Config.debug_jitter_us must be an int"), flux_jax.config(timeout_s=2.0):
        pass


def test_environment_value_round_trips_through_json():
    """What a process's configuration is, written as the variable's value, gives it back."""
    cfg = flux_jax.Config(timeout_s=5.0, fused_path="latency", debug_jitter_us=3)
    text = json.dumps(dataclasses.asdict(cfg))
    assert _config._from_environment("FLUX_JAX_CONFIG", text, flux_jax.Config) == cfg
