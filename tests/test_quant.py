"""kipp.formats.quant: GGML layouts checked against the `gguf` package, encoder error bounds,
rejections."""

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from kipp.errors import QuantError
from kipp.formats import quant
from kipp.formats.quant import SCHEMES, dequantize, error_bound, quantize

BLOCK_SCHEMES = ["q8_0", "affine4_gs32", "scale4_gs32"]
GGUF_TYPE = {
    "bf16": GGMLQuantizationType.BF16,
    "q8_0": GGMLQuantizationType.Q8_0,
    "affine4_gs32": GGMLQuantizationType.Q4_1,
    "scale4_gs32": GGMLQuantizationType.Q4_0,
}
FILE_TYPE = {
    "bf16": LlamaFileType.MOSTLY_BF16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
    "affine4_gs32": LlamaFileType.MOSTLY_Q4_1,
    "scale4_gs32": LlamaFileType.MOSTLY_Q4_0,
}
FP16_NORMAL_MIN = 2.0**-14


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def params(raw, name):
    """Per block: d float64 [rows, blocks], m (affine4) or None, stored q [rows, blocks, 32]."""
    d, m, q = quant._unpack(raw, SCHEMES[name])
    return d[..., 0].astype(np.float64), None if m is None else m[..., 0].astype(np.float64), q


def block_errors(x, y):
    """Largest |x - y| per 32-weight block, float64 [rows, blocks]."""
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    return err.reshape(len(x), -1, 32).max(axis=-1)


def roundtrip(x, name):
    raw = quantize(x, name)
    return raw, dequantize(raw, name, x.shape[1])


# The largest |w| each scheme accepts: its fp16 parameters overflow beyond.
LARGEST = {"q8_0": 127 * 65504.0, "scale4_gs32": 8 * 65504.0, "affine4_gs32": 65504.0}


def weights(kind, rows, cols, seed=0, name="q8_0"):
    rng = np.random.default_rng(seed)
    shape = (rows, cols)
    if kind == "normal":
        x = rng.standard_normal(shape) * 0.02
    elif kind == "uniform":
        x = rng.uniform(-3, 5, shape)
    elif kind == "heavy":  # Student-t with 1.5 dof: outliers dominate many blocks
        x = rng.standard_t(1.5, shape)
    elif kind == "offset":  # a large mean and a small spread: affine4's hard case
        x = 100 + rng.standard_normal(shape) * 0.01
    elif kind == "tiny":  # fp16-subnormal scales
        x = rng.standard_normal(shape) * 1e-6
    elif kind == "tiny_and_huge":  # each block: one huge weight, the rest tiny
        x = rng.standard_normal(shape) * 1e-7
        x[:, rng.integers(0, 32) :: 32] = rng.choice([-1, 1], (rows, cols // 32)) * 3e4
    elif kind == "plus_minus_max":  # +a and -a in every block, a the largest the scheme takes
        x = rng.standard_normal(shape)
        x[:, 0::32], x[:, 1::32] = LARGEST[name], -LARGEST[name]
    else:
        raise ValueError(kind)
    return x.astype(np.float32)


KINDS = ["normal", "uniform", "heavy", "offset", "tiny", "tiny_and_huge"]
COLS = [32, 64, 4096]


@pytest.mark.parametrize("name", list(SCHEMES))
def test_scheme_table_matches_gguf(name):
    s = quant.scheme(name)
    assert s is SCHEMES[name] and s.name == name
    assert s.ggml_type == GGUF_TYPE[name].value
    assert (s.block_weights, s.block_bytes) == GGML_QUANT_SIZES[GGUF_TYPE[name]]
    assert s.file_type == FILE_TYPE[name].value
    assert quant.SCHEMES_BY_GGML_TYPE[s.ggml_type] is s
    assert s.row_bytes(4096) == 4096 // s.block_weights * s.block_bytes


def test_ggml_type_bytes():
    assert quant.GGML_F32 == GGMLQuantizationType.F32.value
    assert quant.GGML_BF16 == GGMLQuantizationType.BF16.value
    for t in (quant.GGML_F32, quant.GGML_BF16, quant.GGML_Q8_0, quant.GGML_Q4_0, quant.GGML_Q4_1):
        per_block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t)]
        assert quant.ggml_type_bytes(t, 96 * 1024) == 96 * 1024 // per_block * block_bytes
    with pytest.raises(QuantError, match="unsupported GGML tensor type 1"):
        quant.ggml_type_bytes(GGMLQuantizationType.F16.value, 32)
    with pytest.raises(QuantError, match="Q8_0: 33 elements"):
        quant.ggml_type_bytes(quant.GGML_Q8_0, 33)


def test_unknown_scheme_names_the_valid_ones():
    valid = "bf16, q8_0, affine4_gs32, scale4_gs32"
    with pytest.raises(QuantError, match=rf"unknown weight scheme 'q4_k'; valid: {valid}"):
        quant.scheme("q4_k")
    with pytest.raises(QuantError, match="'int4'"):
        quantize(np.zeros((1, 32), np.float32), "int4")


def test_row_bytes_rejects_partial_blocks():
    with pytest.raises(QuantError, match="q8_0: cols 48 is not a multiple of 32"):
        SCHEMES["q8_0"].row_bytes(48)
    assert SCHEMES["bf16"].row_bytes(48) == 96


@pytest.mark.parametrize("kind", KINDS + ["plus_minus_max"])
@pytest.mark.parametrize("name", BLOCK_SCHEMES)
def test_dequantize_equals_gguf_bitwise(name, kind):
    x = weights(kind, 8, 256, name=name)
    raw, y = roundtrip(x, name)
    assert raw.dtype == np.uint8 and raw.shape == (8, SCHEMES[name].row_bytes(256))
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.array_equal(bits(y), bits(gguf_dequantize(raw, GGUF_TYPE[name])))


@pytest.mark.parametrize("name", BLOCK_SCHEMES)
def test_dequantize_arbitrary_bytes_equals_gguf_bitwise(name):
    """Any bytes with finite fp16 fields are valid blocks (q8_0's -128 included)."""
    s = SCHEMES[name]
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (16, 64, s.block_bytes), dtype=np.uint8)
    n_fp16 = 2 if name == "affine4_gs32" else 1
    for k in range(n_fp16):  # clear one exponent bit: no inf/NaN d or m
        blocks[..., 2 * k + 1] &= 0b1011_1111
    raw = blocks.reshape(16, -1)
    y = dequantize(raw, name, 64 * 32)
    assert np.array_equal(bits(y), bits(gguf_dequantize(raw, GGUF_TYPE[name])))


@pytest.mark.parametrize("name", list(SCHEMES))
def test_layout_does_not_depend_on_memory_order(name):
    x = weights("normal", 64, 96)
    for w in (x, x.astype(ml_dtypes.bfloat16)):
        assert np.array_equal(quantize(np.asfortranarray(w), name), quantize(w, name))
        assert np.array_equal(quantize(w[:, ::-1][:, ::-1], name), quantize(w, name))


def test_nibble_order_and_q8_0_layout_by_hand():
    # scale4: d = 1.0; element j low nibble, element j + 16 high nibble; w = q - 8
    block = np.zeros((1, 18), np.uint8)
    block[0, :2] = np.array([1.0], "<f2").view(np.uint8)
    block[0, 2:] = np.arange(16, dtype=np.uint8) | (np.uint8(15) << 4)
    y = dequantize(block, "scale4_gs32", 32)[0]
    assert np.array_equal(y[:16], np.arange(16) - 8.0) and np.all(y[16:] == 7.0)
    # q8_0: d = 0.5, q = -128..-97 (int8 -128 is decodable)
    block = np.zeros((1, 34), np.uint8)
    block[0, :2] = np.array([0.5], "<f2").view(np.uint8)
    block[0, 2:] = np.arange(-128, -96, dtype=np.int8).view(np.uint8)
    assert np.array_equal(dequantize(block, "q8_0", 32)[0], np.arange(-128, -96) * 0.5)


def test_bf16_bytes_are_ml_dtypes_rounding():
    x = np.concatenate([weights("normal", 4, 64), weights("heavy", 4, 64)])
    x[0, :4] = [0.0, -0.0, 1 + 2**-8, 1 + 3 * 2**-8]  # ties round to even
    raw = quantize(x, "bf16")
    expected = x.astype(ml_dtypes.bfloat16)
    assert np.array_equal(raw, expected.view(np.uint16).astype("<u2").view(np.uint8))
    assert np.array_equal(raw, gguf_quantize(x, GGMLQuantizationType.BF16))
    y = dequantize(raw, "bf16", 64)
    assert np.array_equal(bits(y), bits(expected.astype(np.float32)))
    assert np.array_equal(bits(y), bits(gguf_dequantize(raw, GGMLQuantizationType.BF16)))
    assert np.array_equal(quantize(expected, "bf16"), raw)  # bfloat16 input passes through


def test_scales_match_llama_cpp_when_normal():
    """q8_0 and scale4 pick llama.cpp's fp16 scale for every block whose scale is an fp16
    normal; only the q choice differs (Kipp divides by the rounded scale, llama.cpp by the
    unrounded one). affine4's m is the floor of llama.cpp's nearest-rounded m."""
    x = np.concatenate([weights(k, 4, 256, seed=5) for k in ("normal", "uniform", "heavy")])
    for name, header in (("q8_0", 2), ("scale4_gs32", 2), ("affine4_gs32", 4)):
        ours = quantize(x, name).reshape(len(x), -1, SCHEMES[name].block_bytes)
        theirs = gguf_quantize(x, GGUF_TYPE[name]).reshape(ours.shape)
        d, m, _ = params(ours.reshape(len(x), -1), name)
        assert np.all(np.abs(d) >= FP16_NORMAL_MIN)
        if name != "affine4_gs32":
            assert np.array_equal(ours[..., :header], theirs[..., :header])
        else:
            their_m = np.ascontiguousarray(theirs[..., 2:4]).view("<f2")[..., 0]
            one_below = np.nextafter(their_m, np.float16(-np.inf))
            assert np.all((m == their_m) | (m == one_below))
            assert np.all(m <= x.reshape(len(x), -1, 32).min(-1))


def assert_within_bounds(x, name):
    """Kipp's encoder bounds (see quant.error_bound), exact comparisons in float64."""
    raw, y = roundtrip(x, name)
    err = block_errors(x, y)
    bound = error_bound(x, raw, name)
    assert np.all(err <= bound), f"worst err/bound {np.max(err / bound)}"
    d, m, q = params(raw, name)
    if name == "q8_0":
        assert np.all(err <= d / 2)  # the bump makes every block within d/2, subnormal d too
        assert np.all(np.abs(q) <= 127)  # -128 is never written
    elif name == "affine4_gs32":
        largest_level = np.maximum(np.abs(m), np.abs(m + 15 * d)).astype(np.float32)
        decoded_rounding = np.spacing(largest_level).astype(np.float64) / 2
        assert np.all(err <= d / 2 + decoded_rounding)
        assert np.all(bound <= d / 2 + decoded_rounding)
    else:
        blocks = x.reshape(len(x), -1, 32).astype(np.float64)
        big_side = np.sign(blocks) == -np.sign(d)[..., None]  # the sign of the largest |w|
        own = np.abs(y.reshape(blocks.shape) - blocks)
        assert np.all(np.where(big_side, own, 0) <= np.abs(d)[..., None] / 2)
        assert np.all(err <= 1.5 * np.abs(d))
        normal = np.abs(d) >= FP16_NORMAL_MIN
        assert np.all(err[normal] <= np.abs(d[normal]) * (1 + 2**-8))
    return raw, y


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", BLOCK_SCHEMES)
def test_error_bounds(name, kind, cols):
    assert_within_bounds(weights(kind, 16, cols, seed=cols), name)


def test_bf16_error_bound():
    x = weights("heavy", 8, 96)
    raw, y = roundtrip(x, "bf16")
    assert np.all(np.abs(y.astype(np.float64) - x) <= error_bound(x, raw, "bf16"))


@pytest.mark.parametrize("name", BLOCK_SCHEMES)
def test_plus_minus_max_blocks(name):
    """+a and -a in every block, a the largest weight the scheme accepts."""
    raw, y = assert_within_bounds(weights("plus_minus_max", 4, 64, name=name), name)
    d = params(raw, name)[0]
    if name == "q8_0":
        assert np.all(d == 65504) and np.all(y[:, 0::32] == -y[:, 1::32])
    elif name == "scale4_gs32":
        assert np.all(d == -65504) and np.all(y[:, 0::32] == LARGEST[name])


def test_scale4_saturates_the_short_side():
    """The first of +-a sits on level q = 0 exactly; the other reaches only 7 |d| = 7a/8."""
    x = np.zeros((1, 32), np.float32)
    x[0, :2] = [40000.0, -40000.0]
    raw, y = assert_within_bounds(x, "scale4_gs32")
    assert y[0, 0] == 40000.0 and y[0, 1] == -35000.0


@pytest.mark.parametrize("name", BLOCK_SCHEMES)
def test_zero_blocks_round_trip_to_positive_zero(name):
    x = np.zeros((3, 64), np.float32)
    x[1] = -0.0
    raw, y = roundtrip(x, name)
    assert np.array_equal(bits(y), np.zeros_like(bits(y)))
    assert np.all(params(raw, name)[0] == 0)


@pytest.mark.parametrize("name", ["affine4_gs32", "scale4_gs32"])
@pytest.mark.parametrize("value", [0.5, -0.5, 3.0, -7.25, 1234.0, -65504.0, 2.0**-14])
def test_constant_fp16_blocks_round_trip_exactly(name, value):
    """affine4: m = value, d = 0; scale4: d = value / -8 is exact too. So every constant that
    is an fp16 (every bfloat16 within fp16's normal range, i.e. real checkpoints) is exact."""
    x = np.full((2, 64), value, np.float32)
    raw, y = roundtrip(x, name)
    assert np.array_equal(bits(y), bits(x))


@pytest.mark.parametrize("value", [0.1, -0.1, 1000.1, 3.3e-3, -3e-6, 1e-30])
def test_constant_non_fp16_blocks(value):
    """A constant that is not an fp16 cannot round-trip exactly in affine4; flooring m gives
    d > 0 and the error stays within d/2, which is <= an fp16 ulp / 30 where m is an fp16
    normal (float32 decode rounding aside); below that d is at least 2**-24, error <= 2**-25.
    q8_0 stores 127 d and scale4 -8 d: within d/2 (q8_0) and |d|/2 (scale4's own side)."""
    x = np.full((1, 32), value, np.float32)
    for name in BLOCK_SCHEMES:
        assert_within_bounds(x, name)
    if abs(value) < FP16_NORMAL_MIN:
        return
    raw, y = roundtrip(x, "affine4_gs32")
    d, m, _ = params(raw, "affine4_gs32")
    ulp16 = np.spacing(np.float16(m[0, 0])).astype(np.float64)
    assert d[0, 0] <= ulp16 / 15 * (1 + 2**-10) and abs(y[0, 0] - np.float64(x[0, 0])) <= ulp16 / 30


@pytest.mark.parametrize("name", BLOCK_SCHEMES)
def test_fp16_subnormal_scales_are_bumped_not_saturated(name):
    """amax / 127 below fp16's smallest subnormal must not flush the block to zero."""
    x = np.zeros((1, 32), np.float32)
    x[0, 3], x[0, 9] = 1.4 * 2.0**-25 * 127, -1e-9
    raw, y = assert_within_bounds(x, name)
    assert params(raw, name)[0][0, 0] != 0


def test_q8_0_is_odd_symmetric():
    x = weights("heavy", 8, 128)
    a, b = quantize(x, "q8_0").reshape(8, -1, 34), quantize(-x, "q8_0").reshape(8, -1, 34)
    assert np.array_equal(a[..., :2], b[..., :2])
    assert np.array_equal(a[..., 2:].view(np.int8), -b[..., 2:].view(np.int8))


def idempotent_blocks(x, name):
    """Which blocks re-quantize to the same bytes, and which the encoder guarantees will.

    Guaranteed (all exact arguments, no tolerance):
    - q8_0, when d == 0 or some |q| == 127: the decoded max is 127 d exactly, so the new scale
      is fp16(127 d / 127) == d and every decoded weight sits on its own level.
    - scale4, when d == 0 or some q == 0: the decoded largest magnitude is -8 d (only q == 0
      reaches 8 |d|), so the new scale is fp16(-8 d / -8) == d.
    - affine4, when d == 0, or q holds both 0 and 15 and the decoder's float32 add was exact:
      then min and max decode to m and m + 15 d exactly, floor(m) == m and the new d is d.
    Every block with a normal fp16 d meets the q8_0/scale4 condition (rounding d moves the
    extreme by < 0.07 of a level). With a subnormal d the one-step bump can leave the extreme
    short of the end level and a different scale is chosen the second time: not idempotent.
    """
    raw, y = roundtrip(x, name)
    bb = SCHEMES[name].block_bytes
    same = (quantize(y, name).reshape(len(x), -1, bb) == raw.reshape(len(x), -1, bb)).all(-1)
    d, m, q = params(raw, name)
    if name == "q8_0":
        promised = (d == 0) | (np.abs(q).max(-1) == 127)
    elif name == "scale4_gs32":
        promised = (d == 0) | (q == 0).any(-1)
    else:
        exact_add = (m[..., None] + d[..., None] * q == y.reshape(q.shape)).all(-1)
        promised = (d == 0) | ((q == 0).any(-1) & (q == 15).any(-1) & exact_add)
    return same, promised, d


@pytest.mark.parametrize("kind", ["normal", "uniform", "heavy"])
@pytest.mark.parametrize("name", ["bf16"] + BLOCK_SCHEMES)
def test_requantizing_the_decoded_weights_reproduces_the_bytes(name, kind):
    x = weights(kind, 16, 512, seed=11)
    raw, y = roundtrip(x, name)
    assert np.array_equal(quantize(y, name), raw)
    if name != "bf16":
        _, promised, _ = idempotent_blocks(x, name)
        assert promised.all()


@pytest.mark.parametrize("name", ["q8_0", "scale4_gs32"])
def test_normal_scales_promise_idempotence(name):
    x = np.concatenate([weights(k, 8, 256, seed=2) for k in KINDS])
    same, promised, d = idempotent_blocks(x, name)
    assert np.all(same[promised])
    assert np.all(promised[np.abs(d) >= FP16_NORMAL_MIN])


# Every weight within fp16's range is quantizable by every scheme (the limits are tested below).
# Hypothesis mixes in 0, -0, subnormals, 65504 and near-duplicates.
blocks_strategy = st.integers(1, 3).flatmap(
    lambda n: arrays(np.float32, (2, 32 * n), elements=st.floats(-65504, 65504, width=32))
)
scaled_strategy = st.tuples(
    st.integers(1, 3), st.integers(-30, 12), st.integers(0, 2**32 - 1), st.floats(-100, 100)
)


def nearest_level_is_chosen(x, raw, name):
    """Independent exact check (Fractions): each weight's level beats its neighbouring levels,
    ties going to the larger |q| (q8_0) or the larger q (4-bit). A d == 0 block stores the q
    that decodes to 0 (m for affine4)."""
    d, m, q = params(raw, name)
    flat_q = 8 if name == "scale4_gs32" else 0
    assert np.all(q[d == 0] == flat_q)
    lo_q, hi_q = (-127, 127) if name == "q8_0" else (0, 15)
    offset = 8 if name == "scale4_gs32" else 0
    for r, b in zip(*np.nonzero(d)):
        D = Fraction(float(d[r, b]))
        M = Fraction(float(m[r, b])) if m is not None else Fraction(0)

        def key(w, k):  # smaller is better: distance, then the tie-break
            return abs(w - (D * (k - offset) + M)), -abs(k) if name == "q8_0" else -k

        for j in range(32):
            w, k = Fraction(float(x[r, 32 * b + j])), int(q[r, b, j])
            for other in (k - 1, k + 1):
                if lo_q <= other <= hi_q:
                    assert key(w, k) < key(w, other), (name, r, b, j)


def test_ties_and_near_ties():
    """Exact midpoints go to the larger |q| (q8_0) or the larger q (4-bit). A weight a hair
    below a midpoint at 0 is a tie in float64's (x - m) / d, and must still go down."""
    ties = [0.5, 1.5, 2.5, -0.5, -2.5]
    x = np.zeros((1, 32), np.float32)
    x[0, :7] = [127.0, -127.0] + ties  # d = 1
    raw, _ = roundtrip(x, "q8_0")
    assert list(params(raw, "q8_0")[2][0, 0, 2:7]) == [1, 2, 3, -1, -3]
    x[0, :7] = [-8.0, 0.0] + ties  # d = 1, q = x + 8
    raw, _ = roundtrip(x, "scale4_gs32")
    assert list(params(raw, "scale4_gs32")[2][0, 0, 2:7]) == [9, 10, 11, 8, 6]
    x = np.full((1, 32), 0.0, np.float32)
    x[0, :5] = [-1.5, 13.5, -1e-30, 1e-30, 1.0]  # m = -1.5, d = 1: levels -1.5, -0.5, 0.5, ...
    raw, y = roundtrip(x, "affine4_gs32")
    assert list(params(raw, "affine4_gs32")[2][0, 0, :5]) == [0, 15, 1, 2, 3]
    nearest_level_is_chosen(x, raw, "affine4_gs32")


@settings(max_examples=150, deadline=None)
@given(x=blocks_strategy, name=st.sampled_from(BLOCK_SCHEMES))
def test_property_arbitrary_blocks(x, name):
    raw, y = assert_within_bounds(x, name)
    assert np.array_equal(bits(y), bits(gguf_dequantize(raw, GGUF_TYPE[name])))
    same, promised, _ = idempotent_blocks(x, name)
    assert np.all(same[promised])
    nearest_level_is_chosen(x, raw, name)


@settings(max_examples=150, deadline=None)
@given(spec=scaled_strategy, name=st.sampled_from(BLOCK_SCHEMES))
def test_property_scaled_normal_blocks(spec, name):
    """Weight-like blocks at scales 2**-30 .. 2**12 (kept inside fp16's range), and blocks
    with an offset for affine4's sake."""
    n, exponent, seed, offset = spec
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, 32 * n)) * 2.0**exponent).astype(np.float32)
    x[1] += np.float32(offset * 2.0 ** min(exponent, 8))
    raw, y = assert_within_bounds(x, name)
    same, promised, _ = idempotent_blocks(x, name)
    assert np.all(same[promised])
    nearest_level_is_chosen(x[:, :64], raw[:, : 2 * SCHEMES[name].block_bytes], name)


@pytest.mark.parametrize("name", BLOCK_SCHEMES)
def test_rejects_partial_blocks(name):
    with pytest.raises(QuantError, match=r"shape \(2, 40\).*cols 40 is not a multiple of 32"):
        quantize(np.zeros((2, 40), np.float32), name)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_rejects_non_finite_weights_naming_the_row(name, bad):
    x = np.ones((4, 64), np.float32)
    x[2, 37] = bad
    message = rf"{name}: row 2 holds a non-finite weight \({bad}\) at column 37"
    with pytest.raises(QuantError, match=message):
        quantize(x, name)
    with pytest.raises(QuantError, match="row 2"):
        quantize(x.astype(ml_dtypes.bfloat16), name)


@pytest.mark.parametrize(
    "name, value, why",
    [
        ("q8_0", 127 * 65520.0, "scale overflows fp16"),
        ("scale4_gs32", -8 * 65520.0, "scale overflows fp16"),
        ("affine4_gs32", -65520.0, "min weight is below -65504"),
        ("affine4_gs32", 16 * 65520.0, "scale overflows fp16"),
    ],
)
def test_rejects_weights_beyond_fp16_naming_row_and_block(name, value, why):
    x = np.zeros((3, 96), np.float32)
    x[1, 70] = value
    with pytest.raises(QuantError, match=rf"{name}: row 1, block 2 \(columns 64..95\): .*{why}"):
        quantize(x, name)


def test_rejects_bf16_overflow():
    x = np.zeros((2, 4), np.float32)
    x[1, 3] = np.finfo(np.float32).max
    with pytest.raises(QuantError, match="bf16: row 1, column 3: .* overflows bfloat16"):
        quantize(x, "bf16")


def test_rejects_bad_weight_arrays():
    with pytest.raises(QuantError, match="2-D"):
        quantize(np.zeros(64, np.float32), "q8_0")
    with pytest.raises(QuantError, match="float32 or bfloat16, got float64"):
        quantize(np.zeros((1, 64)), "q8_0")


@pytest.mark.parametrize("name", list(SCHEMES))
def test_rejects_wrong_raw_width(name):
    s = SCHEMES[name]
    raw = np.zeros((2, s.row_bytes(64) + s.block_bytes), np.uint8)
    expected, found = s.row_bytes(64), s.row_bytes(64) + s.block_bytes
    with pytest.raises(QuantError, match=rf"64 cols take {expected} bytes per row, found {found}"):
        dequantize(raw, name, 64)
    with pytest.raises(QuantError, match="2-D uint8"):
        dequantize(raw.view(np.int8), name, 64)
    with pytest.raises(QuantError, match="cols -32"):
        dequantize(raw, name, -32)
    if name != "bf16":
        with pytest.raises(QuantError, match="cols 65 is not a multiple of 32"):
            dequantize(raw, name, 65)
