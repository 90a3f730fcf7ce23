"""examples/train_transformer.py: fused == xla training, the CPU default end to end, resume.

Reduced sizes keep this fast on a 2-core machine. The in-process runs import
the example's `main(argv)`; one run goes through the real command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_transformer.py"
TINY = [
    "--layers",
    "1",
    "--hidden",
    "32",
    "--heads",
    "4",
    "--kv-heads",
    "4",
    "--ffn",
    "64",
    "--seq",
    "16",
    "--batch",
    "4",
    "--sample-chars",
    "0",
]


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import train_transformer

        yield train_transformer
    finally:
        sys.path.remove(str(EXAMPLE.parent))


def test_fused_and_xla_give_the_same_losses(example, tmp_path):
    summary = example.main([*TINY, "--layers", "2", "--steps", "20", "--compare", "--out", str(tmp_path)])
    fused, xla = summary["runs"]["fused"]["losses"], summary["runs"]["xla"]["losses"]
    assert len(fused) == len(xla) == 20
    for step, (a, b) in enumerate(zip(fused, xla), start=1):
        assert abs(a - b) <= 1e-4 * max(abs(b), 1.0), f"step {step}: fused {a} vs xla {b}"
    assert summary["compare"]["max_abs_loss_diff"] <= 1e-4 * max(xla)
    assert summary["compare"]["step_time_ratio_xla_over_fused"] > 0
    assert fused[-1] < fused[0]


def test_without_sequence_parallelism_fused_and_xla_give_the_same_losses(example, tmp_path):
    """--no-sequence-parallel: column_matmul / matmul_ar projections, any sequence length."""
    summary = example.main(
        [*TINY, "--seq", "15", "--steps", "8", "--compare", "--no-sequence-parallel", "--out", str(tmp_path)]
    )
    assert summary["config"]["sequence_parallel"] is False
    fused, xla = summary["runs"]["fused"]["losses"], summary["runs"]["xla"]["losses"]
    assert len(fused) == len(xla) == 8
    for step, (a, b) in enumerate(zip(fused, xla), start=1):
        assert abs(a - b) <= 1e-4 * max(abs(b), 1.0), f"step {step}: fused {a} vs xla {b}"
    assert fused[-1] < fused[0]


def test_fp8_loss_curve_tracks_the_bf16_one(example, tmp_path):
    """--fp8 (the projections on FP8 operands, fused latency path) trains like bf16: the loss of
    every step stays within 2% of the bf16 run's from the same seed, and falls."""
    common = [*TINY, "--dtype", "bfloat16", "--steps", "10"]
    bf16 = example.main([*common, "--out", str(tmp_path / "bf16")])["runs"]["fused"]["losses"]
    summary = example.main([*common, "--fp8", "--out", str(tmp_path / "fp8")])
    fp8 = summary["runs"]["fused"]["losses"]
    assert summary["config"]["fp8"] is True and len(fp8) == len(bf16) == 10
    for step, (a, b) in enumerate(zip(fp8, bf16), start=1):
        assert abs(a - b) <= 0.02 * max(abs(b), 1.0), f"step {step}: fp8 {a} vs bf16 {b}"
    assert fp8 != bf16  # quantized: not the same numbers
    assert fp8[-1] < fp8[0]


@pytest.mark.parametrize("mesh", ["2,1,4", "1,2,4"])
def test_gspmd_mesh_fused_and_xla_give_the_same_losses(example, tmp_path, mesh):
    """--mesh dp,fsdp,tp: a GSPMD model whose blocks' TP part is a shard_map over tp only. The
    compiled fused step holds the flux_jax calls of every projection, forward and backward (dp and
    fsdp are the partitioner's), the xla step none; both train alike."""
    layers = 2
    summary = example.main(
        [*TINY, "--layers", str(layers), "--mesh", mesh, "--steps", "8", "--compare", "--out", str(tmp_path)]
    )
    config = summary["config"]
    assert (config["dp"], config["fsdp"], config["tp"]) == tuple(map(int, mesh.split(",")))
    fused, xla = summary["runs"]["fused"], summary["runs"]["xla"]
    assert fused["flux_calls"] == {"flux_jax_ag_matmul": 4 * layers, "flux_jax_matmul_rs": 4 * layers}
    assert xla["flux_calls"] == {}
    assert len(fused["losses"]) == len(xla["losses"]) == 8
    for step, (a, b) in enumerate(zip(fused["losses"], xla["losses"]), start=1):
        assert abs(a - b) <= 1e-4 * max(abs(b), 1.0), f"step {step}: fused {a} vs xla {b}"
    assert fused["losses"][-1] < fused["losses"][0]


def test_gspmd_mesh_trains_like_the_fully_manual_model(example, tmp_path):
    """The same model and batches: --mesh 1,2,4 (batch and parameters split over fsdp by the
    partitioner) gives the losses of --dp 2 --tp 4 (one shard_map over every axis)."""
    run = [*TINY, "--steps", "6"]
    manual = example.main([*run, "--dp", "2", "--tp", "4", "--out", str(tmp_path / "manual")])
    gspmd = example.main([*run, "--mesh", "1,2,4", "--out", str(tmp_path / "gspmd")])
    got, want = gspmd["runs"]["fused"]["losses"], manual["runs"]["fused"]["losses"]
    assert len(got) == 6
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= 1e-4 * max(abs(b), 1.0), f"step {step}: --mesh {a} vs --dp/--tp {b}"


def test_cpu_default_command_runs_end_to_end(tmp_path):
    """The README's main command with its CPU defaults (mesh, impl), reduced in size."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the example sets up 8 devices itself
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), *TINY, "--steps", "8", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "8/8" in out.stderr  # the progress bar
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (tmp_path / "loss.png").stat().st_size > 1000
    config = summary["config"]
    assert (config["dp"], config["tp"], config["impl"], config["devices"]) == (2, 4, "fused", 8)
    losses = summary["runs"]["fused"]["losses"]
    assert len(losses) == 8 and summary["final_loss"] == losses[-1] < losses[0]
    assert summary["tokens_per_s"] > 0 and summary["step_time_ms"] > 0


def test_stopped_run_resumes_with_identical_losses(example, tmp_path):
    common = [*TINY, "--steps", "6", "--ckpt-every", "3"]
    ckpt = str(tmp_path / "ckpt")
    uninterrupted = example.main([*common, "--out", str(tmp_path / "a")])
    stopped = example.main([*common, "--ckpt-dir", ckpt, "--stop-after", "3", "--out", str(tmp_path / "b")])
    assert stopped["runs"]["fused"]["completed_steps"] == 3
    resumed = example.main([*common, "--ckpt-dir", ckpt, "--resume", "--out", str(tmp_path / "c")])
    run = resumed["runs"]["fused"]
    assert run["first_step"] == 4 and run["completed_steps"] == 6
    assert run["losses"][:3] == stopped["runs"]["fused"]["losses"]
    assert run["losses"] == pytest.approx(uninterrupted["runs"]["fused"]["losses"], rel=1e-6, abs=0)

    with pytest.raises(SystemExit, match="made with other settings"):
        example.main([*common, "--lr", "1e-2", "--ckpt-dir", ckpt, "--resume", "--out", str(tmp_path / "d")])
    with pytest.raises(SystemExit, match="already holds checkpoints"):
        example.main([*common, "--ckpt-dir", ckpt, "--out", str(tmp_path / "e")])
    finished = example.main([*common, "--ckpt-dir", ckpt, "--resume", "--out", str(tmp_path / "f")])
    run = finished["runs"]["fused"]  # nothing left to train: the restored run, reported
    assert (
        run["compile_s"] is None and run["completed_steps"] == 6 and run["losses"] == resumed["runs"]["fused"]["losses"]
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--heads", "6", "--kv-heads", "2"], "heads=6 is not divisible by tp=4"),
        (["--hidden", "30"], "hidden=30 is not divisible by tp=4"),
        (["--seq", "18"], "seq=18 is not divisible by tp=4"),
        (["--batch", "3"], "batch=3 is not divisible by the data-parallel size 2"),
        (["--dp", "4"], "only 8 cpu devices"),
        (["--mesh", "2,4"], "argument --mesh: expected three sizes >= 1, dp,fsdp,tp (e.g. 2,1,4), got '2,4'"),
        (["--mesh", "2,x,4"], "argument --mesh: expected three sizes"),
        (["--mesh", "0,1,4"], "argument --mesh: expected three sizes >= 1"),
        (["--mesh", "2,2,4"], "--mesh 2,2,4 needs dp x fsdp x tp = 16 devices, but only 8 cpu devices"),
        (["--mesh", "2,1,4", "--tp", "4"], "--mesh dp,fsdp,tp replaces --dp and --tp"),
        (["--mesh", "1,3,2"], "hidden=32 is not divisible by fsdp=3 (mesh axis 'fsdp'): FSDP shards"),
        (["--mesh", "1,2,4", "--batch", "3"], "batch=3 is not divisible by the data-parallel size 2 (dp=1 x fsdp=2)"),
        (["--mesh", "1,2,4", "--seq", "18"], "seq=18 is not divisible by tp=4"),
        (["--flux-config", "gpu_tile_n=100"], "--flux-config: GpuTuning.tile_n must be"),
        (["--flux-config", "gpu_tile_n"], "--flux-config: expected name=value"),
        (["--flux-config", "no_such_field=1"], "no_such_field"),
        (["--hidden", "36"], "head_dim=9 is odd: rotary embeddings rotate pairs"),
        (["--dtype", "float16"], "--dtype float16 needs a GPU"),
        (["--stop-after", "0"], "--stop-after must be >= 1, got 0"),
        (["--ckpt-every", "0"], "--ckpt-every must be >= 1, got 0"),
        (["--compare"], "--compare times the steps after the compiling one: it needs --steps"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--lr", "-1"], "--lr must be a positive finite number, got -1.0"),
        (["--warmup", "-5"], "--warmup must be in 0..--steps (1), got -5"),
        (["--sample-chars", "-3"], "--sample-chars must be >= 0, got -3"),
        (["--profile-steps", "-1"], "--profile-steps must be >= 0, got -1"),
        (["--seq", "4", "--sample-chars", "8"], "--seq 4 leaves no room to sample after the 4-character prompt 'the '"),
    ],
)
def test_shapes_that_cannot_shard_are_usage_errors(example, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        example.main([*TINY, *flags, "--steps", "1"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_two_processes_train_like_one(tmp_path):
    """The documented multi-process launch (jax.distributed, 2 processes x 4 CPU devices) gives
    the single-process losses; only process 0 writes the summary."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    run = [*TINY, "--steps", "6"]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(EXAMPLE),
                *run,
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--out",
                str(tmp_path / f"p{i}"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in (0, 1)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    assert not (tmp_path / "p1").exists()
    multi = json.loads((tmp_path / "p0" / "summary.json").read_text())
    assert multi["config"]["devices"] == 8
    single = subprocess.run(
        [sys.executable, str(EXAMPLE), *run, "--out", str(tmp_path / "single")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert single.returncode == 0, single.stdout + single.stderr
    want = json.loads((tmp_path / "single" / "summary.json").read_text())["runs"]["fused"]["losses"]
    got = multi["runs"]["fused"]["losses"]
    assert len(got) == 6
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-4 * max(abs(b), 1.0), (got, want)


def test_profile_summary_sorts_kernels_into_categories(example, tmp_path):
    """--profile-steps reads a Perfetto trace: per GPU, time per step by category and top kernels.
    A synthetic trace of 2 steps stands in for a GPU run; the CPU run reports no GPU activity."""
    import gzip

    from training.profile import StepTracer, category, summarize

    gpu, host = 7, 8
    events = [
        {"ph": "M", "name": "process_name", "pid": gpu, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": host, "args": {"name": "/host:CPU"}},
    ]
    t = 0.0
    for _ in range(2):  # per step: our GEMM 300 us, XLA's GEMM 200, NCCL 100 (overlapping), a copy
        for name, dur, gap in [
            ("_ZN7cutlass13device_kernelIN8flux_jax4cuda5Gated", 300, 10),
            ("ncclDevKernel_ReduceScatter", 100, -100),
            ("nvjet_sm90_tst_256x128", 200, 0),
            ("loop_add_fusion", 50, 40),
            ("MemcpyP2P", 20, 0),
        ]:
            events.append({"ph": "X", "pid": gpu, "name": name, "ts": t, "dur": dur})
            t += dur + gap
        events.append({"ph": "X", "pid": host, "name": "PjitFunction(train_step)", "ts": 0.0, "dur": 5.0})
    trace = tmp_path / "plugins" / "profile" / "run"
    trace.mkdir(parents=True)
    with gzip.open(trace / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)

    summary = summarize(str(tmp_path), steps=2)
    dev = summary["devices"]["/device:GPU:0"]
    assert dev["ms_per_step"] == {"flux": 0.3, "gemm": 0.2, "nccl": 0.1, "other": 0.05, "copy": 0.02}
    assert dev["busy_ms_per_step"] == pytest.approx(0.55)  # NCCL overlaps the GEMM; copies not counted
    assert dev["top_kernels"][0]["name"].startswith("_ZN7cutlass") and dev["top_kernels"][0]["calls_per_step"] == 1
    assert category("cudnn_generated_fort_native_sdpa_sm90") == "attention" and category("fusion.12") == "other"

    summary = example.main([*TINY, "--steps", "5", "--profile-steps", "2", "--out", str(tmp_path / "run")])
    assert summary["runs"]["fused"]["profile"] == {"error": "no GPU activity in the trace (profiles are for GPU runs)"}
    assert not StepTracer(0, first=3).active(3) and StepTracer(2, first=3).active(4)
