"""The multi-host step compiled for H200s on this machine, without a GPU (kipp.cuda.aot).

An abstract topology of 2 hosts x 8 H200s: Qwen3-32B's decode step in BF16, pipeline parallel
over the hosts (each holds 32 of the 64 layers) and tensor parallel over each host's 8 GPUs
(kipp.cuda.sharding's stage shardings, kipp.cuda.forward's pipeline): it must compile, spill
no registers, hand the hidden state between hosts with a collective-permute, and meet the
row-parallel partial sums in all-reduces. The collectives are counted in the report.
"""

import pytest

jax = pytest.importorskip("jax")

from kipp.cuda import aot  # noqa: E402  (before JAX starts: kipp.cuda.aot.host_setup)

REASON = aot.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no H200 compile here: {REASON}")

from kipp.cuda import aot_hosts  # noqa: E402
from kipp.formats import registry  # noqa: E402

COMPILED: list[tuple[str, str]] = []  # (case id, outcome): printed by conftest at the end
HOSTS, PER_HOST = 2, 8


@pytest.mark.slow
def test_two_hosts_of_eight_h200s_compile_the_pipelined_step():
    entry = registry.get("Qwen/Qwen3-32B")
    build, counts, mesh = aot_hosts.compile_pipelined(entry, HOSTS, PER_HOST)
    assert [d.process_index for d in mesh.devices.flat] == [
        h for h in range(HOSTS) for _ in range(PER_HOST)]
    assert build.kernels  # XLA's fusions of the twins' step, each through ptxas -v
    assert all(k.spills == 0 and k.stack == 0 for k in build.kernels), [
        k for k in build.kernels if k.spills or k.stack]
    assert counts["collective-permute"] >= 1  # the hidden state, host to host
    assert counts["all-reduce"] >= 2  # O and down's partial sums within a host
    q = build.compiled.input_shardings[0][0]["layers"]["q"].w
    assert q.shard_shape((entry.layers, entry.attention_width, entry.hidden)) == (
        entry.layers // HOSTS, entry.attention_width // PER_HOST, entry.hidden)
    COMPILED.append((f"pipelined step 32B bf16 decode on {HOSTS} hosts x {PER_HOST} H200s",
                     f"ok {build.seconds:5.1f} s  {len(build.kernels)} kernels, collectives "
                     + ", ".join(f"{k} {v}" for k, v in counts.items() if v)))
