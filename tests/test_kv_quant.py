"""The q8_0 KV cache: kipp.formats.kvquant against kipp.formats.quant, and each backend's q8_0 slab
against its BF16 slab, against the other backend, and against its own block-table layout.

Bounds. Per value, q8_0 KV is off by at most d/2 = amax/254 of its 32-value block (about 0.4%
of a row's largest value) against BF16's 2^-9 relative; on the tiny checkpoint the logits move
by NMSE ~2.6e-5 (the seeds measured ~1.4e-5 on a real 0.6B). KV_NMSE = 2e-4 leaves room for
other prompts and positions; a dequantizer that drops a block's scale, mixes blocks or
loses a sign moves the logits by NMSE ~1e-2 or more. Reference vs JAX on the same q8_0 KV:
DESIGN.md's 1e-4 between backends.
"""

import numpy as np
import pytest

from kipp import gates
from kipp.backend import EvalItem
from kipp.errors import KippError
from kipp.formats import kvquant, quant
from kipp.formats.artifact import open_artifact
from kipp.model import Model, load
from kipp.reference.backend import ReferenceBackend

TINY = "kipp-synthetic/qwen3-tiny"
UNTIED = "kipp-synthetic/qwen3-tiny-untied"
KV_NMSE = 2e-4
BACKEND_NMSE = 1e-4
BLOCKS = 12


def _rows(seed: int, n: int) -> np.ndarray:
    """float32 head-rows [n, 8, 128] over 20 binades, with the encoder's edge cases."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8, 128)) * np.exp(rng.uniform(-20, 8, (n, 8, 1)))
    x = x.astype(np.float32)
    x[0, 0, :32] = 0.0  # a flat block
    x[0, 1, :] = -0.0
    x[0, 2, :32] = 3e-9  # a subnormal fp16 scale
    x[0, 3, :32] = np.arange(32) * 0.5 + 0.25  # values on level midpoints
    return x


def _midpoint_rows() -> np.ndarray:
    """Rows whose block maximum is 127 x an fp16 midpoint (or one float32 step off it): where a
    float32 amax / 127 rounds to fp16 differently from the exact quotient."""
    h = np.arange(1, 0x7BFF, 7, dtype=np.uint16).view(np.float16).astype(np.float32)
    mid = (h + np.nextafter(h.astype(np.float16), np.float16(np.inf)).astype(np.float32)) / 2
    amax = (mid * np.float32(127)).astype(np.float32)
    amax = np.concatenate([amax, np.nextafter(amax, np.float32(0)),
                           np.nextafter(amax, np.float32(np.inf))])
    x = np.zeros((len(amax) // 8, 8, 128), np.float32)
    flat = x.reshape(-1, 128)
    flat[:, 0], flat[:, 40], flat[:, 77] = amax[:len(flat)], -amax[:len(flat)], amax[:len(flat)] / 3
    return x


def test_kvquant_is_kipp_quant_q8_0_on_each_head_row():
    x = _rows(0, 64)
    q, d = kvquant.quantize(x)
    assert q.dtype == np.int8 and q.shape == x.shape and d.dtype == np.float16
    assert d.shape == (64, 8, 4)
    raw = quant.quantize(x.reshape(-1, 128), "q8_0")
    packed = kvquant.pack(q, d)
    assert packed.shape == (64, 8, 136) and np.array_equal(packed.reshape(-1, 136), raw)
    q2, d2 = kvquant.unpack(packed)
    assert np.array_equal(q2, q) and np.array_equal(d2.view(np.uint16), d.view(np.uint16))
    got = kvquant.dequantize(q, d)
    want = quant.dequantize(raw, "q8_0", 128).reshape(x.shape)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    half = d.astype(np.float64)[..., None] / 2  # the per-block error bound, d / 2
    error = np.abs(got.astype(np.float64) - x).reshape(64, 8, 4, 32)
    assert (error <= half + 1e-30).all() and np.count_nonzero(got) > 0.8 * got.size
    with pytest.raises(KippError):
        kvquant.quantize(x[..., :64])


def test_kv_bytes_per_token():
    assert kvquant.row_bytes("q8_0") == 136 and kvquant.row_bytes("bf16") == 256
    assert kvquant.bytes_per_token(28, "q8_0") == 28 * 2 * 8 * 136
    with pytest.raises(KippError, match="kv_scheme"):
        kvquant.row_bytes("q4")


def test_jax_quantizer_is_bitwise_the_oracle():
    jnp = pytest.importorskip("jax.numpy")
    from kipp.cuda import kvcache

    for x in (_rows(1, 256), _midpoint_rows()):
        q, d = kvquant.quantize(x)
        jq, jd = (np.asarray(a) for a in kvcache.quantize_kv(jnp.asarray(x)))
        assert np.array_equal(jq, q)
        assert np.array_equal(jd.astype(np.float16).view(np.uint16), d.view(np.uint16))
        got = np.asarray(kvcache.dequantize_kv(jnp.asarray(q), jnp.asarray(d)))
        assert np.array_equal(got.view(np.uint32), kvquant.dequantize(q, d).view(np.uint32))
    # the midpoint rows are the hard case: float32 alone rounds some of their scales wrongly
    amax = np.abs(_midpoint_rows().reshape(-1, 4, 32)).max(-1)
    naive = np.asarray((jnp.asarray(amax) / 127).astype(jnp.float16))
    assert np.count_nonzero(naive != kvquant.quantize(_midpoint_rows())[1].reshape(-1, 4)) > 0


@pytest.fixture(scope="module")
def kv_models(artifacts):
    """(bf16 KV, q8_0 KV) reference models of the tiny checkpoint."""
    path = artifacts(TINY)
    return (load(path, backend="reference", kv_tokens=1024, progress=False),
            load(path, backend="reference", kv_tokens=1024, kv_scheme="q8_0", progress=False))


def test_reference_q8_0_kv_vs_bf16_kv(kv_models):
    bf16, q8 = kv_models
    assert q8.backend.kv_bytes_per_token == q8.entry.layers * 2 * 8 * 136
    assert bf16.backend.kv_bytes_per_token == bf16.entry.kv_bytes_per_token
    ratio = bf16.backend.kv_bytes_per_token / q8.backend.kv_bytes_per_token
    slab = q8.backend.k_cache
    assert slab.q.nbytes + slab.d.nbytes == q8.backend.num_blocks * 32 * q8.entry.layers * 8 * 136
    tokens = q8.tokenizer.encode(gates.DEFAULT_PROMPTS[2])[:40]  # across a block boundary
    got = gates.all_position_logits(q8, tokens)
    want = gates.all_position_logits(bf16, tokens)
    worst = max(gates.nmse(g, w) for g, w in zip(got, want))  # the worst position
    assert np.array_equal(got.argmax(-1), want.argmax(-1))
    print(f"q8_0 KV vs BF16 KV (reference, tiny): worst NMSE {worst:.2e}; "
          f"KV {q8.backend.kv_bytes_per_token} vs {bf16.backend.kv_bytes_per_token} bytes/token "
          f"({ratio:.2f}x smaller)")
    assert 0 < worst <= KV_NMSE and ratio > 1.88
    prompt = q8.tokenizer.encode(gates.DEFAULT_PROMPTS[1])
    a = q8.generate(prompt, 16, temperature=0, stream=True)
    b = bf16.generate(prompt, 16, temperature=0, stream=True)
    list(a), list(b)
    assert a.stats.tokens == b.stats.tokens


def test_reference_q8_0_kv_layout_gates(kv_models):
    """Scrambled table bitwise identity, and cached decode vs recompute (bitwise here too:
    a position's K/V, hence its q8_0 row, is the same whatever call evaluates it)."""
    _, q8 = kv_models
    for result in (gates.gate_scrambled_table(q8, prompt=gates.DEFAULT_PROMPTS[1]),
                   gates.gate_cached_decode(q8)):
        assert result.passed, result


def _jax_backends(artifacts, checkpoint_id, **options):
    from kipp.cuda.backend import JaxBackend

    artifact = open_artifact(artifacts(checkpoint_id))
    return (ReferenceBackend(artifact, BLOCKS, kv_scheme="q8_0"),
            JaxBackend(artifact, BLOCKS, kv_scheme="q8_0", **options))


def _jax_gate(ref, jb, prompt_len, logits_rows, decode_steps):
    """Prefill on a scrambled table, then decode on across the 31/32/33 block boundary."""
    prompt = np.random.default_rng(4).integers(0, 151_643, prompt_len)
    result = gates.gate_backends(ref, jb, prompt, (7, 2, 9), logits_rows=logits_rows,
                                 decode_steps=decode_steps, bound=BACKEND_NMSE)
    assert result.passed, result.detail


def test_jax_q8_0_kv_matches_reference(artifacts):
    """The default CPU path: jax.numpy twins (float32 weights), q8_0 slab as int8 + fp16 bits."""
    pytest.importorskip("jax")
    ref, jb = _jax_backends(artifacts, TINY)
    assert "q8_0 KV" in jb.describe() and jb.kv_bytes_per_token == ref.kv_bytes_per_token
    _jax_gate(ref, jb, prompt_len=30, logits_rows=30, decode_steps=4)


@pytest.mark.slow
def test_jax_q8_0_kv_kernels_in_interpret_mode_match_reference(artifacts):
    """The whole model through the Pallas kernels in interpret mode (GQA group 5); ~30 s."""
    pytest.importorskip("jax")
    ref, jb = _jax_backends(artifacts, UNTIED, path="interpret", weight_layout="device")
    _jax_gate(ref, jb, prompt_len=31, logits_rows=3, decode_steps=2)


def _q8_slab(rng, blocks):
    """A random q8_0 K or V slab: (numpy q, d) and its dequantized float32 values."""
    x = rng.standard_normal((blocks, 32, 8, 128)).astype(np.float32)
    q, d = kvquant.quantize(x)
    return q, d, kvquant.dequantize(q, d)


@pytest.mark.parametrize("heads", [16, 40])  # query groups of 2 and 5 per KV head
def test_attention_kernels_on_q8_0_slabs(heads):
    """Decode and prefill kernels (interpret mode on a CPU) and their twins on a q8_0 slab vs
    numpy attention over kipp.formats.kvquant's dequantized values."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from kipp.cuda.kvcache import QuantizedKV
    from kipp.cuda.pallas.decode_attention import decode_attention, decode_attention_reference
    from kipp.cuda.pallas.prefill_attention import paged_attention_reference, prefill_attention
    from test_jax_kernels import _kernel_oracle, _numpy_attention, check_paged_attention

    interpret = jax.default_backend() != "gpu"
    rng = np.random.default_rng(heads)
    (kq, kd, k), (vq, vd, v) = _q8_slab(rng, 12), _q8_slab(rng, 12)
    bits = jnp.uint16 if interpret else jnp.float16  # the CPU slab keeps fp16 as bits
    slab = [QuantizedKV(jnp.asarray(a), jnp.asarray(b).view(bits)) for a, b in ((kq, kd),
                                                                               (vq, vd))]
    tables = np.stack([rng.permutation(12)[:4] for _ in range(3)]).astype(np.int32)
    lengths = np.array([32, 33, 100], np.int32)  # the last query at 31, 32, 99
    q = rng.standard_normal((3, heads, 128)).astype(np.float32)
    args = (jnp.asarray(q), *slab, jnp.asarray(lengths), jnp.asarray(tables))
    kernel = np.asarray(decode_attention(*args, interpret=interpret, blocks_per_split=2))
    twin = np.asarray(decode_attention_reference(*args))
    for s, length in enumerate(lengths):
        want, slack = _kernel_oracle(q[s], k, v, length - 1, tables[s])
        assert np.all(np.abs(kernel[s] - want) <= slack)
        want = _numpy_attention(q[s], k, v, length - 1, tables[s])
        np.testing.assert_allclose(twin[s], want, rtol=1e-5, atol=1e-5)
    query_pos = np.full((2, 8), -1, np.int32)
    query_pos[0], query_pos[1, :5] = np.arange(28, 36), np.arange(5)
    q = rng.standard_normal((2, 8, heads, 128)).astype(np.float32)
    args = (jnp.asarray(q), *slab, jnp.asarray(query_pos), jnp.asarray(tables[:2]))
    kernel = np.asarray(prefill_attention(*args, interpret=interpret, block_q=8))
    twin = np.asarray(paged_attention_reference(*args))
    check_paged_attention(kernel, twin, q, k, v, query_pos, tables)


@pytest.mark.slow  # one of the default suite's longest (CI's longest-checks step)
def test_jax_q8_0_kv_scrambled_table_and_vs_bf16(artifacts):
    pytest.importorskip("jax")
    from kipp.cuda.backend import JaxBackend

    artifact = open_artifact(artifacts(TINY))
    q8 = Model(artifact, JaxBackend(artifact, BLOCKS, kv_scheme="q8_0"))
    bf16 = Model(artifact, JaxBackend(artifact, BLOCKS))
    result = gates.gate_scrambled_table(q8)
    assert result.passed, result
    tokens = q8.tokenizer.encode(gates.DEFAULT_PROMPTS[2])[:40]
    got, want = gates.all_position_logits(q8, tokens), gates.all_position_logits(bf16, tokens)
    print(f"q8_0 KV vs BF16 KV (jax, tiny): NMSE {gates.nmse(got, want):.2e}")
    assert 0 < gates.nmse(got, want) <= KV_NMSE
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_q8_0_kv_kernels_lower_for_cuda(artifacts):
    """The GPU program with a q8_0 slab (fp16 scales, int8 planes) lowers through Pallas'
    Triton lowering: prefill and decode attention both dequantize inside the kernels."""
    jax = pytest.importorskip("jax")
    import functools

    import jax.numpy as jnp
    from jax import export

    from kipp.cuda import forward, kvcache, layout, rounds

    artifact = open_artifact(artifacts(UNTIED))
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    params = jax.tree.map(spec, layout.prepare_weights(artifact, "device"))
    slab = jax.tree.map(spec, jax.eval_shape(
        lambda: kvcache.kv_zeros((BLOCKS, 32, 8, 128), "q8_0", "gpu")))
    assert slab.q.dtype == jnp.int8 and slab.d.dtype == jnp.float16
    kv = tuple((slab, slab) for _ in artifact.weights.layers)
    rope = (jax.ShapeDtypeStruct((4096, 128), jnp.float32),) * 2
    step = jax.jit(functools.partial(forward.step, ops=forward.Ops(kernels=True)))
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    prompt = tuple(int(t) for t in np.random.default_rng(0).integers(0, 151_643, 40))
    for items, kernel in (([EvalItem(prompt, 0, (1, 2), 3)], "kipp_prefill_attention"),
                          ([EvalItem((7,), 40, (1, 2))], "kipp_decode_attention")):
        _, arrays, _ = rounds.pack_round(items, rounds.plan_rounds(items, 512)[0], BLOCKS)
        exported = export.export(step, platforms=["cuda"], disabled_checks=[triton])(
            params, kv, rope, jax.tree.map(spec, arrays))
        assert kernel in exported.mlir_module()


def test_pool_sized_in_bytes_holds_more_tokens_with_q8_0_kv(artifacts):
    from kipp.errors import KippError
    from kipp.formats.registry import get
    from kipp.model import kv_tokens_for, load

    entry = get("kipp-synthetic/qwen3-tiny")
    bf16, q8 = kv_tokens_for(entry, "bf16", 4), kv_tokens_for(entry, "q8_0", 4)
    # 4 MiB / (2 layers * 2 * 8 heads * 256 or 136 bytes), whole 32-token blocks
    assert (bf16, q8) == (512, 960)
    model = load(artifacts("kipp-synthetic/qwen3-tiny"), backend="reference", kv_scheme="q8_0",
                 kv_mib=4, progress=False)
    assert model.pool.num_blocks == 960 // 32
    with pytest.raises(KippError, match="not both"):
        load(artifacts("kipp-synthetic/qwen3-tiny"), backend="reference", kv_mib=4,
             kv_tokens=64, progress=False)
    with pytest.raises(KippError, match="less than one"):
        kv_tokens_for(entry, "bf16", 0.001)
