"""Argument checks that run before anything is traced into the program.

Every error names the op, the argument and the shapes involved.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flux_jax.fp8 import Fp8Weight, check_weight

IMPLS = ("auto", "fused", "xla")
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class AxisInfo:
    """Where the op runs: the TP axis inside the enclosing shard_map."""

    axis_name: str | tuple[str, ...]  # one mesh axis, or several forming one TP axis
    tp_size: int
    platform: str  # "cpu", "cuda", ... (lowercase, as in the abstract mesh)
    auto_axes: tuple[str, ...]  # mesh axes of size > 1 left to the partitioner


def _describe(a) -> str:
    return f"{jnp.dtype(a.dtype).name}{list(a.shape)}"


def check_impl(op: str, impl) -> None:
    if impl not in IMPLS:
        raise ValueError(f"flux_jax.{op}: impl must be one of {IMPLS}, got {impl!r}")


def axis_tuple(axis_name) -> tuple[str, ...]:
    """The mesh axes of a TP axis name: ("tp",) for "tp", the names of a tuple as given."""
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry: () for None, ("dp",) for "dp", a tuple's names."""
    return () if entry is None else axis_tuple(entry)


def spec_entry(names: tuple[str, ...]):
    """One PartitionSpec entry for mesh axes `names`: None for (), "dp" for ("dp",), else the tuple."""
    return None if not names else names[0] if len(names) == 1 else names


def axis_set(axis_name) -> frozenset[str]:
    """The mesh axes of a TP axis name, as a set (to add to or take from a manual-axis type)."""
    return frozenset(axis_tuple(axis_name))


def varying_axes(x) -> frozenset[str]:
    """The manual axes x varies over by its type (empty where the shard_map does not check types);
    for a pytree (a pre-quantized weight), any of its leaves'."""
    leaves = jax.tree.leaves(x)
    if len(leaves) != 1:
        return frozenset().union(*(varying_axes(leaf) for leaf in leaves))
    t = jax.typeof(leaves[0])
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(t, "vma", ()))


def check_replicated(op: str, x, axis_name) -> None:
    """x must be the same on every rank of the TP axis: an input whose type says it varies over
    the axis would get an all-reduced gradient where each rank's own is meant."""
    axes = sorted(varying_axes(x) & axis_set(axis_name))
    if axes:
        raise ValueError(
            f"flux_jax.{op}: x {_describe(x)} varies over mesh axis {', '.join(map(repr, axes))} by its type, but "
            f"x must be the same on every rank of axis_name={axis_name!r} (its gradient is all-reduced over it). "
            "Pass x replicated over the axis (no such axis in its in_specs; lax.psum's result is replicated); "
            "for rows gathered with lax.all_gather use flux_jax.ag_matmul, for rows that differ per rank jnp.dot"
        )


def parse_axis_name(axis_name) -> tuple[str, ...] | None:
    """The mesh axes a TP axis name stands for: (name,) for a str, the names of a non-empty tuple of
    distinct str (one TP axis over their devices in row-major order, as lax.all_gather and
    lax.axis_index read a tuple); None for anything else (the caller words the error)."""
    if isinstance(axis_name, str):
        return (axis_name,)
    if isinstance(axis_name, tuple) and axis_name and all(isinstance(a, str) for a in axis_name):
        if len(set(axis_name)) == len(axis_name):
            return axis_name
    return None


def axis_size(sizes, axis_name) -> int:
    """Devices along a TP axis name: the product of its mesh axes' sizes (`sizes`: name -> size)."""
    return int(np.prod([sizes[a] for a in axis_tuple(axis_name)]))


def normalize_axis_name(op: str, axis_name):
    """`axis_name` as the ops carry it: one mesh axis's name (a str; a 1-tuple becomes its name), or
    a tuple of two or more distinct names (parse_axis_name)."""
    names = parse_axis_name(axis_name)
    if names is not None:
        return names[0] if len(names) == 1 else names
    raise ValueError(
        f"flux_jax.{op}: axis_name must name a mesh axis (a str) or several distinct ones (a tuple of "
        f"str), got {axis_name!r}"
    )


def check_axis(op: str, axis_name) -> AxisInfo:
    """The op must run inside jax.shard_map with every axis of `axis_name` manual."""
    axis_name = normalize_axis_name(op, axis_name)
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(mesh.axis_names)
    manual = frozenset(getattr(mesh, "manual_axes", ()))
    missing = [a for a in axis_tuple(axis_name) if a not in names or a not in manual]
    if missing:
        where = f"the current mesh has axes {names} (manual: {tuple(sorted(manual))})" if names else "no mesh is active"
        which = f"axis {missing[0]!r} is" if len(missing) == 1 else f"axes {tuple(missing)} are"
        raise ValueError(
            f"flux_jax.{op} is a per-shard op: call it inside jax.shard_map over a mesh whose {which} "
            f"mapped (in_specs / out_specs mention it); {where}. For a global-view "
            f"call use flux_jax.{op}_sharded(x, w, mesh=..., axis_name=...)."
        )
    sizes = dict(zip(names, mesh.axis_sizes))
    device = getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None) or jax.default_backend()
    auto = tuple(a for a in names if sizes[a] > 1 and a not in manual)
    return AxisInfo(axis_name, axis_size(sizes, axis_name), platform_name(platform), auto)


def check_operands(op: str, x, w) -> None:
    """Ranks, dtypes and the contraction dimension (shared by both ops). `w` may be a
    pre-quantized flux_jax.Fp8Weight: its leaves are checked, and its logical [K, N] is what x
    must match (x keeps a high-precision dtype, the output's)."""
    prequantized = isinstance(w, Fp8Weight)
    if prequantized:
        check_weight(op, w)
    for name, a in (("x", x), ("w", w)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"flux_jax.{op}: {name} must be an array, got {type(a).__name__}")
        symbolic = [d for d in a.shape if not isinstance(d, (int, np.integer))]
        if symbolic:
            raise NotImplementedError(
                f"flux_jax.{op}: {name} has the symbolic dimension {str(symbolic[0])!r} (shape polymorphism, "
                "jax.export with export.symbolic_shape): the plan, the kernels and the workspace depend on every "
                "dimension; export with concrete shapes"
            )
    if len(x.shape) < 2:
        raise ValueError(f"flux_jax.{op}: x must have rank >= 2 ([rows, ..., K]), got x {_describe(x)}")
    if prequantized:
        _check_prequantized(op, x, w)
        return
    if len(w.shape) != 2:
        raise ValueError(f"flux_jax.{op}: w must have rank 2 ([K, N]), got w {_describe(w)}")
    if jnp.dtype(x.dtype) != jnp.dtype(w.dtype):
        raise TypeError(
            f"flux_jax.{op}: x and w must have the same dtype (no silent promotion), got "
            f"x {_describe(x)} and w {_describe(w)}; cast one of them explicitly"
        )
    if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        hint = ""
        if jnp.dtype(x.dtype).itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating):
            hint = (
                "; for FP8 GEMMs pass high-precision x and w with fp8=True (the op quantizes them), "
                "or a weight quantized once with flux_jax.Fp8Weight.quantize"
            )
        raise TypeError(f"flux_jax.{op}: unsupported dtype {jnp.dtype(x.dtype).name}; supported: {names}{hint}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"flux_jax.{op}: contraction mismatch: x {_describe(x)} has K={x.shape[-1]} but w "
            f"{_describe(w)} has K={w.shape[0]} (w must be [K, N])"
        )


def _check_prequantized(op: str, x, w) -> None:
    if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise TypeError(
            f"flux_jax.{op}: with a pre-quantized w, x must be {names} (the output's dtype), got x {_describe(x)}"
        )
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"flux_jax.{op}: contraction mismatch: x {_describe(x)} has K={x.shape[-1]} but the "
            f"pre-quantized w is [K, N] = {list(w.shape)} (w.q {_describe(w.q)} stores it as [N, K])"
        )


def platform_name(platform) -> str:
    """ "cpu" or "cuda" (JAX says "gpu" for CUDA devices), else the platform's own name."""
    name = str(platform).lower()
    return "cuda" if name == "gpu" else name


def check_dimension(op: str, x, dim, name: str) -> int:
    """`dim` names a dimension of x other than the last (the contraction); returns it >= 0."""
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"flux_jax.{op}: {name} must be an int, got {dim!r}")
    ndim = len(x.shape)
    d = int(dim) + ndim if dim < 0 else int(dim)
    if not 0 <= d < ndim - 1:
        raise ValueError(
            f"flux_jax.{op}: {name}={dim} must name a dimension of x {_describe(x)} other than the "
            f"last (the contraction dimension): -{ndim}..{ndim - 2} except -1"
        )
    return d


def check_divisible(op: str, x, dim: int, tp_size: int, axis_name: str) -> None:
    if x.shape[dim] % tp_size:
        which = "the leading dimension" if dim == 0 else f"dimension {dim}"
        raise ValueError(
            f"flux_jax.{op}: {which} of x {_describe(x)} ({x.shape[dim]} rows) must be divisible by "
            f"the size of axis {axis_name!r} ({tp_size}) to be scattered over it"
        )


def rows_of(x) -> int:
    """Rows of x once its middle dimensions are folded into the leading one."""
    return int(np.prod(x.shape[:-1], dtype=np.int64))
