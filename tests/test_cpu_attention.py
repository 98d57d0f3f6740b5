"""Kipp's CPU attention (kipp/cuda/cpu/attention.*), decode (one query a sequence) and prefill
(several): kernel vs the jax.numpy twin vs numpy in float64, a stacked slab's layer, per-sequence
independence and a prefill query's bits equal to a decode query's (bitwise), bad input, and the
JAX backend's use of it.

Bound: the kernel and the twin both compute in float32 from the same BF16 K and V; against
float64 numpy their error is a few float32 ulps of the output's scale. Measured (max |err| /
max |want| per sequence, positions 31 to 199, groups of 2 and 5; position 0 is exact): kernel
1.8e-7 .. 6.4e-7, twin 2.3e-7 .. 5.8e-7; the gate is 2e-6. A prefill query runs the same
operations as a decode query at its position, so the same bound holds and the bits are equal.
"""

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from test_jax_kernels import _numpy_attention  # noqa: E402

from kipp.cuda.cpu import attention as cpu_attention  # noqa: E402
from kipp.cuda.pallas.prefill_attention import paged_attention_reference  # noqa: E402

BOUND = 2e-6

needs_kernel = pytest.mark.skipif(not cpu_attention.available()[0],
                                  reason=f"Kipp's CPU attention: {cpu_attention.available()[1]}")


def _slab(rng, *shape):
    """K and V as BF16 bit patterns (uint16), the CPU slab's storage, and as BF16."""
    k, v = (rng.standard_normal(shape + (32, 8, 128)).astype(ml_dtypes.bfloat16)
            for _ in range(2))
    return k.view(np.uint16), v.view(np.uint16), k, v


def _numpy(q, k, v, position, table):
    """float64 attention of q [H, 128] over positions 0..position through `table`."""
    return _numpy_attention(q, k, v, position, table, np.float64)


def _rel(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


@needs_kernel
@pytest.mark.parametrize("heads", [16, 40])  # query groups of 2 and 5 per KV head
def test_kernel_matches_numpy_and_the_twin(heads):
    """Positions on both sides of block edges and a long one, scrambled block tables, and a
    padding row (position -1: zeros)."""
    rng = np.random.default_rng(heads)
    k, v, kb, vb = _slab(rng, 24)
    pos = np.array([0, 31, 32, 33, 199, -1], np.int32)
    tables = np.stack([rng.permutation(24)[:8] for _ in pos]).astype(np.int32)
    q = rng.standard_normal((len(pos), heads, 128)).astype(np.float32)
    got = np.asarray(jax.jit(cpu_attention.decode_attention)(q, k, v, pos, tables))
    twin = np.asarray(jax.jit(paged_attention_reference)(q[:, None], k, v, pos[:, None],
                                                         tables))[:, 0]
    for s, position in enumerate(pos[:-1]):
        want = _numpy(q[s], kb, vb, position, tables[s])
        assert _rel(got[s], want) <= BOUND, (s, _rel(got[s], want), _rel(twin[s], want))
        assert _rel(twin[s], want) <= BOUND
    assert np.array_equal(got[-1], np.zeros_like(got[-1]))


@needs_kernel
@pytest.mark.parametrize("queries", [None, 3])  # decode (q [S, H, 128]) and a 3-query chunk
def test_a_stacked_slab_is_read_at_its_layer(queries):
    """The scanned step passes the whole [layers, blocks, ...] slab and a traced layer index:
    each layer reads its own rows, bitwise what the same rows give as a layer's own slab."""
    rng = np.random.default_rng(3)
    k, v, _, _ = _slab(rng, 3, 6)
    tables = np.array([[4, 1], [0, 5]], np.int32)
    if queries is None:
        call, pos = cpu_attention.decode_attention, np.array([40, 7], np.int32)
        q = rng.standard_normal((2, 16, 128)).astype(np.float32)
    else:
        call, pos = cpu_attention.attention, np.array([[38, 39, 40], [5, 6, -1]], np.int32)
        q = rng.standard_normal((2, queries, 16, 128)).astype(np.float32)
    stacked = jax.jit(lambda i: call(q, k, v, pos, tables, i))
    own = jax.jit(call)
    outs = [np.asarray(stacked(jnp.int32(i))) for i in range(3)]
    for i, out in enumerate(outs):
        assert np.array_equal(out, np.asarray(own(q, k[i], v[i], pos, tables))), i
    assert not np.array_equal(outs[0], outs[1])


@needs_kernel
@pytest.mark.parametrize("heads", [16, 40])
def test_a_sequence_gets_the_same_bits_alone_or_in_a_batch(heads):
    """Four sequences read each position's 8 KV heads in one unit, two read 4 at a time, and
    one alone runs one KV head a unit (on two threads or more): the same bits each way."""
    rng = np.random.default_rng(5)
    k, v, _, _ = _slab(rng, 16)
    pos = np.array([70, 3, 127, 31], np.int32)
    tables = np.stack([rng.permutation(16)[:4] for _ in pos]).astype(np.int32)
    q = rng.standard_normal((4, heads, 128)).astype(np.float32)
    call = jax.jit(cpu_attention.decode_attention)
    together = np.asarray(call(q, k, v, pos, tables))
    for width in (1, 2):
        for s in range(0, 4, width):
            part = np.asarray(call(q[s:s + width], k, v, pos[s:s + width], tables[s:s + width]))
            assert np.array_equal(part, together[s:s + width]), (width, s)


@needs_kernel
@pytest.mark.parametrize("heads", [16, 40])
def test_prefill_matches_numpy_and_the_twin_and_each_query_is_its_decode(heads):
    """Two sequences of a round: a 70-query chunk from position 0 (three query tiles of the
    kernel's 32, block edges inside) and a 5-query chunk continuing at 197 with padding
    queries behind it, scrambled tables. Each live query within the bound of float64 numpy
    attention over its own positions; each one bitwise decode_attention's at its position;
    padding queries zeros."""
    rng = np.random.default_rng(heads + 1)
    k, v, kb, vb = _slab(rng, 24)
    pos = np.full((2, 70), -1, np.int32)
    pos[0] = np.arange(70)
    pos[1, :5] = np.arange(197, 202)
    tables = np.stack([rng.permutation(24)[:8] for _ in range(2)]).astype(np.int32)
    q = rng.standard_normal((2, 70, heads, 128)).astype(np.float32)
    got = np.asarray(jax.jit(cpu_attention.attention)(q, k, v, pos, tables))
    twin = np.asarray(jax.jit(paged_attention_reference)(q, k, v, pos, tables))
    decode = jax.jit(cpu_attention.decode_attention)
    for s, i in zip(*np.nonzero(pos >= 0)):
        want = _numpy(q[s, i], kb, vb, pos[s, i], tables[s])
        assert _rel(got[s, i], want) <= BOUND, (s, i, _rel(got[s, i], want))
        assert _rel(twin[s, i], want) <= BOUND
    for s, i in [(0, 0), (0, 31), (0, 32), (0, 69), (1, 0), (1, 4)]:
        alone = np.asarray(decode(q[s:s + 1, i], k, v, pos[s:s + 1, i], tables[s:s + 1]))
        assert np.array_equal(alone[0], got[s, i]), (s, i)
    assert np.array_equal(got[1, 5:], np.zeros_like(got[1, 5:]))


@needs_kernel
def test_bad_input_is_an_error_naming_the_kernel():
    rng = np.random.default_rng(1)
    k, v, _, _ = _slab(rng, 2, 4)
    q = rng.standard_normal((1, 16, 128)).astype(np.float32)
    pos, tables = np.array([3], np.int32), np.array([[0]], np.int32)
    with pytest.raises(Exception, match="kipp_cpu_decode_attention: layer out of range"):
        jax.block_until_ready(cpu_attention.decode_attention(q, k, v, pos, tables, 2))
    with pytest.raises(Exception, match="kipp_cpu_decode_attention: expected"):
        jax.block_until_ready(cpu_attention.decode_attention(q[:, :12], k, v, pos, tables, 0))
    with pytest.raises(Exception, match="kipp_cpu_attention: layer out of range"):
        jax.block_until_ready(cpu_attention.attention(q[:, None], k, v, pos[:, None], tables, 2))
    with pytest.raises(Exception, match="kipp_cpu_attention: expected"):
        jax.block_until_ready(cpu_attention.attention(q[:, None], k, v, pos, tables[:, :0], 0))


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(cpu_attention.ENV, "0")
    ok, why = cpu_attention.available()
    assert not ok and cpu_attention.ENV in why


@pytest.mark.slow  # one of the default suite's longest (CI's longest-checks step)
@needs_kernel
def test_the_jax_backend_decodes_through_it(artifacts, monkeypatch):
    """On one CPU device over a BF16 slab the backend's decode rounds run the kernel (describe()
    says so) and agree with the twin's within the gates' bound; q8_0 KV and the switch keep the
    twin."""
    from kipp import gates
    from kipp.backend import EvalItem
    from kipp.cuda.backend import JaxBackend
    from kipp.formats.artifact import open_artifact

    artifact = open_artifact(artifacts("kipp-synthetic/qwen3-tiny-untied", "bf16"))
    prompt = tuple(int(t) for t in np.random.default_rng(0).integers(0, 151_643, 40))

    def decode(backend):
        backend.eval([EvalItem(prompt, 0, (3, 1))])
        return backend.eval([EvalItem((11,), 40, (3, 1)), EvalItem((12,), 40, (3, 1))])

    on = JaxBackend(artifact, 6)
    assert on.cpu_attention and "Kipp CPU attention" in on.describe()
    assert not JaxBackend(artifact, 6, kv_scheme="q8_0").cpu_attention
    monkeypatch.setenv(cpu_attention.ENV, "0")
    off = JaxBackend(artifact, 6)
    assert not off.cpu_attention and "attention" not in off.describe()
    for a, b in zip(decode(on), decode(off)):
        # measured NMSE 1.2e-13 and 1.7e-13: float32 rounding in another order
        assert gates.nmse(a, b) <= 1e-11 and np.array_equal(a.argmax(-1), b.argmax(-1))
    # the prefill rounds too: every row of a 40-token chunk against the twin's
    a, b = (x.eval([EvalItem(prompt, 0, (3, 1), logits_rows=40)])[0] for x in (on, off))
    assert gates.nmse(a, b) <= 1e-11 and np.array_equal(a.argmax(-1), b.argmax(-1))


@needs_kernel
def test_the_step_attention_benchmark_reports_every_sequence_count_and_context():
    from kipp.cuda.bench import step_attention

    text = step_attention(contexts=(40, 70), sequences=(1, 4), layers=2, repeats=1)
    lines = text.splitlines()
    assert len(lines) == 3 and lines[1].startswith("  S=1") and lines[2].startswith("  S=4")
    assert all("C=40:" in line and "C=70:" in line for line in lines[1:])
