"""Bad input fails in Python, before anything is traced or launched, with a
message that names the argument and the shapes."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flux_jax
from flux_jax import _config, _native, _overlap_gemm, _plan

from helpers import cpu_mesh

MESH = None


def _run(fn, x, w, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"), mesh=None, **kw):
    mesh = mesh or cpu_mesh((8,), ("tp",), AxisType.Auto)
    f = jax.shard_map(functools.partial(fn, **kw), mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    return jax.jit(f)(x, w)


def _zeros(shape, dtype=jnp.float32):
    return jnp.ones(shape, dtype)


OPS = [flux_jax.ag_matmul, flux_jax.matmul_rs, flux_jax.matmul_ar, flux_jax.column_matmul]
# The ops whose forward is a fused custom call (column_matmul's forward is a local GEMM).
FUSED_FORWARD = OPS[:3]


@pytest.mark.parametrize("fn", OPS)
def test_contraction_mismatch(fn):
    with pytest.raises(
        ValueError, match=r"contraction mismatch: x float32\[\d+, 16\] has K=16 but w float32\[12, \d+\]"
    ):
        _run(fn, _zeros((16, 16)), _zeros((12, 16)), in_specs=(P(), P()), out_specs=P(), axis_name="tp")


@pytest.mark.parametrize("fn", OPS)
def test_rank_below_two(fn):
    with pytest.raises(ValueError, match=r"x must have rank >= 2.*got x float32\[16\]"):
        _run(fn, _zeros((16,)), _zeros((16, 8)), in_specs=(P(), P()), out_specs=P(), axis_name="tp")
    with pytest.raises(ValueError, match=r"w must have rank 2.*got w float32\[16, 8, 2\]"):
        _run(fn, _zeros((16, 16)), _zeros((16, 8, 2)), in_specs=(P(), P()), out_specs=P(), axis_name="tp")


@pytest.mark.parametrize("fn", OPS)
def test_mixed_dtypes_are_not_promoted(fn):
    with pytest.raises(
        TypeError, match=r"same dtype \(no silent promotion\), got x bfloat16\[16, 16\] and w float32\[16, 8\]"
    ):
        _run(fn, _zeros((16, 16), jnp.bfloat16), _zeros((16, 8)), in_specs=(P(), P()), out_specs=P(), axis_name="tp")


@pytest.mark.parametrize("fn", OPS)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float8_e4m3fn])
def test_unsupported_dtype(fn, dtype):
    with pytest.raises(TypeError, match=r"unsupported dtype .*supported: float32, bfloat16, float16") as err:
        _run(fn, _zeros((16, 16), dtype), _zeros((16, 8), dtype), in_specs=(P(), P()), out_specs=P(), axis_name="tp")
    # FP8 operands are pointed at the two ways in: fp8=True, or a weight quantized once
    assert ("fp8=True" in str(err.value) and "Fp8Weight.quantize" in str(err.value)) == (dtype == jnp.float8_e4m3fn)


def test_matmul_rs_rows_not_divisible():
    with pytest.raises(
        ValueError,
        match=r"leading dimension of x float32\[12, 16\] \(12 rows\) must be divisible by the size of axis 'tp' \(8\)",
    ):
        _run(flux_jax.matmul_rs, _zeros((12, 16)), _zeros((16, 8)), in_specs=(P(), P()), out_specs=P(), axis_name="tp")


@pytest.mark.parametrize("fn", OPS)
def test_unknown_impl(fn):
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'fused', 'xla'\), got 'cuda'"):
        _run(fn, _zeros((16, 16)), _zeros((16, 8)), axis_name="tp", impl="cuda")


def test_return_gathered_must_be_a_bool():
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match=r"ag_matmul: return_gathered must be a bool, got"):
            _run(flux_jax.ag_matmul, _zeros((16, 16)), _zeros((16, 8)), axis_name="tp", return_gathered=bad)


@pytest.mark.parametrize("fn", OPS)
def test_outside_shard_map(fn):
    with pytest.raises(ValueError, match=r"per-shard op: call it inside jax.shard_map.*no mesh is active"):
        fn(_zeros((16, 16)), _zeros((16, 8)), axis_name="tp")
    with pytest.raises(ValueError, match=r"per-shard op"):
        jax.jit(functools.partial(fn, axis_name="tp"))(_zeros((16, 16)), _zeros((16, 8)))


@pytest.mark.parametrize("fn", OPS)
def test_unknown_axis(fn):
    with pytest.raises(ValueError, match=r"axis 'model' is mapped.*the current mesh has axes \('tp',\)"):
        _run(fn, _zeros((16, 16)), _zeros((16, 8)), in_specs=(P(), P()), out_specs=P(), axis_name="model")
    with pytest.raises(ValueError, match=r"axis_name must name a mesh axis \(a str\) or several distinct ones"):
        _run(fn, _zeros((16, 16)), _zeros((16, 8)), in_specs=(P(), P()), out_specs=P(), axis_name=("tp", 3))


@pytest.mark.parametrize("fn", [flux_jax.column_matmul, flux_jax.column_matmul_xla])
def test_column_matmul_refuses_an_x_that_varies_over_the_axis(fn):
    """Its dx is all-reduced over the axis: rows that differ per rank (or were all_gathered,
    whose transpose sums again) would get a wrong gradient. A replicated x runs; check_vma=False
    leaves no type to read."""
    x, w = _zeros((16, 16)), _zeros((16, 8))
    for body in (lambda x: x, lambda x: jax.lax.all_gather(x, "tp", tiled=True)[:2]):
        with pytest.raises(
            ValueError, match=r"column_matmul(_xla)?: x float32\[2, 16\] varies over mesh axis 'tp'.*ag_matmul"
        ):
            _run(lambda x, w: fn(body(x), w, axis_name="tp"), x, w, out_specs=P("tp"))
    assert _run(fn, x, w, in_specs=(P(), P(None, "tp")), axis_name="tp").shape == (16, 8)
    mesh = cpu_mesh((8,), ("tp",), AxisType.Auto)
    f = jax.shard_map(
        functools.partial(fn, axis_name="tp"),
        mesh=mesh,
        in_specs=(P("tp"), P(None, "tp")),
        out_specs=P("tp"),
        check_vma=False,
    )
    assert jax.jit(f)(x, w).shape == (16, 1)


@pytest.mark.parametrize("fn", FUSED_FORWARD)
def test_partial_manual_shard_map_runs_fused(fn):
    """shard_map manual over tp only, dp left to the partitioner: the fused op runs (in a manual
    region over dp that it opens itself) and equals the twin."""
    mesh = cpu_mesh((2, 4), ("dp", "tp"), AxisType.Auto)
    specs, out = {
        flux_jax.ag_matmul: ((P("tp"), P(None, "tp")), P(None, "tp")),
        flux_jax.matmul_rs: ((P(None, "tp"), P("tp")), P("tp")),
        flux_jax.matmul_ar: ((P(None, "tp"), P("tp")), P()),
    }[fn]

    def call(impl):
        f = jax.jit(
            jax.shard_map(
                functools.partial(fn, axis_name="tp", impl=impl),
                mesh=mesh,
                in_specs=specs,
                out_specs=out,
                axis_names={"tp"},
            )
        )
        x, w = _zeros((16, 16)) + 1, _zeros((16, 16)) + 1
        return f(x, w), f.lower(x, w).as_text()

    fused, text = call("fused")
    assert "flux_jax_" in text
    np.testing.assert_allclose(np.asarray(fused), np.asarray(call("xla")[0]))


def test_config_validation():
    with pytest.raises(ValueError, match="timeout_s"):
        flux_jax.Config(timeout_s=0)
    with pytest.raises(ValueError, match="timeout_s"):
        flux_jax.Config(timeout_s=1e-7)  # would round to 0 us
    with pytest.raises(ValueError, match="timeout_s"):
        flux_jax.Config(timeout_s=True)
    with pytest.raises(ValueError, match="timeout_s"):
        flux_jax.Config(timeout_s=float("nan"))
    with pytest.raises(ValueError, match="debug_jitter_us"):
        flux_jax.Config(debug_jitter_us=-1)
    with pytest.raises(ValueError, match="debug_drop_rank"):
        flux_jax.Config(debug_drop_rank=True)
    with pytest.raises(TypeError, match="flux_jax.Config"):
        flux_jax.set_config({"timeout_s": 1})
    with pytest.raises(TypeError):
        flux_jax.Config(gpu_tile_n=192)  # GPU tuning is private: _config.GpuTuning
    for bad in (-1, 17, 2.0):
        with pytest.raises(ValueError, match="rs_stage_launches"):
            _config.GpuTuning(rs_stage_launches=bad)
    for bad in (128, -1, 192.0, True):
        with pytest.raises(ValueError, match="tile_n"):
            _config.GpuTuning(tile_n=bad)
    for bad in (-2, 3, True, 1.0):
        with pytest.raises(ValueError, match="rs_tile_signal"):
            _config.GpuTuning(rs_tile_signal=bad)
    for bad in (-2, 2, True, 1.0):
        with pytest.raises(ValueError, match="tile_serpentine"):
            _config.GpuTuning(tile_serpentine=bad)
    with pytest.raises(ValueError, match="piece_bytes"):
        _config.GpuTuning(piece_bytes=1 << 62)  # would overflow an attribute
    assert _config.GpuTuning().rs_tile_signal == -1  # automatic


def test_drop_rank_beyond_the_group_is_an_error():
    with flux_jax.config(debug_drop_rank=8), pytest.raises(ValueError, match="debug_drop_rank=8 names no rank"):
        _run(flux_jax.ag_matmul, _zeros((16, 16)), _zeros((16, 8)), axis_name="tp", impl="fused")


def test_gpu_tuning_fields_reach_the_kernel_attributes():
    """Every GPU tuning field travels as a typed custom-call attribute that the handlers decode
    (the CPU handler decodes the same set, so a missing one fails here, not only on GPU)."""
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 48)), jnp.float32)
    f = jax.jit(
        jax.shard_map(
            functools.partial(flux_jax.matmul_rs, axis_name="tp", impl="fused"),
            mesh=mesh,
            in_specs=(P(None, "tp"), P("tp", None)),
            out_specs=P("tp", None),
        )
    )
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "tp")))
    ws = jax.device_put(w, NamedSharding(mesh, P("tp", None)))
    with _config.gpu_tuning(
        rs_stage_launches=0,
        piece_bytes=4096,
        tile_group_m=2,
        tile_serpentine=1,
        tile_n=192,
        rs_tile_signal=2,
        gemm_kernel="128x160_c2x1",
        gate_probe=1,
    ):
        hlo = f.lower(xs, ws).as_text()
        out = f(xs, ws)
    for attr in (
        "rs_stage_launches = 0",
        "piece_bytes = 4096",
        "tile_group_m = 2",
        "tile_serpentine = 1",
        "tile_n = 192",
        "rs_tile_signal = 2",
        "path = 0 : i32",
        "gemm_kernel = 3",
        "gate_probe = true",
    ):
        assert attr in hlo, attr
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) @ np.asarray(w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", _config.GEMM_KERNELS)
def test_every_gemm_kernel_name_passes_the_handlers_attribute_check(kernel):
    """Each GpuTuning.gemm_kernel name lowers to its index and the handler's range check accepts
    it (a kernel added to GEMM_KERNELS but not to attrs.h's range fails here, on CPU)."""
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    x, w = jnp.ones((32, 16), jnp.float32), jnp.ones((16, 24), jnp.float32)
    f = jax.jit(
        jax.shard_map(
            functools.partial(flux_jax.ag_matmul, axis_name="tp", impl="fused"),
            mesh=mesh,
            in_specs=(P("tp", None), P(None, "tp")),
            out_specs=P(None, "tp"),
        )
    )
    xs = jax.device_put(x, NamedSharding(mesh, P("tp", None)))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "tp")))
    with _config.gpu_tuning(gemm_kernel=kernel):
        hlo = f.lower(xs, ws).as_text()
        out = f(xs, ws)
    assert f"gemm_kernel = {_config.GEMM_KERNELS.index(kernel)}" in hlo
    np.testing.assert_allclose(np.asarray(out), np.full((32, 24), 16.0), rtol=1e-6)


def test_parse_overrides_for_tools_and_test_tuning():
    from flux_jax._config import parse_overrides

    public, tuning = parse_overrides(" gpu_tile_group_m=16, fused_path = latency,debug_drop_rank=-1,")
    assert public == {"fused_path": "latency", "debug_drop_rank": -1}
    assert tuning == {"tile_group_m": 16}
    assert flux_jax.Config(**public).fused_path == "latency"
    assert parse_overrides("") == ({}, {})
    public, _ = parse_overrides("debug_poison_outputs=True")
    assert flux_jax.Config(**public).debug_poison_outputs is True
    assert parse_overrides("debug_poison_outputs=false")[0] == {"debug_poison_outputs": False}
    with pytest.raises(ValueError, match="expected name=value"):
        parse_overrides("gpu_tile_group_m")
    public, _ = parse_overrides("timeout_s=0.5,tuning=None")
    assert public == {"timeout_s": 0.5, "tuning": None}
    assert flux_jax.Config(**public).timeout_s == 0.5


def test_build_info_reports_the_build():
    info = flux_jax.build_info()
    assert info["jaxlib_headers"] == "0.11.2"
    assert info["ffi_api_version"] == "0.4"
    assert isinstance(info["cuda"], bool)
    assert info["cuda"] == bool(info["cuda_archs"])
    if info["cuda"]:
        assert "sm_90a" in info["cuda_archs"]


def _problem(op, rows, k, n, platform="cuda", tp=2, dtype=jnp.bfloat16):
    return _plan.Problem(op, rows, k, n, np.dtype(dtype), tp, platform)


def test_fused_without_a_kernel_for_the_platform_is_a_clear_error():
    cfg = flux_jax.Config()
    if "ag_matmul" not in flux_jax.build_info()["cuda_kernels"]:
        with pytest.raises(flux_jax.FusedUnavailableError, match=r"cannot run here: this flux_jax build was compiled"):
            _plan.plan(_problem("ag_matmul", 64, 64, 64), "fused", cfg)
        assert _plan.plan(_problem("ag_matmul", 64, 64, 64), "auto", cfg).path == "twin"
    with pytest.raises(flux_jax.FusedUnavailableError, match="no fused kernel for platform 'tpu'"):
        _plan.plan(_problem("matmul_rs", 64, 64, 64, platform="tpu"), "fused", cfg)


def test_auto_uses_the_twin_on_cpu():
    cfg = flux_jax.Config()
    cpu = _problem("ag_matmul", 4096, 4096, 4096, platform="cpu", tp=8)
    assert _plan.plan(cpu, "auto", cfg).path == "twin"
    assert _plan.plan(cpu, "fused", cfg).path == "overlap"
    assert _plan.plan(cpu, "xla", cfg).path == "twin"
    assert _plan.plan(cpu, "auto", cfg, backward=True).path == "overlap"


def test_auto_gpu_policy_follows_the_measured_table():
    from flux_jax import _auto_rule

    bf16 = np.dtype(jnp.bfloat16)
    choose = functools.partial(_auto_rule.choose, tp=2, dtype=bf16)
    # (op, global M, per-rank k, per-rank n) -> the winner measured on 2x H200
    # (docs/decisions/2026-11-30-auto-overlap-region.md and the decode-path records)
    assert choose("ag_matmul", rows=4096, k=8192, n=4096) == "overlap"  # 1.40x
    assert choose("ag_matmul", rows=8192, k=8192, n=14336) == "overlap"  # 1.03x, latency 1.01x
    assert choose("matmul_rs", rows=8192, k=2048, n=28672) == "overlap"  # 1.15x, latency 1.02x
    assert choose("ag_matmul", rows=2048, k=14336, n=2048) == "latency"  # one wave: overlap 0.97x, latency 1.10x
    assert choose("ag_matmul", rows=2048, k=28672, n=4096) == "overlap"  # 256 tiles: 1.22x
    assert choose("ag_matmul", rows=2048, k=4096, n=3072) == "overlap"  # 192 tiles: 1.26x, latency 1.18x
    assert choose("matmul_rs", rows=2048, k=2048, n=28672) == "overlap"  # 1.15x (latency 1.03x)
    assert choose("ag_matmul", rows=256, k=8192, n=5120) == "latency"  # 1.21x
    assert choose("ag_matmul", rows=256, k=4096, n=3072) == "decode"  # 8B qkv: 1.54x, latency 1.10x
    assert choose("ag_matmul", rows=256, k=8192, n=4096) == "latency"  # 128 tiles + push: decode 1.18x, latency 1.32x
    assert choose("ag_matmul", rows=192, k=4096, n=3200) == "decode"  # 100 tiles
    assert choose("ag_matmul", rows=192, k=4096, n=3208) == "latency"  # 102 tiles
    assert choose("ag_matmul", rows=264, k=4096, n=1024) == "latency"  # more rows than two tiles
    assert choose("ag_matmul", rows=64, k=4096, n=3072) == "decode"  # 8B qkv: 1.29x, latency 1.12x
    assert choose("ag_matmul", rows=8, k=8192, n=5120) == "decode"  # 70B qkv: 1.14x, latency 1.09x
    assert choose("ag_matmul", rows=128, k=8192, n=5120) == "decode"  # 70B qkv: 1.35x, latency 1.17x
    assert choose("ag_matmul", rows=64, k=4096, n=14336) == "latency"  # 8B gate+up: decode 0.98-1.18x
    assert choose("ag_matmul", rows=16, k=8192, n=28672) == "latency"  # 70B gate+up: 1.05x, decode 0.98x
    assert choose("ag_matmul", rows=64, k=4096, n=3072, dtype=np.dtype(np.float16)) == "latency"  # no f16 decode
    assert choose("ag_matmul", rows=320, k=5120, n=3584) == "latency"  # held out: 1.18x
    assert choose("ag_matmul", rows=12288, k=5120, n=13824) == "xla"  # held out: overlap 0.97-1.01x
    assert choose("ag_matmul", rows=8192, k=4096, n=14336) == "overlap"  # 1.02-1.21x
    assert choose("ag_matmul", rows=16384, k=8192, n=28672) == "overlap"  # 70B gate+up: 1.03x
    assert choose("matmul_rs", rows=4096, k=4096, n=8192) == "overlap"  # 1.42x
    assert choose("matmul_rs", rows=1024, k=4096, n=8192) == "overlap"  # 1.24x (latency 1.10x)
    assert choose("matmul_rs", rows=1024, k=2048, n=4096) == "latency"  # 1.23x (overlap 0.77x)
    assert choose("matmul_rs", rows=16, k=2048, n=4096) == "decode"  # 8B out-proj: 1.30x, latency 1.22x
    assert choose("matmul_rs", rows=16, k=14336, n=8192) == "decode"  # 70B down: 1.08x, latency 1.06x
    assert choose("matmul_rs", rows=128, k=2048, n=4096) == "decode"  # 8B out-proj: 1.45-1.53x, latency 1.22-1.25x
    assert choose("matmul_rs", rows=128, k=4096, n=8192) == "latency"  # 70B out-proj: 1.21-1.23x, decode 1.18-1.20x
    assert choose("matmul_rs", rows=128, k=7168, n=4096) == "latency"  # 8B down: 1.14-1.16x, decode 1.03-1.13x
    assert choose("matmul_rs", rows=96, k=2560, n=5120) == "decode"  # held out: latency 1.32x; weight 13M
    assert choose("matmul_rs", rows=96, k=2560, n=8192) == "latency"  # weight 21M: as at 128 rows
    assert choose("matmul_rs", rows=64, k=4096, n=8192) == "decode"  # 70B out-proj: 1.27-1.36x, latency 1.13-1.16x
    assert choose("matmul_rs", rows=8, k=7168, n=4096) == "decode"  # 8B down: 1.19x, latency 1.21x (a tie)
    assert choose("matmul_rs", rows=64, k=4096, n=8192, dtype=np.dtype(np.float16)) == "latency"  # no f16 decode
    assert choose("matmul_rs", rows=256, k=4096, n=8192) == "latency"  # 1.38-1.40x
    assert choose("ag_matmul", rows=8192, k=8192, n=2048, tp=4) == "xla"  # never measured
    assert choose("ag_matmul", rows=8192, k=8192, n=4096, dtype=np.dtype(np.float32)) == "xla"
    # impl="fused" on a shape where the twin wins still runs the better fused path.
    assert _auto_rule.best_fused_path("ag_matmul", 2, 256, 8192, 5120, bf16) == "latency"
    assert _auto_rule.best_fused_path("matmul_rs", 2, 8192, 8192, 8192, bf16) == "overlap"


def test_explain_auto_names_the_choice_and_the_reason():
    assert "fused, overlap path" in flux_jax.explain_auto("ag_matmul", 4096, 8192, 8192, 2)
    assert "fused, latency path" in flux_jax.explain_auto("matmul_rs", 256, 4096, 4096, 2)
    assert "fused, decode path" in flux_jax.explain_auto("ag_matmul", 64, 8192, 10240, 2)
    assert "reduce-scatters each output tile" in flux_jax.explain_auto("matmul_rs", 64, 8192, 8192, 2)
    assert "128 output tiles" in flux_jax.explain_auto("ag_matmul", 2048, 14336, 4096, 2)
    assert "tp=8 has not been measured" in flux_jax.explain_auto("ag_matmul", 8192, 8192, 57344, 8)
    assert "the CUDA kernels take bfloat16 or float16" in flux_jax.explain_auto(
        "ag_matmul", 4096, 8192, 8192, 2, "float32"
    )
    assert "multiples of 8" in flux_jax.explain_auto("ag_matmul", 4096, 8192, 8196, 2)
    assert "fused, latency path" in flux_jax.explain_auto("matmul_rs", 128, 28672, 8192, 2)  # 70B down
    assert "small share of this wide GEMM" in flux_jax.explain_auto("ag_matmul", 12288, 5120, 27648, 2)
    with pytest.raises(ValueError, match="cannot shard"):
        flux_jax.explain_auto("matmul_rs", 4096, 8191, 8192, 2)
    with pytest.raises(ValueError, match="op must be"):
        flux_jax.explain_auto("matmul", 4096, 8192, 8192, 2)
    with pytest.raises(TypeError, match="M must be an int, got '4096'"):
        flux_jax.explain_auto("ag_matmul", "4096", 8192, 8192, 2)
    with pytest.raises(TypeError, match="tp must be an int, got True"):
        flux_jax.explain_auto("ag_matmul", 4096, 8192, 8192, True)
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        flux_jax.explain_auto("ag_matmul", 4096, 8192, 8192, 2, fp8="yes")


def test_explain_auto_plans_the_path_for_the_gpu_it_is_given():
    """gpu=(SMs, GB/s) scales the built-in table's shape classes to that GPU's SMs, as impl="auto"
    does on it (an H100 PCIe's 114 SMs: fewer row tiles to hide the transfer under)."""
    shape = ("ag_matmul", 2048, 4096, 6144, 2)
    assert "fused, overlap path" in flux_jax.explain_auto(*shape, gpu=(132, 4800))
    assert "fused, latency path" in flux_jax.explain_auto(*shape, gpu=(114, 2000))


@pytest.mark.skipif(
    not hasattr(_native.extension(), "cuda_auto_gemm_plan"), reason="the GEMM rule is in CUDA builds only"
)
def test_explain_names_the_overlap_gemm_instance():
    """On a GPU's overlap path explain says which GEMM instance op_common.h's rule runs, for the
    GEMM each handler launches (ag_matmul: every rank's rows; matmul_rs: one rank's share), on the
    GPU's SMs and DRAM bandwidth (an H200's without a GPU)."""
    text = flux_jax.explain_auto("ag_matmul", 4096, 8192, 8192, 2)
    assert text.endswith(
        "; overlap GEMM: cooperative 128x256 tiles, row tiles in groups of 16 (132 SMs, 4.8 TB/s DRAM, assumed)"
    ), text
    assert "overlap GEMM" not in flux_jax.explain_auto("matmul_rs", 256, 4096, 4096, 2)  # latency path
    h200, h100 = (132, 4800), (132, 3352)
    bf16 = np.dtype(jnp.bfloat16)
    dx = _plan.Problem("matmul_rs", 4096, 4096, 7168, bf16, 2, "cuda", transpose_w=True)  # 8B down dx
    assert _overlap_gemm.gemm_rows(dx) == (2048, 2048)
    assert "cooperative 128x224 tiles, row tiles in groups of 16 (132 SMs, 4.8 TB/s DRAM)" in _overlap_gemm.describe(
        dx, h200
    )
    ag = _plan.Problem("ag_matmul", 2048, 2560, 5120, bf16, 2, "cuda")
    assert _overlap_gemm.gemm_rows(ag) == (2048, 1024)
    for gpu in (h200, h100):  # at 2048 rows the waves decide, on either GPU
        assert "ping-pong 128x128 tiles in 2x1 clusters, row tiles in groups of 8" in _overlap_gemm.describe(ag, gpu)
    # 8B out-proj, 8192 rows: ping-pong 128x128 where the DRAM is an H200's, 128x192 on an H100
    out_proj = _plan.Problem("ag_matmul", 8192, 2048, 4096, bf16, 2, "cuda")
    assert "ping-pong 128x128 tiles" in _overlap_gemm.describe(out_proj, h200)
    assert "ping-pong 128x192 tiles" in _overlap_gemm.describe(out_proj, h100)
    assert _overlap_gemm.describe(out_proj, h100).endswith("(132 SMs, 3.4 TB/s DRAM)")
    two_shot = _plan.Problem("matmul_ar", 4096, 2560, 5120, bf16, 2, "cuda")
    one_call = _plan.Problem("matmul_ar", 512, 2560, 5120, bf16, 2, "cuda")  # below the two-shot's rows
    assert _overlap_gemm.gemm_rows(two_shot) == (2048, 2048) and _overlap_gemm.gemm_rows(one_call) == (512, 512)
    # FP8 matmul_ar's overlap is always matmul_rs's FP8 call and an all_gather: it plans matmul_rs's
    # GEMM (on an H100, 4096 x 2048 x 4096 runs ping-pong 128x128 where 8192 rows would run 128x192)
    for rows in (512, 8192):
        fp8_ar = _plan.Problem("matmul_ar", rows, 2048, 4096, bf16, 2, "cuda", fp8="float8_e4m3fn")
        fp8_rs = dataclasses.replace(fp8_ar, op="matmul_rs")
        assert _overlap_gemm.gemm_rows(fp8_ar) == _overlap_gemm.gemm_rows(fp8_rs) == (rows // 2, rows // 2)
        assert _overlap_gemm.describe(fp8_ar, h100) == _overlap_gemm.describe(fp8_rs, h100)
    fp8_ar = _plan.Problem("matmul_ar", 8192, 2048, 4096, bf16, 2, "cuda", fp8="float8_e4m3fn")
    assert "ping-pong 128x128 tiles" in _overlap_gemm.describe(fp8_ar, h100)
    # explain_auto plans for another GPU on request (an 8192 x 2048 x 4096 GEMM per GPU)
    on_h100 = flux_jax.explain_auto("ag_matmul", 8192, 2048, 8192, 2, gpu=h100)
    h100_instance = "ping-pong 128x192 tiles in 2x1 clusters, row tiles in groups of 8 (132 SMs, 3.4 TB/s DRAM)"
    assert on_h100.endswith(h100_instance), on_h100
    assert "ping-pong 128x128 tiles" in flux_jax.explain_auto("ag_matmul", 8192, 2048, 8192, 2, gpu=h200)
    for bad in ((132,), (132, 0), [132, 3352], (132.0, 3352), (True, 3352), "h100"):
        with pytest.raises(TypeError, match="gpu must be"):
            flux_jax.explain_auto("ag_matmul", 8192, 2048, 8192, 2, gpu=bad)
    assert _overlap_gemm.describe(_plan.Problem("ag_matmul", 2048, 256, 256, np.dtype(np.float32), 2, "cuda")) is None
    with _config.gpu_tuning(gemm_kernel="128x192"):
        assert _overlap_gemm.describe(ag, h200) == "overlap GEMM: as GpuTuning forces it (gemm_kernel='128x192')"
    # tile_n forces the 16-bit rows' tile; FP8 rows keep their rule under it (op_common.h:
    # ChooseFp8GemmInstance); gemm_kernel forces either row format's instance
    fp8_ag = dataclasses.replace(ag, fp8="float8_e4m3fn")
    e5m2_ag = dataclasses.replace(ag, fp8="float8_e5m2")
    rule = _overlap_gemm.describe(fp8_ag, h200)
    with _config.gpu_tuning(tile_n=192):
        assert _overlap_gemm.describe(ag, h200) == "overlap GEMM: as GpuTuning forces it (tile_n=192)"
        assert _overlap_gemm.describe(fp8_ag, h200) == rule and "ping-pong 128x128" in rule
    with _config.gpu_tuning(gemm_kernel="128x160_pp_c2x1"):
        for call in (fp8_ag, e5m2_ag):
            assert "forces it (gemm_kernel='128x160_pp_c2x1')" in _overlap_gemm.describe(call, h200)
    with _config.gpu_tuning(tile_group_m=4):
        assert _overlap_gemm.describe(ag, h200).endswith("groups of 4 (132 SMs, 4.8 TB/s DRAM)")


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs", "matmul_ar"])
def test_explain_auto_at_tp_1_says_there_is_nothing_to_overlap(op, fp8):
    """A mesh axis of size 1 moves no data: auto takes the twin, says why, and does not send the
    user to the tuner (which refuses TP=1)."""
    for rows in (8, 4096):
        text = flux_jax.explain_auto(op, rows, 4096, 4096, 1, fp8=fp8)
        assert "the XLA twin" in text and "no communication to overlap" in text, text
        assert "flux_jax.tune" not in text and "not been measured" not in text and "tp > 1" not in text, text


def test_auto_at_tp_1_takes_the_twin_and_fused_still_runs():
    cfg = flux_jax.Config()
    for platform in ("cpu", "cuda"):
        problem = _problem("ag_matmul", 64, 64, 64, platform=platform, tp=1)
        plan = _plan.plan(problem, "auto", cfg, on_hopper=platform == "cuda")
        assert plan.path == "twin" and plan.decided_by == "TP size", plan
    cpu = _problem("matmul_rs", 64, 64, 64, platform="cpu", tp=1)
    assert _plan.plan(cpu, "fused", cfg).path == "overlap"  # the kernels' cost without peers
    assert _plan.plan(cpu, "auto", cfg, backward=True).path == "overlap"
    assert _plan.plan(cpu, "auto", flux_jax.Config(fused_path="latency")).path == "latency"


def test_set_gpu_tuning_checks_what_it_installs():
    """The process-wide GPU tuning gets the checks of GpuTuning(...): anything else is an error
    when it is set, not a failure in a later lowering."""
    before = _config.get_gpu_tuning()
    for bad in ({"tile_n": 192}, "tile_n=192", None):
        with pytest.raises(TypeError, match=r"set_gpu_tuning expects a flux_jax._config.GpuTuning, got"):
            _config.set_gpu_tuning(bad)
    altered = _config.GpuTuning()
    object.__setattr__(altered, "tile_n", 100)  # frozen, yet alterable
    with pytest.raises(ValueError, match=r"GpuTuning.tile_n must be 0 \(by waves\), 192 or 256, got 100"):
        _config.set_gpu_tuning(altered)
    assert _config.get_gpu_tuning() == before  # nothing was installed
    _config.set_gpu_tuning(_config.GpuTuning(tile_n=192))
    assert _config.get_gpu_tuning() == _config.GpuTuning(tile_n=192)


def test_explain_lists_every_call_site_with_its_plan():
    mesh = cpu_mesh((8,), ("tp",), AxisType.Auto)

    def block(x, w1, w2):
        h = flux_jax.ag_matmul(x, w1, axis_name="tp", impl="fused")
        return flux_jax.matmul_rs(jnp.tanh(h), w2, axis_name="tp")

    f = jax.shard_map(block, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P("tp"))
    sites = flux_jax.explain(f, _zeros((16, 8)), _zeros((8, 16)), _zeros((16, 8)))
    assert [s.op for s in sites] == ["ag_matmul", "matmul_rs"]
    assert sites[0].plan.path == "overlap" and sites[1].plan.path == "twin"
    assert "fused, overlap path" in str(sites) and "the XLA twin" in str(sites)
    grads = flux_jax.explain(
        jax.grad(lambda *a: f(*a).sum(), argnums=1), _zeros((16, 8)), _zeros((8, 16)), _zeros((16, 8))
    )
    assert any(s.backward and s.op == "matmul_rs" for s in grads)  # ag_matmul's backward
    assert any(not s.backward and s.op == "ag_matmul" for s in grads)  # and the forward, traced before
    # A function that already ran (JAX traced and compiled it) is traced afresh.
    jitted = jax.jit(f)
    jitted(_zeros((16, 8)), _zeros((8, 16)), _zeros((16, 8)))
    for _ in range(2):
        again = flux_jax.explain(jitted, _zeros((16, 8)), _zeros((8, 16)), _zeros((16, 8)))
        assert [s.op for s in again] == ["ag_matmul", "matmul_rs"], str(again)
