"""Every Pallas kernel vs its jax.numpy twin vs the numpy reference (kipp.formats.quant,
kipp.reference).

On a CPU the kernels run in Pallas interpret mode; on a GPU they run compiled (set
KIPP_PALLAS_INTERPRET=1 to force interpret mode there). Shapes are drawn within the family's:
widths that are multiples of 32 with different power-of-two factors, query groups of 2 and 5
(padded to Triton's power-of-two tiles), scrambled block tables, ragged lengths and positions
on both sides of the 32-position block boundary.
"""

import os

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kipp.cuda.layout import pack_linear  # noqa: E402
from kipp.cuda.pallas.decode_attention import decode_attention, decode_attention_reference  # noqa: E402
from kipp.cuda.pallas.prefill_attention import paged_attention_reference, prefill_attention  # noqa: E402
from kipp.cuda.pallas.quant_matmul import (  # noqa: E402
    MATVEC_ROWS,
    dequantize_reference,
    quant_matmul,
    quant_matmul_reference,
)
from kipp.formats import quant  # noqa: E402
from kipp.formats.artifact import Tensor  # noqa: E402
from kipp.reference import ops  # noqa: E402

INTERPRET = os.environ.get("KIPP_PALLAS_INTERPRET",
                           "0" if jax.default_backend() == "gpu" else "1") == "1"
SCHEMES = list(quant.SCHEMES)


def _packed(rng, rows, cols, scheme, layout="device"):
    """(prepared Linear on the device, the numpy dequantized float32 oracle)."""
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    w[0, :32] = 0.0  # a flat block: every scheme's edge case
    raw = quant.quantize(w, scheme)
    tensor = Tensor("w", (rows, cols), quant.SCHEMES[scheme].ggml_type, raw.reshape(-1))
    return jax.tree.map(jnp.asarray, pack_linear(tensor, layout)), quant.dequantize(raw, scheme,
                                                                                   cols)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_twin_dequantizer_is_bitwise_the_numpy_dequantizer(scheme):
    rng = np.random.default_rng(1)
    w, want = _packed(rng, 48, 320, scheme)
    got = np.asarray(dequantize_reference(w))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_matmul_kernel_dequantizes_exactly(scheme):
    """x = identity makes every output one weight times 1 plus exact zeros: the kernel's
    dequantized tile, which must equal kipp.formats.quant.dequantize (as values: -0 == +0)."""
    rng = np.random.default_rng(2)
    w, want = _packed(rng, 64, 96, scheme)
    got = np.asarray(quant_matmul(jnp.eye(96, dtype=jnp.float32), w, interpret=INTERPRET))
    assert np.array_equal(got.T, want)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("rows", [1, 3, 21, 70])  # matvec (<= 4 rows), 16- and 64-row dots
def test_matmul_kernel_vs_twin_vs_numpy(scheme, rows):
    """The dot kernel (more than MATVEC_ROWS rows) rounds x to BF16 for the tensor cores and
    keeps every weight exact, so it must equal bf16(x) @ W (float64) up to float32
    accumulation, and the float32 twin within BF16's rounding of x: |x| @ |W|^T * 2^-8."""
    rng = np.random.default_rng(3 + rows)
    n, k = [(32, 768), (128, 256), (96, 160)][rows % 3]
    w, dense = _packed(rng, n, k, scheme)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    tensor_cores = rows > MATVEC_ROWS
    seen = _bf16(x) if tensor_cores else x.astype(np.float64)
    want = x.astype(np.float64) @ dense.T.astype(np.float64)
    kernel = np.asarray(quant_matmul(jnp.asarray(x), w, interpret=INTERPRET))
    twin = np.asarray(quant_matmul_reference(jnp.asarray(x), w))
    scale = np.abs(want).max()
    assert np.abs(kernel - seen @ dense.T.astype(np.float64)).max() <= 1e-5 * scale
    assert np.abs(twin - want).max() <= 1e-5 * scale
    rounding = np.abs(x) @ np.abs(dense.T) * 2.0 ** -8 if tensor_cores else 0.0
    assert np.all(np.abs(kernel - twin) <= rounding + 1e-5 * scale)


def _bf16(a):
    """a rounded to BF16 (nearest even), as float64."""
    return a.astype(ml_dtypes.bfloat16).astype(np.float64)


def test_f32_layout_twin_equals_numpy_dense():
    rng = np.random.default_rng(4)
    w, dense = _packed(rng, 64, 128, "q8_0", layout="f32")
    assert w.fmt == "f32" and np.array_equal(np.asarray(w.w), dense)
    x = rng.standard_normal((5, 128)).astype(np.float32)
    got = np.asarray(quant_matmul(jnp.asarray(x), w, interpret=INTERPRET))
    np.testing.assert_allclose(got, x @ dense.T, rtol=1e-5, atol=1e-5)


def _slab(rng, blocks):
    shape = (blocks, 32, 8, 128)
    return (rng.standard_normal(shape).astype(ml_dtypes.bfloat16),
            rng.standard_normal(shape).astype(ml_dtypes.bfloat16))


def _numpy_attention(q, k, v, position, table, dtype=np.float32):
    """ops.attend over positions 0..position gathered through the block table, in `dtype`."""
    p = np.arange(position + 1)
    slots = np.asarray(table)[p // 32] * 32 + p % 32
    keys = k.reshape(-1, 8, 128)[slots].astype(dtype)
    values = v.reshape(-1, 8, 128)[slots].astype(dtype)
    return ops.attend(q.astype(dtype).reshape(8, -1, 128), keys, values).reshape(q.shape)


def _kernel_oracle(q, k, v, position, table):
    """(want, slack) for the attention kernels: numpy attention over q, K and V rounded to BF16
    for the tensor cores (a no-op for a BF16 slab), and the bound of the kernels' one other
    rounding, the probabilities to BF16 for the dot with V (relative 2^-8 each): 2^-8 x the
    softmax-weighted |V|."""
    qb, kb, vb = (_bf16(a).astype(np.float32) for a in (q, k, v))
    want = _numpy_attention(qb, kb, vb, position, table)
    return want, 2.0 ** -8 * _numpy_attention(qb, kb, np.abs(vb), position, table) + 1e-5


def check_paged_attention(kernel, twin, q, k, v, query_pos, tables):
    """Every live query row of a prefill: the kernel within its rounding bound, the twin
    within float32 reassociation of numpy attention."""
    for s, i in zip(*np.nonzero(query_pos >= 0)):
        want, slack = _kernel_oracle(q[s, i], k, v, query_pos[s, i], tables[s])
        assert np.all(np.abs(kernel[s, i] - want) <= slack)
        want = _numpy_attention(q[s, i], k, v, query_pos[s, i], tables[s])
        np.testing.assert_allclose(twin[s, i], want, rtol=1e-5, atol=1e-5)


def _tables(rng, seqs, width, blocks):
    return np.stack([rng.permutation(blocks)[:width] for _ in range(seqs)]).astype(np.int32)


@pytest.mark.parametrize("heads", [16, 40])  # query groups of 2 and 5 per KV head
def test_decode_attention_kernel_vs_twin_vs_numpy(heads):
    rng = np.random.default_rng(heads)
    k, v = _slab(rng, 24)
    lengths = np.array([1, 32, 33, 34, 200, 0], np.int32)  # positions 0, 31, 32, 33, 199; 0: pad
    tables = _tables(rng, len(lengths), 8, 24)
    q = rng.standard_normal((len(lengths), heads, 128)).astype(np.float32)
    args = [jnp.asarray(a) for a in (q, k, v, lengths, tables)]
    kernel = np.asarray(decode_attention(*args, interpret=INTERPRET, blocks_per_split=2))
    twin = np.asarray(decode_attention_reference(*args))
    for s, length in enumerate(lengths[:-1]):
        want, slack = _kernel_oracle(q[s], k, v, length - 1, tables[s])
        assert np.all(np.abs(kernel[s] - want) <= slack)
        want = _numpy_attention(q[s], k, v, length - 1, tables[s])
        np.testing.assert_allclose(twin[s], want, rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(kernel))


@pytest.mark.parametrize("heads", [16, 40])
def test_prefill_attention_kernel_vs_twin_vs_numpy(heads):
    rng = np.random.default_rng(100 + heads)
    k, v = _slab(rng, 16)
    # ragged pieces: positions across the 31/32/33 boundary, a chunk continuing a prefix,
    # and a short piece padded with -1
    query_pos = np.full((3, 20), -1, np.int32)
    query_pos[0, :20] = np.arange(20, 40)
    query_pos[1, :6] = np.arange(28, 34)
    query_pos[2, :3] = np.arange(3)
    tables = _tables(rng, 3, 4, 16)
    q = rng.standard_normal((3, 20, heads, 128)).astype(np.float32)
    args = [jnp.asarray(a) for a in (q, k, v, query_pos, tables)]
    kernel = np.asarray(prefill_attention(*args, interpret=INTERPRET, block_q=8))
    twin = np.asarray(paged_attention_reference(*args))
    check_paged_attention(kernel, twin, q, k, v, query_pos, tables)


@pytest.mark.parametrize("heads", [16, 40])
def test_twin_one_query_per_sequence_matches_numpy(heads, monkeypatch):
    """Decode rounds take the all-pairs form (every query head against all KV heads' rows,
    the other heads masked): it must equal numpy's attention per sequence and the grouped form
    it replaces (planted: the own-head mask dropped, every row off by ~1e-1)."""
    from kipp.cuda.pallas import prefill_attention as pa

    rng = np.random.default_rng(11)
    k, v = _slab(rng, 16)
    q = rng.standard_normal((4, 1, heads, 128)).astype(np.float32)
    pos = np.array([[70], [0], [127], [-1]], np.int32)  # the last row is padding
    tables = _tables(rng, 4, 4, 16)
    args = [jnp.asarray(a) for a in (q, k, v, pos, tables)]
    pairs = np.asarray(paged_attention_reference(*args))
    for s in range(3):
        want = _numpy_attention(q[s, 0], k, v, pos[s, 0], tables[s])
        np.testing.assert_allclose(pairs[s, 0], want, rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(pairs))  # the padding row too
    monkeypatch.setattr(pa, "ALL_PAIRS_MAX_SCORES", 0)  # the grouped form
    grouped = np.asarray(paged_attention_reference(*args))
    np.testing.assert_allclose(pairs[:3], grouped[:3], rtol=1e-6, atol=1e-6)


def test_twin_reads_the_uint16_slab_bitwise_like_bf16():
    """The CPU stores the slab as BF16 bit patterns (uint16); the twin must not care."""
    rng = np.random.default_rng(7)
    k, v = _slab(rng, 8)
    q = rng.standard_normal((2, 3, 16, 128)).astype(np.float32)
    pos = np.array([[30, 31, 32], [0, 1, -1]], np.int32)
    tables = _tables(rng, 2, 2, 8)
    bf16 = paged_attention_reference(*(jnp.asarray(a) for a in (q, k, v, pos, tables)))
    bits = paged_attention_reference(jnp.asarray(q), jnp.asarray(k.view(np.uint16)),
                                     jnp.asarray(v.view(np.uint16)), jnp.asarray(pos),
                                     jnp.asarray(tables))
    assert np.array_equal(np.asarray(bf16), np.asarray(bits))


def _lowers_for_cuda(fn, *shapes):
    """Lower `fn` for CUDA on this machine: Pallas runs its Triton lowering, so a primitive the
    Triton backend cannot lower fails here, without a GPU or the CUDA plugin (the whole compile
    to a cubin is tests/test_cuda_compile.py's). jax >= 0.11 needs the target GPU named by a
    scoped abstract mesh (kipp.cuda.aot.gpu_target)."""
    from jax import export

    from kipp.cuda.aot import gpu_target

    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with gpu_target():
        exported = export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=[triton])(*shapes)
    return exported.mlir_module()


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("fmt", ["f32", "bf16"] + SCHEMES[1:])
@pytest.mark.parametrize("rows", [2, 20])
def test_matmul_kernel_lowers_to_triton(fmt, rows):
    from kipp.cuda.layout import Linear

    n, k = 128, 768
    planes = {"f32": (_spec((n, k), jnp.float32),), "bf16": (_spec((n, k), jnp.bfloat16),),
              "q8_0": (_spec((n, k // 32, 32), jnp.int8), _spec((n, k // 32), jnp.float16)),
              "scale4_gs32": (_spec((n, k // 32, 16), jnp.uint8),
                              _spec((n, k // 32), jnp.float16)),
              "affine4_gs32": (_spec((n, k // 32, 16), jnp.uint8),
                               _spec((n, k // 32), jnp.float16),
                               _spec((n, k // 32), jnp.float16))}[fmt]
    w = Linear(*planes, fmt=fmt)
    text = _lowers_for_cuda(lambda x, w: quant_matmul(x, w), _spec((rows, k), jnp.float32), w)
    assert "xla.gpu.triton" in text


@pytest.mark.parametrize("heads", [16, 40])
def test_attention_kernels_lower_to_triton(heads):
    slab = _spec((24, 32, 8, 128), jnp.bfloat16)
    i32 = lambda *shape: _spec(shape, jnp.int32)  # noqa: E731
    decode = _lowers_for_cuda(lambda *a: decode_attention(*a), _spec((6, heads, 128), jnp.float32),
                              slab, slab, i32(6), i32(6, 40))
    prefill = _lowers_for_cuda(lambda *a: prefill_attention(*a),
                               _spec((3, 20, heads, 128), jnp.float32), slab, slab, i32(3, 20),
                               i32(3, 4))
    assert "xla.gpu.triton" in decode and "xla.gpu.triton" in prefill
