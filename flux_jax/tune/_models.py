"""The model presets of `python -m flux_jax.tune --model`: a decoder layer's tensor-parallel GEMMs.

The layer shapes of benchmarks/presets.py (benchmarks/ is not installed with the package).
Shapes are global: ag_matmul's x [M, K] is row-sharded and w [K, N] column-sharded over TP;
matmul_rs's and matmul_ar's x [M, K] and w [K, N] are sharded on K.
"""

from __future__ import annotations

# hidden, ffn, query heads, KV heads, head dim
MODELS = {
    "llama3-8b": (4096, 14336, 32, 8, 128),
    "llama3-70b": (8192, 28672, 64, 8, 128),
    "qwen2.5-14b": (5120, 13824, 40, 8, 128),
    "phi3-mini": (3072, 8192, 32, 32, 96),
}

# Rows (tokens per step) swept by default: decode batches to long prefills.
DEFAULT_MS = (8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def layers(model: str, sequence_parallel: bool = True) -> tuple:
    """(op, K, N, label) of the layer's GEMMs whose communication a fused op carries.

    With sequence parallelism: QKV (ag), out-proj (rs), gate+up (ag), down (rs). Without it
    (Megatron's first layout) the column-parallel GEMMs move nothing forward (column_matmul) and
    all-reduce their input gradient backward, dx = dy w^T (matmul_ar over their N); the
    row-parallel ones all-reduce their output (matmul_ar).
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; the presets are: {', '.join(MODELS)}")
    hidden, ffn, q_heads, kv_heads, head_dim = MODELS[model]
    qkv = (q_heads + 2 * kv_heads) * head_dim
    if not sequence_parallel:
        return (
            ("matmul_ar", qkv, hidden, f"{model} qkv dx"),
            ("matmul_ar", q_heads * head_dim, hidden, f"{model} out-proj"),
            ("matmul_ar", 2 * ffn, hidden, f"{model} gate+up dx"),
            ("matmul_ar", ffn, hidden, f"{model} down"),
        )
    return (
        ("ag_matmul", hidden, qkv, f"{model} qkv"),
        ("matmul_rs", q_heads * head_dim, hidden, f"{model} out-proj"),
        ("ag_matmul", hidden, 2 * ffn, f"{model} gate+up"),
        ("matmul_rs", ffn, hidden, f"{model} down"),
    )
