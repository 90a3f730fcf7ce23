"""What `python -m flux_jax.tune` measures: the shapes of a request (explicit, a model preset's
layers, or a function's flux_jax calls), each one op's global GEMM at one TP size and dtype."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import numpy as np

from flux_jax import _tuning
from flux_jax.tune import _models

OPS = ("ag_matmul", "matmul_rs", "matmul_ar")
_OP_ALIASES = {"ag": "ag_matmul", "rs": "matmul_rs", "ar": "matmul_ar", **{op: op for op in OPS}}
# "fp8": bfloat16 x and w with fp8=True (the default recipe: e4m3 operands, current scaling),
# against the FP8 twin; its table entries have dtype "float8_e4m3fn" (flux_jax/_tuning).
DTYPES = ("bfloat16", "float16", "float32", "fp8")


class TuneError(Exception):
    """A request the tool cannot run (the message says why and what to do)."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """One global GEMM of one op at one TP size and dtype."""

    op: str
    M: int
    K: int
    N: int
    tp: int
    dtype: str
    label: str = ""

    @property
    def text(self) -> str:
        return f"{self.op}:{self.M}x{self.K}x{self.N}"

    @property
    def fp8(self) -> bool:
        return self.dtype == "fp8"

    @property
    def x_dtype(self) -> str:
        return "bfloat16" if self.fp8 else self.dtype

    @property
    def table_dtype(self) -> str:
        """The dtype of the shape's table entry (flux_jax/_tuning.table_dtype)."""
        return _tuning.FP8 if self.fp8 else self.dtype

    def per_rank(self) -> tuple[int, int, int]:
        """(rows, k, n) of the per-rank GEMM, as flux_jax/_plan.Problem counts them."""
        if self.op == "ag_matmul":
            return self.M, self.K, self.N // self.tp
        return self.M, self.K // self.tp, self.N

    def invalid(self) -> str | None:
        if self.op != "matmul_ar" and self.M % self.tp:  # matmul_ar's rows stay whole on every rank
            return f"M={self.M} is not divisible by tp={self.tp} (rows are sharded)"
        name, value = ("N", self.N) if self.op == "ag_matmul" else ("K", self.K)
        if value % self.tp:
            return f"{name}={value} is not divisible by tp={self.tp}"
        return None


def _op(text: str) -> str:
    if text not in _OP_ALIASES:
        raise TuneError(f"unknown op {text!r}: use ag_matmul, matmul_rs or matmul_ar (or ag, rs, ar)")
    return _OP_ALIASES[text]


def parse_ints(text, what: str) -> list[int]:
    if isinstance(text, (list, tuple)):
        values = list(text)
    else:
        try:
            values = [int(v) for v in str(text).split(",") if v.strip()]
        except ValueError:
            raise TuneError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or any(type(v) is not int or v < 1 for v in values):
        raise TuneError(f"{what} must be positive integers, got {text!r}")
    return values


def parse_names(text, what: str, allowed) -> list[str]:
    values = list(text) if isinstance(text, (list, tuple)) else [v.strip() for v in str(text).split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if not values or bad:
        raise TuneError(f"{what} must be among {', '.join(allowed)}, got {text!r}")
    return values


def parse_shapes(text, tps, dtypes) -> list[Shape]:
    """Shapes from "op:MxKxN,op:MxKxN" (global shapes; op ag_matmul / matmul_rs / matmul_ar, or
    ag / rs / ar)."""
    items = list(text) if isinstance(text, (list, tuple)) else [s for s in str(text).split(",") if s.strip()]
    out = []
    for item in items:
        op, sep, dims = str(item).strip().partition(":")
        try:
            m, k, n = (int(v) for v in dims.lower().split("x"))
        except ValueError:
            raise TuneError(f"a shape is op:MxKxN (e.g. ag_matmul:4096x8192x28672), got {item!r}") from None
        if not sep or min(m, k, n) < 1:
            raise TuneError(f"a shape is op:MxKxN with positive sizes, got {item!r}")
        out += [Shape(_op(op), m, k, n, tp, dtype, "--shapes") for tp in tps for dtype in dtypes]
    return out


def model_shapes(model: str, ms, tps, dtypes, sequence_parallel: bool = True) -> list[Shape]:
    """A model preset's layer GEMMs at every M, TP size and dtype (`sequence_parallel`: the ops of
    the two layouts, _models.layers)."""
    try:
        layers = _models.layers(model, sequence_parallel)
    except ValueError as err:
        raise TuneError(str(err)) from None
    return [
        Shape(op, m, k, n, tp, dtype, label) for tp in tps for dtype in dtypes for op, k, n, label in layers for m in ms
    ]


def function_shapes(target) -> list[Shape]:
    """The flux_jax calls of `target` (a "module:function" or a callable) that returns (fn, args),
    found with flux_jax.explain: every call site's GEMM at its TP size and dtype."""
    from flux_jax import _explain

    given = target if isinstance(target, str) else getattr(target, "__qualname__", repr(target))
    if isinstance(target, str):
        module, sep, name = target.partition(":")
        if not sep or not module or not name:
            raise TuneError(f"--from takes module:function, got {target!r}")
        try:
            target = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as err:
            raise TuneError(f"--from {module}:{name}: {err}") from None
    expected = "a function that takes no arguments and returns (fn, args)"
    if not callable(target):
        raise TuneError(f"--from {given} is a {type(target).__name__}, not {expected}")
    try:
        inspect.signature(target).bind()
    except TypeError as err:
        raise TuneError(f"--from {given} cannot be called without arguments ({err}): it must be {expected}") from None
    except ValueError:  # no signature to check (some built-ins): the call below tells
        pass
    made = target()
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])):
        raise TuneError("--from: the function must return (fn, args), a callable and its arguments")
    fn, args = made
    shapes, undescribed = [], []
    for site in _explain.explain(fn, *tuple(args)):
        p = site.problem
        dtype = _tuning.table_dtype(p)
        if p.op in OPS and dtype is None:  # FP8 calls no table describes: e5m2 rows, x not bfloat16
            undescribed.append(f"{p.op} with fp8 on {np.dtype(p.dtype).name} x ({p.fp8} rows)")
        if p.op not in OPS or dtype is None:
            continue
        m, k, n = (p.rows, p.k, p.n * p.tp) if p.op == "ag_matmul" else (p.rows, p.k * p.tp, p.n)
        dtype = "fp8" if dtype == _tuning.FP8 else dtype
        shape = Shape(p.op, m, k, n, p.tp, dtype, "backward" if site.backward else "forward")
        if all(dataclasses.replace(s, label="") != dataclasses.replace(shape, label="") for s in shapes):
            shapes.append(shape)
    if not shapes and undescribed:
        raise TuneError(
            f"--from: the function's only flux_jax calls ({', '.join(sorted(set(undescribed)))}) are FP8 calls "
            'no tuning table describes: tables hold FP8 calls with bfloat16 x (e4m3 rows); impl="auto" '
            'runs the twin for the others, impl="fused" the fused paths'
        )
    if not shapes:
        raise TuneError(
            "--from: the function has no ag_matmul / matmul_rs / matmul_ar call (flux_jax.explain found none)"
        )
    return shapes
