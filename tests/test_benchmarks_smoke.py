"""CPU smoke run of the benchmark harness (benchmarks/): end to end, in seconds.

Runs `python -m benchmarks.run` in-process on the cpu-smoke preset (its M=64 shapes, all three
ops: ag, rs and ar) with a
few variants (two of them GPU-only, so they must show up as unavailable rows) and short loops,
and checks the JSON, the markdown table, the plots and the RESULTS.md writer; then checks
the ring collective matmuls against the twin at tp=8.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import run
from benchmarks.harness import run_case
from benchmarks.presets import Case
from benchmarks.report import ROW_KEYS
from benchmarks.results_page import write_results_page
from benchmarks.timing import TimingParams
from benchmarks.windowed import WindowedEinsum
from flux_jax import _native

SHORT_LOOPS = ["--repeats", "3", "--n1", "2", "--target-ms", "20", "--max-calls", "2000"]
VARIANTS = ["flux_fused", "xla_shard_map", "xla_jit", "xla_windowed_einsum", "pallas_mgpu", "gemm_only", "comm_only"]
META_KEYS = (
    "preset",
    "tp",
    "command",
    "git_commit",
    "date_utc",
    "hardware",
    "versions",
    "flux_jax_build_info",
    "timing",
)


def test_cpu_smoke_run_writes_complete_results(tmp_path):
    argv = ["--preset", "cpu-smoke", "--op", "all", "--m", "64", "--variants", ",".join(VARIANTS)]
    argv += ["--out", str(tmp_path)]
    run.main(argv + SHORT_LOOPS)

    data = json.loads((tmp_path / "cpu-smoke_m64.json").read_text())
    meta, rows = data["metadata"], data["rows"]
    assert all(meta[key] is not None for key in META_KEYS)
    assert meta["hardware"]["platform"] == "cpu" and meta["tp"] == 8
    assert len(rows) == 3 * len(VARIANTS)  # M=64 for ag, rs and ar, one row per variant
    for row in rows:
        assert set(ROW_KEYS) <= set(row), f"missing keys {set(ROW_KEYS) - set(row)}"
        assert row["status"] == "ok" or row["status"].startswith("unavailable: "), row
    by = {(r["op"], r["M"], r["variant"]): r for r in rows}
    for op in ("ag", "rs", "ar"):
        assert by[op, 64, "pallas_mgpu"]["status"].startswith("unavailable: ")
        assert by[op, 64, "xla_windowed_einsum"]["status"].startswith("unavailable: GPU only")
        assert by[op, 64, "flux_fused"]["status"] == "ok"
        assert by[op, 64, "xla_shard_map"]["speedup_vs_xla_shard_map"] == pytest.approx(1.0)
        assert by[op, 64, "flux_fused"]["overlap_efficiency"] is not None
    for row in rows:
        if row["status"] == "ok":
            assert row["ms"] > 0 and row["ms_min"] <= row["ms"] <= row["ms_max"]
            assert row["max_rel_err"] < 2e-2
            assert row["n2"] > row["n1"] >= 2

    table = (tmp_path / "cpu-smoke_m64.md").read_text()
    assert "| op | layer | M | K | N |" in table and "flux_fused speedup" in table
    for name in ("cpu-smoke_m64_speedup.png", "cpu-smoke_m64_time_split.png"):
        assert (tmp_path / name).stat().st_size > 10_000

    page = write_results_page(
        [tmp_path / "cpu-smoke_m64.json"],
        page=tmp_path / "RESULTS.md",
        figures=tmp_path / "figures",
        allow_non_gpu=True,
    )
    text = page.read_text()
    assert meta["git_commit"] in text and "](figures/cpu-smoke_m64_speedup.png)" in text
    assert (tmp_path / "figures" / "cpu-smoke_m64_time_split.png").exists()


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_ring_variants_match_the_twin(op):
    case = Case(op, 32, 48, 96, 8, "bfloat16", "ring test")
    rows = run_case(
        case,
        ["xla_shard_map", "jax_ring", "jax_ring_bidi"],
        seed=1,
        params=TimingParams(n1=1, target_ms=0.1, max_calls=2, repeats=1),
        windowed=WindowedEinsum(),
    )
    for row in rows:
        assert row["max_rel_err"] is not None and row["max_rel_err"] < 2e-2, row


def test_gpu_state_reading_parses_nvidia_smi_and_rejects_junk():
    from benchmarks import gpu_state

    reading = gpu_state.parse("1980, 650.25, 61\n1755, 701.00, 66\n")
    # the slowest clock paces the group; the hottest / hungriest GPU is reported
    assert reading == {"sm_mhz": 1755.0, "power_w": 701.0, "temp_c": 66.0}
    assert gpu_state.parse("[N/A], 650, 61\n") is None
    assert gpu_state.parse("1980, 650\n") is None
    assert gpu_state.parse("") is None
    assert gpu_state.columns([None, None]) == {}
    cols = gpu_state.columns([reading, None])
    assert cols == {"sm_mhz": [1755.0, None], "power_w": [701.0, None], "temp_c": [66.0, None]}


def test_round_order_is_a_seeded_shuffle_that_changes_neighbours():
    from benchmarks.harness import round_order

    orders = [round_order(7, r) for r in range(5)]
    assert all(sorted(o) == list(range(7)) for o in orders)
    assert orders == [round_order(7, r) for r in range(5)], "runs must repeat"

    def follows(order):
        return {(order[i - 1], order[i]) for i in range(1, len(order))}

    # a rotation keeps every (predecessor, variant) pair; the shuffle must not
    assert len(set.union(*(follows(o) for o in orders))) > len(follows(orders[0])) + 6


def test_preheat_runs_the_long_loop_for_the_requested_time(monkeypatch):
    """Runs until the runs' own wall time reaches preheat_ms (each run's time counted as
    measured; a fixed 4 ms here, so the count does not depend on the machine's load)."""
    from benchmarks import timing
    from benchmarks.timing import LoopTimer

    calls = []
    monkeypatch.setattr(timing, "_wall", lambda f, args: calls.append(f) or 0.004)
    timer = LoopTimer.__new__(LoopTimer)  # the loops themselves do not matter here
    timer._f2, timer._args = object(), ()
    timer._params = TimingParams(n1=1, target_ms=1, max_calls=2, repeats=1, preheat_ms=10)
    assert timer.preheat() == 3 and calls == [timer._f2] * 3  # 4 + 4 + 4 ms >= 10 ms
    timer._params = TimingParams(n1=1, target_ms=1, max_calls=2, repeats=1, preheat_ms=0)
    assert timer.preheat() == 0 and len(calls) == 3


@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_grad_mode_times_the_training_step_and_checks_dx(op, monkeypatch):
    """--grad: every step returns dx = ct @ w^T (every op), checked against a float32 reference.
    Each sample reads a fixed 0.1 ms per call: loops this small can drown in a busy host's noise
    (T(n2) - T(n1) <= 0), and the loop timing has tests of its own."""
    import jax
    import numpy as np

    from benchmarks import variants
    from benchmarks.data import case_rng, make_xw, random_normal, rel_max_err
    from benchmarks.timing import LoopTimer

    monkeypatch.setattr(LoopTimer, "sample", lambda self: 1e-4)

    case = Case(op, 32, 48, 96, 8, "bfloat16", "grad test")
    names = ["flux_fused", "xla_shard_map", "pallas_mgpu", "gemm_only", "comm_only"]
    rows = run_case(
        case,
        names,
        seed=2,
        params=TimingParams(n1=2, target_ms=20, max_calls=400, repeats=3),
        windowed=WindowedEinsum(),
        grad=True,
    )
    by = {r["variant"]: r for r in rows}
    assert by["pallas_mgpu"]["status"].startswith("unavailable: ")
    for name in ("flux_fused", "xla_shard_map", "gemm_only", "comm_only"):
        assert by[name]["status"] == "ok" and by[name]["pass"] == "fwd+bwd", by[name]
        assert by[name]["max_rel_err"] < 2e-2
    # TFLOP/s count three GEMMs of the op's size
    assert by["gemm_only"]["ms"] == pytest.approx(0.1)
    assert by["gemm_only"]["tflops"] == pytest.approx(3 * case.flops_per_gpu / (0.1 * 1e9))

    # The reference itself against float32 numpy, and the checks reject a wrong dx.
    mesh, auto_mesh = variants.make_meshes(case.tp)
    x, w = make_xw(case, 2)
    ctx = variants.CaseContext(case, "cpu", mesh, auto_mesh, x, w, 2, grad=True)
    ctx.ct = random_normal(case_rng(case, 2, "cotangent"), (case.M, case.N), case.dtype)
    twin = variants.xla_shard_map(ctx)
    dx = np.asarray(jax.jit(twin.step)(*twin.args))
    expected = ctx.ct.astype(np.float32) @ w.astype(np.float32).T
    assert dx.shape == (case.M, case.K) and rel_max_err(dx, expected) < 2e-2
    ctx.twin_out = dx
    for name in ("flux_fused", "gemm_only"):
        built = variants.BUILDERS[name](ctx)
        out = np.asarray(jax.jit(built.step)(*built.args))
        assert built.check(out) < 2e-2
        assert built.check(out * 2) > 0.5  # a wrong dx fails


def _load_diagnostic(name):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "diagnostics" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loop_anatomy_reads_a_trace_and_flags_a_host_bound_profile(tmp_path):
    """loop_anatomy.py on a synthetic trace of 2 calls: per device the span, busy time and
    gaps per call, copies apart from kernels, and the host time per call of the busiest loop
    thread; the summary warns when that host time reaches the traced time per call (the
    profiler's host overhead shapes the timeline then) and stays quiet when it is far below."""
    import gzip

    anatomy = _load_diagnostic("loop_anatomy")

    def trace(host_us_per_call):
        meta = [
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "host"}},
        ]
        gpu = []
        for call in range(2):  # each call: gemm 0-80 us, copy 10-40 (overlapping), gemm 85-95; period 100
            t = 100 * call
            gpu += [
                {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "ts": t, "dur": 80},
                {"ph": "X", "pid": 1, "tid": 9, "name": "MemcpyP2P", "ts": t + 10, "dur": 30},
                {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "ts": t + 85, "dur": 10},
            ]
        host = [
            {"ph": "X", "pid": 2, "tid": tid, "name": "while.3", "ts": 0, "dur": 2 * us}
            for tid, us in ((1, host_us_per_call), (2, host_us_per_call / 2))
        ]
        run_dir = tmp_path / f"host{host_us_per_call}" / "plugins" / "profile" / "run"
        run_dir.mkdir(parents=True)
        with gzip.open(run_dir / "perfetto_trace.json.gz", "wt") as f:
            json.dump({"traceEvents": meta + gpu + host}, f)
        return str(tmp_path / f"host{host_us_per_call}")

    quiet = anatomy.read_trace(trace(30.0), calls=2)
    dev = quiet["devices"]["/device:GPU:0"]
    assert dev["per_call_us"] == 97.5 and dev["busy_per_call_us"] == 90.0 and dev["gap_per_call_us"] == 7.5
    assert dev["copies"] == [{"name": "MemcpyP2P", "per_call": 1.0, "mean_us": 30.0}]
    assert quiet["host_loop_per_call_us"] == 30.0
    row = {"case": "rs:8x8x8", "variant": "flux_overlap", "loop_us": 96.0, **quiet}
    assert "HOST-BOUND" not in anatomy.summary_line(row)
    bound = anatomy.read_trace(trace(120.0), calls=2)
    assert bound["host_loop_per_call_us"] == 120.0  # the busier of the two threads
    assert "HOST-BOUND UNDER THE PROFILER" in anatomy.summary_line({**row, **bound})


def test_presets_expand_to_shardable_cases_and_the_holdout_is_disjoint():
    from benchmarks.presets import M_DECODE, M_SWEEP, OPS, PRESETS, select_cases

    for name, preset in PRESETS.items():
        tp = preset.tp or 8
        cases, skipped = select_cases(preset, tp, OPS, None, None)
        assert all(case.invalid_reason() is None for case in cases), name
        # only decode's M = 1 cannot be sharded (documented in benchmarks/README.md)
        assert all(s["M"] == 1 for s in skipped), (name, skipped)
    holdout, _ = select_cases(PRESETS["holdout-tp2"], 2, OPS, None, None)
    tuned = {
        (c.op, c.K, c.N)
        for name in ("llama8b-tp2", "llama70b-tp2", "baselines-tp2", "decode-8192-tp2", "gemm-8192-tp2")
        for c in select_cases(PRESETS[name], 2, OPS, None, None)[0]
    }
    assert len(holdout) == 48
    assert not {c.M for c in holdout} & (set(M_SWEEP) | set(M_DECODE))
    assert not {(c.op, c.K, c.N) for c in holdout} & tuned
    assert any(c.M % 128 for c in holdout)  # row-tile tails


def test_run_notes_flag_tp1_and_cpu_timings():
    from benchmarks.run import run_notes

    assert any("tp=1" in n for n in run_notes(1, "gpu"))
    assert any("do not predict GPU speed" in n for n in run_notes(8, "cpu"))
    assert run_notes(2, "gpu") == []


def _refused(parse, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err


_BAD_LOOPS = (
    (["--target-ms", "nan"], "--target-ms must be a positive finite number, got nan"),
    (["--target-ms", "inf"], "--target-ms must be a positive finite number, got inf"),
    (["--target-ms", "0"], "--target-ms must be a positive finite number, got 0.0"),
    (["--target-ms", "-5"], "--target-ms must be a positive finite number, got -5.0"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--n1", "0"], "--n1 must be >= 1, got 0"),
    (["--n1", "4", "--max-calls", "4"], "--max-calls must be greater than --n1 (4), got 4"),
    (["--preheat-ms", "nan"], "--preheat-ms must be a finite number >= 0, got nan"),
)


def test_run_refuses_bad_loop_options(capsys):
    for argv, message in _BAD_LOOPS:
        _refused(run.parse_args, ["--preset", "cpu-smoke", *argv], message, capsys)


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "grad"])
@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_fp8_cases_run_against_the_fp8_twin(op, grad):
    """dtype "fp8": bf16 operands, the ops with fp8=True; the FP8 twin is the reference, gemm_only
    its FP8 GEMM, comm_only moves the FP8 rows; flux_overlap runs the FP8 overlap kernel (K and N
    per rank aligned); variants without an FP8 form say so."""
    from benchmarks.presets import PRESETS, select_cases

    case = Case(op, 32, 128, 128, 8, "fp8", "fp8 test")
    assert case.fp8 and case.operand_dtype == "bfloat16"
    names = ["flux_fused", "flux_overlap", "xla_shard_map", "jax_ring", "gemm_only", "comm_only"]
    rows = run_case(
        case,
        names,
        seed=3,
        params=TimingParams(n1=2, target_ms=10, max_calls=200, repeats=2),
        windowed=WindowedEinsum(),
        grad=grad,
    )
    by = {r["variant"]: r for r in rows}
    for name in ("flux_fused", "flux_overlap", "xla_shard_map", "gemm_only", "comm_only"):
        # checked against the twin; the timing of such small loops may drown in a busy host's noise
        status = by[name]["status"]
        assert status == "ok" or status.startswith("unavailable: not resolved"), by[name]
        assert by[name]["max_rel_err"] < 2e-2 and by[name]["dtype"] == "fp8"
    assert by["jax_ring"]["status"].startswith("unavailable: no FP8 form"), by["jax_ring"]
    cases, _ = select_cases(PRESETS["llama8b-fp8-tp2"], 2, ("ag", "rs"), (64,), None)
    assert cases and all(c.fp8 for c in cases)


def test_gemm_parity_preset_holds_every_tp2_layer_forward_dx_and_decode():
    """gemm-parity-1gpu: the per-GPU GEMM of every TP=2 layer preset at M = 2048-16384, forward
    and in the dx orientation (the weight read transposed), the forward at decode sizes; shapes
    shared by two layers appear once."""
    from benchmarks.presets import M_PARITY, M_PARITY_DECODE, OPS, PRESETS, select_cases

    cases, skipped = select_cases(PRESETS["gemm-parity-1gpu"], 1, OPS, None, None)
    assert not skipped and all(c.tp == 1 and c.op == "ag" for c in cases)
    keys = [(c.M, c.K, c.N, c.transpose_w) for c in cases]
    assert len(keys) == len(set(keys))
    per_gpu = set()
    for name in ("llama8b-tp2", "llama70b-tp2", "holdout-tp2", "gemm-8192-tp2"):
        for c in select_cases(PRESETS[name], 2, OPS, None, None)[0]:
            per_gpu.add((c.K, c.N // 2) if c.op == "ag" else (c.K // 2, c.N))
    assert {(c.K, c.N) for c in cases if not c.transpose_w} == per_gpu
    assert {(c.N, c.K) for c in cases if c.transpose_w} == per_gpu
    for k, n in per_gpu:
        assert all((m, k, n, False) in keys and (m, n, k, True) in keys for m in M_PARITY)
    decode = {(c.K, c.N) for c in cases if c.M in M_PARITY_DECODE}
    assert decode == per_gpu - {(8192, 8192)} and not any(c.transpose_w for c in cases if c.M < 2048)
    assert "8B qkv" in next(c.layer for c in cases if (c.M, c.K, c.N) == (2048, 4096, 3072))
    assert "Phi3mini down" in next(c.layer for c in cases if (c.M, c.K, c.N) == (2048, 4096, 3072))


def test_dx_case_runs_gemm_only_on_the_transposed_weight():
    """A transposed-weight case (tp=1): gemm_only computes x @ (w stored [N, K])^T, checked
    against the twin; the variants not built for it say so."""
    import jax
    import numpy as np

    from benchmarks import variants

    case = Case("ag", 64, 48, 32, 1, "bfloat16", "dx test", transpose_w=True)
    rows = run_case(
        case,
        ["xla_shard_map", "gemm_only", "flux_fused", "flux_gemm_only"],
        seed=3,
        params=TimingParams(n1=1, target_ms=1, max_calls=50, repeats=1, preheat_ms=0),
        windowed=WindowedEinsum(),
    )
    by = {r["variant"]: r for r in rows}
    # checked against the reference; the timing of such small loops may drown in a busy host's noise
    status = by["gemm_only"]["status"]
    assert status == "ok" or status.startswith("unavailable: not resolved"), status
    assert by["gemm_only"]["max_rel_err"] < 2e-2
    assert by["gemm_only"]["transpose_w"] is True
    assert by["flux_fused"]["status"] == "unavailable: not built for a transposed-weight (dx) case"
    assert by["flux_gemm_only"]["status"].startswith("unavailable: GPU only")
    mesh, auto_mesh = variants.make_meshes(1)
    x, w = variants.make_xw(case, 3)
    ctx = variants.CaseContext(case, "cpu", mesh, auto_mesh, x, w, 3)
    built = variants.gemm_only(ctx)
    assert built.args[1].shape == (case.N, case.K)  # stored as the layer's weight: [N, K]
    out = np.asarray(jax.jit(built.step)(*built.args), np.float32)
    np.testing.assert_allclose(out, x.astype(np.float32) @ w.astype(np.float32), rtol=2e-2, atol=2e-2)


def test_gemm_parity_runner_checks_and_reports_on_cpu(tmp_path):
    """python -m benchmarks.gemm_parity end to end on CPU (XLA and our CPU backend at tp=1),
    forward and dx: every row checked against the float32 reference, JSON and markdown written."""
    from benchmarks import gemm_parity

    rows = gemm_parity.main(
        [
            "--out",
            str(tmp_path),
            "--shapes",
            "64:32:48,64:48:32:dx",
            "--dtypes",
            "bfloat16",
            "--repeats",
            "1",
            "--target-ms",
            "20",
            "--preheat-ms",
            "0",
            "--max-calls",
            "2000",
            "--no-profiler",
            "--energy-s",
            "0.05",
            "--seed",
            "5",
        ]
    )
    assert all(r["energy_mj"] is None for r in rows)  # no NVML counter on CPU: nothing recorded
    assert [(r["orientation"], r["variant"]) for r in rows] == [
        ("fwd", "xla"),
        ("fwd", "flux:auto"),
        ("dx", "xla"),
        ("dx", "flux:auto"),
    ]
    for r in rows:  # checked before timed; a CPU loop may not resolve its time (noise)
        assert r["max_rel_err"] <= r["err_bound"], r
        assert (r["status"] == "ok" and r["us"] > 0) or r["status"].startswith("unavailable: not resolved"), r
    data = json.loads((tmp_path / "gemm_parity.json").read_text())
    assert data["metadata"]["seed"] == 5 and data["metadata"]["left_out_by_preflight"] == {}
    table = (tmp_path / "gemm_parity.md").read_text()
    assert "| 64x48x32 dx bfloat16 |" in table and "best of ours per shape" in table


def test_gemm_parity_summary_by_loop_kernel_time():
    """The kernel-time summary pairs each variant's loop kernel time with XLA's on the same shape
    and leaves out shapes where either was not profiled."""
    from benchmarks import gemm_parity

    def row(m, variant, us, kernel_us):
        return {
            "M": m, "K": 64, "N": 64, "orientation": "fwd", "dtype": "bfloat16", "layer": "", "variant": variant,
            "status": "ok", "us": us, "ratio_vs_xla": None, "loop_kernel_us": kernel_us, "note": "",
            "host_us": None, "kernels": [],
        }  # fmt: skip

    rows = [
        row(128, "xla", 10.0, 8.0),
        row(128, "flux:auto", 12.0, 8.8),
        row(256, "xla", 20.0, 16.0),
        row(256, "flux:auto", 22.0, 16.0),
        row(512, "xla", 30.0, None),  # not profiled: no pair
        row(512, "flux:auto", 33.0, 30.0),
    ]
    for r in rows:
        r["ratio_vs_xla"] = r["us"] / {128: 10.0, 256: 20.0, 512: 30.0}[r["M"]]
    s = gemm_parity.summary(rows)
    kernel = s["kernel_time_over_xla"]["flux:auto"]
    assert kernel["shapes"] == 2 and kernel["worst"] == pytest.approx(1.1) and kernel["best"] == pytest.approx(1.0)
    assert s["ours_over_xla"]["flux:auto"]["shapes"] == 3
    meta = {
        "hardware": {"device_kind": "cpu"}, "date_utc": "", "git_commit": "", "git_dirty": False,
        "versions": {"jax": ""}, "seed": 0,
    }  # fmt: skip
    assert "By kernel time under the same load" in gemm_parity.markdown(meta, rows)


def test_gemm_parity_kernel_spec_sets_the_tile_order():
    """--kernels KERNEL/gG/sS: the same instance traced with GpuTuning.tile_group_m=G and
    tile_serpentine=S, a variant of its own; a bad spec is refused."""
    from benchmarks import gemm_parity

    assert gemm_parity.parse_kernel_spec("128x256") == ("128x256", 0, -1)
    assert gemm_parity.parse_kernel_spec("auto/g16") == ("auto", 16, -1)
    assert gemm_parity.parse_kernel_spec("auto/s1") == ("auto", 0, 1)
    assert gemm_parity.parse_kernel_spec("128x256/g4/s0") == ("128x256", 4, 0)
    bad_specs = ("auto/g0", "auto/g65", "auto/gx", "256x256", "256x256/g8", "auto/s2", "auto/s", "auto/g8/g8")
    for bad in (*bad_specs, "auto/s1/s1", "auto/g8/s1/x", "auto/"):
        with pytest.raises(ValueError, match="--kernels"):
            gemm_parity.parse_kernel_spec(bad)
    shape = gemm_parity.Shape(8192, 4096, 8192, False, "bfloat16", "")
    variants = gemm_parity.variants_for(shape, "gpu", ("auto", "auto/g16", "auto/s1"), False, False)
    assert [(v.name, v.kernel, v.tile_group_m, v.tile_serpentine) for v in variants] == [
        ("xla", None, 0, -1),
        ("flux:auto", "auto", 0, -1),
        ("flux:auto/g16", "auto", 16, -1),
        ("flux:auto/s1", "auto", 0, 1),
    ]
    assert variants[2].tuning == {"gemm_kernel": "auto", "gate_probe": 0, "tile_group_m": 16, "tile_serpentine": -1}
    assert gemm_parity._variant_from_name("flux:128x256/g4").tile_group_m == 4
    assert gemm_parity._variant_from_name("flux:auto/g4/s1").tile_serpentine == 1
    with pytest.raises(SystemExit):
        gemm_parity.parse_args(["--out", "x", "--kernels", "auto,auto/g99"])


def test_gemm_parity_refuses_bad_shapes_and_loop_options(capsys):
    from benchmarks import gemm_parity

    bad_shapes = ("64:64", "a:b:c", "64:64:64:xx", "0:64:64", "64:64:64:dx:1", "64:64:64,64:-1:64")
    for bad in bad_shapes:
        entry = bad.split(",")[-1]
        _refused(gemm_parity.parse_args, ["--out", "x", "--shapes", bad], f"--shapes entry {entry!r}", capsys)
    _refused(gemm_parity.parse_args, ["--out", "x", "--shapes", ","], "names no shape", capsys)
    for argv, message in _BAD_LOOPS:
        _refused(gemm_parity.parse_args, ["--out", "x", *argv], message, capsys)
    args = gemm_parity.parse_args(["--out", "x", "--shapes", "64:32:48, 8:16:24:dx", "--dtypes", "bfloat16"])
    shapes = gemm_parity.shapes_from_args(args, {})
    assert [(s.M, s.K, s.N, s.dx) for s in shapes] == [(64, 32, 48, False), (8, 16, 24, True)]


class _FakeGpu:
    """A GPU that runs queued work back to back at busy_w and idles at idle_w, on a fake clock; its
    energy counter publishes the total every step_s, and every read of it costs the host read_s."""

    def __init__(self, monkeypatch, busy_w=500.0, idle_w=100.0, step_s=0.1, read_s=0.005):
        from benchmarks import gpu_energy

        self.now = self.busy_until = 100.0
        self.next_step_at = self.now + step_s
        self.energy_j = self.published_mj = 0.0
        self.busy_w, self.idle_w, self.step_s, self.read_s = busy_w, idle_w, step_s, read_s
        monkeypatch.setattr(gpu_energy.time, "perf_counter", lambda: self.now)

    def advance(self, dt):
        while dt > 1e-12:
            piece = min(dt, self.next_step_at - self.now)
            busy = min(piece, max(self.busy_until - self.now, 0.0))
            self.energy_j += busy * self.busy_w + (piece - busy) * self.idle_w
            self.now += piece
            dt -= piece
            if self.now >= self.next_step_at - 1e-12:
                self.published_mj = self.energy_j * 1e3
                self.next_step_at += self.step_s

    def dispatcher(self, run_s, queue_runs=None, max_runs=100_000):
        """Each dispatch costs the host 2 us; with queue_runs it first blocks until the GPU's
        backlog fits that many runs with the new one (the host waits inside the dispatch). More than
        max_runs dispatches fail the test instead of looping forever."""
        dispatched = [0]

        def dispatch():
            dispatched[0] += 1
            if dispatched[0] > max_runs:
                pytest.fail(f"{max_runs} runs dispatched: the caller does not stop")
            self.advance(2e-6)
            if queue_runs is not None:
                self.advance(max(self.busy_until - self.now - (queue_runs - 1) * run_s, 0.0))
            end = max(self.now, self.busy_until) + run_s
            self.busy_until = end

            def ready():
                self.advance(1e-5)
                return self.now >= end

            return ready

        return dispatch

    def read_mj(self):
        self.advance(self.read_s)
        return self.published_mj


def test_sustained_energy_per_call(monkeypatch):
    """gpu_energy.sustained keeps runs queued while it reads the counter (each read costs 5 ms of
    host time here): the GPU never idles, so power is the busy power, time per call the run's,
    energy per call their product; the counter's 100 ms steps bound the window."""
    from benchmarks import gpu_energy

    gpu = _FakeGpu(monkeypatch)
    got = gpu_energy.sustained(gpu.dispatcher(0.013), 100, 0.5, gpu.read_mj)  # 100 calls of 130 us
    assert got["sustained_us"] == pytest.approx(130.0, rel=1e-3)
    assert got["power_w"] == pytest.approx(500.0, rel=1e-3)
    assert got["energy_mj"] == pytest.approx(65.0, rel=1e-3)
    assert gpu.now >= gpu.busy_until  # drained: nothing left queued

    gpu = _FakeGpu(monkeypatch)  # one run queued: reads leave the GPU idle, power and time drift
    got = gpu_energy.sustained(gpu.dispatcher(0.004), 10, 0.5, gpu.read_mj, depth=1)
    assert got["power_w"] < 490.0
    gpu = _FakeGpu(monkeypatch)
    with pytest.raises(RuntimeError, match="runs finish"):
        gpu_energy.sustained(gpu.dispatcher(0.3), 10, 0.1, gpu.read_mj)


def test_sustained_energy_stalls_raise_not_hang(monkeypatch):
    """gpu_energy.sustained raises, naming what stalled, where no run finishes or the energy counter
    does not step for stall_s (the fake clock advances on every ready check and read)."""
    from benchmarks import gpu_energy

    gpu = _FakeGpu(monkeypatch, step_s=1e9)  # the counter never steps
    with pytest.raises(RuntimeError, match=r"counter did not step for 2 s \(\d+ runs of 10 calls finished"):
        gpu_energy.sustained(gpu.dispatcher(0.004), 10, 0.5, gpu.read_mj, stall_s=2.0)
    gpu = _FakeGpu(monkeypatch)
    with pytest.raises(RuntimeError, match="no run finished for 2 s"):
        gpu_energy.sustained(gpu.dispatcher(1e6), 10, 0.5, gpu.read_mj, stall_s=2.0)


def test_sustained_energy_ends_where_each_dispatch_waits_for_a_run(monkeypatch):
    """Where a dispatch blocks for as long as a run takes (the FP8 overlap loop's, three runs queued,
    on one H200), the oldest run has always finished when the next dispatch returns;
    sustained still ends after its window, with the run's time per call."""
    from benchmarks import gpu_energy

    gpu = _FakeGpu(monkeypatch)
    got = gpu_energy.sustained(gpu.dispatcher(0.02, queue_runs=2, max_runs=2000), 10, 1.0, gpu.read_mj, depth=3)
    assert got["sustained_us"] == pytest.approx(2000.0, rel=0.01)
    assert got["power_w"] == pytest.approx(500.0, rel=0.05)


def test_energy_meter_reads_every_gpu_or_is_absent(monkeypatch):
    """EnergyMeter.open(): None without the driver library, NVML or its energy counter; else the
    counters of all GPUs, summed."""
    from benchmarks import gpu_energy

    def no_library(_name):
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(gpu_energy.ctypes, "CDLL", no_library)
    assert gpu_energy.EnergyMeter.open() is None

    class FakeNvml:
        def __init__(self, init=0, energy=(1000, 2500)):
            self.init, self.energy = init, energy

        def nvmlInit_v2(self):
            return self.init

        def nvmlDeviceGetCount_v2(self, count):
            count._obj.value = len(self.energy)
            return 0

        def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
            handle._obj.value = index.value + 1
            return 0

        def nvmlDeviceGetTotalEnergyConsumption(self, handle, mj):
            value = self.energy[handle.value - 1]
            if value is None:
                return 3  # NVML_ERROR_NOT_SUPPORTED
            mj._obj.value = value
            return 0

    monkeypatch.setattr(gpu_energy.ctypes, "CDLL", lambda _name: FakeNvml())
    meter = gpu_energy.EnergyMeter.open()
    assert meter is not None and meter.read_mj() == 3500.0
    assert meter.step_ms() is None  # a counter that never steps
    monkeypatch.setattr(gpu_energy.ctypes, "CDLL", lambda _name: FakeNvml(init=1))
    assert gpu_energy.EnergyMeter.open() is None
    monkeypatch.setattr(gpu_energy.ctypes, "CDLL", lambda _name: FakeNvml(energy=(1000, None)))
    assert gpu_energy.EnergyMeter.open() is None


def test_gemm_parity_summary_by_energy():
    """With --energy-s rows, the summary pairs each variant's energy and sustained time per call
    with XLA's on the same shape, and the markdown shows both."""
    from benchmarks import gemm_parity

    def row(m, variant, energy, us):
        return {
            "M": m, "K": 64, "N": 64, "orientation": "fwd", "dtype": "bfloat16", "layer": "", "variant": variant,
            "status": "ok", "us": us, "ratio_vs_xla": 1.0, "loop_kernel_us": None, "note": "", "host_us": None,
            "kernels": [], "sustained_us": us, "energy_mj": energy, "power_w": 500.0,
        }  # fmt: skip

    rows = [row(128, "xla", 10.0, 100.0), row(128, "flux:auto", 11.0, 104.0)]
    s = gemm_parity.summary(rows)
    assert s["energy_over_xla"]["flux:auto"]["median"] == pytest.approx(1.1)
    assert s["sustained_time_over_xla"]["flux:auto"]["median"] == pytest.approx(1.04)
    meta = {
        "hardware": {"device_kind": "gpu"}, "date_utc": "", "git_commit": "", "git_dirty": False,
        "versions": {"jax": ""}, "seed": 0,
    }  # fmt: skip
    table = gemm_parity.markdown(meta, rows)
    assert "At the power cap" in table and "| 128x64x64 fwd bfloat16 | flux:auto | 104.0 | 11.000 | 500 |" in table
    assert ", gpu, jax" in table  # no rule inputs recorded: nothing said of them
    meta.update(sm_count=132, dram_gbps=3352)  # what the instance rule read of the GPU, in the header
    assert ", gpu (132 SMs, 3.4 TB/s DRAM), jax" in gemm_parity.markdown(meta, rows)


def test_gemm_parity_variants_follow_the_build():
    """Which instances a shape runs (gemm_plan.h HasGemmInstance)."""
    from benchmarks.gemm_parity import KERNELS, Shape, variants_for

    def names(m, k, n, dx, dtype):
        return [v.name for v in variants_for(Shape(m, k, n, dx, dtype, ""), "gpu", KERNELS, True, True)]

    forward = ["xla", "flux:auto", "flux:128x256", "flux:128x192", "flux:128x128_pp_c2x1", "flux:128x320_c2x1"]
    forward.append("flux:128x192_pp_c2x1")  # the [K, N] weight only
    # 128x224 and 128x160: the transposed weight only
    transposed = forward[:3] + ["flux:128x224", "flux:128x192", "flux:128x160_c2x1"] + forward[4:6]
    for dtype in ("bfloat16", "float16"):  # float16 has every bfloat16 instance
        for m, k, n in ((2048, 2560, 5120), (8192, 8192, 8192)):
            assert names(m, k, n, False, dtype) == forward + ["flux:auto+gate_probe"]
            assert names(m, n, k, True, dtype) == transposed
    assert names(64, 8192, 5120, False, "bfloat16") == [
        "xla",
        "flux:auto",
        "flux:128x256",
        "flux:decode",
        "flux:ar_decode",
    ]
    assert names(200, 8192, 5120, False, "bfloat16") == ["xla", "flux:auto", "flux:128x256", "flux:decode"]
    assert names(64, 8192, 5120, False, "float16") == ["xla", "flux:auto", "flux:128x256"]


CUDA_RULES = pytest.mark.skipif(
    not hasattr(_native._ext, "cuda_auto_gemm_plan"), reason="the GEMM rules are in CUDA builds only"
)


@CUDA_RULES
def test_overlap_gemm_rule_picks_by_waves():
    """What GpuTuning.gemm_kernel="auto" resolves to (op_common.h ChooseGemmInstance) on the
    measured shapes of docs/decisions (one H200: 132 SMs)."""
    from benchmarks.gemm_parity import auto_kernel

    assert auto_kernel("bfloat16", False, 2048, 4096, 3072, 132) == "128x192"  # 8B qkv: the measured case
    assert auto_kernel("bfloat16", False, 2048, 8192, 5120, 132) == "128x320_c2x1"  # 70B qkv: N % 320, long K
    assert auto_kernel("bfloat16", True, 2048, 5120, 2560, 132) == "128x320_c2x1"  # the transposed weight too
    assert auto_kernel("bfloat16", False, 2048, 2560, 5120, 132) == "128x128_pp_c2x1"  # K < 4096: N % 160 == 0
    assert auto_kernel("bfloat16", True, 2048, 2048, 2560, 132) == "128x160_c2x1"  # the transposed weight
    assert auto_kernel("bfloat16", False, 4096, 6912, 5120, 132) == "128x256"  # M > 2048: waves tie
    assert auto_kernel("bfloat16", False, 8192, 8192, 5120, 132) == "128x256"
    assert auto_kernel("bfloat16", True, 4096, 5120, 2560, 132) == "128x320_c2x1"  # 2 waves against 3
    assert auto_kernel("bfloat16", True, 8192, 5120, 2560, 132) == "128x256"  # 4 x 320 = 5 x 256 columns
    assert auto_kernel("bfloat16", False, 4096, 3072, 2560, 132) == "128x320_c2x1"  # against 128x192's waves
    assert auto_kernel("bfloat16", False, 4096, 2048, 2560, 132) == "128x128_pp_c2x1"  # K <= 2048 first
    assert auto_kernel("bfloat16", False, 16384, 1536, 3072, 132) == "128x128_pp_c2x1"  # short K: Phi-3 out-proj
    assert auto_kernel("float16", False, 8192, 2048, 4096, 132) == "128x128_pp_c2x1"  # short K: 8B out-proj
    assert auto_kernel("bfloat16", False, 2048, 2048, 4096, 132) == "128x256"  # short K above 2048 rows only
    assert auto_kernel("bfloat16", True, 8192, 2048, 4096, 132) == "128x256"  # the [K, N] weight only
    assert auto_kernel("bfloat16", False, 8192, 2560, 5120, 132) == "128x256"  # K > 2048
    assert auto_kernel("bfloat16", True, 2048, 3584, 5120, 132) == "128x320_c2x1"  # transposed: K >= 3584
    assert auto_kernel("bfloat16", True, 2048, 4608, 3072, 132) == "128x192"  # 2 x 192 < 2 x 256, = 3 x 128
    assert auto_kernel("bfloat16", False, 4096, 5120, 3584, 132) == "128x128_pp_c2x1"  # 7 x 128 < 4 x 256
    assert auto_kernel("bfloat16", True, 4096, 5120, 3584, 132) == "128x224"  # transposed: 4 x 224 = 7 x 128
    assert auto_kernel("bfloat16", True, 2048, 3072, 1536, 132) == "128x192"  # 96 tiles of 256; 128 of 192
    assert auto_kernel("bfloat16", True, 1024, 3072, 1536, 132) == "128x256"  # under a wave at <= 1024 rows
    assert auto_kernel("bfloat16", False, 2048, 5120, 3584, 132) == "128x256"  # 4 x 128 = 2 x 256 ([K, N]: no 128x224)
    assert auto_kernel("bfloat16", False, 1024, 8192, 5120, 132) == "128x192"  # M <= 1024: the 1x1 rule
    assert auto_kernel("bfloat16", True, 2048, 4096, 3072, 132) == "128x192"  # either layout
    assert auto_kernel("bfloat16", True, 2048, 4096, 7168, 132) == "128x224"  # 4 x 224 = 7 x 128 < 4 x 256 (5 x 192)
    assert auto_kernel("bfloat16", True, 2048, 5120, 6912, 132) == "128x224"  # 31 tiles of 224 columns a row
    assert auto_kernel("bfloat16", True, 2048, 3072, 4096, 132) == "128x256"  # 4 x 128 = 2 x 256
    # K <= 2048 above 2048 rows: ping-pong 128x128 where the DRAM is an H200's (4.8 TB/s); where it is an
    # H100's (3.35 TB/s) ping-pong 128x192 where its waves are at most 5% longer than 128x256's, else
    # 128x256 (docs/decisions/2026-12-05-pingpong-by-gpu.md, 2026-12-05-pingpong-128x192.md); 0
    # (unknown): the H200 rule
    h100_pick = {(4096, 2048, 4096): "128x256"}  # 6 x 192 columns against 4 x 256
    for m, k, n in ((4096, 2048, 4096), (8192, 2048, 4096), (4096, 1536, 3072), (16384, 1536, 3072)):
        pick = h100_pick.get((m, k, n), "128x192_pp_c2x1")
        assert auto_kernel("bfloat16", False, m, k, n, 132, dram_gbps=3352) == pick
        assert auto_kernel("bfloat16", False, m, k, n, 132, dram_gbps=3999) == pick
        assert auto_kernel("float16", False, m, k, n, 132, dram_gbps=3352) == pick
        for dram_gbps in (0, 4000, 4915):
            assert auto_kernel("bfloat16", False, m, k, n, 132, dram_gbps=dram_gbps) == "128x128_pp_c2x1"
    # at 2048 rows the waves pick ping-pong 128x128 on either GPU
    assert auto_kernel("bfloat16", False, 2048, 2560, 5120, 132, dram_gbps=3352) == "128x128_pp_c2x1"
    # above them, on an H100, 128x192 tiles in ping-pong (5 x 192 columns against 4 x 256) before 128x128
    assert auto_kernel("bfloat16", False, 4096, 5120, 3584, 132, dram_gbps=3352) == "128x192_pp_c2x1"
    assert auto_kernel("bfloat16", True, 4096, 5120, 3584, 132, dram_gbps=3352) == "128x224"  # [K, N] weight only
    assert auto_kernel("bfloat16", False, 4096, 3072, 2560, 132, dram_gbps=3352) == "128x320_c2x1"  # 2 x 320 first
    assert auto_kernel("bfloat16", False, 16384, 3072, 8192, 132, dram_gbps=3352) == "128x192_pp_c2x1"
    # float16 has every instance bfloat16 has: the same rule
    for m in (1024, 2048, 4096, 8192, 16384):
        for k, n in ((1536, 3072), (2048, 4096), (2560, 5120), (3072, 4608), (4096, 7168), (5120, 2560), (8192, 5120)):
            for dx in (False, True):
                assert auto_kernel("float16", dx, m, k, n, 132) == auto_kernel("bfloat16", dx, m, k, n, 132)
    with pytest.raises(ValueError, match="bfloat16, float16, float8_e4m3fn or float8_e5m2"):
        auto_kernel("float32", False, 2048, 4096, 3072, 132)


@CUDA_RULES
def test_fp8_gemm_rule_and_tile_groups():
    """ChooseFp8GemmInstance (the rows' format: e4m3 forward, e5m2 a backward's dy) and TileGroupM
    on the measured shapes of docs/decisions (one H200: 132 SMs)."""
    from benchmarks.gemm_parity import auto_kernel, auto_plan

    assert auto_kernel("float8_e4m3fn", True, 2048, 2560, 5120, 132) == "128x128_pp_c2x1"  # below 8192^2 outputs
    assert auto_kernel("float8_e4m3fn", True, 8192, 8192, 8192, 132) == "128x256"
    assert auto_kernel("float8_e4m3fn", True, 8192, 8192, 28672, 132) == "128x256"
    assert auto_kernel("float8_e4m3fn", True, 16384, 4096, 8192, 132) == "128x128_pp_c2x1"  # K <= 4096
    assert auto_kernel("float8_e4m3fn", True, 16384, 3072, 8192, 132) == "128x128_pp_c2x1"
    # 8192^2 outputs and more at K <= 4096: ping-pong 128x128 on an H200; on an H100 (below 4 TB/s of
    # DRAM) ping-pong 128x192 above 2048 rows where its waves are at most 5% longer than 128x256's
    # (docs/decisions/2026-12-05-pingpong-by-gpu.md, 2026-12-05-pingpong-128x192.md)
    assert auto_kernel("float8_e4m3fn", True, 16384, 3072, 8192, 132, dram_gbps=4915) == "128x128_pp_c2x1"
    for m, k, n in ((16384, 3072, 8192), (16384, 4096, 8192), (8192, 2048, 4096), (4096, 3072, 4608)):
        assert auto_kernel("float8_e4m3fn", True, m, k, n, 132, dram_gbps=3352) == "128x192_pp_c2x1"
        assert auto_kernel("float8_e4m3fn", True, m, k, n, 132) == "128x128_pp_c2x1"  # unknown: the H200 rule
    for m, k, n in ((2048, 2560, 5120), (2048, 8192, 5120)):  # 2048 rows: 4 x 192 columns against 5 x 128
        assert auto_kernel("float8_e4m3fn", True, m, k, n, 132, dram_gbps=3352) != "128x192_pp_c2x1"
    # 2048 rows or fewer: ping-pong 128x192 in place of the ping-pong tile where its waves give each SM
    # no more columns, at any K (docs/decisions/2026-12-06-fp8-pingpong-128x192-at-2048-rows.md)
    for m, k, n in ((2048, 4096, 1536), (2048, 3072, 3072), (2048, 8192, 3072), (2048, 4096, 6144)):
        assert auto_kernel("float8_e4m3fn", True, m, k, n, 132, dram_gbps=3352) == "128x192_pp_c2x1"
        assert auto_kernel("float8_e4m3fn", True, m, k, n, 132, dram_gbps=4915) == "128x128_pp_c2x1"
    assert (
        auto_kernel("float8_e4m3fn", True, 2048, 5120, 4096, 132, dram_gbps=3352) == "128x128_pp_c2x1"
    )  # 3 x 192 > 4 x 128
    assert (
        auto_kernel("float8_e4m3fn", True, 1024, 4096, 3072, 132, dram_gbps=3352) == "128x192_pp_c2x1"
    )  # 1 x 192 < 2 x 128
    assert (
        auto_kernel("float8_e4m3fn", True, 512, 4096, 8192, 132, dram_gbps=3352) == "128x128_pp_c2x1"
    )  # 2 x 192 > 2 x 128
    assert auto_kernel("float8_e5m2", True, 2048, 8192, 3072, 132, dram_gbps=3352) == "128x192_pp_c2x1"  # dx, K 8192
    assert (
        auto_kernel("float8_e5m2", True, 2048, 3072, 4096, 132, dram_gbps=3352) == "128x128_pp_c2x1"
    )  # 3 x 192 > 4 x 128
    assert auto_kernel("float8_e5m2", True, 2048, 8192, 3072, 132, dram_gbps=4915) == "128x128_pp_c2x1"
    for m, k, n in ((4096, 8192, 8192), (8192, 8192, 5120), (4096, 14336, 8192)):  # K >= 8192: cooperative
        assert auto_kernel("float8_e4m3fn", True, m, k, n, 132, dram_gbps=3352) == "128x256"
    # e5m2 rows (dx: M x N output, K deep) too, at K <= 4608 (2026-12-06-fp8-e5m2-pingpong-128x192.md)
    for m, k, n in ((16384, 4096, 2048), (4096, 4608, 3072), (16384, 3072, 8192)):
        assert auto_kernel("float8_e5m2", True, m, k, n, 132, dram_gbps=3352) == "128x192_pp_c2x1"
        assert auto_kernel("float8_e5m2", True, m, k, n, 132, dram_gbps=4915) == "128x128_pp_c2x1"
    for m, k, n in ((8192, 4096, 2048), (4096, 3072, 4096), (4096, 4096, 2048)):  # waves 12.5% longer
        assert auto_kernel("float8_e5m2", True, m, k, n, 132, dram_gbps=3352) == "128x128_pp_c2x1"
    assert auto_kernel("float8_e5m2", True, 2048, 5120, 2560, 132, dram_gbps=3352) == "128x160_pp_c2x1"  # 2048 rows
    assert auto_kernel("float8_e5m2", True, 16384, 8192, 8192, 132, dram_gbps=3352) == "128x128_pp_c2x1"  # K > 4608
    # Ping-pong 128x160 in place of the ping-pong tile where N % 160 == 0 and its waves give each SM no
    # more columns, either row format (docs/decisions/2026-12-06-fp8-pingpong-128x160-equal-waves.md)
    for rows in ("float8_e4m3fn", "float8_e5m2"):
        for m, k, n in ((2048, 2560, 5120), (2048, 6912, 5120), (2048, 8192, 5120), (4096, 6912, 5120)):
            assert auto_kernel(rows, True, m, k, n, 132, dram_gbps=3352) == "128x160_pp_c2x1"  # 4 x 160 = 5 x 128
            assert auto_kernel(rows, True, m, k, n, 132, dram_gbps=4915) == "128x128_pp_c2x1"
    for m, k, n in ((4096, 2560, 5120), (8192, 2560, 5120), (1024, 8192, 5120)):  # in place of 128x192
        assert auto_kernel("float8_e4m3fn", True, m, k, n, 132, dram_gbps=3352) == "128x160_pp_c2x1"
    for k in (3584, 4096, 6912):  # dx 2048 x 5120, K deep
        assert auto_kernel("float8_e5m2", True, 2048, k, 5120, 132, dram_gbps=3352) == "128x160_pp_c2x1"
    assert auto_kernel("float8_e4m3fn", True, 256, 4096, 5120, 132, dram_gbps=3352) == "128x128_pp_c2x1"  # 160 > 128
    assert auto_kernel("float8_e4m3fn", True, 8192, 8192, 5120, 132, dram_gbps=3352) == "128x256"  # cooperative
    # benchmarks/fp8_gemm.py labels its rule row with the same answer (dx: e5m2 rows, K and N swapped)
    from benchmarks.fp8_gemm import auto_instance

    assert auto_instance(16384, 3072, 8192, False, (132, 3352)) == "128x192_pp_c2x1/g8"
    assert auto_instance(16384, 3072, 8192, False, (132, 4915)) == "128x128_pp_c2x1/g16"
    assert auto_instance(2048, 2560, 5120, True, (132, 4915)) == "128x160_pp_c2x1/g8"  # --backward 2048x2560x5120
    assert auto_instance(2048, 5120, 2560, False, None) is None
    # below 8192^2 outputs: cooperative at K >= 8192 where its 4+ waves tie (8 x 256 = 16 x 128 columns)
    assert auto_kernel("float8_e4m3fn", True, 4096, 8192, 8192, 132) == "128x256"
    assert auto_kernel("float8_e4m3fn", True, 2048, 8192, 5120, 132) == "128x128_pp_c2x1"  # 3 x 256 > 5 x 128
    assert auto_kernel("float8_e4m3fn", True, 4096, 6912, 5120, 132) == "128x128_pp_c2x1"  # K < 8192
    assert auto_kernel("float8_e4m3fn", True, 2048, 14336, 8192, 132) == "128x128_pp_c2x1"  # 3.9 waves of work
    assert auto_kernel("float8_e4m3fn", True, 64, 8192, 28672, 132) == "128x128_pp_c2x1"  # one wave
    assert auto_kernel("float8_e5m2", True, 2048, 5120, 2560, 132) == "128x160_pp_c2x1"  # 2 x 160 < 3 x 128
    assert auto_kernel("float8_e5m2", True, 2048, 5120, 8192, 132) == "128x128_pp_c2x1"  # 7 x 160 > 8 x 128
    assert auto_kernel("float8_e5m2", True, 8192, 8192, 8192, 132) == "128x128_pp_c2x1"  # e5m2: ping-pong only
    # Groups of 16 row tiles for the bf16 / f16 cooperative tiles 192+ columns wide over chunks of
    # 2048+ rows, else 8.
    assert auto_plan("bfloat16", False, 8192, 8192, 8192, 132) == ("128x256", 16)
    assert auto_plan("float16", True, 16384, 3072, 4096, 132) == ("128x256", 16)
    assert auto_plan("bfloat16", False, 8192, 8192, 8192, 132, chunk_rows=1024) == ("128x256", 8)  # TP 8's chunks
    assert auto_plan("bfloat16", False, 2048, 4096, 3072, 132) == ("128x192", 16)
    assert auto_plan("bfloat16", True, 2048, 4096, 7168, 132) == ("128x224", 16)
    assert auto_plan("bfloat16", False, 2048, 8192, 5120, 132) == ("128x320_c2x1", 16)
    assert auto_plan("float16", True, 2048, 3584, 5120, 132) == ("128x320_c2x1", 16)
    assert auto_plan("bfloat16", False, 2048, 8192, 5120, 132, chunk_rows=1024) == ("128x320_c2x1", 8)
    assert auto_plan("bfloat16", False, 8192, 2048, 4096, 132) == ("128x128_pp_c2x1", 8)  # ping-pong: not measured
    assert auto_plan("float8_e4m3fn", True, 8192, 8192, 8192, 132) == ("128x256", 8)  # FP8 128x256: not measured
    # FP8 e4m3 ping-pong: 16 where B (K x N bytes) is 16 MiB or more, over chunks of 2048+ rows.
    assert auto_plan("float8_e4m3fn", True, 16384, 3072, 8192, 132) == ("128x128_pp_c2x1", 16)  # 24 MiB
    assert auto_plan("float8_e4m3fn", True, 2048, 8192, 5120, 132) == ("128x128_pp_c2x1", 16)  # 40 MiB
    assert auto_plan("float8_e4m3fn", True, 2048, 8192, 5120, 132, chunk_rows=1024) == ("128x128_pp_c2x1", 8)
    assert auto_plan("float8_e4m3fn", True, 4096, 3072, 4608, 132) == ("128x128_pp_c2x1", 8)  # 13.5 MiB
    assert auto_plan("float8_e4m3fn", True, 8192, 2048, 4096, 132) == ("128x128_pp_c2x1", 8)
    assert auto_plan("float8_e5m2", True, 2048, 5120, 8192, 132) == ("128x128_pp_c2x1", 8)  # e5m2: not measured
    # ping-pong 128x192 (an H100's rule): groups of 8, as ping-pong 128x128 at 16-bit
    assert auto_plan("bfloat16", False, 16384, 3072, 8192, 132, dram_gbps=3352) == ("128x192_pp_c2x1", 8)
    assert auto_plan("float8_e4m3fn", True, 16384, 3072, 8192, 132, dram_gbps=3352) == ("128x192_pp_c2x1", 8)


def test_gemm_parity_preflight_child_reports_each_variant(capsys):
    """The preflight's child (run here in-process, CPU backend): START then OK / FAIL per variant,
    which the parent reads to leave out a variant that fails, faults or hangs."""
    from benchmarks import gemm_parity

    assert gemm_parity.preflight_variants(gemm_parity.KERNELS, True, True) == [
        "flux:128x256",
        "flux:128x224",
        "flux:128x192",
        "flux:128x160_c2x1",
        "flux:128x128_pp_c2x1",
        "flux:128x320_c2x1",
        "flux:128x192_pp_c2x1",
        "flux:auto+gate_probe",
        "flux:decode",
        "flux:ar_decode",
    ]
    gemm_parity.main(["--preflight-child", "flux:128x160_c2x1,flux:nonsense"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == ["START flux:128x160_c2x1", "OK flux:128x160_c2x1", "START flux:nonsense"]
    assert lines[3].startswith("FAIL flux:nonsense ValueError: --kernels 'nonsense'")


def test_gemm_parity_plot_from_a_results_file(tmp_path):
    """--plot draws gemm_parity.png from a results JSON: a bar per shape and variant that ran."""
    import json

    from benchmarks import gemm_parity

    def row(variant, ratio, status="ok", m=2048):
        return dict(
            M=m, K=4096, N=3072, orientation="fwd", dtype="bfloat16", variant=variant, status=status, ratio_vs_xla=ratio
        )

    rows = [row("xla", 1.0), row("flux:auto", 1.07), row("flux:128x256", 1.3), row("flux:128x192", None, "WRONG")]
    rows += [row("xla", 1.0, m=64), row("flux:auto", 2.1, m=64)]
    results = tmp_path / "gemm_parity.json"
    results.write_text(json.dumps({"metadata": {}, "rows": rows}))
    gemm_parity.main(["--out", str(tmp_path / "out"), "--plot", str(results)])
    png = (tmp_path / "out" / "gemm_parity.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_plots_and_runs_where_no_variant_was_timed(tmp_path, capsys):
    """Nothing timed (every variant unavailable, or the budget spent before the first shape): the
    plots are drawn without a legend and the run ends with its table."""
    from benchmarks import gemm_parity, plots

    row = dict(op="ag", M=64, K=64, N=64, layer="smoke", variant="xla_shard_map", status="unavailable: x", ms=None)
    for path in plots.write_plots([dict(row, speedup_vs_xla_shard_map=None)], tmp_path, "untimed"):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    argv = ["--out", str(tmp_path), "--shapes", "64:64:64", "--dtypes", "bfloat16", "--no-preflight", "--budget-s", "0"]
    assert gemm_parity.main(argv) == []
    assert (tmp_path / "gemm_parity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Not run (time budget spent): 1 shapes." in capsys.readouterr().out


@pytest.mark.parametrize("dx", [False, True], ids=["forward", "dx"])
def test_ncu_gemm_programs_and_arguments(dx, capsys):
    """benchmarks/diagnostics/ncu_gemm.py: shapes and variant specs parsed (bad ones refused before
    anything runs), each variant's program equal to XLA's GEMM (CPU backend here), and a clear exit
    where JAX sees no GPU."""
    import jax
    import jax.numpy as jnp

    ncu = _load_diagnostic("ncu_gemm")
    assert ncu.parse_shape("16384:3072:8192") == (16384, 3072, 8192, False)
    assert ncu.parse_shape("2048:5120:2560:dx") == (2048, 5120, 2560, True)
    for bad in ("16384:3072", "1:2:3:dw", "0:2:3", "a:2:3", "1:2:3:dx:dx"):
        with pytest.raises(ValueError, match="--shapes"):
            ncu.parse_shape(bad)
    assert ncu.tuning_of("xla") is None
    tuning = dict(gemm_kernel="128x128_pp_c2x1", tile_group_m=16, tile_serpentine=0)
    assert ncu.tuning_of("128x128_pp_c2x1/g16/s0") == tuning
    shape = ["--shapes", "64:64:64"]
    for argv in (["--shapes", "1:2"], [*shape, "--variants", "xla,256x256"], [*shape, "--calls", "0"]):
        with pytest.raises(SystemExit):
            ncu.main(argv)

    mesh = jax.make_mesh((1,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:1])
    x, w = ncu._operands(256, 128, 192, dx, jnp.bfloat16, mesh)
    assert w.shape == ((192, 128) if dx else (128, 192))
    ref = ncu._program("xla", dx, mesh)(x, w).astype(jnp.float32)
    out = ncu._program("auto/g16", dx, mesh)(x, w).astype(jnp.float32)
    assert out.shape == (256, 192) and float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))) <= ncu.ERROR_BOUND

    assert ncu.main(["--shapes", "64:64:64"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_provenance_names_the_commit_and_whether_the_tree_differed():
    """Every benchmark's metadata names its commit: `git rev-parse HEAD`, or --git-commit for a
    copy of the tree without .git; the dirty flag is None where git cannot tell."""
    from benchmarks import report

    got = report.provenance(None)
    assert len(got["git_commit"]) == 40 and all(c in "0123456789abcdef" for c in got["git_commit"])
    assert isinstance(got["git_dirty"], bool) and got["date_utc"].startswith("20")
    assert report.provenance("abc1234")["git_commit"] == "abc1234"


def test_fp8_gemm_kernel_specs_set_instance_and_tile_order(monkeypatch):
    """benchmarks.fp8_gemm --kernels: flux:<spec> per KERNEL[/gG][/sS] after the twin and the rule,
    each program traced under that GpuTuning; a bad spec is refused before anything runs."""
    from benchmarks import fp8_gemm

    got = fp8_gemm.kernel_variants("auto, auto/g16,128x128_pp_c2x1/g8/s0,auto/g16")
    assert got == (
        ("xla", "xla", "auto"),
        ("flux", "fused", "auto"),
        ("flux:auto/g16", "fused", "auto/g16"),
        ("flux:128x128_pp_c2x1/g8/s0", "fused", "128x128_pp_c2x1/g8/s0"),
    )
    for bad in ("128x192", "auto/g0", "auto/s2", "128x256/g8/g8"):  # 128x192: no FP8 instance
        with pytest.raises(ValueError, match="--kernels"):
            fp8_gemm.kernel_variants(bad)
        with pytest.raises(SystemExit):
            fp8_gemm.main(["--kernels", bad])
    with pytest.raises(SystemExit):
        fp8_gemm.main(["--kernels", "auto/g16", "--decode"])

    import contextlib
    import types

    from flux_jax import _config

    in_effect = []

    @contextlib.contextmanager
    def recording(**overrides):  # the real override, noting what the call ran under
        with _config.gpu_tuning(**overrides) as tuning:
            in_effect.append((tuning.gemm_kernel, tuning.tile_group_m, tuning.tile_serpentine))
            yield tuning

    monkeypatch.setattr(fp8_gemm, "_config", types.SimpleNamespace(gpu_tuning=recording))
    mesh = fp8_gemm._mesh()
    args, ref = fp8_gemm._operands(256, 256, 512, 0, mesh)
    program = fp8_gemm._program("fused", mesh, "128x128_pp_c2x1/g16/s0")
    assert float(fp8_gemm._rel_err(program(*args), ref)) < 0.1  # the CPU backend ignores the tuning
    assert in_effect == [("128x128_pp_c2x1", 16, 0)]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "dx"])
def test_fp8_gemm_power_cap_loop_carries_what_the_output_depends_on(backward):
    """benchmarks.fp8_gemm --energy-s: each variant's whole call in a serialized loop read by the
    energy meter (a fake counter here). The loop carries x forward and dy backward (dx does not
    depend on x, so carrying x would let XLA hoist the call out of the loop)."""
    from benchmarks import fp8_gemm

    class CountingMeter:  # steps on every read
        mj = 0.0

        def read_mj(self):
            self.mj += 1.0
            return self.mj

    mesh = fp8_gemm._mesh()
    args, _ = fp8_gemm._operands(256, 256, 512, 0, mesh, backward)
    program = fp8_gemm._program("fused", mesh, "auto", backward)
    got = fp8_gemm._sustained(program, args, mesh, 0.5, CountingMeter(), per_call_us=20000.0)
    assert got["sustained_us"] > 0 and got["energy_mj"] > 0 and got["power_w"] > 0


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_dispatch_ahead_keeps_runs_queued_and_reports_a_stall(fp8):
    """dispatch_ahead.py: the fused loop runs `depth` runs ahead until `runs` finish (CPU backend);
    a dispatch that never returns is reported by the watchdog, not waited for."""
    import threading

    ahead = _load_diagnostic("dispatch_ahead")
    loop, args = ahead.build_loop(64, 128, 256, 3, "fused", "overlap", fp8)
    got = ahead.run_ahead(loop, args, depth=3, runs=5, stall_s=60.0, on_stall=pytest.fail)
    assert got["runs"] == 5 and got["ms_per_run"] > 0

    stalled, release = [], threading.Event()

    def stuck_loop(*_):  # the first dispatch returns, the second never does (until released)
        if calls:
            release.wait(30)
        calls.append(1)
        return loop(*args)

    calls = []
    got = ahead.run_ahead(
        stuck_loop, args, depth=2, runs=3, stall_s=0.5, on_stall=lambda what: (stalled.append(what), release.set())
    )
    assert stalled and "no dispatch returned" in stalled[0]
    assert got["runs"] == 3  # released by the stall handler, the loop then finishes
