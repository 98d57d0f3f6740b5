"""The multi-host step compiled for H200s on this machine, without a GPU (kipp.cuda.aot).

An abstract topology of 2 hosts x 8 H200s: Qwen3-32B's decode step in BF16, pipeline parallel
over the hosts (each holds 32 of the 64 layers) and tensor parallel over each host's 8 GPUs
(kipp.cuda.sharding's stage shardings, kipp.cuda.forward's pipeline): it must compile, spill
no registers, hand the hidden state between hosts with a collective-permute, and meet the
row-parallel partial sums in all-reduces. The collectives are counted in the report.
"""

import functools
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from kipp.cuda import aot  # noqa: E402  (before JAX starts: kipp.cuda.aot.host_setup)

REASON = aot.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no H200 compile here: {REASON}")

from kipp.cuda import forward, sharding  # noqa: E402
from kipp.cuda.layout import NORMS, PROJECTIONS  # noqa: E402
from kipp.cuda.pallas import kernel_shapes  # noqa: E402
from kipp.formats import registry  # noqa: E402

COMPILED: list[tuple[str, str]] = []  # (case id, outcome): printed by conftest at the end
HOSTS, PER_HOST = 2, 8
COLLECTIVES = ("all-reduce", "collective-permute", "all-gather", "reduce-scatter", "all-to-all")


def stacked_specs(entry):
    """step_specs' parameters and slab with the layers stacked `[layers, ...]`."""
    params, kv, rope, arrays = kernel_shapes.step_specs(entry, "bf16", tokens=8, seqs=8,
                                                        queries=1)

    def stack(*leaves):
        return jax.ShapeDtypeStruct((len(leaves),) + leaves[0].shape, leaves[0].dtype)

    layers = {name: jax.tree.map(stack, *[layer[name] for layer in params["layers"]])
              for name in PROJECTIONS + NORMS}
    slab = kv[0][0]
    stacked_kv = (stack(*[slab] * entry.layers),) * 2
    return dict(params, layers=layers), stacked_kv, rope, arrays


def collective_counts(hlo: str) -> dict[str, int]:
    return {name: len(re.findall(rf" {name}(?:-start)?\(", hlo)) for name in COLLECTIVES}


@pytest.mark.slow
def test_two_hosts_of_eight_h200s_compile_the_pipelined_step():
    entry = registry.get("Qwen/Qwen3-32B")
    devices = aot.devices(HOSTS * PER_HOST, hosts=HOSTS)
    assert [d.process_index for d in devices] == [h for h in range(HOSTS) for _ in range(8)]
    mesh = jax.sharding.Mesh(np.array(devices).reshape(HOSTS, PER_HOST),
                             (sharding.PIPELINE, sharding.AXIS))
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
    assert build.kernels  # XLA's fusions of the twins' step, each through ptxas -v
    assert all(k.spills == 0 and k.stack == 0 for k in build.kernels), [
        k for k in build.kernels if k.spills or k.stack]
    counts = collective_counts(build.compiled.as_text())
    assert counts["collective-permute"] >= 1  # the hidden state, host to host
    assert counts["all-reduce"] >= 2  # O and down's partial sums within a host
    q = build.compiled.input_shardings[0][0]["layers"]["q"].w
    assert q.shard_shape((entry.layers, entry.attention_width, entry.hidden)) == (
        entry.layers // HOSTS, entry.attention_width // PER_HOST, entry.hidden)
    COMPILED.append((f"pipelined step 32B bf16 decode on {HOSTS} hosts x {PER_HOST} H200s",
                     f"ok {build.seconds:5.1f} s  {len(build.kernels)} kernels, collectives "
                     + ", ".join(f"{k} {v}" for k, v in counts.items() if v)))
