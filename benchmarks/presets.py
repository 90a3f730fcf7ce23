"""Benchmark shapes: named presets of (op, M, K, N) cases at a tensor-parallel degree.

Shapes are global GEMM shapes. For op "ag" (AllGather -> GEMM) x [M, K] is row-sharded over
tp and w [K, N] column-sharded; for op "rs" (GEMM -> ReduceScatter) x [M, K] is sharded on K,
w [K, N] row-sharded, and the output [M, N] row-sharded; for op "ar" (GEMM -> AllReduce, tensor
parallelism without sequence parallelism) x and w as for "rs" and the output [M, N] replicated.

dtype "fp8": bfloat16 operands and the ops with fp8=True (flux_jax.Fp8(): e4m3 operands, per-row
and per-tensor current scaling); the twin is the FP8 twin and gemm_only its FP8 GEMM.
"""

from __future__ import annotations

import dataclasses

OPS = ("ag", "rs", "ar")
M_SWEEP = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
M_DECODE = (1, 8, 16, 32, 64, 128, 256, 512, 1024)
# Held-out M values: none is in M_SWEEP or M_DECODE, none a power of two, two not multiples of
# 128 (row-tile tails); for checking that `impl="auto"` and the kernels generalize.
M_HOLDOUT = (96, 320, 1000, 3000, 6144, 12288)


@dataclasses.dataclass(frozen=True)
class Case:
    """One global GEMM shape of one op at one TP degree."""

    op: str
    M: int
    K: int
    N: int
    tp: int
    dtype: str
    layer: str  # what the shape is, e.g. "70B qkv"
    # The weight is stored [N, K] and read transposed (dx = dy w^T of a backward pass; our kernels'
    # `transpose_w`): one-GPU GEMM cases only (preset gemm-parity-1gpu).
    transpose_w: bool = False

    @property
    def flops_per_gpu(self) -> float:
        return 2.0 * self.M * self.K * self.N / self.tp

    @property
    def key(self) -> tuple:
        return (self.op, self.M, self.K, self.N)

    @property
    def fp8(self) -> bool:
        """The ops run with fp8=True on operand_dtype inputs."""
        return self.dtype == "fp8"

    @property
    def operand_dtype(self) -> str:
        """The dtype of x and w (and of the cotangent, the output and the partials)."""
        return "bfloat16" if self.fp8 else self.dtype

    def invalid_reason(self) -> str | None:
        """Why this shape cannot be sharded at its tp, or None."""
        if self.transpose_w and (self.op != "ag" or self.tp != 1):
            return "a transposed-weight case is a one-GPU GEMM: op ag at tp=1 only"
        if self.M % self.tp and self.op != "ar":  # matmul_ar shards no rows
            return f"M={self.M} is not divisible by tp={self.tp} (rows are sharded)"
        sharded = ("N", self.N) if self.op == "ag" else ("K", self.K)
        if sharded[1] % self.tp:
            return f"{sharded[0]}={sharded[1]} is not divisible by tp={self.tp}"
        return None


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named list of shapes; `tp=None` means "all devices, up to 8" (cpu-smoke)."""

    name: str
    tp: int | None
    dtype: str
    layers: tuple  # (op, K, N, label) per layer
    ms: tuple  # M values swept for every layer
    fixed: tuple = ()  # (op, M, K, N, label[, transpose_w]): exact shapes, not swept


# hidden, ffn, query heads, KV heads, head dim
_MODELS = {
    "70B": (8192, 28672, 64, 8, 128),  # LLaMA-3 70B
    "8B": (4096, 14336, 32, 8, 128),  # LLaMA-3 8B
    "Qwen14B": (5120, 13824, 40, 8, 128),  # Qwen2.5-14B-like: K and N not powers of two
    "Phi3mini": (3072, 8192, 32, 32, 96),  # Phi-3-mini-like: head dim 96, no GQA
}


def _row_parallel_layers(model: str) -> tuple:
    """A decoder's row-parallel GEMMs as GEMM -> AllReduce (no sequence parallelism): out-proj, down."""
    hidden, ffn, q_heads, _, head_dim = _MODELS[model]
    return (
        ("ar", q_heads * head_dim, hidden, f"{model} out-proj"),
        ("ar", ffn, hidden, f"{model} down"),
    )


def _llama_layers(model: str) -> tuple:
    """A decoder's TP layer GEMMs: QKV (ag), out-proj (rs), gate+up (ag), down (rs)."""
    hidden, ffn, q_heads, kv_heads, head_dim = _MODELS[model]
    qkv = (q_heads + 2 * kv_heads) * head_dim
    return (
        ("ag", hidden, qkv, f"{model} qkv"),
        ("rs", q_heads * head_dim, hidden, f"{model} out-proj"),
        ("ag", hidden, 2 * ffn, f"{model} gate+up"),
        ("rs", ffn, hidden, f"{model} down"),
    )


_BASELINES = (
    ("ag", 8192, 8192, 28672),
    ("ag", 4096, 8192, 8192),
    ("ag", 16384, 8192, 8192),
    ("ag", 256, 8192, 28672),
    ("ag", 64, 8192, 8192),
    ("rs", 8192, 28672, 8192),
    ("rs", 4096, 8192, 8192),
    ("rs", 16384, 8192, 8192),
    ("rs", 256, 28672, 8192),
    ("rs", 64, 8192, 8192),
)


def _build_presets() -> dict[str, Preset]:
    presets = {
        "baselines-tp2": Preset(
            "baselines-tp2",
            2,
            "bfloat16",
            (),
            (),
            tuple((op, m, k, n, "baselines.md") for op, m, k, n in _BASELINES),
        ),
        "decode-tp2": Preset("decode-tp2", 2, "bfloat16", _llama_layers("8B") + _llama_layers("70B"), M_DECODE),
        # Issue 8's target shapes: K = N = 8192, AG and RS, at the decode / chunked-prefill M.
        "decode-8192-tp2": Preset(
            "decode-8192-tp2",
            2,
            "bfloat16",
            (),
            (),
            tuple((op, m, 8192, 8192, "K=N=8192") for op in ("ag", "rs") for m in (64, 128, 256, 512, 1024)),
        ),
        # matmul_ar (TP without sequence parallelism) at decode sizes: the row-parallel layers of
        # LLaMA-3 8B and 70B; the twin is psum(dot), the limits the GEMM and the all-reduce alone.
        "decode-ar-tp2": Preset(
            "decode-ar-tp2", 2, "bfloat16", _row_parallel_layers("8B") + _row_parallel_layers("70B"), M_DECODE
        ),
        "decode-ar-tp4": Preset(
            "decode-ar-tp4", 4, "bfloat16", _row_parallel_layers("8B") + _row_parallel_layers("70B"), M_DECODE
        ),
        # Issue 4's GEMM check: per GPU an 8192^3 GEMM (AG at tp=2 splits N), for
        # flux_gemm_only (our GEMM alone) vs gemm_only (XLA's jnp.dot).
        "gemm-8192-tp2": Preset("gemm-8192-tp2", 2, "bfloat16", (), (), (("ag", 8192, 8192, 16384, "8192^3 per GPU"),)),
        # Shapes no kernel or rule was tuned on (models and M values not in the other presets).
        "holdout-tp2": Preset(
            "holdout-tp2",
            2,
            "bfloat16",
            _llama_layers("Qwen14B") + _llama_layers("Phi3mini"),
            M_HOLDOUT,
        ),
        "cpu-smoke": Preset(
            "cpu-smoke",
            None,
            "bfloat16",
            (),
            (),
            tuple((op, m, k, n, "smoke") for op in OPS for m, k, n in ((64, 64, 64), (32, 48, 96))),
        ),
    }
    for model in ("70B", "8B"):
        for tp in (2, 4, 8):
            name = f"llama{model.lower()}-tp{tp}"
            presets[name] = Preset(name, tp, "bfloat16", _llama_layers(model), M_SWEEP)
        # FP8 operands (dtype "fp8"), against the FP8 twin and its FP8 GEMM.
        name = f"llama{model.lower()}-fp8-tp2"
        presets[name] = Preset(name, 2, "fp8", _llama_layers(model), M_SWEEP)
    return presets


PRESETS = _build_presets()


# ---- gemm-parity-1gpu: our GEMM against XLA's on one GPU ---------------------------------------
# The per-GPU GEMMs of every TP=2 layer preset (llama8b/70b-tp2, holdout-tp2's Qwen2.5-14B-like and
# Phi-3-mini-like layers, gemm-8192-tp2's 8192^3), as op "ag" at tp=1 (x [M, k] @ w [k, n], no
# communication): forward at M_PARITY, and the dx orientation of the same layer (dx = dy w^T:
# [M, n] @ w[k, n]^T, the weight read transposed, as a fused op's backward runs it); the forward
# of the LLaMA and holdout layers at decode sizes M_PARITY_DECODE (bf16 only on the decode GEMM).
# Runs with `benchmarks.run --preset gemm-parity-1gpu` (variants gemm_only, flux_gemm_only,
# flux_gemm_only_decode) or `python -m benchmarks.gemm_parity` (every GEMM instance A/B'd in one
# process; benchmarks/README.md).
M_PARITY = (2048, 4096, 8192, 16384)
M_PARITY_DECODE = (8, 16, 32, 64, 128, 256)
PARITY_MODELS = ("8B", "70B", "Qwen14B", "Phi3mini")


def parity_layers(tp: int = 2) -> tuple:
    """(k, n, label) of the per-GPU GEMM of every TP layer of PARITY_MODELS at `tp`, plus 8192^3."""
    layers = []
    for model in PARITY_MODELS:
        for op, k, n, label in _llama_layers(model):
            k_gpu, n_gpu = (k, n // tp) if op == "ag" else (k // tp, n)
            layers.append((k_gpu, n_gpu, f"{label} ({op} tp={tp})"))
    layers.append((8192, 8192, "8192^2 (gemm-8192-tp2)"))
    return tuple(layers)


def _gemm_parity_preset() -> Preset:
    shapes: dict[tuple, list[str]] = {}  # (M, K, N, transpose_w) -> labels (layers sharing a GEMM)
    for k, n, label in parity_layers():
        for m in M_PARITY:
            shapes.setdefault((m, k, n, False), []).append(label)
            shapes.setdefault((m, n, k, True), []).append(f"{label} dx")  # dy [M, n] @ (w [k, n])^T
        if not label.startswith("8192^2"):
            for m in M_PARITY_DECODE:
                shapes.setdefault((m, k, n, False), []).append(f"{label} decode")
    fixed = tuple(("ag", m, k, n, " = ".join(labels), transposed) for (m, k, n, transposed), labels in shapes.items())
    return Preset("gemm-parity-1gpu", 1, "bfloat16", (), (), fixed)


PRESETS["gemm-parity-1gpu"] = _gemm_parity_preset()


def preset_tp(preset: Preset, device_count: int) -> int:
    """The TP degree a preset runs at on this machine (errors if devices are missing)."""
    if preset.tp is None:
        return min(device_count, 8)
    if device_count < preset.tp:
        raise SystemExit(
            f"preset {preset.name!r} needs tp={preset.tp} devices, but only {device_count} are "
            "visible (use cpu-smoke on a machine with fewer devices)"
        )
    return preset.tp


def case_from_text(text: str, tp: int, label: str, dtype: str = "bfloat16") -> Case:
    """A Case from "op:MxKxN" (global shapes, as the diagnostics take them on the command line)."""
    op, _, dims = text.partition(":")
    m, k, n = (int(v) for v in dims.lower().split("x"))
    return Case(op, m, k, n, tp, dtype, label)


def select_cases(
    preset: Preset, tp: int, ops: tuple[str, ...], ms: tuple[int, ...] | None, dtype: str | None
) -> tuple[list[Case], list[dict]]:
    """The preset's cases for `ops` (and the --m subset), plus the skipped shapes with reasons."""
    dtype = dtype or preset.dtype
    shapes = [(op, m, k, n, label) for op, k, n, label in preset.layers for m in preset.ms]
    shapes += list(preset.fixed)
    cases, skipped = [], []
    for op, m, k, n, label, *transposed in shapes:
        if op not in ops or (ms is not None and m not in ms):
            continue
        case = Case(op, m, k, n, tp, dtype, label, transpose_w=bool(transposed and transposed[0]))
        reason = case.invalid_reason()
        if reason:
            skipped.append({"op": op, "M": m, "K": k, "N": n, "layer": label, "reason": reason})
        else:
            cases.append(case)
    if not cases:
        raise SystemExit(f"preset {preset.name!r} has no valid case for ops={ops} and M={ms}")
    return cases, skipped
