"""Megatron-style tensor-parallel linear layers, with or without sequence parallelism.

Both layers are *per-shard*: their `__call__` runs inside a `jax.shard_map`
that maps the tensor-parallel axis (every axis, as `flux_jax.flax.sharded_call`
does, or only TP with `axis_names={tp}` inside a GSPMD model), and sees the
local shard of each parameter. The parameters themselves are created with
their global shapes and a sharding annotation, so `nnx` state is placed on the
mesh as the layer expects.

  ColumnParallelLinear   x [S/tp, ..., K] --AllGather(S)+GEMM--> [S, ..., N/tp]
  RowParallelLinear      x [S, ..., K/tp] --GEMM+ReduceScatter(S)--> [S/tp, ..., N]

The sequence is the leading dimension by default; `seq_axis=1` takes batch-first
activations [B, S, ...] (the gather / scatter runs over dimension 1).

`tp_axis` names the TP mesh axis, or is a tuple of mesh axes forming one TP axis (ranks
row-major in the order named, as the ops read it); the kernels' TP dimension is annotated with it.

`fsdp_axis` (in a shard_map that maps only the TP axis, as a GSPMD model's) also shards each
kernel's hidden (non-TP) dimension over that mesh axis: with Auto axes the partitioner gathers it
before the TP region, with Explicit axes the op does; the gradient comes back summed over the
data-parallel axes and split as the kernel is.

A column layer followed by a row layer is one Megatron block: the sequence is
gathered inside the first GEMM and scattered again inside the second
(flux_jax.ag_matmul / flux_jax.matmul_rs), with no other communication.

With `sequence_parallel=False` (inference decode, small TP) every rank holds the whole
sequence between blocks:

  ColumnParallelLinear   x [S, ..., K] (replicated) --GEMM--> [S, ..., N/tp]
                         backward: dx = AllReduce(dy @ w^T) fused  (flux_jax.column_matmul)
  RowParallelLinear      x [S, ..., K/tp] --GEMM+AllReduce--> [S, ..., N] (replicated)
                         backward: local GEMMs                    (flux_jax.matmul_ar)

one fused op in each direction of a block.

Inference with pre-quantized kernels: `layer.quantize_kernel(recipe)` (or `quantize_kernels(model)`
for every layer of a model) quantizes each kernel to FP8 once, into a flux_jax.Fp8Weight held as
two `Fp8Kernel` variables (its FP8 values, transposed to [out, in], and its scales) annotated for
the mesh like the kernel; the layer then passes that weight to its op, and no call quantizes the
kernel again (x still is, per row). The kernel is frozen from then on: its gradient is zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flux_jax
from flux_jax import _validation
from flux_jax import fp8 as fp8_lib
from flux_jax.flax.sharding import normalize_tp_axis, tp_axis_names

IMPLS = ("auto", "fused", "xla")


def axis_size(mesh: jax.sharding.Mesh, axis_name) -> int:
    """Size of the TP axis `axis_name` in `mesh` (a tuple of mesh axes: the product of their sizes),
    with an error naming the mesh's axes if one is missing."""
    for name in tp_axis_names(axis_name):
        if name not in mesh.axis_names:
            raise ValueError(
                f"mesh axes are {tuple(mesh.axis_names)}; the tensor-parallel axis {name!r} is not one of them"
            )
    return _validation.axis_size(mesh.shape, axis_name)


def check_divisible(what: str, value: int, axis_name, size: int, why: str) -> None:
    """ValueError naming the numbers when `value` cannot be split evenly over a mesh axis (or over
    a tuple of mesh axes, one TP axis)."""
    if value % size:
        names = tp_axis_names(axis_name)
        label, axes = "*".join(names), f"mesh axes {names}" if len(names) > 1 else f"mesh axis {names[0]!r}"
        raise ValueError(f"{what}={value} is not divisible by {label}={size} ({axes}): {why}")


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def check_fsdp_axis(mesh: jax.sharding.Mesh, fsdp_axis: str | None, tp_axis, what: str, value: int) -> None:
    """ValueError for an FSDP axis that is missing, is (one of) the TP axis, or cannot split `value`."""
    if fsdp_axis is None:
        return
    if fsdp_axis == tp_axis:
        raise ValueError(f"fsdp_axis and tp_axis are both {tp_axis!r}: FSDP shards a non-TP dimension")
    if fsdp_axis in tp_axis_names(tp_axis):
        raise ValueError(f"fsdp_axis {fsdp_axis!r} is one of tp_axis {tp_axis!r}: FSDP shards a non-TP dimension")
    if fsdp_axis not in mesh.axis_names:
        raise ValueError(f"mesh axes are {tuple(mesh.axis_names)}; the FSDP axis {fsdp_axis!r} is not one of them")
    check_divisible(what, value, fsdp_axis, int(mesh.shape[fsdp_axis]), "FSDP shards the hidden dimension")


def check_layer_args(layer: str, in_features, out_shape: tuple, mesh, dtype) -> None:
    """The constructor's sizes, mesh and dtype, with errors naming the argument."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"{layer}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = ["in_features"]
    names += ["out_features"] if len(out_shape) == 1 else [f"out_features[{i}]" for i in range(len(out_shape))]
    if not out_shape:
        raise ValueError(f"{layer}: out_features must be a positive int or a non-empty sequence of them, got ()")
    for name, value in zip(names, (in_features, *out_shape)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise TypeError(f"{layer}: {name} must be a positive int, got {value!r}")
    if dtype is not None:
        try:
            jnp.dtype(dtype)
        except TypeError:
            raise TypeError(f"{layer}: dtype must be a JAX dtype (or None), got {dtype!r}") from None


def check_sequence_args(layer: str, sequence_parallel, seq_axis) -> None:
    """sequence_parallel a bool, seq_axis a dimension index >= 0 (never the features' last one,
    which a layer cannot know the rank of until it is called: the op checks that)."""
    if not isinstance(sequence_parallel, (bool, np.bool_)):
        raise TypeError(f"{layer}: sequence_parallel must be a bool, got {sequence_parallel!r}")
    if isinstance(seq_axis, bool) or not isinstance(seq_axis, (int, np.integer)) or seq_axis < 0:
        raise ValueError(
            f"{layer}: seq_axis must be the sequence's dimension, an int >= 0 (0 for [S, B, D], "
            f"1 for batch-first [B, S, D]), got {seq_axis!r}"
        )


def check_fp8(layer: str, fp8) -> None:
    """fp8 must be what the flux_jax ops take: None, a bool or a flux_jax.Fp8."""
    fp8_lib.resolve(layer, fp8)


class Fp8Kernel(nnx.Variable):
    """A leaf of a layer's pre-quantized kernel (`quantize_kernel`): its FP8 values [out, in] or
    their float32 scales. Not an nnx.Param: optimizers and nnx.grad (wrt Param) leave it alone."""


def _kernel_recipe(layer: str, fp8, recipe) -> fp8_lib.Fp8:
    """The recipe `quantize_kernel` quantizes with: `recipe`, else the layer's own (fp8=Fp8(...)),
    else the default; a recipe whose weight_scaling differs from the layer's is an error."""
    if recipe is not None and not isinstance(recipe, fp8_lib.Fp8):
        raise TypeError(f"{layer}.quantize_kernel: recipe must be a flux_jax.Fp8 (or None), got {recipe!r}")
    own = fp8 if isinstance(fp8, fp8_lib.Fp8) else None
    if recipe is not None and own is not None and recipe.weight_scaling != own.weight_scaling:
        raise ValueError(
            f"{layer}.quantize_kernel: recipe.weight_scaling={recipe.weight_scaling!r} conflicts with the "
            f"layer's fp8 recipe (weight_scaling={own.weight_scaling!r})"
        )
    return recipe or own or fp8_lib.Fp8()


def _quantized_kernel(layer: str, module, w, recipe, q_axes: tuple, keep_kernel: bool) -> None:
    """Stores the Fp8Weight of w [in, n] (global) on `module` as its Fp8Kernel variables, placed
    and annotated as q [n, in] over `q_axes` and the scales over q_axes[0] (or replicated)."""
    if not isinstance(keep_kernel, bool):
        raise TypeError(f"{layer}.quantize_kernel: keep_kernel must be a bool, got {keep_kernel!r}")
    weight = fp8_lib.Fp8Weight.quantize(w, recipe)
    scale_axes = () if weight.scaling == "tensor" else (q_axes[0],)
    mesh = getattr(getattr(w, "sharding", None), "mesh", None)
    mesh = mesh if isinstance(mesh, jax.sharding.Mesh) else None  # None: traced (nnx.jit)
    leaves = []
    for value, axes in ((weight.q, q_axes), (weight.scale, scale_axes)):
        if mesh is not None:
            value = jax.device_put(value, jax.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes)))
        # placed here; the annotation is what sharded_call's in_specs read
        leaves.append(Fp8Kernel(value, out_sharding=axes, mesh=mesh, eager_sharding=False))
    module.kernel_q, module.kernel_scale = leaves
    module.kernel_scaling = weight.scaling
    if not keep_kernel:
        module.kernel = nnx.data(None)


def _prequantized(module):
    """The layer's pre-quantized kernel as a flux_jax.Fp8Weight, or None."""
    if module.kernel_q is None:
        return None
    return fp8_lib.Fp8Weight(module.kernel_q[...], module.kernel_scale[...], module.kernel_scaling)


def _no_kernel(layer: str, module) -> None:
    if module.kernel is None:
        raise ValueError(f"{layer}.quantize_kernel: the kernel was dropped (keep_kernel=False); nothing to quantize")


def quantize_kernels(module: nnx.Module, recipe: fp8_lib.Fp8 | None = None, *, keep_kernel: bool = True) -> int:
    """Calls `quantize_kernel(recipe, keep_kernel=...)` on every ColumnParallelLinear and
    RowParallelLinear in `module` (a layer, a block, a GPT); returns how many. For inference:
    the kernels are frozen FP8 from then on."""
    count = 0
    for _, sub in nnx.iter_modules(module):
        if isinstance(sub, (ColumnParallelLinear, RowParallelLinear)):
            sub.quantize_kernel(recipe, keep_kernel=keep_kernel)
            count += 1
    return count


def _fan_in_init(ndim: int) -> Callable:
    """LeCun-normal init for a kernel [in, *out]: fan-in is the first axis, fan-out the rest."""
    return nnx.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=tuple(range(1, ndim))
    )


class ColumnParallelLinear(nnx.Module):
    """AllGather -> GEMM: gathers the sequence and computes this rank's output columns.

    Per shard: x [S/tp, ..., in_features] (this rank's rows of the sequence)
    -> y [S, ..., *out_local], every row, where out_local is `out_features`
    with its first entry divided by tp.

    `out_features` may be a tuple: the kernel is [in_features, *out_features]
    and tensor parallelism splits the first output axis. Fused projections use
    this to keep each rank's slice self-contained, e.g. QKV as
    (kv_heads, q_per_kv + 2, head_dim) gives each rank whole groups of heads,
    and SwiGLU's gate+up as (ffn, 2) gives each rank matching gate and up
    columns. The output keeps that trailing shape.

    Parameters (global shape, annotation):
      kernel [in_features, *out_features]  (fsdp_axis, tp, None, ...)  (fsdp_axis None by default)
      bias   [*out_features]               (tp, None, ...)   if use_bias
    The bias is sharded like the columns it is added to. With `fsdp_axis` the layer runs in a
    shard_map that maps only the TP axis (a GSPMD model): the kernel's rows are sharded over it.

    With `sequence_parallel=False` x is the whole sequence on every rank, [S, ..., in_features]
    (replicated over tp), and the layer is flux_jax.column_matmul: a local GEMM whose backward
    all-reduces dx in a fused matmul_ar.
    `fp8=True` (or a flux_jax.Fp8 recipe) runs the GEMM on FP8 operands: the rows are
    quantized per row before they are gathered, the kernel per tensor (flux_jax.ag_matmul;
    without sequence parallelism the local FP8 GEMM, and dx's all-reduce takes dy in FP8).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | Sequence[int],
        *,
        mesh: jax.sharding.Mesh,
        tp_axis: str | tuple[str, ...] = "tp",
        use_bias: bool = False,
        impl: str = "auto",
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init: Callable | None = None,
        bias_init: Callable = nnx.initializers.zeros,
        sequence_parallel: bool = True,
        seq_axis: int = 0,
        fsdp_axis: str | None = None,
        fp8=False,
        rngs: nnx.Rngs,
    ):
        check_impl(impl)
        check_fp8("ColumnParallelLinear", fp8)
        check_sequence_args("ColumnParallelLinear", sequence_parallel, seq_axis)
        self.fp8 = fp8
        self.seq_axis = seq_axis
        out_shape = tuple(out_features) if isinstance(out_features, (list, tuple)) else (out_features,)
        check_layer_args("ColumnParallelLinear", in_features, out_shape, mesh, dtype)
        tp_axis = normalize_tp_axis(tp_axis)
        tp = axis_size(mesh, tp_axis)
        check_divisible(
            "out_features" if len(out_shape) == 1 else "out_features[0]",
            out_shape[0],
            tp_axis,
            tp,
            "a column-parallel layer splits its output columns over TP",
        )
        check_fsdp_axis(mesh, fsdp_axis, tp_axis, "in_features", in_features)
        self.in_features, self.out_shape = in_features, out_shape
        self.tp_axis, self.impl, self.dtype = tp_axis, impl, dtype
        self.sequence_parallel = sequence_parallel
        kernel_shape = (in_features, *out_shape)
        kernel_init = kernel_init or _fan_in_init(len(kernel_shape))
        tail = (None,) * (len(out_shape) - 1)
        init = nnx.with_partitioning(kernel_init, (fsdp_axis, tp_axis, *tail), mesh=mesh)
        self.kernel = nnx.Param(init(rngs.params(), kernel_shape, param_dtype))
        self.fsdp_axis = fsdp_axis
        bias = None
        if use_bias:
            init = nnx.with_partitioning(bias_init, (tp_axis, *tail), mesh=mesh)
            bias = nnx.Param(init(rngs.params(), out_shape, param_dtype))
        self.bias = nnx.data(bias)
        self.kernel_q, self.kernel_scale = nnx.data(None), nnx.data(None)  # set by quantize_kernel
        self.kernel_scaling = None

    def quantize_kernel(self, recipe: fp8_lib.Fp8 | None = None, *, keep_kernel: bool = True) -> None:
        """Quantizes the kernel to FP8 once, for inference (flux_jax.Fp8Weight.quantize on the
        global kernel [in_features, prod(out_features)]): from then on every call passes that
        weight to its op and none quantizes the kernel again. `recipe`: the layer's own Fp8
        recipe, else flux_jax.Fp8(); a per-tensor scale is one for the whole global kernel. The
        FP8 kernel is frozen (its gradient is zero; x's still flows). keep_kernel=False drops the
        high-precision kernel (its memory); the layer then only runs quantized."""
        _no_kernel("ColumnParallelLinear", self)
        recipe = _kernel_recipe("ColumnParallelLinear", self.fp8, recipe)
        kernel = self.kernel[...]  # global [in, out0, *rest]: out0 outermost, so q's rows split over tp as it does
        w = kernel.reshape(kernel.shape[0], -1)
        _quantized_kernel("ColumnParallelLinear", self, w, recipe, (self.tp_axis, self.fsdp_axis), keep_kernel)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Per shard: [S/tp, ..., in_features] -> [S, ..., *out_local] (S at `seq_axis`; without
        sequence parallelism: [S, ..., in_features] -> [S, ..., *out_local])."""
        dtype = self.dtype or x.dtype
        w, fp8 = _prequantized(self), self.fp8 or None  # fp8=None: the pre-quantized weight's recipe
        if w is None:
            kernel = self.kernel[...]  # local shard [in, out0/tp, *rest]
            w, fp8 = kernel.reshape(kernel.shape[0], -1).astype(dtype), self.fp8
        if self.sequence_parallel:
            y = flux_jax.ag_matmul(
                x.astype(dtype), w, axis_name=self.tp_axis, axis=self.seq_axis, impl=self.impl, fp8=fp8
            )
        else:
            y = flux_jax.column_matmul(x.astype(dtype), w, axis_name=self.tp_axis, impl=self.impl, fp8=fp8)
        y = y.reshape(*y.shape[:-1], -1, *self.out_shape[1:])
        if self.bias is not None:
            y = y + self.bias[...].astype(dtype)
        return y


class RowParallelLinear(nnx.Module):
    """GEMM -> ReduceScatter: sums the ranks' partial products and scatters the sequence.

    Per shard: x [S, ..., in_features/tp] (every row, this rank's input
    features) -> y [S/tp, ..., out_features] (this rank's rows, all features).

    Parameters (global shape, annotation):
      kernel [in_features, out_features]  (tp, fsdp_axis)  (fsdp_axis None by default)
      bias   [out_features]               (None,)   if use_bias
    The bias is replicated and added once, after the reduce-scatter (adding it
    before would count it tp times). `fsdp_axis`: as for ColumnParallelLinear (the kernel's
    columns are sharded over it).

    With `sequence_parallel=False` the partial products are all-reduced instead (flux_jax.matmul_ar):
    x [S, ..., in_features/tp] -> y [S, ..., out_features], the same bits on every rank.
    `fp8=True` (or a flux_jax.Fp8 recipe) runs the GEMM on FP8 operands and reduce-scatters
    (without sequence parallelism: all-reduces) its partial in the compute dtype.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        mesh: jax.sharding.Mesh,
        tp_axis: str | tuple[str, ...] = "tp",
        use_bias: bool = False,
        impl: str = "auto",
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init: Callable | None = None,
        bias_init: Callable = nnx.initializers.zeros,
        sequence_parallel: bool = True,
        seq_axis: int = 0,
        fsdp_axis: str | None = None,
        fp8=False,
        rngs: nnx.Rngs,
    ):
        check_impl(impl)
        check_fp8("RowParallelLinear", fp8)
        check_sequence_args("RowParallelLinear", sequence_parallel, seq_axis)
        check_layer_args("RowParallelLinear", in_features, (out_features,), mesh, dtype)
        self.fp8 = fp8
        self.seq_axis = seq_axis
        tp_axis = normalize_tp_axis(tp_axis)
        tp = axis_size(mesh, tp_axis)
        check_divisible(
            "in_features", in_features, tp_axis, tp, "a row-parallel layer splits its input features over TP"
        )
        check_fsdp_axis(mesh, fsdp_axis, tp_axis, "out_features", out_features)
        self.in_features, self.out_features = in_features, out_features
        self.tp_axis, self.impl, self.dtype = tp_axis, impl, dtype
        self.sequence_parallel = sequence_parallel
        kernel_init = kernel_init or _fan_in_init(2)
        init = nnx.with_partitioning(kernel_init, (tp_axis, fsdp_axis), mesh=mesh)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype))
        self.fsdp_axis = fsdp_axis
        bias = None
        if use_bias:
            init = nnx.with_partitioning(bias_init, (None,), mesh=mesh)
            bias = nnx.Param(init(rngs.params(), (out_features,), param_dtype))
        self.bias = nnx.data(bias)
        self.kernel_q, self.kernel_scale = nnx.data(None), nnx.data(None)  # set by quantize_kernel
        self.kernel_scaling = None

    def quantize_kernel(self, recipe: fp8_lib.Fp8 | None = None, *, keep_kernel: bool = True) -> None:
        """Quantizes the kernel to FP8 once, for inference: as ColumnParallelLinear.quantize_kernel
        (q [out, in] sharded (fsdp_axis, tp) like the kernel transposed; per-column scales, one
        per output feature over the whole K, replicated over tp)."""
        _no_kernel("RowParallelLinear", self)
        recipe = _kernel_recipe("RowParallelLinear", self.fp8, recipe)
        _quantized_kernel(
            "RowParallelLinear", self, self.kernel[...], recipe, (self.fsdp_axis, self.tp_axis), keep_kernel
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Per shard: [S, ..., in_features/tp] -> [S/tp, ..., out_features] (S at `seq_axis`;
        without sequence parallelism: -> [S, ..., out_features], replicated)."""
        dtype = self.dtype or x.dtype
        w, fp8 = _prequantized(self), self.fp8 or None  # fp8=None: the pre-quantized weight's recipe
        if w is None:
            w, fp8 = self.kernel[...].astype(dtype), self.fp8
        if self.sequence_parallel:
            y = flux_jax.matmul_rs(
                x.astype(dtype),
                w,
                axis_name=self.tp_axis,
                scatter_dimension=self.seq_axis,
                impl=self.impl,
                fp8=fp8,
            )
        else:
            y = flux_jax.matmul_ar(x.astype(dtype), w, axis_name=self.tp_axis, impl=self.impl, fp8=fp8)
        if self.bias is not None:
            y = y + self.bias[...].astype(dtype)
        return y
