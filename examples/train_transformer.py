"""Train a small GPT whose transformer blocks run tensor-parallel through flux_jax.

    python examples/train_transformer.py              # no GPU: 8 CPU devices, dp=2 x tp=4, ~2 min
    python examples/train_transformer.py --compare    # impl="fused" and impl="xla" from one seed
    python examples/train_transformer.py --no-sequence-parallel   # TP without SP: matmul_ar
    python examples/train_transformer.py --fp8        # the projections' GEMMs on FP8 operands
    python examples/train_transformer.py --mesh 2,1,4 # a GSPMD model: only TP manual, dp x fsdp automatic
    python examples/train_transformer.py --ckpt-dir /tmp/ckpt          # stop it (Ctrl-C) ...
    python examples/train_transformer.py --ckpt-dir /tmp/ckpt --resume # ... and continue

One process per GPU (or per group of CPU devices), e.g. 2 processes on one host:

    python examples/train_transformer.py --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 0 &
    python examples/train_transformer.py --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 1

Each block's four projections (QKV, attention out, gate+up, down) are
flux_jax.ag_matmul / flux_jax.matmul_rs calls inside one shard_map over the
dp x tp mesh (Megatron sequence parallelism, see docs/flax.md). With
--no-sequence-parallel every TP rank holds the whole sequence and the projections
are flux_jax.column_matmul / flux_jax.matmul_ar (one fused all-reduce per
row projection forward, one per column projection backward). With --mesh dp,fsdp,tp
the model is a GSPMD program instead: batch-first activations, each block in a
shard_map over tp only, the batch split over dp x fsdp by the partitioner and the
parameters' hidden dimension sharded over fsdp (FSDP). The text is a
character corpus generated from a small grammar (examples/training/text.py),
so nothing is downloaded. Optimizer: AdamW, linear warm-up then cosine decay,
gradient clipping. On a GPU host the defaults switch to all local GPUs as TP
(dp=1) and a larger bf16 model.

Outputs in --out: summary.json (settings, losses, tokens/s, step time) and
loss.png. Errors for shapes that cannot shard name the numbers.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from training.checkpoint import TrainCheckpoints
from training.profile import StepTracer
from training.profile import describe as describe_profile
from training.progress import ProgressBar
from training.report import plot_losses, write_summary
from training.text import CharVocab, batch_at, generate_corpus

import flux_jax
from flux_jax import _config
from flux_jax.flax import GPT, GPTConfig, check_config, check_tokens_shape

# Defaults per platform; every one can be overridden by its flag.
CPU_DEFAULTS = dict(
    dp=2,
    tp=4,
    layers=4,
    hidden=128,
    heads=8,
    kv_heads=4,
    ffn=384,
    seq=64,
    batch=16,
    steps=400,
    lr=3e-3,
    dtype="float32",
    impl="fused",
)
GPU_DEFAULTS = dict(
    dp=1,
    tp=None,
    layers=8,
    hidden=2048,
    heads=16,
    kv_heads=8,
    ffn=5632,
    seq=2048,
    batch=8,
    steps=300,
    lr=1e-3,
    dtype="bfloat16",
    impl="auto",
)
# Named model/run sizes (--preset); explicit flags still win.
PRESETS = {
    # The issue-6 GPU benchmark: LLaMA-3-8B-like layers (hidden 4096, FFN 14336, 32 query / 8 KV
    # heads, sequence 4096), a few of them, bf16; run with --compare for fused vs xla step time.
    "llama3-8b-layers": dict(
        layers=4,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn=14336,
        seq=4096,
        batch=2,
        steps=30,
        lr=3e-4,
        dtype="bfloat16",
        remat=True,
    ),
}
EVAL_BATCHES = 4
SAMPLE_PROMPT = "the "


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("mesh (default CPU: dp=2 tp=4; GPU: dp=1, tp=all GPUs)")
    g.add_argument("--dp", type=int, help="data-parallel size (batch sharding)")
    g.add_argument("--tp", type=int, help="tensor-parallel size (heads, ffn and sequence sharding)")
    g.add_argument(
        "--mesh",
        type=mesh_shape,
        metavar="DP,FSDP,TP",
        help="run as a GSPMD model on a (dp, fsdp, tp) mesh, e.g. 2,1,4: each block's TP part in a "
        "shard_map over tp only, the batch over dp x fsdp and the parameters over fsdp left to the "
        "partitioner (instead of --dp/--tp, whose one shard_map maps every axis)",
    )
    g = p.add_argument_group("model")
    g.add_argument("--preset", choices=sorted(PRESETS), help="named sizes (flags given explicitly win)")
    for flag in ("--layers", "--hidden", "--heads", "--kv-heads", "--ffn"):
        g.add_argument(flag, type=int)
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="compute dtype")
    g.add_argument(
        "--impl",
        choices=["fused", "xla", "auto"],
        help="flux_jax implementation of the projections (default: fused on CPU, to "
        "exercise the protocol; auto on GPU, fused only where measured faster)",
    )
    g.add_argument(
        "--fp8",
        action="store_true",
        help="the projections' GEMMs on FP8 operands (flux_jax.Fp8(): e4m3 forward, e5m2 "
        "gradients, current scaling); the rest of the model keeps --dtype",
    )
    g.add_argument(
        "--remat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute block activations in the backward pass (the 8B preset's default)",
    )
    g.add_argument(
        "--flux-config",
        default="",
        help="flux_jax.Config fields for the whole run, and GPU tuning knobs as gpu_<GpuTuning field>, e.g. "
        "'timeout_s=30,gpu_tile_group_m=16'",
    )
    g.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shard the sequence over TP between blocks (ag_matmul / matmul_rs); "
        "--no-sequence-parallel keeps it whole on every TP rank (column_matmul / matmul_ar)",
    )
    g.add_argument(
        "--attention",
        choices=["auto", "xla", "cudnn"],
        default="auto",
        help="jax.nn.dot_product_attention backend (auto: cuDNN flash attention on GPU "
        "with bf16/f16, XLA otherwise; XLA materializes the [T, T] scores)",
    )
    g = p.add_argument_group("training")
    g.add_argument("--seq", type=int, help="sequence length (characters)")
    g.add_argument("--batch", type=int, help="global batch size (sequences)")
    g.add_argument("--steps", type=int, help="optimizer steps")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--warmup", type=int, help="warm-up steps (default: 5%% of --steps)")
    g.add_argument("--seed", type=int, default=0, help="parameter init and batch order")
    g = p.add_argument_group("multi-process (jax.distributed; one launch per process)")
    g.add_argument("--coordinator", help="host:port of process 0's coordinator")
    g.add_argument("--num-processes", type=int, default=1, help="processes of the job")
    g.add_argument("--process-id", type=int, default=0, help="this process's index")
    g = p.add_argument_group("outputs")
    g.add_argument(
        "--compare", action="store_true", help="train with impl=fused and impl=xla from the same seed and compare"
    )
    g.add_argument("--out", default="out/train_transformer", help="directory for summary.json and loss.png")
    g.add_argument("--ckpt-dir", help="save orbax checkpoints here")
    g.add_argument("--ckpt-every", type=int, default=50, help="checkpoint interval in steps")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    g.add_argument("--stop-after", type=int, help="stop after this step as if interrupted (tests resume)")
    g.add_argument("--sample-chars", type=int, default=40, help="characters to generate at the end (0: none)")
    g.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="GPU: trace this many steps (after the compile step and one more) and report "
        "device time per step by kernel category; those steps are left out of the timing",
    )
    args = p.parse_args(argv)
    args.fsdp = None
    if args.mesh is not None:
        if args.dp is not None or args.tp is not None:
            p.error("--mesh dp,fsdp,tp replaces --dp and --tp: give one or the other")
        args.dp, args.fsdp, args.tp = args.mesh
    if args.num_processes > 1:
        init_distributed(args, p)

    on_gpu = jax.default_backend() != "cpu"
    defaults = dict(GPU_DEFAULTS if on_gpu else CPU_DEFAULTS)
    if args.preset:
        preset = dict(PRESETS[args.preset])
        defaults.update(preset)
    defaults.setdefault("remat", False)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    n_devices = len(jax.devices())
    if args.tp is None:
        args.tp = n_devices // args.dp
    if args.attention == "auto":
        args.attention = "cudnn" if on_gpu and args.dtype in ("bfloat16", "float16") else "xla"
    if args.attention == "cudnn" and (not on_gpu or args.dtype == "float32"):
        p.error("--attention cudnn needs an NVIDIA GPU and --dtype bfloat16 or float16")
    if args.dtype == "float16" and not on_gpu:
        p.error("--dtype float16 needs a GPU: XLA:CPU has no float16 attention (dot_general F16_F16_F32)")
    if args.warmup is None:
        args.warmup = max(1, args.steps // 20)
    if args.num_processes > 1:
        args.sample_chars = 0  # sampling reads whole logits arrays, which no process holds alone
        if args.ckpt_dir:
            p.error("checkpoints are single-process in this example; drop --ckpt-dir with --num-processes")
    if args.profile_steps < 0:
        p.error(f"--profile-steps must be >= 0, got {args.profile_steps}")
    if args.profile_steps and args.profile_steps + 2 > args.steps:
        p.error(f"--profile-steps {args.profile_steps} needs --steps >= profile steps + 2 (got {args.steps})")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.lr is not None and not 0 < args.lr < float("inf"):
        p.error(f"--lr must be a positive finite number, got {args.lr}")
    if args.warmup is not None and not 0 <= args.warmup <= args.steps:
        p.error(f"--warmup must be in 0..--steps ({args.steps}), got {args.warmup}")
    if args.sample_chars < 0:
        p.error(f"--sample-chars must be >= 0, got {args.sample_chars}")
    if args.compare and args.ckpt_dir:
        p.error("--compare trains twice from scratch; it does not take --ckpt-dir")
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    if args.stop_after is not None and args.stop_after < 1:
        p.error(f"--stop-after must be >= 1, got {args.stop_after}")
    if args.ckpt_every < 1:
        p.error(f"--ckpt-every must be >= 1, got {args.ckpt_every}")
    if args.compare and min(args.steps, args.stop_after or args.steps) < 2:
        p.error("--compare times the steps after the compiling one: it needs --steps (and --stop-after) >= 2")
    if min(args.dp, args.tp, args.steps, args.seq, args.batch) < 1:
        p.error("--dp, --tp, --steps, --seq and --batch must be >= 1")
    if args.sample_chars and args.seq <= len(SAMPLE_PROMPT):
        p.error(
            f"--seq {args.seq} leaves no room to sample after the {len(SAMPLE_PROMPT)}-character prompt "
            f"{SAMPLE_PROMPT!r}: pass --seq {len(SAMPLE_PROMPT) + 1} or more, or --sample-chars 0"
        )
    if args.mesh is not None and np.prod(args.mesh) > n_devices:
        p.error(
            f"--mesh {','.join(map(str, args.mesh))} needs dp x fsdp x tp = {np.prod(args.mesh)} devices, "
            f"but only {n_devices} {jax.default_backend()} devices are visible"
        )
    if args.dp * args.tp > n_devices:
        p.error(
            f"--dp {args.dp} x --tp {args.tp} = {args.dp * args.tp} devices, but only {n_devices} "
            f"{jax.default_backend()} devices are visible"
        )
    return args, p


def mesh_shape(text: str) -> tuple[int, int, int]:
    """--mesh DP,FSDP,TP: three sizes >= 1."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) != 3 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected three sizes >= 1, dp,fsdp,tp (e.g. 2,1,4), got {text!r}")
    return sizes


def init_distributed(args, parser) -> None:
    """jax.distributed for one process per GPU (per CPU device group without GPUs)."""
    if not args.coordinator or not 0 <= args.process_id < args.num_processes:
        parser.error("--num-processes > 1 needs --coordinator host:port and 0 <= --process-id < --num-processes")
    if not _host_has_gpus():
        # CPU processes: split the 8 emulated devices, and talk through gloo.
        jax.config.update("jax_num_cpu_devices", max(1, 8 // args.num_processes))
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    else:
        jax.distributed.initialize(
            args.coordinator, args.num_processes, args.process_id, local_device_ids=[args.process_id]
        )


def _host_has_gpus() -> bool:
    """Whether this host has NVIDIA GPUs, asked without initializing JAX (jax.distributed must come first)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return False
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return any(line.startswith("GPU ") for line in listing.splitlines())


def global_array(host, sharding: NamedSharding) -> jax.Array:
    """A global array from a host value every process holds (works with one or many processes)."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def make_mesh(args) -> jax.sharding.Mesh:
    """(dp, tp) with Explicit axes for the fully manual model; --mesh: (dp, fsdp, tp) with Auto axes,
    which the partitioner shards outside the TP regions."""
    if args.mesh is not None:
        devices = np.array(jax.devices()[: np.prod(args.mesh)]).reshape(args.mesh)
        return jax.sharding.Mesh(devices, ("dp", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3)
    devices = np.array(jax.devices()[: args.dp * args.tp]).reshape(args.dp, args.tp)
    return jax.sharding.Mesh(devices, ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)


def model_config(args, vocab_size: int, impl: str) -> GPTConfig:
    return GPTConfig(
        vocab_size=vocab_size,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        ffn=args.ffn,
        impl=impl,
        dtype=args.dtype,
        remat=args.remat,
        attention_implementation=None if args.attention == "xla" else args.attention,
        sequence_parallel=args.sequence_parallel,
        fp8=args.fp8,
        gspmd=args.mesh is not None,
        fsdp_axis="fsdp" if args.mesh is not None else None,
    )


def make_optimizer(args) -> optax.GradientTransformation:
    """AdamW with linear warm-up and cosine decay to 10%, after clipping the global grad norm to 1."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1), end_value=args.lr * 0.1
    )
    decay_matrices_only = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98, weight_decay=0.1, mask=decay_matrices_only)
    )


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token loss. A one-hot product, not a gather: it keeps the batch/sequence
    sharding of the logits (vocabularies here are small)."""
    one_hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.sum(logits * one_hot, axis=-1))


def make_step_functions(graphdef, tx, out_shardings=None):
    """jit-compiled train step (params and optimizer state donated) and loss/logits functions.
    `out_shardings`: the step's (params, opt_state, loss) placement; on Auto axes it keeps the
    state where it started (else the partitioner picks, and the next step sees other shardings)."""

    def loss_fn(params, inputs, targets):
        return cross_entropy(nnx.merge(graphdef, params)(inputs), targets)

    @functools.partial(jax.jit, donate_argnums=(0, 1), out_shardings=out_shardings)
    def train_step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    logits_fn = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))
    return train_step, jax.jit(loss_fn), logits_fn


def flux_calls(compiled) -> dict[str, int]:
    """The flux_jax custom calls in a compiled step, by target (none: every projection is a twin)."""
    targets = re.findall(r'custom_call_target="(flux_jax_\w+)"', compiled.as_text())
    return dict(sorted(collections.Counter(targets).items()))


def on_mesh(tree, mesh):
    """Replicate every leaf that is not already placed on `mesh` (e.g. optax's step counter),
    so the train step sees the same shardings on every call and compiles once."""
    replicated = NamedSharding(mesh, P())
    return jax.tree.map(
        lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding) else global_array(x, replicated), tree
    )


def trajectory_settings(args, config: GPTConfig) -> dict:
    """What must match for a checkpoint to continue this run."""
    model = dataclasses.asdict(config)
    model.pop("impl")  # fused and xla compute the same function
    return dict(
        model=model, seed=args.seed, seq=args.seq, batch=args.batch, steps=args.steps, lr=args.lr, warmup=args.warmup
    )


def open_checkpoints(args, settings: dict, state: dict):
    """(checkpoints or None, steps done, state, losses so far): a fresh start, or the latest checkpoint."""
    if not args.ckpt_dir:
        return None, 0, state, []
    checkpoints = TrainCheckpoints(args.ckpt_dir, args.ckpt_every)
    latest = checkpoints.latest_step()
    if latest is None:
        if args.resume:
            print(f"no checkpoint in {args.ckpt_dir} yet: starting at step 0")
        return checkpoints, 0, state, []
    if not args.resume:
        raise SystemExit(
            f"error: {args.ckpt_dir} already holds checkpoints (latest step {latest}); "
            "pass --resume to continue that run or use an empty --ckpt-dir"
        )
    step, state, meta = checkpoints.restore(state)
    if meta["settings"] != settings:
        raise SystemExit(
            f"error: the checkpoint in {args.ckpt_dir} was made with other settings:\n"
            f"  checkpoint: {meta['settings']}\n  this run:   {settings}"
        )
    print(f"resuming from step {step} ({args.ckpt_dir})")
    return checkpoints, step, state, list(meta["losses"])


def sample(logits_fn, params, vocab: CharVocab, args) -> str:
    """Greedy continuation of SAMPLE_PROMPT, one forward pass over the whole window per character."""
    length = min(args.sample_chars, args.seq - len(SAMPLE_PROMPT))
    window = np.zeros((args.dp * (args.fsdp or 1), args.seq), np.int32)  # one row per batch shard
    window[:, : len(SAMPLE_PROMPT)] = vocab.encode(SAMPLE_PROMPT)
    for pos in range(len(SAMPLE_PROMPT), len(SAMPLE_PROMPT) + length):
        logits = logits_fn(params, window)
        window[:, pos] = int(np.argmax(np.asarray(logits)[0, pos - 1]))
    return vocab.decode(window[0, : len(SAMPLE_PROMPT) + length])


def train(args, mesh, vocab: CharVocab, train_data, eval_data, impl: str) -> dict:
    """One training run; returns its losses, timings and evaluation."""
    config = model_config(args, len(vocab), impl)
    model = GPT(config, mesh=mesh, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = make_optimizer(args)
    state = on_mesh({"params": params, "opt_state": tx.init(params)}, mesh)
    out_shardings = None
    if config.gspmd:
        shardings = jax.tree.map(lambda a: a.sharding, state)
        out_shardings = (shardings["params"], shardings["opt_state"], NamedSharding(mesh, P()))
    train_step, loss_fn, logits_fn = make_step_functions(graphdef, tx, out_shardings)
    token_sharding = NamedSharding(mesh, model.token_spec())
    place = lambda a: global_array(a, token_sharding)

    settings = trajectory_settings(args, config)
    checkpoints, start, state, losses = open_checkpoints(args, settings, state)
    last = min(args.steps, args.stop_after if args.stop_after is not None else args.steps)
    tokens_per_step = args.batch * args.seq
    step_times, compile_s, compiled, calls = [], None, None, None
    tracer = StepTracer(args.profile_steps, first=start + 3)  # after the compile step and a warm one
    bar = ProgressBar(args.steps, start=start, desc=f"{impl:>5} ")
    try:
        for step in range(start + 1, last + 1):
            inputs, targets = batch_at(train_data, step, args.batch, args.seq, args.seed)
            tracer.before(step)
            t0 = time.perf_counter()
            batch = (state["params"], state["opt_state"], place(inputs), place(targets))
            if compiled is None:  # compiled ahead of time once, to report its flux_jax calls
                compiled = train_step.lower(*batch).compile()
                calls = flux_calls(compiled)
            params, opt_state, loss = compiled(*batch)
            loss = float(loss)  # waits for the step
            dt = time.perf_counter() - t0
            state = {"params": params, "opt_state": opt_state}
            if compile_s is None:
                compile_s = dt  # the first call compiles
            elif not tracer.active(step):
                step_times.append(dt)
            tracer.after(step)
            losses.append(loss)
            bar.update(step, loss, tokens_per_step / dt)
            if checkpoints and checkpoints.due(step, last):
                checkpoints.save(step, state, {"settings": settings, "losses": losses})
    except KeyboardInterrupt:
        bar.close()
        saved = checkpoints and checkpoints.latest_step()
        print("interrupted" + (f"; --resume continues from step {saved}" if saved else ""))
        raise SystemExit(130) from None
    bar.close()
    if checkpoints:
        checkpoints.close()

    eval_loss = statistics.fmean(
        float(loss_fn(state["params"], *map(place, batch_at(eval_data, i, args.batch, args.seq, args.seed))))
        for i in range(EVAL_BATCHES)
    )
    median = statistics.median(step_times) if step_times else None
    result = dict(
        impl=impl,
        flux_calls=calls,
        first_step=start + 1,
        completed_steps=last,
        losses=losses,
        first_loss=losses[0] if losses else None,
        final_loss=losses[-1] if losses else None,
        eval_loss=eval_loss,
        compile_s=compile_s,
        step_time_ms=median and median * 1e3,
        tokens_per_s=median and tokens_per_step / median,
    )
    if tracer.summary is not None:
        result["profile"] = tracer.summary
    if args.sample_chars > 0:
        result["sample"] = sample(logits_fn, state["params"], vocab, args)
    return result


def describe(args, vocab_size: int) -> str:
    devices = jax.devices()
    sp = "" if args.sequence_parallel else " (no sequence parallelism)"
    mesh = f"dp={args.dp} x tp={args.tp}"
    if args.mesh is not None:
        mesh = f"dp={args.dp} x fsdp={args.fsdp} x tp={args.tp} (GSPMD, TP manual)"
    return (
        f"flux_jax {flux_jax.__version__} | {len(devices)} x {devices[0].platform} | mesh {mesh}{sp} | "
        f"GPT {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads} kv, ffn {args.ffn}, "
        f"vocab {vocab_size} | seq {args.seq} x batch {args.batch}, "
        f"{args.steps} steps, {args.dtype}" + (" with FP8 projections" if args.fp8 else "")
    )


def main(argv=None) -> dict:
    """Runs the example; returns the summary it writes to --out/summary.json."""
    args, parser = parse_args(argv)
    corpus = generate_corpus()
    vocab = CharVocab(corpus)
    data = vocab.encode(corpus)
    split = int(len(data) * 0.9)  # the last 10% is held out for the evaluation loss
    impls = ("fused", "xla") if args.compare else (args.impl,)
    mesh = make_mesh(args)
    try:  # shapes that cannot shard: a usage error naming the numbers, before anything runs
        check_config(model_config(args, len(vocab), impls[0]), mesh)
        check_tokens_shape((args.batch, args.seq), mesh, sequence_parallel=args.sequence_parallel)
    except ValueError as e:
        parser.error(str(e))
    try:  # a misspelled or out-of-range --flux-config field: a usage error now, not after compiling
        with _config.overriding(args.flux_config):
            pass
    except (ValueError, TypeError) as e:
        parser.error(f"--flux-config: {e}")
    print(describe(args, len(vocab)))

    runs = {}
    for impl in impls:
        # The GSPMD model traces under the concrete mesh (nested manual regions need it).
        mesh_context = jax.set_mesh(mesh) if args.mesh is not None else contextlib.nullcontext()
        try:
            with _config.overriding(args.flux_config), mesh_context:
                runs[impl] = train(args, mesh, vocab, data[:split], data[split:], impl)
        except flux_jax.FusedUnavailableError as e:
            raise SystemExit(f"error: {e}\n(use --impl auto to fall back to the XLA twin)") from e
        r = runs[impl]
        print(
            f"impl={impl}: loss {r['first_loss']:.3f} -> {r['final_loss']:.3f} (eval {r['eval_loss']:.3f})"
            + (f", {r['step_time_ms']:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s" if r["step_time_ms"] else "")
            + (f", compile {r['compile_s']:.1f} s" if r["compile_s"] is not None else ", no step left to run")
            + (f"; fused calls in the step: {r['flux_calls']}" if r["flux_calls"] else "")
        )
        if "profile" in r:
            print(describe_profile(r["profile"]))
        if "sample" in r:
            print(f"  sample: {r['sample']!r}")

    main_run = runs[impls[0]]
    summary = dict(
        config=vars(args)
        | {
            "vocab_size": len(vocab),
            "platform": jax.default_backend(),
            "devices": len(jax.devices()),
            "flux_jax": flux_jax.__version__,
        },
        final_loss=main_run["final_loss"],
        tokens_per_s=main_run["tokens_per_s"],
        step_time_ms=main_run["step_time_ms"],
        runs=runs,
    )
    if args.compare:
        fused, xla = runs["fused"], runs["xla"]
        summary["compare"] = dict(
            step_time_ratio_xla_over_fused=xla["step_time_ms"] / fused["step_time_ms"],
            max_abs_loss_diff=max(abs(a - b) for a, b in zip(fused["losses"], xla["losses"])),
        )
        print(
            f"compare: fused is {summary['compare']['step_time_ratio_xla_over_fused']:.3f}x the speed "
            f"of xla; largest loss difference {summary['compare']['max_abs_loss_diff']:.2e}"
        )

    if jax.process_index() != 0:  # one writer per job
        return summary
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_summary(out / "summary.json", summary)
    plot_losses(out / "loss.png", {impl: r["losses"] for impl, r in runs.items()}, describe(args, len(vocab)))
    print(f"wrote {out / 'summary.json'} and {out / 'loss.png'}")
    return summary


if __name__ == "__main__":
    # Without accelerators, emulate 8 CPU devices (must precede any JAX computation;
    # it changes nothing on a GPU host, where the GPUs are the devices).
    jax.config.update("jax_num_cpu_devices", 8)
    main()
