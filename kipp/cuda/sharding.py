"""Tensor parallelism over a jax.sharding.Mesh: how Kipp grows past one GPU.

Megatron-style placement, expressed only as shardings; XLA's SPMD partitioner derives the
per-device programs and inserts the collectives (nothing home-made):
- Q, K, V, gate and up are split along their output rows (attention heads, FFN columns), so
  each device computes whole heads: with 8 KV heads over 2 devices, device i holds KV heads
  4i..4i+3 and exactly the query heads that share them.
- O and down are split along their input columns; their partial sums meet in one all-reduce.
- The KV slab is split along its KV-head axis: each device stores only its heads.
- Norms, embedding and output head are replicated.
Packed quantized planes split the same way: rows for column-parallel projections, whole
32-weight groups for row-parallel ones (every family width is a multiple of 32 * devices).
kipp.cuda.shard_check compares a sharded backend's logits with one device's.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kipp.cuda.layout import Linear

AXIS = "tp"
COLUMN_PARALLEL = ("q", "k", "v", "gate", "up")
ROW_PARALLEL = ("o", "down")


def make_mesh(devices: int | None = None) -> Mesh:
    """A one-axis ("tp") mesh over the first `devices` JAX devices (all by default)."""
    found = jax.devices()
    count = devices or len(found)
    if count > len(found):
        raise ValueError(f"asked for {count} devices, JAX sees {len(found)}")
    return Mesh(np.array(found[:count]), (AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """Slab [blocks, 32, 8 kv heads, 128] split over KV heads."""
    return NamedSharding(mesh, P(None, None, AXIS, None))


def _linear_sharding(w: Linear, mesh: Mesh, column: bool) -> Linear:
    def spec(a):
        if a is None:
            return None
        axes = [None] * a.ndim
        axes[0 if column else 1] = AXIS
        return NamedSharding(mesh, P(*axes))

    return Linear(spec(w.w), spec(w.d), spec(w.m), fmt=w.fmt)


def leaf_sharding(name: str, value, mesh: Mesh):
    """The sharding of one prepared parameter (kipp.cuda.layout.place_weights' names): a
    Linear of shardings for a projection, replicated for everything else."""
    if name in COLUMN_PARALLEL or name in ROW_PARALLEL:
        return _linear_sharding(value, mesh, name in COLUMN_PARALLEL)
    return replicated(mesh)


def param_shardings(params, mesh: Mesh):
    """A pytree of NamedShardings matching kipp.cuda.layout.prepare_weights' output."""
    rep = replicated(mesh)
    layers = [{name: leaf_sharding(name, value, mesh) for name, value in layer.items()}
              for layer in params["layers"]]
    return {"embed": rep, "head": None if params["head"] is None else rep,
            "output_norm": rep, "layers": layers}


def put(tree, shardings):
    """A pytree of host arrays placed on `shardings` (one sharding, or a matching pytree).
    Across processes (a sharding not fully addressable) each process builds only the shards
    its own devices hold, from its own copy of the host value (jax.make_array_from_callback;
    every process passes the same value); within one process, jax.device_put."""
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)

    def one(a, s):
        if s is None or s.is_fully_addressable:
            return jax.device_put(a, s)
        a = np.asarray(a)
        # each local shard a fresh copy: never a view of the artifact's mapped pages
        return jax.make_array_from_callback(a.shape, s, lambda index: np.array(a[index]))

    return jax.tree.map(one, tree, shardings)


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated (or single-process) result as one numpy array; across processes
    np.asarray refuses, so a replicated array is read from this process's own copy."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if not x.is_fully_replicated:
        raise ValueError("a sharded multi-process result: gather it first")
    return np.asarray(x.addressable_data(0))


# -- pipeline parallel --------------------------------------------------------------------------

PIPELINE = "pp"


def make_pipeline_mesh(stages: int | None = None, tensor: int = 1) -> Mesh:
    """A ("pp", "tp") mesh: stage i holds the i-th contiguous range of the layers, tensor
    parallel over `tensor` devices within it (a host's GPUs: the stages are the hosts)."""
    found = jax.devices()
    stages = stages or len(found) // tensor
    if stages * tensor > len(found) or stages < 1:
        raise ValueError(f"asked for {stages} stages of {tensor} devices, JAX sees "
                         f"{len(found)}")
    return Mesh(np.array(found[:stages * tensor]).reshape(stages, tensor), (PIPELINE, AXIS))


def pipelined(mesh: Mesh | None) -> bool:
    return mesh is not None and PIPELINE in mesh.axis_names


def stage_sharding(mesh: Mesh, tensor_axis: int | None = None, ndim: int = 1) -> NamedSharding:
    """A stacked `[layers, ...]` array split along its layers over the stages, and along
    `tensor_axis` (an axis of the stacked array) over the "tp" axis, if given."""
    axes = [PIPELINE] + [None] * (ndim - 1)
    if tensor_axis is not None:
        axes[tensor_axis] = AXIS
    return NamedSharding(mesh, P(*axes))


def stage_leaf_sharding(name: str, value, mesh: Mesh):
    """The sharding of one stacked layer parameter (kipp.cuda.layout's names) on a pipeline
    mesh: its layers over "pp"; a projection also split over "tp" as `leaf_sharding` splits
    it (rows of column-parallel ones, input groups of row-parallel ones)."""
    if name in COLUMN_PARALLEL or name in ROW_PARALLEL:
        axis = 1 if name in COLUMN_PARALLEL else 2

        def spec(a):
            return None if a is None else stage_sharding(mesh, axis, a.ndim)

        return Linear(spec(value.w), spec(value.d), spec(value.m), fmt=value.fmt)
    return stage_sharding(mesh)


def stage_kv_sharding(mesh: Mesh) -> NamedSharding:
    """A stacked slab [layers, blocks, 32, 8 kv heads, 128]: layers over "pp", KV heads over
    "tp"."""
    return NamedSharding(mesh, P(PIPELINE, None, None, AXIS, None))
