"""Global-view helpers: build the jax.shard_map around the per-shard ops.

For users who do not write their own shard_map. Inputs are global arrays; the
helpers place them as the sharding contract requires (resharding explicitly on
Explicit mesh axes; Auto axes are resharded by shard_map itself). Mesh axes
other than `axis_name` replicate the computation. `w` may be a pre-quantized
flux_jax.Fp8Weight (global: q [N, K], its scales): its leaves are placed per
`Fp8Weight.partition_spec` of the weight's spec below.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from flux_jax import _validation
from flux_jax import fp8 as _fp8
from flux_jax.ops import ag_matmul, column_matmul, matmul_ar, matmul_rs

# What each helper splits over the axis: (name, global dimension as (operand, index)).
_SPLITS = {
    "ag_matmul_sharded": (("M", "x", 0), ("N", "w", 1)),
    "matmul_rs_sharded": (("M", "x", 0), ("K", "w", 0)),
    "matmul_ar_sharded": (("K", "w", 0),),
    "column_matmul_sharded": (("N", "w", 1),),
}


def _check_global(op: str, x, w, mesh, axis_name, fp8):
    """The global operands and the mesh, checked before the shard_map (whose errors would show
    per-shard shapes the caller never passed); returns the axis name as the ops carry it."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"flux_jax.{op}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    axis_name = _validation.normalize_axis_name(op, axis_name)
    missing = [a for a in _validation.axis_tuple(axis_name) if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"flux_jax.{op}: axis_name {missing[0]!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    _validation.check_operands(op, x, w)
    _fp8.resolve(op, fp8, w)
    tp = _validation.axis_size(dict(zip(mesh.axis_names, mesh.axis_sizes)), axis_name)
    for name, operand, dim in _SPLITS[op]:
        a = x if operand == "x" else w
        if a.shape[dim] % tp:
            raise ValueError(
                f"flux_jax.{op}: {name} = {a.shape[dim]} ({operand} {jax.numpy.dtype(a.dtype).name}"
                f"{list(a.shape)}) must be divisible by the size of axis {axis_name!r} ({tp})"
            )
    return axis_name


def _weight_spec(w, spec):
    """The in_spec of the weight: `spec` over [K, N], or its leaves' for a pre-quantized weight."""
    return w.partition_spec(spec) if isinstance(w, _fp8.Fp8Weight) else spec


def _place(x, mesh, spec):
    """x resharded to `spec` over the mesh's Explicit axes (shard_map moves it over the Auto
    ones; reshard refuses to name them). A pre-quantized weight: each leaf to its spec."""
    if isinstance(x, _fp8.Fp8Weight):
        return jax.tree.map(lambda a, s: _place(a, mesh, s), x, spec)
    explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
    if not explicit:
        return x

    def keep(entry):
        return _validation.spec_entry(tuple(a for a in _validation.entry_axes(entry) if a in explicit))

    return jax.sharding.reshard(x, NamedSharding(mesh, P(*(keep(e) for e in spec))))


def ag_matmul_sharded(
    x, w, *, mesh, axis_name: str | tuple[str, ...], impl: str = "auto", return_gathered: bool = False, fp8=None
):
    """Global-view AllGather -> GEMM (column-parallel linear over sequence-sharded rows).

    Args:
      x: global [M, ..., K], placed row-sharded over `axis_name`: P(axis_name, None, ...).
      w: global [K, N], placed column-sharded over `axis_name`: P(None, axis_name); or a
        pre-quantized flux_jax.Fp8Weight of it.
      mesh: a jax.sharding.Mesh containing `axis_name`.
      impl, return_gathered, fp8: as in flux_jax.ag_matmul.

    Returns:
      x @ w, global [M, ..., N], column-sharded over `axis_name`: P(None, ..., axis_name);
      with `return_gathered`, also x itself replicated over `axis_name`.
    M must be divisible by the axis size.
    """
    axis_name = _check_global("ag_matmul_sharded", x, w, mesh, axis_name, fp8)
    x_spec = P(axis_name, *([None] * (x.ndim - 1)))
    w_spec = _weight_spec(w, P(None, axis_name))
    out_spec = P(*([None] * (x.ndim - 1)), axis_name)
    body = functools.partial(ag_matmul, axis_name=axis_name, impl=impl, return_gathered=return_gathered, fp8=fp8)
    out_specs = (out_spec, P()) if return_gathered else out_spec
    # The gathered copy is identical on every rank but typed as varying, so the
    # replicated out_spec needs check_vma off.
    f = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_specs, check_vma=not return_gathered)
    return f(_place(x, mesh, x_spec), _place(w, mesh, w_spec))


def matmul_rs_sharded(x, w, *, mesh, axis_name: str | tuple[str, ...], impl: str = "auto", fp8=None):
    """Global-view GEMM -> ReduceScatter (row-parallel linear, sequence-sharded output).

    Args:
      x: global [M, ..., K], placed sharded on its last (contraction) dim: P(None, ..., axis_name).
      w: global [K, N], placed row-sharded over `axis_name`: P(axis_name, None); or a
        pre-quantized flux_jax.Fp8Weight of it.
      mesh: a jax.sharding.Mesh containing `axis_name`.
      impl, fp8: as in flux_jax.matmul_rs.

    Returns:
      x @ w, global [M, ..., N], row-sharded over `axis_name`: P(axis_name, None, ...).
    M must be divisible by the axis size.
    """
    axis_name = _check_global("matmul_rs_sharded", x, w, mesh, axis_name, fp8)
    x_spec = P(*([None] * (x.ndim - 1)), axis_name)
    w_spec = _weight_spec(w, P(axis_name, None))
    out_spec = P(axis_name, *([None] * (x.ndim - 1)))
    body = functools.partial(matmul_rs, axis_name=axis_name, impl=impl, fp8=fp8)
    f = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
    return f(_place(x, mesh, x_spec), _place(w, mesh, w_spec))


def matmul_ar_sharded(x, w, *, mesh, axis_name: str | tuple[str, ...], impl: str = "auto", fp8=None):
    """Global-view GEMM -> AllReduce (row-parallel linear, replicated output).

    Args:
      x: global [M, ..., K], placed sharded on its last (contraction) dim: P(None, ..., axis_name).
      w: global [K, N], placed row-sharded over `axis_name`: P(axis_name, None); or a
        pre-quantized flux_jax.Fp8Weight of it.
      mesh: a jax.sharding.Mesh containing `axis_name`.
      impl, fp8: as in flux_jax.matmul_ar.

    Returns:
      x @ w, global [M, ..., N], replicated over `axis_name`: P(None, ...).
    """
    axis_name = _check_global("matmul_ar_sharded", x, w, mesh, axis_name, fp8)
    x_spec = P(*([None] * (x.ndim - 1)), axis_name)
    w_spec = _weight_spec(w, P(axis_name, None))
    out_spec = P(*([None] * x.ndim))
    body = functools.partial(matmul_ar, axis_name=axis_name, impl=impl, fp8=fp8)
    f = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
    return f(_place(x, mesh, x_spec), _place(w, mesh, w_spec))


def column_matmul_sharded(x, w, *, mesh, axis_name: str | tuple[str, ...], impl: str = "auto", fp8=None):
    """Global-view column-parallel GEMM on a replicated input (its backward is a fused matmul_ar).

    Args:
      x: global [M, ..., K], replicated over `axis_name`: P(None, ...).
      w: global [K, N], placed column-sharded over `axis_name`: P(None, axis_name); or a
        pre-quantized flux_jax.Fp8Weight of it.
      mesh: a jax.sharding.Mesh containing `axis_name`.
      impl, fp8: as in flux_jax.column_matmul.

    Returns:
      x @ w, global [M, ..., N], column-sharded over `axis_name`: P(None, ..., axis_name).
    """
    axis_name = _check_global("column_matmul_sharded", x, w, mesh, axis_name, fp8)
    x_spec = P(*([None] * x.ndim))
    w_spec = _weight_spec(w, P(None, axis_name))
    out_spec = P(*([None] * (x.ndim - 1)), axis_name)
    body = functools.partial(column_matmul, axis_name=axis_name, impl=impl, fp8=fp8)
    f = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
    return f(_place(x, mesh, x_spec), _place(w, mesh, w_spec))
