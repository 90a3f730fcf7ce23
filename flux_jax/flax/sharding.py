"""Running per-shard nnx modules on global arrays: a jax.shard_map over the mesh axes.

The layers in this package are written per shard. `sharded_call` runs one inside a
shard_map: over every mesh axis (a whole forward pass in one fully manual region), or, with
`axis_names={tp}`, over the TP axis only, inside a GSPMD model whose other axes stay with the
partitioner. The module's state goes in with the PartitionSpecs of its sharding annotations,
so each rank sees exactly its shard of every parameter, and gradients flow back to the global
parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from flux_jax._validation import entry_axes as _names
from flux_jax._validation import parse_axis_name
from flux_jax._validation import spec_entry as _entry


def tp_axis_names(tp_axis) -> tuple[str, ...]:
    """The mesh axes of a TP axis: ("tp",) for "tp"; for a tuple of distinct names, those names (one
    TP axis over their devices, ranks row-major in the order named, as the flux_jax ops read it)."""
    names = parse_axis_name(tp_axis)
    if names is not None:
        return names
    raise ValueError(
        f"tp_axis must name a mesh axis (a str) or several distinct ones (a tuple of str), got {tp_axis!r}"
    )


def normalize_tp_axis(tp_axis):
    """`tp_axis` as the layers keep it: a str, or a tuple of two or more names (a 1-tuple is its name)."""
    names = tp_axis_names(tp_axis)
    return names[0] if len(names) == 1 else names


def data_axes(mesh: jax.sharding.Mesh, tp_axis) -> tuple[str, ...]:
    """The mesh axes other than `tp_axis`'s: the batch is sharded over all of them (data parallel)."""
    tp = tp_axis_names(tp_axis)
    return tuple(a for a in mesh.axis_names if a not in tp)


def batch_axis_entry(mesh: jax.sharding.Mesh, tp_axis):
    """The PartitionSpec entry for a batch dimension: None, one axis name, or a tuple of them."""
    axes = data_axes(mesh, tp_axis)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def data_parallel_size(mesh: jax.sharding.Mesh, tp_axis) -> int:
    size = 1
    for a in data_axes(mesh, tp_axis):
        size *= int(mesh.shape[a])
    return size


def place(x: jax.Array, mesh: jax.sharding.Mesh, spec: P) -> jax.Array:
    """Reshard `x` to `spec` on Explicit meshes (on Auto axes shard_map reshards by itself)."""
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))
    return x


def place_manual(x: jax.Array, mesh: jax.sharding.Mesh, spec: P, axis_names) -> jax.Array:
    """For a shard_map over `axis_names` only: on Explicit meshes, reshard `x` so that it splits
    over those axes as `spec` says, keeping its sharding over the other (automatic) axes. On a
    dimension split over both, the manual axes come first, as such a shard_map types it."""
    if not any(t == AxisType.Explicit for t in mesh.axis_types):
        return x
    sharding = getattr(jax.typeof(x), "sharding", None)
    current = getattr(sharding, "spec", None) or P()
    if getattr(getattr(sharding, "mesh", None), "axis_names", None) != mesh.axis_names:
        current = P()  # not on this mesh yet (a host array)
    at = lambda p, d: _names(p[d]) if d < len(p) else ()  # noqa: E731
    dims = [
        _entry(
            tuple(a for a in at(spec, d) if a in axis_names) + tuple(a for a in at(current, d) if a not in axis_names)
        )
        for d in range(len(jax.typeof(x).shape))
    ]
    return jax.sharding.reshard(x, NamedSharding(mesh, P(*dims)))


def manual_spec(spec: P, axis_names) -> P:
    """`spec` with only the entries on `axis_names` (the axes a partially manual shard_map maps)."""

    return P(*(_entry(tuple(a for a in _names(e) if a in axis_names)) for e in spec))


def sharded_call(
    module: nnx.Module,
    fn: Callable[..., Any],
    *args,
    mesh: jax.sharding.Mesh,
    in_specs: Sequence[P],
    out_specs,
    axis_names=None,
) -> Any:
    """`fn(module_shard, *arg_shards)` inside one jax.shard_map over every axis of `mesh`
    (or only over `axis_names`).

    Args:
      module: an nnx module whose parameters carry sharding annotations
        (nnx.with_partitioning); inside `fn` it holds this rank's shards.
      fn: per-shard code, e.g. `lambda layer, x: layer(x)`.
      *args: global arrays, one per entry of `in_specs`. On meshes with Explicit axes the
        arguments and the parameters are resharded to their specs first (with `axis_names`:
        over those axes, keeping their sharding over the others).
      mesh: the device mesh; every axis is mapped unless `axis_names` says otherwise.
      in_specs, out_specs: PartitionSpecs of the arguments and results, as for jax.shard_map.
      axis_names: map only these axes (e.g. {"tp"}); the others stay automatic: the arguments
        keep their sharding over them, and so do the parameters annotated over them (FSDP):
        the partitioner gathers them for the region on Auto axes, the flux_jax ops gather their
        weight on Explicit ones (its gradient comes back split). Trace under
        `jax.set_mesh(mesh)` (nested manual regions need the concrete mesh).

    Works under jax.jit / nnx.jit and jax.grad / nnx.grad: parameters that are
    replicated over an axis get their gradient summed over it automatically.
    State that `fn` mutates is not written back (the layers here are pure).
    """
    if len(args) != len(in_specs):
        raise ValueError(f"sharded_call got {len(args)} arguments but {len(in_specs)} in_specs")
    graphdef, state = nnx.split(module)
    state_specs = nnx.get_partition_spec(state)

    def per_shard(state, *shards):
        return fn(nnx.merge(graphdef, state), *shards)

    if axis_names is not None:
        axis_names = set(axis_names)
        state_specs = jax.tree.map(
            lambda s: manual_spec(s, axis_names), state_specs, is_leaf=lambda s: isinstance(s, P)
        )
        mapped = jax.shard_map(
            per_shard, mesh=mesh, in_specs=(state_specs, *in_specs), out_specs=out_specs, axis_names=axis_names
        )
        state = jax.tree.map(lambda a, s: place_manual(a, mesh, s, axis_names), state, state_specs)
        return mapped(state, *(place_manual(a, mesh, s, axis_names) for a, s in zip(args, in_specs)))
    mapped = jax.shard_map(per_shard, mesh=mesh, in_specs=(state_specs, *in_specs), out_specs=out_specs)
    # The parameters too: values put back by hand (nnx.update with host or one-device arrays, a
    # checkpoint read without shardings) lose their annotation's placement on Explicit meshes.
    state = jax.tree.map(lambda a, s: place(a, mesh, s), state, state_specs)
    return mapped(state, *(place(a, mesh, s) for a, s in zip(args, in_specs)))
