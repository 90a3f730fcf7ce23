"""The built-in impl="auto" rule for Hopper GPUs at TP=2: the points measured on 2x H200.

`POINTS` lists, per per-rank GEMM (`rows` of the whole GEMM, contraction `k`, output columns `n`
per rank), the path that won on 2x H200 at TP=2 in bfloat16 and the speedups over the twin
behind it (docs/decisions/2026-11-30-auto-overlap-region.md, -latency-path-rank-free.md,
-ag-decode-path.md, -rs-decode-path.md). They are the built-in tuning table,
flux_jax/_tuning/h200_tp2.json, written by the tuning tool's table code (`write_table`;
`python -m flux_jax._auto_rule` rewrites it); impl="auto" reads the table through
flux_jax/_plan.py like any measured one, and interpolates between these points the same way
(flux_jax/_tuning/__init__.py). float16 runs the same kernels on 2-byte elements as bfloat16
but has no decode kernels: its entries are the bfloat16 points, where the decode path won with
the tool's choice among the other paths measured (the latency path where none was).

`choose` and `best_fused_path` answer what the planner runs under this table on a Hopper GPU.
"""

from __future__ import annotations

import numpy as np

# H200 (132 SMs) at TP=2: XLA's all-gather moves 134 MB per GPU at 226.9 GB/s (AG 16384 x 8192)
# and takes 19.7 us at its smallest (RS 96 x 3072 x 3072), comm_only in
# benchmarks/data/harness_{baselines,holdout}-tp2*_2026-11-30.json.
DEVICE_KIND, SMS, LINK_GBPS, LINK_LATENCY_US, GPU_COUNT, TP = "NVIDIA H200", 132, 226.9, 19.7, 2, 2

_OVERLAP = "enough row tiles to hide the transfer under the overlap GEMM"
_AG_DECODE = "the rows pushed over NVLink while a GEMM in the weight's orientation already streams the weight"
_RS_DECODE = "one GEMM in the weight's orientation whose epilogue reduce-scatters each output tile over NVLink"
_LATENCY = "our NVLink collective + XLA's GEMM"


def _data(run: str) -> str:
    return f"the harness run in benchmarks/data/harness_{run}_2026-11-30.json"


_WIDE = "the gather is a small share of this wide GEMM and XLA's GEMM is 1-6% faster than ours here"

# (op, rows, k, n, path that won, speedups over the twin, note)
POINTS = (
    ("ag_matmul", 4096, 8192, 4096, "overlap", {"overlap": 1.40}, _OVERLAP),
    ("ag_matmul", 8192, 8192, 14336, "overlap", {"overlap": 1.03, "latency": 1.01}, _OVERLAP),
    ("ag_matmul", 8192, 4096, 14336, "overlap", {"overlap": 1.10}, f"{_OVERLAP} (1.02-1.21x in four runs)"),
    ("ag_matmul", 16384, 8192, 28672, "overlap", {"overlap": 1.03}, f"{_OVERLAP} (70B gate+up)"),
    ("ag_matmul", 2048, 28672, 4096, "overlap", {"overlap": 1.22, "latency": 1.05}, f"{_OVERLAP} (256 tiles)"),
    ("ag_matmul", 2048, 4096, 3072, "overlap", {"overlap": 1.26, "latency": 1.18}, f"{_OVERLAP} (192 tiles)"),
    (
        "ag_matmul",
        2048,
        14336,
        2048,
        "latency",
        {"overlap": 0.97, "latency": 1.10},
        (
            "the per-rank GEMM has 128 output tiles of 128 x 256, about one wave: the overlap kernel cannot "
            "hide the transfer"
        ),
    ),
    ("ag_matmul", 1024, 4096, 3072, "latency", {"overlap": 0.85, "latency": 1.20}, _LATENCY),
    (
        "ag_matmul",
        12288,
        5120,
        13824,
        "twin",
        {"overlap": 0.99, "latency": 1.00},
        f"{_WIDE}: the overlap measured 0.97-1.01x",
    ),
    (
        "ag_matmul",
        16384,
        4096,
        14336,
        "twin",
        {"overlap": 1.00},
        f"{_WIDE}: the overlap measured 0.98-1.15x in four runs, a 1-3% loss in three of six",
    ),
    ("ag_matmul", 320, 5120, 3584, "latency", {"latency": 1.18}, f"{_LATENCY} (held out)"),
    ("ag_matmul", 264, 4096, 1024, "latency", {}, f"{_LATENCY}: more rows than two decode tiles"),
    ("ag_matmul", 256, 8192, 5120, "latency", {"latency": 1.21, "decode": 0.98}, _LATENCY),
    ("ag_matmul", 256, 4096, 3072, "decode", {"decode": 1.54, "latency": 1.10}, f"{_AG_DECODE} (8B qkv, 96 tiles)"),
    (
        "ag_matmul",
        256,
        8192,
        4096,
        "latency",
        {"decode": 1.18, "latency": 1.32},
        f"{_LATENCY}: 128 decode tiles and the push's 32 blocks overflow 132 SMs",
    ),
    ("ag_matmul", 192, 4096, 3200, "decode", {}, f"{_AG_DECODE}: 100 tiles and the push's 32 blocks fill 132 SMs"),
    (
        "ag_matmul",
        192,
        4096,
        3208,
        "latency",
        {},
        f"{_LATENCY}: 102 decode tiles and the push's 32 blocks overflow 132 SMs",
    ),
    ("ag_matmul", 128, 8192, 5120, "decode", {"decode": 1.35, "latency": 1.17}, f"{_AG_DECODE} (70B qkv)"),
    ("ag_matmul", 64, 4096, 3072, "decode", {"decode": 1.29, "latency": 1.12}, f"{_AG_DECODE} (8B qkv)"),
    ("ag_matmul", 8, 8192, 5120, "decode", {"decode": 1.14, "latency": 1.09}, f"{_AG_DECODE} (70B qkv)"),
    (
        "ag_matmul",
        64,
        4096,
        14336,
        "latency",
        {"decode": 1.08, "latency": 1.03},
        f"{_LATENCY} (8B gate+up: decode 0.98-1.18x)",
    ),
    ("ag_matmul", 16, 8192, 28672, "latency", {"decode": 0.98, "latency": 1.05}, f"{_LATENCY} (70B gate+up)"),
    ("matmul_rs", 8192, 2048, 28672, "overlap", {"overlap": 1.15, "latency": 1.02}, _OVERLAP),
    ("matmul_rs", 4096, 4096, 8192, "overlap", {"overlap": 1.42}, _OVERLAP),
    ("matmul_rs", 2048, 2048, 28672, "overlap", {"overlap": 1.15, "latency": 1.03}, _OVERLAP),
    ("matmul_rs", 1024, 4096, 8192, "overlap", {"overlap": 1.24, "latency": 1.10}, _OVERLAP),
    ("matmul_rs", 1024, 2048, 4096, "latency", {"overlap": 0.77, "latency": 1.23}, _LATENCY),
    ("matmul_rs", 256, 4096, 8192, "latency", {"latency": 1.39}, _LATENCY),
    ("matmul_rs", 128, 4096, 8192, "latency", {"latency": 1.22, "decode": 1.19}, f"{_LATENCY} (70B out-proj)"),
    ("matmul_rs", 128, 7168, 4096, "latency", {"latency": 1.15, "decode": 1.08}, f"{_LATENCY} (8B down)"),
    ("matmul_rs", 128, 2048, 4096, "decode", {"decode": 1.49, "latency": 1.23}, f"{_RS_DECODE} (8B out-proj)"),
    ("matmul_rs", 96, 2560, 5120, "decode", {"latency": 1.32}, f"{_RS_DECODE} (held out; a 13M-element weight)"),
    ("matmul_rs", 96, 2560, 8192, "latency", {}, f"{_LATENCY} (a 21M-element weight, as at 128 rows)"),
    ("matmul_rs", 64, 4096, 8192, "decode", {"decode": 1.31, "latency": 1.14}, f"{_RS_DECODE} (70B out-proj)"),
    ("matmul_rs", 16, 2048, 4096, "decode", {"decode": 1.30, "latency": 1.22}, f"{_RS_DECODE} (8B out-proj)"),
    ("matmul_rs", 16, 14336, 8192, "decode", {"decode": 1.08, "latency": 1.06}, f"{_RS_DECODE} (70B down)"),
    ("matmul_rs", 8, 7168, 4096, "decode", {"decode": 1.19, "latency": 1.21}, f"{_RS_DECODE} (8B down: a tie)"),
    # The harness's other shapes where a path was measured (one run each; decode-tp2 timed
    # auto, the rule's path): the path is the rule's choice, settled over the runs above where
    # one run reads a tie.
    ("ag_matmul", 16384, 4096, 3072, "overlap", {"overlap": 1.37}, _data("llama8b-tp2_ag_m8192-16384")),
    ("ag_matmul", 16384, 8192, 4096, "overlap", {"latency": 1.04, "overlap": 1.25}, _data("baselines-tp2")),
    ("ag_matmul", 16384, 8192, 5120, "overlap", {"overlap": 1.26}, _data("llama70b-tp2_ag")),
    ("ag_matmul", 12288, 3072, 4608, "overlap", {"latency": 1.05, "overlap": 1.08}, _data("holdout-tp2_ag")),
    ("ag_matmul", 12288, 5120, 3584, "overlap", {"latency": 1.11, "overlap": 1.29}, _data("holdout-tp2_ag")),
    ("ag_matmul", 8192, 4096, 3072, "overlap", {"overlap": 1.35}, _data("llama8b-tp2_ag_m8192-16384")),
    ("ag_matmul", 8192, 8192, 5120, "overlap", {"overlap": 1.24}, _data("llama70b-tp2_ag")),
    ("ag_matmul", 8192, 8192, 28672, "overlap", {"overlap": 0.99}, _data("llama70b-tp2_ag")),
    ("ag_matmul", 6144, 3072, 4608, "overlap", {"latency": 1.11, "overlap": 1.18}, _data("holdout-tp2_ag")),
    ("ag_matmul", 6144, 5120, 3584, "overlap", {"latency": 1.07, "overlap": 1.26}, _data("holdout-tp2_ag")),
    ("ag_matmul", 6144, 5120, 13824, "overlap", {"latency": 1.03, "overlap": 1.04}, _data("holdout-tp2_ag")),
    ("ag_matmul", 4096, 4096, 3072, "overlap", {"overlap": 1.42}, _data("llama8b-tp2_ag_m2048-4096")),
    ("ag_matmul", 4096, 4096, 14336, "overlap", {"overlap": 1.01}, _data("llama8b-tp2_ag_m2048-4096")),
    ("ag_matmul", 4096, 8192, 5120, "overlap", {"overlap": 1.23}, _data("llama70b-tp2_ag")),
    ("ag_matmul", 4096, 8192, 28672, "overlap", {"overlap": 1.02}, _data("llama70b-tp2_ag")),
    ("ag_matmul", 3000, 3072, 4608, "overlap", {"latency": 1.1, "overlap": 1.06}, _data("holdout-tp2_ag")),
    ("ag_matmul", 3000, 5120, 3584, "overlap", {"latency": 1.1, "overlap": 1.15}, _data("holdout-tp2_ag")),
    ("ag_matmul", 3000, 5120, 13824, "overlap", {"latency": 1.02, "overlap": 1.02}, _data("holdout-tp2_ag")),
    ("ag_matmul", 2048, 4096, 14336, "overlap", {"overlap": 1.07}, _data("llama8b-tp2_ag_m2048-4096")),
    ("ag_matmul", 2048, 8192, 5120, "overlap", {"overlap": 1.13}, _data("llama70b-tp2_ag")),
    ("ag_matmul", 2048, 8192, 28672, "overlap", {"overlap": 1.08}, _data("llama70b-tp2_ag")),
    ("ag_matmul", 1024, 4096, 14336, "latency", {"latency": 1.08}, _data("decode-tp2")),
    ("ag_matmul", 1024, 8192, 4096, "latency", {"decode": 1.18, "latency": 1.16}, _data("decode-8192-tp2")),
    ("ag_matmul", 1024, 8192, 5120, "latency", {"latency": 1.13}, _data("decode-tp2")),
    ("ag_matmul", 1024, 8192, 28672, "latency", {"latency": 1.04}, _data("decode-tp2")),
    ("ag_matmul", 1000, 3072, 4608, "latency", {"latency": 1.2, "overlap": 0.93}, _data("holdout-tp2_ag")),
    ("ag_matmul", 1000, 3072, 8192, "latency", {"latency": 1.15, "overlap": 1.06}, _data("holdout-tp2_ag")),
    ("ag_matmul", 1000, 5120, 3584, "latency", {"latency": 1.17, "overlap": 1.04}, _data("holdout-tp2_ag")),
    ("ag_matmul", 1000, 5120, 13824, "latency", {"latency": 1.06, "overlap": 0.92}, _data("holdout-tp2_ag")),
    ("ag_matmul", 512, 4096, 3072, "latency", {"latency": 1.4}, _data("decode-tp2")),
    ("ag_matmul", 512, 4096, 14336, "latency", {"latency": 1.16}, _data("decode-tp2")),
    ("ag_matmul", 512, 8192, 4096, "latency", {"decode": 1.26, "latency": 1.26}, _data("decode-8192-tp2")),
    ("ag_matmul", 512, 8192, 5120, "latency", {"latency": 1.22}, _data("decode-tp2")),
    ("ag_matmul", 512, 8192, 28672, "latency", {"latency": 1.09}, _data("decode-tp2")),
    ("ag_matmul", 320, 3072, 4608, "latency", {"latency": 1.02, "overlap": 0.62}, _data("holdout-tp2_ag")),
    ("ag_matmul", 320, 3072, 8192, "latency", {"latency": 1.13, "overlap": 0.71}, _data("holdout-tp2_ag")),
    ("ag_matmul", 320, 5120, 13824, "latency", {"latency": 1.14, "overlap": 0.85}, _data("holdout-tp2_ag")),
    ("ag_matmul", 256, 4096, 14336, "latency", {"latency": 1.2}, _data("decode-tp2")),
    ("ag_matmul", 256, 8192, 14336, "latency", {"latency": 1.19, "overlap": 0.88}, _data("baselines-tp2")),
    ("ag_matmul", 256, 8192, 28672, "latency", {"latency": 1.06}, _data("decode-tp2")),
    ("ag_matmul", 128, 4096, 3072, "decode", {"decode": 1.41}, _data("decode-tp2")),
    ("ag_matmul", 128, 4096, 14336, "latency", {"latency": 1.09}, _data("decode-tp2")),
    ("ag_matmul", 128, 8192, 4096, "decode", {"decode": 1.3, "latency": 1.23}, _data("decode-8192-tp2")),
    ("ag_matmul", 128, 8192, 28672, "latency", {"latency": 1.12}, _data("decode-tp2")),
    ("ag_matmul", 96, 3072, 4608, "decode", {"latency": 1.05, "overlap": 0.63}, _data("holdout-tp2_ag")),
    ("ag_matmul", 96, 3072, 8192, "decode", {"latency": 0.94, "overlap": 0.64}, _data("holdout-tp2_ag")),
    ("ag_matmul", 96, 5120, 3584, "decode", {"latency": 1.03, "overlap": 0.5}, _data("holdout-tp2_ag")),
    ("ag_matmul", 96, 5120, 13824, "latency", {"latency": 1.07, "overlap": 0.82}, _data("holdout-tp2_ag")),
    ("ag_matmul", 64, 8192, 4096, "decode", {"decode": 1.24, "latency": 1.05, "overlap": 0.34}, _data("baselines-tp2")),
    ("ag_matmul", 64, 8192, 5120, "decode", {"decode": 1.48}, _data("decode-tp2")),
    ("ag_matmul", 64, 8192, 28672, "latency", {"latency": 1.08}, _data("decode-tp2")),
    ("ag_matmul", 8, 4096, 3072, "decode", {"decode": 1.42}, _data("decode-tp2")),
    ("ag_matmul", 8, 4096, 14336, "latency", {"latency": 1.06}, _data("decode-tp2")),
    ("ag_matmul", 8, 8192, 28672, "latency", {"latency": 1.02}, _data("decode-tp2")),
    ("matmul_rs", 16384, 4096, 8192, "overlap", {"latency": 1.03, "overlap": 1.19}, _data("baselines-tp2")),
    ("matmul_rs", 16384, 14336, 8192, "overlap", {"overlap": 1.05}, _data("llama70b-tp2_rs")),
    ("matmul_rs", 12288, 1536, 3072, "overlap", {"latency": 1.15, "overlap": 1.4}, _data("holdout-tp2_rs")),
    ("matmul_rs", 12288, 2560, 5120, "overlap", {"latency": 1.12, "overlap": 1.31}, _data("holdout-tp2_rs")),
    ("matmul_rs", 12288, 4096, 3072, "overlap", {"latency": 1.1, "overlap": 1.17}, _data("holdout-tp2_rs")),
    ("matmul_rs", 12288, 6912, 5120, "overlap", {"latency": 1.03, "overlap": 1.05}, _data("holdout-tp2_rs")),
    ("matmul_rs", 8192, 4096, 8192, "overlap", {"overlap": 1.2}, _data("llama70b-tp2_rs")),
    ("matmul_rs", 8192, 14336, 8192, "overlap", {"latency": 1.02, "overlap": 1.06}, _data("baselines-tp2")),
    ("matmul_rs", 6144, 1536, 3072, "overlap", {"latency": 1.19, "overlap": 1.25}, _data("holdout-tp2_rs")),
    ("matmul_rs", 6144, 2560, 5120, "overlap", {"latency": 1.11, "overlap": 1.31}, _data("holdout-tp2_rs")),
    ("matmul_rs", 6144, 4096, 3072, "overlap", {"latency": 1.08, "overlap": 1.17}, _data("holdout-tp2_rs")),
    ("matmul_rs", 6144, 6912, 5120, "overlap", {"latency": 1.04, "overlap": 1.06}, _data("holdout-tp2_rs")),
    ("matmul_rs", 4096, 14336, 8192, "overlap", {"overlap": 1.12}, _data("llama70b-tp2_rs")),
    ("matmul_rs", 3000, 1536, 3072, "overlap", {"latency": 1.2, "overlap": 1.13}, _data("holdout-tp2_rs")),
    ("matmul_rs", 3000, 2560, 5120, "overlap", {"latency": 1.15, "overlap": 1.36}, _data("holdout-tp2_rs")),
    ("matmul_rs", 3000, 4096, 3072, "overlap", {"latency": 1.12, "overlap": 1.07}, _data("holdout-tp2_rs")),
    ("matmul_rs", 3000, 6912, 5120, "overlap", {"latency": 1.06, "overlap": 1.08}, _data("holdout-tp2_rs")),
    ("matmul_rs", 2048, 4096, 8192, "overlap", {"overlap": 1.31}, _data("llama70b-tp2_rs")),
    ("matmul_rs", 2048, 14336, 8192, "overlap", {"overlap": 1.07}, _data("llama70b-tp2_rs")),
    ("matmul_rs", 1024, 7168, 4096, "latency", {"latency": 1.16}, _data("decode-tp2")),
    ("matmul_rs", 1024, 14336, 8192, "overlap", {"overlap": 1.04}, _data("decode-tp2")),
    ("matmul_rs", 1000, 1536, 3072, "latency", {"latency": 1.25, "overlap": 0.83}, _data("holdout-tp2_rs")),
    ("matmul_rs", 1000, 2560, 5120, "latency", {"latency": 1.22, "overlap": 1.15}, _data("holdout-tp2_rs")),
    ("matmul_rs", 1000, 4096, 3072, "latency", {"latency": 1.22, "overlap": 0.74}, _data("holdout-tp2_rs")),
    ("matmul_rs", 1000, 6912, 5120, "latency", {"latency": 1.08, "overlap": 0.9}, _data("holdout-tp2_rs")),
    ("matmul_rs", 512, 2048, 4096, "latency", {"latency": 1.5}, _data("decode-tp2")),
    ("matmul_rs", 512, 4096, 8192, "latency", {"latency": 1.25}, _data("decode-8192-tp2")),
    ("matmul_rs", 512, 7168, 4096, "latency", {"latency": 1.27}, _data("decode-tp2")),
    ("matmul_rs", 512, 14336, 8192, "latency", {"latency": 1.05}, _data("decode-tp2")),
    ("matmul_rs", 320, 1536, 3072, "latency", {"latency": 1.26, "overlap": 0.59}, _data("holdout-tp2_m96-320")),
    ("matmul_rs", 320, 2560, 5120, "latency", {"latency": 1.12, "overlap": 0.56}, _data("holdout-tp2_m96-320")),
    ("matmul_rs", 320, 4096, 3072, "latency", {"latency": 1.27, "overlap": 0.48}, _data("holdout-tp2_m96-320")),
    ("matmul_rs", 320, 6912, 5120, "latency", {"latency": 1.23, "overlap": 0.46}, _data("holdout-tp2_m96-320")),
    ("matmul_rs", 256, 2048, 4096, "latency", {"latency": 1.37}, _data("decode-tp2")),
    ("matmul_rs", 256, 7168, 4096, "latency", {"latency": 1.31}, _data("decode-tp2")),
    ("matmul_rs", 256, 14336, 8192, "latency", {"latency": 1.1}, _data("baselines-tp2")),
    ("matmul_rs", 128, 14336, 8192, "latency", {"latency": 1.17}, _data("decode-tp2")),
    ("matmul_rs", 96, 1536, 3072, "decode", {"latency": 1.43, "overlap": 0.62}, _data("holdout-tp2_m96-320")),
    ("matmul_rs", 96, 4096, 3072, "decode", {"latency": 1.3, "overlap": 0.4}, _data("holdout-tp2_m96-320")),
    ("matmul_rs", 96, 6912, 5120, "latency", {"latency": 1.31, "overlap": 0.37}, _data("holdout-tp2_m96-320")),
    ("matmul_rs", 64, 2048, 4096, "decode", {"decode": 1.72}, _data("decode-tp2")),
    ("matmul_rs", 64, 7168, 4096, "decode", {"decode": 1.35}, _data("decode-tp2")),
    ("matmul_rs", 64, 14336, 8192, "decode", {"decode": 1.19}, _data("decode-tp2")),
    ("matmul_rs", 8, 2048, 4096, "decode", {"decode": 1.29}, _data("decode-tp2")),
    ("matmul_rs", 8, 4096, 8192, "decode", {"decode": 1.16}, _data("decode-tp2")),
    ("matmul_rs", 8, 14336, 8192, "decode", {"decode": 1.07}, _data("decode-tp2")),
)


def _float16(path: str, speedup: dict, note: str) -> dict:
    """A point's float16 entry: the bfloat16 one, but where the decode path won (no float16
    decode kernel) the tool's choice among the other paths measured, or the latency path where
    none was (the decode region's small-M calls, where latency is the measured winner)."""
    if path != "decode":
        return {"path": path, "speedup": speedup, "note": f"{note}; the bfloat16 measurement"}
    from flux_jax.tune import _table

    rest = {p: s for p, s in speedup.items() if p != "decode"}
    chosen = _table.choose(rest) if rest else "latency"
    why = "" if chosen != "twin" else ", and no other path beat the twin"
    return {"path": chosen, "speedup": rest, "note": f"the bfloat16 measurement; no float16 decode kernel{why}"}


def entries():
    """The built-in table's entries: POINTS in bfloat16, and in float16 without the decode path."""
    from flux_jax.tune import _table

    device = _table.Device(DEVICE_KIND, "gpu", SMS, LINK_GBPS, LINK_LATENCY_US)
    out = {}
    for op, rows, k, n, path, speedup, note in POINTS:
        f16 = _float16(path, speedup, note)
        for dtype, chosen in (("bfloat16", {"path": path, "speedup": speedup, "note": note}), ("float16", f16)):
            entry = _table.make_entry(
                device,
                GPU_COUNT,
                TP,
                dtype,
                op,
                rows,
                k,
                n,
                chosen["speedup"],
                path=chosen["path"],
                note=chosen["note"],
            )
            out.setdefault(entry.key, entry)  # a point listed earlier keeps its shape class
    return device, list(out.values())


def write_table(path) -> None:
    """Writes the built-in table (flux_jax/_tuning/h200_tp2.json) with the tool's table code."""
    from flux_jax.tune import _table

    device, points = entries()
    _table.write(path, _table.merged(None, device, points))


def _plan_on_hopper(op: str, tp: int, rows: int, k: int, n: int, dtype, impl: str) -> str:
    from flux_jax import _plan, _tuning
    from flux_jax._config import Config

    problem = _plan.Problem(op, rows, k, n, np.dtype(dtype), tp, "cuda")
    path = _plan.plan(problem, impl, Config(tuning=str(_tuning.BUILTIN_PATH)), on_hopper=True).path
    return "xla" if path == "twin" else path


def choose(op: str, tp: int, rows: int, k: int, n: int, dtype) -> str:
    """ "overlap", "latency", "decode" or "xla": what impl="auto" runs on a Hopper GPU under the
    built-in table for a per-rank GEMM (`k`, `n`: AG: K and N/tp; RS: K/tp and N)."""
    return _plan_on_hopper(op, tp, rows, k, n, dtype, "auto")


def best_fused_path(op: str, tp: int, rows: int, k: int, n: int, dtype) -> str:
    """The fused path for a call that must be fused (impl="fused", fused_path="auto")."""
    return _plan_on_hopper(op, tp, rows, k, n, dtype, "fused")


if __name__ == "__main__":
    from flux_jax import _tuning

    write_table(_tuning.BUILTIN_PATH)
    print(f"wrote {_tuning.BUILTIN_PATH}")
