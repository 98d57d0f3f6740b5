"""The multi-host step compiled for H200s without a GPU: an abstract topology of hosts x GPUs.

    build, counts = aot_hosts.compile_pipelined(registry.get("Qwen/Qwen3-32B"), hosts=2)

A checkpoint's decode step in BF16, pipeline parallel over the hosts (each holds its range of
the stacked layers) and tensor parallel over each host's GPUs (kipp.cuda.sharding's stage
shardings, kipp.cuda.forward's pipeline). XLA's own fusions are reported (the twins' step has
no Pallas kernel), and the collectives in the compiled HLO are counted: the hidden state
crosses hosts in a collective-permute, the row-parallel partial sums meet in all-reduces.
"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np

from kipp.cuda import aot, forward, sharding
from kipp.cuda.layout import NORMS, PROJECTIONS
from kipp.cuda.pallas import kernel_shapes

COLLECTIVES = ("all-reduce", "collective-permute", "all-gather", "reduce-scatter", "all-to-all")


def stacked_specs(entry, seqs: int = 8):
    """step_specs' parameters and KV slab with the layers stacked `[layers, ...]`: decode of
    `seqs` sequences, one token each."""
    params, kv, rope, arrays = kernel_shapes.step_specs(entry, "bf16", tokens=seqs, seqs=seqs,
                                                        queries=1)

    def stack(*leaves):
        return jax.ShapeDtypeStruct((len(leaves),) + leaves[0].shape, leaves[0].dtype)

    layers = {name: jax.tree.map(stack, *[layer[name] for layer in params["layers"]])
              for name in PROJECTIONS + NORMS}
    slab = kv[0][0]
    stacked_kv = (stack(*[slab] * entry.layers),) * 2
    return dict(params, layers=layers), stacked_kv, rope, arrays


def collective_counts(hlo: str) -> dict[str, int]:
    """Each collective's count in compiled HLO text (async ones by their start)."""
    return {name: len(re.findall(rf" {name}(?:-start)?\(", hlo)) for name in COLLECTIVES}


def pipelined_mesh(hosts: int, per_host: int) -> jax.sharding.Mesh:
    """The abstract H200s as a (pipeline, tensor) mesh: one pipeline stage per host."""
    devices = aot.devices(hosts * per_host, hosts=hosts)
    return jax.sharding.Mesh(np.array(devices).reshape(hosts, per_host),
                             (sharding.PIPELINE, sharding.AXIS))


def compile_pipelined(entry, hosts: int = 2, per_host: int = 8):
    """(aot.Build, collective counts, mesh) of `entry`'s pipelined decode step."""
    mesh = pipelined_mesh(hosts, per_host)
    params, kv, rope, arrays = stacked_specs(entry)

    def put(a, where):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where)

    replicated = sharding.replicated(mesh)
    layers = {name: jax.tree.map(put, value, sharding.stage_leaf_sharding(name, value, mesh))
              for name, value in params["layers"].items()}
    params = jax.tree.map(lambda a: put(a, replicated), dict(params, layers={}))
    params["layers"] = layers
    kv = jax.tree.map(lambda a: put(a, sharding.stage_kv_sharding(mesh)), kv)
    rope, arrays = jax.tree.map(lambda a: put(a, replicated), (rope, arrays))
    step = jax.jit(functools.partial(forward.step, ops=forward.Ops(pipeline=mesh)),
                   donate_argnums=(1,))
    build = aot.compile_for_h200(step, params, kv, rope, arrays, xla_kernels=True)
    return build, collective_counts(build.compiled.as_text()), mesh
