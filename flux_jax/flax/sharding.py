"""Running per-shard nnx modules on global arrays: one jax.shard_map over every mesh axis.

The fused kernels need a *fully manual* shard_map (every mesh axis mapped), so
the layers in this package are written per shard and a whole forward pass runs
inside one shard_map. `sharded_call` builds it: the module's state goes in with
the PartitionSpecs of its sharding annotations, so each rank sees exactly its
shard of every parameter, and gradients flow back to the global parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def data_axes(mesh: jax.sharding.Mesh, tp_axis: str) -> tuple[str, ...]:
    """The mesh axes other than `tp_axis`: the batch is sharded over all of them (data parallel)."""
    return tuple(a for a in mesh.axis_names if a != tp_axis)


def batch_axis_entry(mesh: jax.sharding.Mesh, tp_axis: str):
    """The PartitionSpec entry for a batch dimension: None, one axis name, or a tuple of them."""
    axes = data_axes(mesh, tp_axis)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def data_parallel_size(mesh: jax.sharding.Mesh, tp_axis: str) -> int:
    size = 1
    for a in data_axes(mesh, tp_axis):
        size *= int(mesh.shape[a])
    return size


def place(x: jax.Array, mesh: jax.sharding.Mesh, spec: P) -> jax.Array:
    """Reshard `x` to `spec` on Explicit meshes (on Auto axes shard_map reshards by itself)."""
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))
    return x


def sharded_call(
    module: nnx.Module, fn: Callable[..., Any], *args, mesh: jax.sharding.Mesh, in_specs: Sequence[P], out_specs
) -> Any:
    """`fn(module_shard, *arg_shards)` inside one jax.shard_map over every axis of `mesh`.

    Args:
      module: an nnx module whose parameters carry sharding annotations
        (nnx.with_partitioning); inside `fn` it holds this rank's shards.
      fn: per-shard code, e.g. `lambda layer, x: layer(x)`.
      *args: global arrays, one per entry of `in_specs`.
      mesh: the device mesh; every axis is mapped (the fused kernels need that).
      in_specs, out_specs: PartitionSpecs of the arguments and results, as for jax.shard_map.

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

    mapped = jax.shard_map(per_shard, mesh=mesh, in_specs=(state_specs, *in_specs), out_specs=out_specs)
    return mapped(state, *(place(a, mesh, s) for a, s in zip(args, in_specs)))
