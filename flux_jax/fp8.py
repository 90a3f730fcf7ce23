"""FP8 operands for the fused ops: the recipe `Fp8`, current scaling and the FP8 GEMM.

`ag_matmul(..., fp8=True)`, `matmul_rs`, `matmul_ar` and `column_matmul` (or `fp8=Fp8(...)`) take
high-precision x and w (float32, bfloat16, float16), quantize them with current scaling (the amax of the values
at hand, no history), run the op on the FP8 operands with float32 accumulation and the scales
applied after the GEMM, and return x's dtype. Scaling granularity:

  x   one scale per row: a rank's rows travel with their own scales, so no amax crosses ranks;
  w   one scale per tensor, or one per output column of the GEMM (`weight_scaling="column"`);
  dy  (backward) one scale per row, in the backward format (float8_e5m2 by default).

Quantization is straight-through: the gradients reach the high-precision x and w as if the
rounding were the identity. The backward runs the paired op on FP8 operands, as the forward:

  ag_matmul:  dx = matmul_rs(dy, w^T): dy (e5m2, per row) x w (e4m3) FP8 GEMM, then the
              reduce-scatter of the partial in x's dtype;
              dw = AG(x)^T dy in x's dtype, AG(x) the dequantized FP8 rows the forward gathered.
  matmul_rs:  dx = ag_matmul(dy, w^T): the e5m2 rows of dy and their scales are gathered, then
              the FP8 GEMM with w (e4m3);
              dw = x^T AG(dy) in x's dtype, AG(dy) the dequantized e5m2 rows that gather moved.
  matmul_ar:  (dy is replicated) dx = dy (e5m2) x w^T (e4m3), a local FP8 GEMM; dw = x^T dy.
  column_matmul: dx = matmul_ar(dy, w^T) on dy's e5m2 rows; dw = x^T dy.

The weight gradients run in x's dtype: their contraction runs over the rows (tokens), the
dimension the per-row scales live on, and a GEMM can apply scales after accumulating only
along its output's rows and columns; an FP8 dw would need x and dy quantized a second time
per column (a second rounding, and another pass over the gathered rows).

Pre-quantized weights. Current scaling reads w twice on every call (its amax, then the
transposing quantization); at decode sizes that is most of the call (94-96 us of a 120-134 us
matmul_ar at 7168 x 8192 and 14336 x 4096 on one H200, benchmarks/RESULTS.md "FP8 at decode
sizes"), and XLA does not hoist it out of a generation loop. `Fp8Weight.quantize(w, recipe)` runs it once (at load
time) and every op takes the resulting `Fp8Weight` as its `w`: the FP8 values K-major, [n, k], as
the fused FP8 GEMMs read them, and their float32 scales (fp8=None then means the default recipe
with the weight's scaling). No path quantizes it again, except the backward of a per-column
weight (below). A pre-quantized weight is frozen: its cotangent is zero.
dx still flows, straight-through as above:

  per-tensor scale: dx's FP8 GEMM reads q transposed with the same scale (no requantization);
  per-column scales: they sit on dx's contraction dimension, where no epilogue can apply them,
              so dx's GEMM takes w dequantized (float32) and quantized again per its own output
              column, as the recipe's high-precision weight would be.

Two fused forms. The FP8 overlap path (`fused_gathered_matmul`, `fused_matmul`) hands the FP8
operands and their scales to the op's own kernel: our FP8 GEMM gathers (or scatters) inside the
GEMM and applies the scales in its epilogue (matmul_rs's and matmul_ar's FP8 decode path,
`fused_matmul` too, likewise: the decode GEMM, its epilogue scaling and exchanging each tile).
The latency composition (`gathered_matmul`, `matmul`) runs XLA's GEMM: `dot_general` directly
on the FP8 operands with float32 accumulation, then the scales (XLA's GEMM rewriter emits
cuBLASLt's FP8 GEMM for it on Hopper; XLA:CPU computes it exactly in float32). The same
functions build the XLA twin (lax collectives; flux_jax/twins.py) and the latency composition
(our collective custom calls; flux_jax/ops/), so those two differ only in the collective's
kernel. docs/design.md says which runs where.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FORMATS = ("float8_e4m3fn", "float8_e5m2")
_ALIASES = {"e4m3": "float8_e4m3fn", "e4m3fn": "float8_e4m3fn", "e5m2": "float8_e5m2"}
WEIGHT_SCALINGS = ("tensor", "column")
# The latency collectives move 16-byte vectors: each float32 row scale travels padded to 4 floats.
_SCALE_ALIGN = 4


def _format_name(value, field: str, allowed=FORMATS, why: str = "") -> str:
    if isinstance(value, str):
        name = _ALIASES.get(value.lower(), value.lower())
    else:
        try:
            name = np.dtype(value).name
        except TypeError:
            raise TypeError(
                f"flux_jax.Fp8: {field} must be an FP8 dtype or its name ({', '.join(FORMATS)}), got {value!r}"
            ) from None
    if name not in allowed:
        aliases = " / ".join(repr(a) for a, full in _ALIASES.items() if full in allowed and a != "e4m3fn")
        what = f"one of {allowed}" if len(allowed) > 1 else allowed[0]
        raise ValueError(f"flux_jax.Fp8: {field} must be {what} (or {aliases}){why}; got {value!r}")
    return name


@dataclasses.dataclass(frozen=True)
class Fp8:
    """An FP8 recipe for the fused ops (hashable: it is part of the traced program).

    Attributes:
      forward_format: x and w in the forward GEMM, and w in the backward ones. float8_e4m3fn
        (e4m3: 3 mantissa bits, max 448); e5m2 is refused here because w takes this format in
        every GEMM and FP8 GEMMs need an e4m3 operand (cuBLASLt has no e5m2 x e5m2 kernel).
      backward_format: dy, the output's cotangent, in the backward GEMMs: float8_e5m2 (the
        default: 2 mantissa bits, max 57344, the range gradients need) or float8_e4m3fn.
      weight_scaling: "tensor" (one scale for w) or "column" (one per output column of each
        GEMM: per column of w in the forward, per row of w in the backward, which reads w
        transposed). x and dy always have one scale per row.
      margin: scales map a row's (a tensor's) amax to the format's max / 2**margin; a margin
        leaves headroom, at the cost of that many bits of the low end.

    Scales are current (from the values at hand) and float32; an all-zero row gets scale 1.
    Formats also take the short names "e4m3" / "e5m2" or the jnp dtypes.
    """

    forward_format: Any = "float8_e4m3fn"
    backward_format: Any = "float8_e5m2"
    weight_scaling: str = "tensor"
    margin: int = 0

    def __post_init__(self):
        forward = _format_name(
            self.forward_format,
            "forward_format",
            ("float8_e4m3fn",),
            ": w takes it in every GEMM, and an FP8 GEMM needs an e4m3 operand (there is no e5m2 x e5m2 GEMM)",
        )
        backward = _format_name(self.backward_format, "backward_format")
        if self.weight_scaling not in WEIGHT_SCALINGS:
            raise ValueError(
                f"flux_jax.Fp8: weight_scaling must be one of {WEIGHT_SCALINGS}, got {self.weight_scaling!r}"
            )
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, np.integer)):
            raise TypeError(f"flux_jax.Fp8: margin must be an int (a power-of-two headroom), got {self.margin!r}")
        if not 0 <= self.margin <= 8:
            raise ValueError(
                f"flux_jax.Fp8: margin must be in 0..8 (scales map amax to max / 2**margin), got {self.margin}"
            )
        object.__setattr__(self, "forward_format", forward)
        object.__setattr__(self, "backward_format", backward)
        object.__setattr__(self, "margin", int(self.margin))

    def x_dtype(self, grad: bool = False) -> np.dtype:
        """The format of the GEMM's row operand: x in the forward, dy (`grad`) in the backward."""
        return jnp.dtype(self.backward_format if grad else self.forward_format)

    @property
    def w_dtype(self) -> np.dtype:
        return jnp.dtype(self.forward_format)


def resolve(op: str, fp8, w=None) -> Fp8 | None:
    """The recipe of an op's `fp8=` argument: None / False -> None, True -> Fp8(), an Fp8 as is.

    With a pre-quantized weight (`w` an Fp8Weight): None / True -> the default recipe with the
    weight's scaling, an Fp8 as is if its weight_scaling is the weight's (else ValueError),
    False -> TypeError (the weight is FP8; there is no unquantized GEMM to run)."""
    if isinstance(w, Fp8Weight):
        if fp8 is None or fp8 is True:
            return w.recipe
        if fp8 is False:
            raise TypeError(
                f"flux_jax.{op}: w is a pre-quantized flux_jax.Fp8Weight but fp8=False; pass fp8=None "
                "(or True, or an Fp8 recipe) to run it, or the high-precision weight to run without FP8"
            )
        if isinstance(fp8, Fp8) and fp8.weight_scaling != w.scaling:
            raise ValueError(
                f"flux_jax.{op}: the recipe's weight_scaling={fp8.weight_scaling!r} conflicts with the "
                f"pre-quantized weight's scaling {w.scaling!r} (its scales are fixed); pass "
                f"fp8=Fp8(weight_scaling={w.scaling!r}, ...) or quantize the weight with this recipe"
            )
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        return Fp8()
    if isinstance(fp8, Fp8):
        return fp8
    raise TypeError(f"flux_jax.{op}: fp8 must be True, False, None or a flux_jax.Fp8 recipe, got {fp8!r}")


# ---- quantization ----------------------------------------------------------------------------


def quantize(a, dtype, axis=None, margin: int = 0):
    """(q, scale) with a ~= q * scale: q in the FP8 `dtype`, scale float32 with the amax taken over
    `axis` (None: the whole tensor) and kept as size-1 dimensions. a / scale rounds to nearest
    even; XLA may compute that quotient as a times 1 / scale, one float32 rounding off, so a value
    a tie apart can round to the other neighbour (every implementation runs this same code).

    An all-zero slice, or a tensor with no elements, gets scale 1. The scale is at least float32's
    smallest normal number: a slice whose amax is below fmax times that (about 5e-36 for e4m3)
    would otherwise get a subnormal scale, which devices that flush subnormals read as 0
    (q = a / 0). A NaN or inf in a slice makes its scale, and so its results, NaN, never a silent
    finite scale."""
    dtype = jnp.dtype(dtype)
    fmax = float(jnp.finfo(dtype).max)
    a32 = a.astype(jnp.float32)
    empty = {"initial": 0.0} if a.size == 0 else {}  # a max over no elements needs a start
    amax = jnp.max(jnp.abs(a32), axis=axis, keepdims=True, **empty)
    smallest = np.float32(np.finfo(np.float32).tiny)
    scale = jnp.where(amax == 0, np.float32(1.0), jnp.maximum(amax / np.float32(fmax / 2.0**margin), smallest))
    q = jnp.clip(a32 / scale, -fmax, fmax).astype(dtype)
    return q, scale


def dequantize(q, scale, dtype):
    """q * scale in `dtype` (the inverse of `quantize` up to its rounding)."""
    return (q.astype(jnp.float32) * scale).astype(dtype)


def quantize_rows(x, recipe: Fp8, grad: bool = False):
    """x [rows, ..., k] -> (q, scale [rows, ..., 1]): one scale per row."""
    return quantize(x, recipe.x_dtype(grad), axis=-1, margin=recipe.margin)


def quantize_weight(w, recipe: Fp8, transpose_w: bool = False):
    """w [k, n] (or [n, k] read transposed) -> (q in w's layout, scale of op(w)'s columns: [n] or [])."""
    if recipe.weight_scaling == "tensor":
        q, scale = quantize(w, recipe.w_dtype, axis=None, margin=recipe.margin)
        return q, scale.reshape(())
    contraction = 1 if transpose_w else 0
    q, scale = quantize(w, recipe.w_dtype, axis=contraction, margin=recipe.margin)
    return q, scale.reshape(-1)


def kmajor_weight(w, recipe: Fp8, transpose_w: bool = False):
    """w quantized for the fused FP8 GEMM: (q [n, k], scale [n] float32), both operands of an FP8
    GEMM being K-major on Hopper (a per-tensor scale is repeated per column). `w` may be an
    Fp8Weight (see `gemm_weight`)."""
    q, scale, q_transposed = gemm_weight(w, recipe, transpose_w)
    q = q if q_transposed else q.T
    return q, jnp.broadcast_to(scale.astype(jnp.float32), (q.shape[0],))


def gemm_weight(w, recipe: Fp8, transpose_w: bool = False):
    """The weight operand of the FP8 GEMM x @ op(w): (q, scale of op(w)'s columns ([n] or []),
    whether q holds op(w) transposed, i.e. [n, k]).

    A high-precision w is quantized per the recipe (q in w's layout). An Fp8Weight is used as
    stored: q [n, k] with its scales in the forward; in the backward (`transpose_w`: op(w) =
    w^T) q read untransposed with its per-tensor scale, or, for per-column scales (they sit on
    this GEMM's contraction dimension), w dequantized and quantized again per this GEMM's
    output column."""
    if not isinstance(w, Fp8Weight):
        q, scale = quantize_weight(w, recipe, transpose_w)
        return q, scale, transpose_w
    if not transpose_w:
        return w.q, w.scale, True
    if w.scaling == "tensor":
        return w.q, w.scale, False
    q, scale = quantize_weight(w.dequantize(jnp.float32), recipe, transpose_w=True)
    return q, scale, True


# ---- pre-quantized weights -------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=("q", "scale"), meta_fields=("scaling",))
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A weight quantized to FP8 once, for the ops' `w` (a pytree: jit, shard_map, device_put).

    The op sees the logical weight w [k, n] (`shape`), stored as the fused FP8 GEMMs read it:

    Attributes:
      q: float8_e4m3fn [n, k], w^T: K-major, one row per output column (`kmajor_weight`).
      scale: float32, w ~= (q * scale)^T: shape [] for scaling "tensor" (one scale), [n] for
        "column" (one per output column).
      scaling: "tensor" or "column" (static: part of the pytree's structure), the recipe's
        `weight_scaling` it was quantized with.

    Build it with `Fp8Weight.quantize(w, recipe)`; under sharding, map the logical weight's
    PartitionSpec with `partition_spec`. The constructor does not check its fields (JAX rebuilds
    pytrees with placeholders); the ops check them before tracing.
    """

    q: Any
    scale: Any
    scaling: str = "tensor"

    @classmethod
    def quantize(cls, w, recipe: Fp8 | None = None, *, transpose_w: bool = False) -> Fp8Weight:
        """w [k, n] (or [n, k] with `transpose_w`: w^T is the op's weight) quantized once with the
        recipe's weight_scaling and margin (default `Fp8()`): the amax and the transposing
        quantization an op's `fp8=` runs on every call. Works on global (sharded) arrays and
        inside jit / shard_map (a shard quantized alone gets its own per-tensor scale)."""
        if recipe is None:
            recipe = Fp8()
        if not isinstance(recipe, Fp8):
            raise TypeError(f"flux_jax.Fp8Weight.quantize: recipe must be a flux_jax.Fp8 (or None), got {recipe!r}")
        if not isinstance(transpose_w, bool):
            raise TypeError(f"flux_jax.Fp8Weight.quantize: transpose_w must be a bool, got {transpose_w!r}")
        if isinstance(w, Fp8Weight):
            raise TypeError("flux_jax.Fp8Weight.quantize: w is already an Fp8Weight")
        if not hasattr(w, "shape") or not hasattr(w, "dtype"):
            raise TypeError(f"flux_jax.Fp8Weight.quantize: w must be an array, got {type(w).__name__}")
        dtype = jnp.dtype(w.dtype)
        if not jnp.issubdtype(dtype, jnp.floating) or dtype.name in FORMATS or dtype.itemsize == 1:
            raise TypeError(
                f"flux_jax.Fp8Weight.quantize: w must be a high-precision float array (float32, bfloat16, "
                f"float16), got {dtype.name}{list(w.shape)}"
            )
        if len(w.shape) != 2:
            layout = "[n, k]" if transpose_w else "[k, n]"
            raise ValueError(f"flux_jax.Fp8Weight.quantize: w must have rank 2 ({layout}), got {list(w.shape)}")
        q, scale = quantize_weight(jnp.asarray(w), recipe, transpose_w)
        return cls(q if transpose_w else q.T, scale.astype(jnp.float32), recipe.weight_scaling)

    @property
    def shape(self) -> tuple[int, int]:
        """The logical weight's shape, [k, n], as the op sees it."""
        return (self.q.shape[1], self.q.shape[0])

    @property
    def dtype(self) -> np.dtype:
        """The FP8 values' dtype (the op's output takes x's dtype)."""
        return jnp.dtype(self.q.dtype)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def recipe(self) -> Fp8:
        """The recipe an op runs with fp8=None / True: the default one with this weight's scaling."""
        return Fp8(weight_scaling=self.scaling)

    def dequantize(self, dtype=jnp.float32):
        """The logical weight, [k, n] = (q * scale)^T in `dtype` (w up to the FP8 rounding)."""
        scale = self.scale if jnp.ndim(self.scale) == 0 else self.scale[:, None]
        return dequantize(self.q, scale, dtype).T

    def partition_spec(self, spec) -> Fp8Weight:
        """The PartitionSpecs of this weight's leaves (a pytree of the same structure, for
        shard_map's in_specs or NamedShardings), from the logical weight's spec over [k, n]:
        q [n, k] takes it transposed, the per-column scale [n] the n entry, a per-tensor scale
        is replicated. E.g. column-parallel P(None, "tp") -> q P("tp", None), scale P("tp") or P();
        row-parallel P("tp", None) -> q P(None, "tp"), scale P() (every rank needs every column's)."""
        return weight_spec(spec, self.scaling)


def weight_spec(spec, scaling: str = "tensor") -> Fp8Weight:
    """`Fp8Weight.partition_spec` for a weight not built yet: `scaling` is its recipe's
    weight_scaling ("tensor" or "column")."""
    from jax.sharding import PartitionSpec

    if scaling not in WEIGHT_SCALINGS:
        raise ValueError(f"flux_jax.fp8.weight_spec: scaling must be one of {WEIGHT_SCALINGS}, got {scaling!r}")
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"flux_jax.fp8.weight_spec: spec must be a PartitionSpec over [k, n], got {spec!r}")
    if len(spec) > 2:
        raise ValueError(f"flux_jax.fp8.weight_spec: the weight has rank 2 ([k, n]), got the spec {spec}")
    k_entry, n_entry = (*spec, None, None)[:2]
    scale = PartitionSpec() if scaling == "tensor" else PartitionSpec(n_entry)
    return Fp8Weight(PartitionSpec(n_entry, k_entry), scale, scaling)


def check_weight(op: str, w) -> None:
    """An Fp8Weight's leaves, checked before an op traces anything (the constructor cannot)."""
    q, scale = w.q, w.scale
    for name, a in (("q", q), ("scale", scale)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"flux_jax.{op}: w.{name} (an Fp8Weight's) must be an array, got {type(a).__name__}")
    if w.scaling not in WEIGHT_SCALINGS:
        raise ValueError(f"flux_jax.{op}: w.scaling must be one of {WEIGHT_SCALINGS}, got {w.scaling!r}")
    described = f"{jnp.dtype(q.dtype).name}{list(q.shape)}"
    if jnp.dtype(q.dtype) != jnp.dtype(Fp8().w_dtype):
        raise TypeError(
            f"flux_jax.{op}: w.q must be float8_e4m3fn (the weight's format in every FP8 GEMM), got "
            f"{described}; build the weight with flux_jax.Fp8Weight.quantize"
        )
    if len(q.shape) != 2:
        raise ValueError(f"flux_jax.{op}: w.q must have rank 2 ([n, k], K-major), got {described}")
    want = () if w.scaling == "tensor" else (q.shape[0],)
    if jnp.dtype(scale.dtype) != jnp.dtype(jnp.float32) or tuple(scale.shape) != want:
        raise ValueError(
            f"flux_jax.{op}: w.scale must be float32{list(want)} for scaling {w.scaling!r} and w.q "
            f"{described} ([n, k]), got {jnp.dtype(scale.dtype).name}{list(scale.shape)}"
        )


# ---- the FP8 GEMM --------------------------------------------------------------------------


def scaled_dot(xq, x_scale, wq, w_scale, transpose_w: bool, out_dtype):
    """(xq * x_scale) @ op(wq * w_scale) in `out_dtype`: the GEMM on the FP8 operands with float32
    accumulation, the scales after (row scales [rows, ..., 1], column scales [n] or []). The
    weight's scale multiplies first, as in the overlap GEMM's epilogue (fp8_scale_epilogue.cuh), so
    the two round alike and huge rows (|x| near float32's limit) do not overflow in between."""
    dims = (((xq.ndim - 1,), (1 if transpose_w else 0,)), ((), ()))
    acc = lax.dot_general(xq, wq, dims, preferred_element_type=jnp.float32)
    return (acc * w_scale * x_scale).astype(out_dtype)


def matmul(x, w, recipe: Fp8, *, transpose_w: bool = False, grad: bool = False):
    """x @ op(w) through FP8: x [rows, ..., k] per row (in the backward format with `grad`), w per
    the recipe (or an Fp8Weight, see `gemm_weight`); returns x's dtype. The GEMM of the GEMM-first
    ops (matmul_rs, matmul_ar)."""
    xq, xs = quantize_rows(x, recipe, grad)
    wq, ws, wq_transposed = gemm_weight(w, recipe, transpose_w)
    return scaled_dot(xq, xs, wq, ws, wq_transposed, x.dtype)


def gather_scales(gather: Callable, scale):
    """Gathers row scales [rows, ..., 1] with `gather` (dimension 0, rank order) -> [tp * rows,
    ..., 1]. Each row's float32 travels padded to 16 bytes (the latency collectives move 16-byte
    vectors); padding the last dimension, not flattening the rows, keeps any other mesh axis's
    sharding of the middle dimensions as it is."""
    pad = [(0, 0)] * (scale.ndim - 1) + [(0, _SCALE_ALIGN - 1)]
    return gather(jnp.pad(scale, pad, constant_values=1))[..., :1]


def gathered_matmul(
    x,
    w,
    recipe: Fp8,
    gather: Callable,
    *,
    transpose_w: bool = False,
    grad: bool = False,
    return_gathered: bool = False,
    blocking_gather: bool = False,
):
    """AG(x) @ op(w) through FP8, x [rows, ..., k] gathered on dimension 0 by `gather`: quantize
    per row, gather the FP8 rows and (alongside) their scales, FP8 GEMM. Returns [out] or
    [out, AG(x) dequantized in x's dtype].

    `blocking_gather` (our collective, whose calls wait for their peers): the scales are gathered
    after the rows, so that every device runs the two in one order. Independent, XLA may start
    them in either order on each device; while waiting calls held XLA:CPU's threads that timed
    out FP8 training of float32 layers at TP 4 on a 2-core host (docs/design.md)."""
    xq, xs = quantize_rows(x, recipe, grad)
    wq, ws, wq_transposed = gemm_weight(w, recipe, transpose_w)
    xq_full = gather(xq)
    if blocking_gather:
        xq_full, xs = lax.optimization_barrier((xq_full, xs))
    xs_full = gather_scales(gather, xs)
    out = scaled_dot(xq_full, xs_full, wq, ws, wq_transposed, x.dtype)
    if not return_gathered:
        return [out]
    return [out, dequantize(xq_full, xs_full, x.dtype)]


def fused_gathered_matmul(
    x,
    w,
    recipe: Fp8,
    gather: Callable,
    fused: Callable,
    *,
    transpose_w,
    grad,
    return_gathered,
    scales_travel: bool = False,
):
    """AG(x) @ op(w) through FP8 in a fused kernel: the overlap path gathers the row scales first
    (one small collective), then `fused(xq, wq [n, k], row_scales [tp * rows], col_scales [n])`
    gathers the FP8 rows inside the GEMM and applies the scales in its epilogue. With
    `scales_travel` (the decode path) `fused` takes this rank's row scales, [rows], and moves them
    with the rows; the scales are gathered here only to dequantize AG(x). Returns [out] or [out,
    AG(x) dequantized]; `fused` returns [out] or [out, AG(xq)]."""
    xq, xs = quantize_rows(x, recipe, grad)
    wq, ws = kmajor_weight(w, recipe, transpose_w)
    xs_full = None if scales_travel else gather_scales(gather, xs)
    outs = fused(xq, wq, (xs if scales_travel else xs_full).reshape(-1), ws)
    if not return_gathered:
        return [outs[0]]
    if xs_full is None:  # after the fused call: two blocking calls in one order (gathered_matmul)
        gathered, xs = lax.optimization_barrier((outs[1], xs))
        return [outs[0], dequantize(gathered, gather_scales(gather, xs), x.dtype)]
    return [outs[0], dequantize(outs[1], xs_full, x.dtype)]


def fused_matmul(x, w, recipe: Fp8, fused: Callable, *, transpose_w, grad):
    """x @ op(w) through FP8 in a fused GEMM-first kernel: `fused(xq, wq [n, k], row_scales
    [rows], col_scales [n])` -> [out], the scales applied in the GEMM's epilogue."""
    xq, xs = quantize_rows(x, recipe, grad)
    wq, ws = kmajor_weight(w, recipe, transpose_w)
    return fused(xq, wq, xs.reshape(-1), ws)
