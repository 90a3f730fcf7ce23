"""What an op is: one `OpSpec` per op, and the machinery every op shares.

An op is a descriptor (its name, FFI target, output shapes, per-rank GEMM, twin, latency
composition and VJP pairing) plus its kernels. `define()` turns a descriptor into a JAX
primitive with abstract evaluation, a batching rule, lowerings (flux_jax/_lowering.py) and a
custom_vjp core (flux_jax/_autodiff.py). Inside the primitive x is [rows, ..., k] with the
gathered / scattered dimension first and w [k, n] (or [n, k] with `transpose_w`); the kernels see
x as [rows * ..., k] (the same bytes). The middle dimensions stay visible so the partitioner can
shard them over the mesh axes a partially manual shard_map leaves to it.

w may also be a pre-quantized flux_jax.Fp8Weight (a pytree): the primitive's operands are then x,
its leaves (q, scale) and the rank, `Call.w_prequantized` rebuilds it, and everything that reads the
weight's shape reads its logical [k, n] (`Fp8Weight.shape`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching

from flux_jax import fp8 as _fp8
from flux_jax._config import Config, GpuTuning
from flux_jax._plan import Plan, Problem
from flux_jax._validation import axis_set
from flux_jax._validation import varying_axes as _varying
from flux_jax.fp8 import Fp8, Fp8Weight


@dataclasses.dataclass(frozen=True)
class Call:
    """Static description of one bound call (a primitive parameter; hashable)."""

    axis_name: str | tuple[str, ...]  # one mesh axis, or several forming one TP axis
    tp: int
    transpose_w: bool
    impl: str  # "auto" | "fused" (a twin plan never binds the primitive)
    backward: bool  # the paired op of a fused op's backward pass
    plan: Plan
    config: Config
    tuning: GpuTuning
    platform: str = "cpu"  # where it was planned ("cpu" or "cuda")
    return_gathered: bool = False  # ag_matmul only
    # Set by the lowering when it wraps the call in a manual region over the mesh axes a
    # partially manual shard_map leaves to the partitioner: the TP groups' (device ids,
    # process indices), found on the concrete mesh outside that region.
    groups: tuple | None = None
    # FP8 operands (flux_jax/fp8.py): the recipe, or None. The row operand is x in the forward
    # and dy in a backward call (`backward`), quantized in the recipe's backward format.
    fp8: Fp8 | None = None
    # A pre-quantized weight (Fp8Weight): its scaling, "tensor" or "column"; None for an array.
    # Set by `bind`, which flattens the weight into the primitive's operands (q, scale).
    w_prequantized: str | None = None
    # Set by the lowering under a multi-platform jax.export: the platform ("cpu" or "cuda") of
    # the lax.platform_dependent branch this call was bound in.
    lowering_platform: str | None = None
    # What `plan` was made for: the planner's view of the traced operands (per device: in a
    # partially manual shard_map, the nested region's shard, ops/_common.device_shape), and
    # whether it was planned as a fused op's backward (a fused path wherever one runs). The
    # lowering plans again where the operands it lowers differ (another platform, a vmapped batch).
    problem: Problem | None = None
    planned_as_backward: bool = False

    @property
    def forced(self) -> bool:
        """impl="fused": an error, not the twin, where the mesh rules fusion out."""
        return self.impl == "fused"

    @property
    def fp8_format(self) -> str | None:
        """The row operand's FP8 format (the planner's `Problem.fp8`), or None."""
        return None if self.fp8 is None else self.fp8.x_dtype(self.backward).name


@dataclasses.dataclass(frozen=True, eq=False)
class OpSpec:
    """Descriptor of one fused op.

    Attributes:
      name: public name, also the FFI target suffix (`flux_jax_<name>`, cpp/include/flux_jax/ops.def).
      out_shapes: (x_shape, w_shape, call) -> the output shapes of the primitive.
      gemm: (x_shape, w_shape, call) -> (rows, k, n) of the per-rank GEMM, as flux_jax/_plan.py
        counts them (rows: every row of the GEMM, middle dimensions folded in).
      twin: (x, w, call) -> outputs, the XLA twin on the primitive's operands.
      latency: (x, w, call, collective) -> outputs, the latency path: XLA's GEMM next to our
        collective custom call, `collective(name, x, out_shape)`.
      fwd / bwd: the custom_vjp rules: fwd(x, w, call) -> (outputs, residuals);
        bwd(call, residuals, cotangents) -> (dx, dw).
      replicated: the outputs are the same on every rank of the axis (an all-reduce), so they
        are typed invariant over it, as lax.psum's are.
      fp8_overlap: (x, w, call, collective, fused) -> outputs, the FP8 overlap path (None: the op
        has none): quantize, then `fused(xq, wq, row_scales, col_scales)`, our kernel on the FP8
        operands (flux_jax/fp8.py), with `collective` for anything moved before it.
      fp8_decode: the same for the FP8 decode path (None: the op has none; flux_jax/_plan.py
        fp8_decode_supported says where it serves).
      composed_overlap: (x, w, call, collective, fused) -> outputs, the overlap path as other ops'
        custom calls where flux_jax/_plan.composed_overlap says so (None: never):
        `fused(op, a, b, out_shape)` is op's overlap custom call with this call's attributes.
    """

    name: str
    out_shapes: Callable
    gemm: Callable
    twin: Callable
    latency: Callable
    fwd: Callable
    bwd: Callable
    replicated: bool = False
    fp8_overlap: Callable | None = None
    fp8_decode: Callable | None = None
    composed_overlap: Callable | None = None
    primitive: Primitive = dataclasses.field(init=False)
    core: Callable = dataclasses.field(init=False)

    @property
    def target(self) -> str:
        return f"flux_jax_{self.name}"

    def problem(
        self, x_shape, w_shape, dtype, tp: int, platform: str, transpose_w: bool, fp8: str | None = None
    ) -> Problem:
        """The planner's view of a call on operands x [rows, ..., k], w (`fp8`: Call.fp8_format)."""
        probe = Call("", tp, transpose_w, "auto", False, None, None, None)  # only shape fields are read
        rows, k, n = self.gemm(x_shape, w_shape, probe)
        return Problem(self.name, int(rows), int(k), int(n), np.dtype(dtype), tp, platform, transpose_w, fp8)


REGISTRY: dict[str, OpSpec] = {}


def weight_2d(w, transpose_w: bool):
    return w.T if transpose_w else w


def weight_of(call: Call, leaves):
    """The weight rebuilt from the primitive's weight operands (arrays, avals or IR values)."""
    leaves = tuple(leaves)
    return leaves[0] if call.w_prequantized is None else Fp8Weight(*leaves, call.w_prequantized)


def local_gemm(x, w, call: Call):
    """x @ op(w), the GEMM of the GEMM-first ops (matmul_rs, ...): XLA's dot, or with `call.fp8`
    the FP8 GEMM on x and w quantized per the recipe (x's dtype out either way)."""
    if call.fp8 is not None:
        return _fp8.matmul(x, w, call.fp8, transpose_w=call.transpose_w, grad=call.backward)
    return jnp.dot(x, weight_2d(w, call.transpose_w))


def gathered_gemm(x, w, call: Call, gather, *, blocking_gather: bool = False) -> list:
    """[AG(x) @ op(w)] (+ [AG(x)] with `call.return_gathered`), the AllGather-first ops, with
    `gather(a)` the all_gather of dimension 0 (lax's or, `blocking_gather`, our collective). With
    `call.fp8` the FP8 rows and their scales are gathered and the gathered x comes back
    dequantized."""
    if call.fp8 is not None:
        return _fp8.gathered_matmul(
            x,
            w,
            call.fp8,
            gather,
            transpose_w=call.transpose_w,
            grad=call.backward,
            return_gathered=call.return_gathered,
            blocking_gather=blocking_gather,
        )
    x_full = gather(x)
    out = jnp.dot(x_full, weight_2d(w, call.transpose_w))
    return [out, x_full] if call.return_gathered else [out]


def define(spec: OpSpec) -> OpSpec:
    """Creates the primitive, its rules and the custom_vjp core of `spec`; registers it."""
    from flux_jax import _autodiff, _lowering

    prim = Primitive(spec.target)
    prim.multiple_results = True

    def abstract_eval(x, *operands, call: Call):
        w = weight_of(call, operands[:-1])  # the last operand is the rank
        outs = [x.update(shape=s) for s in spec.out_shapes(x.shape, w.shape, call)]
        return [invariant_over(o, call.axis_name) for o in outs] if spec.replicated else outs

    prim.def_abstract_eval(abstract_eval)
    batching.primitive_batchers[prim] = functools.partial(_batch_rows, prim)
    object.__setattr__(spec, "primitive", prim)
    _lowering.register(spec)
    object.__setattr__(spec, "core", _autodiff.make_core(functools.partial(bind, spec), spec.fwd, spec.bwd))
    REGISTRY[spec.name] = spec
    return spec


def bind(spec: OpSpec, x, w, call: Call) -> list:
    """Binds the primitive on operands already cast to a common manual-axis type: x, the
    weight's leaves (one array, or a pre-quantized weight's q and scale), the rank."""
    rank = unify_varying(call.axis_name, jax.lax.axis_index(call.axis_name))[0]
    prequantized = w.scaling if isinstance(w, Fp8Weight) else None
    if prequantized != call.w_prequantized:
        call = dataclasses.replace(call, w_prequantized=prequantized)
    leaves = (w.q, w.scale) if prequantized else (w,)
    return spec.primitive.bind(x, *leaves, rank, call=call)


def _batch_rows(prim, args, dims, *, call: Call):
    """vmap over x alone: the batch axis becomes a middle dimension (rows stay first), one call.
    vmap over the weight (stacked experts, say): one call per weight, in sequence (lax.map), each
    the op on its own weight and its slice of a batched x, with the kernels and protocol of a
    scan over layers."""
    x, *operands = args
    x_dim, *operand_dims = dims
    if all(d is None for d in operand_dims):
        outs = prim.bind(jnp.moveaxis(x, x_dim, 1), *operands, call=call)
        return outs, [1] * len(outs)
    batched = [i for i, d in enumerate(dims) if d is not None]

    def one(slices):
        full = list(args)
        for i, a in zip(batched, slices):
            full[i] = a
        return prim.bind(*full, call=call)

    outs = jax.lax.map(one, [jnp.moveaxis(args[i], dims[i], 0) for i in batched])
    return outs, [0] * len(outs)


def invariant_over(aval, axis_name):
    """`aval` typed as the same on every rank of `axis_name` (lax.psum's output type)."""
    mat = getattr(aval, "manual_axis_type", None)
    axes = axis_set(axis_name)
    if mat is None or not axes & frozenset(mat.varying):
        return aval
    return aval.update(manual_axis_type=mat.update(varying=mat.varying - axes))


def unify_varying(axis_name, *xs):
    """pcast every operand (each leaf of a pre-quantized weight) to vary over the union of their
    manual axes and `axis_name`.

    The primitive's results then carry the right manual-axis type, and pcast's transpose adds
    the psums that invariant operands need in the backward pass (e.g. a weight replicated over a
    data-parallel axis).
    """
    target = axis_set(axis_name).union(*(_varying(x) for x in xs))
    return [pcast_to(x, target) for x in xs]


def pcast_to(a, axes: frozenset):
    """`a` (an array or a pytree of them) cast to vary over every manual axis in `axes` it does
    not vary over yet."""

    def cast(leaf):
        missing = tuple(sorted(frozenset(axes) - _varying(leaf)))
        return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(cast, a)
