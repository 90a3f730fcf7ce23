"""Bad input fails in Python, before anything is traced or launched, with a
message that names the argument and the shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import flux_jax
from helpers import cpu_mesh

MESH = None


def _run(fn, x, w, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"), mesh=None, **kw):
    mesh = mesh or cpu_mesh((8,), ("tp",), AxisType.Auto)
    f = jax.shard_map(functools.partial(fn, **kw), mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    return jax.jit(f)(x, w)


def _zeros(shape, dtype=jnp.float32):
    return jnp.ones(shape, dtype)


OPS = [flux_jax.ag_matmul, flux_jax.matmul_rs]


@pytest.mark.parametrize("fn", OPS)
def test_contraction_mismatch(fn):
    with pytest.raises(ValueError, match=r"contraction mismatch: x float32\[\d+, 16\] has K=16 but w float32\[12, \d+\]"):
        _run(fn, _zeros((16, 16)), _zeros((12, 16)), in_specs=(P(), P()), out_specs=P(), axis_name="tp")


@pytest.mark.parametrize("fn", OPS)
def test_rank_below_two(fn):
    with pytest.raises(ValueError, match=r"x must have rank >= 2.*got x float32\[16\]"):
        _run(fn, _zeros((16,)), _zeros((16, 8)), in_specs=(P(), P()), out_specs=P(), axis_name="tp")
    with pytest.raises(ValueError, match=r"w must have rank 2.*got w float32\[16, 8, 2\]"):
        _run(fn, _zeros((16, 16)), _zeros((16, 8, 2)), in_specs=(P(), P()), out_specs=P(), axis_name="tp")


@pytest.mark.parametrize("fn", OPS)
def test_mixed_dtypes_are_not_promoted(fn):
    with pytest.raises(TypeError, match=r"same dtype \(no silent promotion\), got x bfloat16\[16, 16\] and w float32\[16, 8\]"):
        _run(fn, _zeros((16, 16), jnp.bfloat16), _zeros((16, 8)), in_specs=(P(), P()), out_specs=P(), axis_name="tp")


@pytest.mark.parametrize("fn", OPS)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float8_e4m3fn])
def test_unsupported_dtype(fn, dtype):
    with pytest.raises(TypeError, match=r"unsupported dtype .*supported: float32, bfloat16, float16"):
        _run(fn, _zeros((16, 16), dtype), _zeros((16, 8), dtype), in_specs=(P(), P()), out_specs=P(), axis_name="tp")


def test_matmul_rs_rows_not_divisible():
    with pytest.raises(ValueError, match=r"leading dimension of x float32\[12, 16\] \(12 rows\) must be divisible by the size of axis 'tp' \(8\)"):
        _run(flux_jax.matmul_rs, _zeros((12, 16)), _zeros((16, 8)), in_specs=(P(), P()), out_specs=P(), axis_name="tp")


@pytest.mark.parametrize("fn", OPS)
def test_unknown_impl(fn):
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'fused', 'xla'\), got 'cuda'"):
        _run(fn, _zeros((16, 16)), _zeros((16, 8)), axis_name="tp", impl="cuda")


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
    with pytest.raises(ValueError, match=r"axis_name must be the name \(str\) of one mesh axis"):
        _run(fn, _zeros((16, 16)), _zeros((16, 8)), in_specs=(P(), P()), out_specs=P(), axis_name=("tp",))


@pytest.mark.parametrize("fn", OPS)
def test_fused_where_it_cannot_run_partial_manual(fn):
    """shard_map manual over tp only, dp left to the partitioner: fused refuses, auto falls back."""
    mesh = cpu_mesh((2, 4), ("dp", "tp"), AxisType.Auto)
    specs = (P("tp"), P(None, "tp")) if fn is flux_jax.ag_matmul else (P(None, "tp"), P("tp"))
    out = P(None, "tp") if fn is flux_jax.ag_matmul else P("tp")

    def call(impl):
        f = jax.shard_map(functools.partial(fn, axis_name="tp", impl=impl), mesh=mesh, in_specs=specs,
                          out_specs=out, axis_names={"tp"})
        return jax.jit(f)(_zeros((16, 16)), _zeros((16, 16)))

    with pytest.raises(flux_jax.FusedUnavailableError, match=r'impl="fused"\) cannot run here: .*automatic partitioner'):
        call("fused")
    np.testing.assert_allclose(np.asarray(call("auto")), 16.0)  # falls back to the twin


def test_config_validation():
    with pytest.raises(ValueError, match="timeout_s"):
        flux_jax.Config(timeout_s=0)
    with pytest.raises(ValueError, match="debug_jitter_us"):
        flux_jax.Config(debug_jitter_us=-1)
    with pytest.raises(TypeError, match="flux_jax.Config"):
        flux_jax.set_config({"timeout_s": 1})
    for bad in (-1, 17, 2.0):
        with pytest.raises(ValueError, match="gpu_rs_stage_launches"):
            flux_jax.Config(gpu_rs_stage_launches=bad)
    assert flux_jax.Config(gpu_rs_stage_launches=0).gpu_rs_stage_launches == 0
    for bad in (128, -1, 192.0, True):
        with pytest.raises(ValueError, match="gpu_tile_n"):
            flux_jax.Config(gpu_tile_n=bad)
    assert flux_jax.Config(gpu_tile_n=192).gpu_tile_n == 192
    for bad in (-2, 3, True, 1.0):
        with pytest.raises(ValueError, match="gpu_rs_tile_signal"):
            flux_jax.Config(gpu_rs_tile_signal=bad)
    assert flux_jax.Config(gpu_rs_tile_signal=2).gpu_rs_tile_signal == 2
    assert flux_jax.Config().gpu_rs_tile_signal == -1  # automatic


def test_gpu_tuning_fields_reach_the_kernel_attributes():
    """Every GPU tuning field travels as a custom-call attribute that the handlers decode
    (the CPU handler decodes the same set, so a missing one fails here, not only on GPU)."""
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 48)), jnp.float32)
    f = jax.jit(jax.shard_map(functools.partial(flux_jax.matmul_rs, axis_name="tp", impl="fused"), mesh=mesh,
                              in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None)))
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "tp")))
    ws = jax.device_put(w, NamedSharding(mesh, P("tp", None)))
    with flux_jax.config(gpu_rs_stage_launches=0, gpu_piece_bytes=4096, gpu_tile_group_m=2, gpu_tile_n=192,
                         gpu_rs_tile_signal=2):
        hlo = f.lower(xs, ws).as_text()
        out = f(xs, ws)
    for attr in ("rs_stage_launches = 0", "piece_bytes = 4096", "tile_group_m = 2", "tile_n = 192",
                 "rs_tile_signal = 2"):
        assert attr in hlo, attr
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) @ np.asarray(w), rtol=1e-4, atol=1e-4)


def test_parse_overrides_for_tools_and_test_tuning():
    from flux_jax._config import parse_overrides

    got = parse_overrides(" gpu_tile_group_m=16, fused_path = latency,debug_drop_rank=-1,")
    assert got == {"gpu_tile_group_m": 16, "fused_path": "latency", "debug_drop_rank": -1}
    assert flux_jax.Config(**got).fused_path == "latency"
    assert parse_overrides("") == {}
    got = parse_overrides("debug_poison_outputs=True")
    assert got == {"debug_poison_outputs": True}
    assert flux_jax.Config(**got).debug_poison_outputs is True
    assert parse_overrides("debug_poison_outputs=false") == {"debug_poison_outputs": False}
    with pytest.raises(ValueError, match="expected name=value"):
        parse_overrides("gpu_tile_group_m")


def test_build_info_reports_the_build():
    info = flux_jax.build_info()
    assert info["jaxlib_headers"] == "0.11.2"
    assert info["ffi_api_version"] == "0.4"
    assert isinstance(info["cuda"], bool)
    assert info["cuda"] == bool(info["cuda_archs"])
    if info["cuda"]:
        assert "sm_90a" in info["cuda_archs"]


def test_fused_without_a_kernel_for_the_platform_is_a_clear_error():
    from flux_jax import _dispatch, _validation

    gpu = _validation.AxisInfo("tp", 2, "cuda", True)
    if "ag_matmul" not in flux_jax.build_info()["cuda_kernels"]:
        with pytest.raises(flux_jax.FusedUnavailableError, match=r"cannot run here: this flux_jax build was compiled"):
            _dispatch.resolve("ag_matmul", "fused", gpu, 64, 64, 64, jnp.bfloat16)
        assert _dispatch.resolve("ag_matmul", "auto", gpu, 64, 64, 64, jnp.bfloat16) == "xla"
    tpu = _validation.AxisInfo("tp", 2, "tpu", True)
    with pytest.raises(flux_jax.FusedUnavailableError, match="no fused kernel for platform 'tpu'"):
        _dispatch.resolve("matmul_rs", "fused", tpu, 64, 64, 64, jnp.bfloat16)


def test_auto_uses_the_twin_on_cpu():
    from flux_jax import _dispatch, _validation

    cpu = _validation.AxisInfo("tp", 8, "cpu", True)
    assert _dispatch.resolve("ag_matmul", "auto", cpu, 4096, 4096, 4096, jnp.bfloat16) == "xla"
    assert _dispatch.resolve("ag_matmul", "fused", cpu, 4096, 4096, 4096, jnp.bfloat16) == "fused"


def test_auto_gpu_policy_follows_the_measured_table():
    import numpy as np

    from flux_jax import _heuristics

    bf16 = np.dtype(jnp.bfloat16)
    choose = functools.partial(_heuristics.choose, tp=2, dtype=bf16)
    # (op, global M, per-rank k, per-rank n) -> the winner measured on 2x H200 (see _heuristics)
    assert choose("ag_matmul", rows=4096, k=8192, n=4096) == "overlap"  # 1.40x
    assert choose("ag_matmul", rows=8192, k=8192, n=14336) == "overlap"  # 1.03x, latency 1.01x
    assert choose("matmul_rs", rows=8192, k=2048, n=28672) == "overlap"  # 1.15x, latency 1.02x
    assert choose("ag_matmul", rows=2048, k=14336, n=2048) == "latency"  # one wave: overlap 0.97x, latency 1.10x
    assert choose("ag_matmul", rows=2048, k=28672, n=4096) == "overlap"  # 256 tiles: 1.22x
    assert choose("ag_matmul", rows=2048, k=4096, n=3072) == "overlap"  # 192 tiles: 1.26x, latency 1.18x
    assert choose("matmul_rs", rows=2048, k=2048, n=28672) == "overlap"  # 1.15x (latency 1.03x)
    assert choose("ag_matmul", rows=256, k=8192, n=5120) == "latency"  # 1.21x
    assert choose("ag_matmul", rows=256, k=4096, n=3072) == "decode"  # 8B qkv: 1.54x, latency 1.10x (s16)
    assert choose("ag_matmul", rows=256, k=8192, n=4096) == "latency"  # 128 tiles + push: decode 1.18x, latency 1.32x
    assert choose("ag_matmul", rows=192, k=4096, n=3200) == "decode"  # 100 tiles
    assert choose("ag_matmul", rows=192, k=4096, n=3208) == "latency"  # 102 tiles
    assert choose("ag_matmul", rows=264, k=4096, n=1024) == "latency"  # more rows than two tiles
    assert choose("ag_matmul", rows=64, k=4096, n=3072) == "decode"  # 8B qkv: 1.29x, latency 1.12x (s14)
    assert choose("ag_matmul", rows=8, k=8192, n=5120) == "decode"  # 70B qkv: 1.14x, latency 1.09x (s14)
    assert choose("ag_matmul", rows=128, k=8192, n=5120) == "decode"  # 70B qkv: 1.35x, latency 1.17x (s14)
    assert choose("ag_matmul", rows=64, k=4096, n=14336) == "latency"  # 8B gate+up: decode 0.98-1.18x (s14)
    assert choose("ag_matmul", rows=16, k=8192, n=28672) == "latency"  # 70B gate+up: 1.05x, decode 0.98x (s14)
    assert choose("ag_matmul", rows=64, k=4096, n=3072, dtype=np.dtype(np.float16)) == "latency"  # no f16 decode
    assert choose("ag_matmul", rows=320, k=5120, n=3584) == "latency"  # held out: 1.18x
    assert choose("ag_matmul", rows=12288, k=5120, n=13824) == "xla"  # held out: overlap 0.97-1.01x
    assert choose("ag_matmul", rows=8192, k=4096, n=14336) == "overlap"  # 1.02-1.21x
    assert choose("ag_matmul", rows=16384, k=8192, n=28672) == "overlap"  # 70B gate+up: 1.03x
    assert choose("matmul_rs", rows=4096, k=4096, n=8192) == "overlap"  # 1.42x
    assert choose("matmul_rs", rows=1024, k=4096, n=8192) == "overlap"  # 1.24x (latency 1.10x)
    assert choose("matmul_rs", rows=1024, k=2048, n=4096) == "latency"  # 1.23x (overlap 0.77x)
    assert choose("matmul_rs", rows=16, k=2048, n=4096) == "decode"  # 8B out-proj: 1.30x, latency 1.22x (s15)
    assert choose("matmul_rs", rows=16, k=14336, n=8192) == "decode"  # 70B down: 1.08x, latency 1.06x (s15)
    assert choose("matmul_rs", rows=128, k=2048, n=4096) == "decode"  # 8B out-proj: 1.45-1.53x, latency 1.22-1.25x
    assert choose("matmul_rs", rows=128, k=4096, n=8192) == "latency"  # 70B out-proj: 1.21-1.23x, decode 1.18-1.20x
    assert choose("matmul_rs", rows=128, k=7168, n=4096) == "latency"  # 8B down: 1.14-1.16x, decode 1.03-1.13x
    assert choose("matmul_rs", rows=96, k=2560, n=5120) == "decode"  # held out: latency 1.32x (s12); weight 13M
    assert choose("matmul_rs", rows=96, k=2560, n=8192) == "latency"  # weight 21M: as at 128 rows
    assert choose("matmul_rs", rows=64, k=4096, n=8192) == "decode"  # 70B out-proj: 1.27-1.36x, latency 1.13-1.16x
    assert choose("matmul_rs", rows=8, k=7168, n=4096) == "decode"  # 8B down: 1.19x, latency 1.21x (a tie, s15)
    assert choose("matmul_rs", rows=64, k=4096, n=8192, dtype=np.dtype(np.float16)) == "latency"  # no f16 decode
    assert choose("matmul_rs", rows=256, k=4096, n=8192) == "latency"  # 1.38-1.40x (s13)
    assert _heuristics.fused_is_faster("matmul_rs", 2, 64, 2048, 4096, bf16)
    assert not _heuristics.fused_is_faster("ag_matmul", 4, 8192, 8192, 2048, bf16)  # never measured
    assert not _heuristics.fused_is_faster("ag_matmul", 2, 8192, 8192, 4096, np.dtype(np.float32))
    # impl="fused" on a shape where the twin wins still runs the better fused path.
    assert _heuristics.best_fused_path("ag_matmul", 2, 256, 8192, 5120, bf16) == "latency"
    assert _heuristics.best_fused_path("matmul_rs", 2, 8192, 8192, 8192, bf16) == "overlap"


def test_explain_auto_names_the_choice_and_the_reason():
    assert "fused, overlap path" in flux_jax.explain_auto("ag_matmul", 4096, 8192, 8192, 2)
    assert "fused, latency path" in flux_jax.explain_auto("matmul_rs", 256, 4096, 4096, 2)
    assert "fused, decode path" in flux_jax.explain_auto("ag_matmul", 64, 8192, 10240, 2)
    assert "reduce-scatters each output tile" in flux_jax.explain_auto("matmul_rs", 64, 8192, 8192, 2)
    assert "128 output tiles" in flux_jax.explain_auto("ag_matmul", 2048, 14336, 4096, 2)
    assert "tp=8 has not been measured" in flux_jax.explain_auto("ag_matmul", 8192, 8192, 57344, 8)
    assert "no float32 kernels" in flux_jax.explain_auto("ag_matmul", 4096, 8192, 8192, 2, "float32")
    assert "multiples of 8" in flux_jax.explain_auto("ag_matmul", 4096, 8192, 8196, 2)
    assert "fused, latency path" in flux_jax.explain_auto("matmul_rs", 128, 28672, 8192, 2)  # 70B down
    assert "small share of this wide GEMM" in flux_jax.explain_auto("ag_matmul", 12288, 5120, 27648, 2)
    with pytest.raises(ValueError, match="cannot shard"):
        flux_jax.explain_auto("matmul_rs", 4096, 8191, 8192, 2)
    with pytest.raises(ValueError, match="op must be"):
        flux_jax.explain_auto("matmul", 4096, 8192, 8192, 2)
