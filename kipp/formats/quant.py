"""Kipp's weight schemes in numpy: the oracle every dequantizing kernel is tested against.

Four schemes, each a GGML tensor type, so the `gguf` package and llama.cpp read Kipp's bytes:

| scheme       | GGML | block bytes (32 weights)            | decode, in float32            |
| ------------ | ---- | ----------------------------------- | ----------------------------- |
| bf16         | BF16 | 2 per weight                        | bits << 16                    |
| q8_0         | Q8_0 | 34: fp16 d, 32 x int8 q             | w = d * q                     |
| affine4_gs32 | Q4_1 | 20: fp16 d, fp16 m, 16 nibble bytes | w = d * q + m                 |
| scale4_gs32  | Q4_0 | 18: fp16 d, 16 nibble bytes         | w = d * (q - 8)               |

Blocks are 32 consecutive weights along a row (the input dimension); all values little-endian.
Nibble byte j holds element j in its low nibble and element j + 16 in its high nibble.

Decode arithmetic (kernels must match it bitwise). d and m are fp16 widened to float32 (exact);
q is an integer widened to float32 (exact).
- q8_0 and scale4: one float32 multiply. d has 11 significant bits and q (or q - 8) at most 8,
  so the product is exact: no rounding happens, in any order, with or without FMA.
- affine4: float32 multiply d * q (exact, 15 significant bits), then one float32 add of m,
  rounded to nearest even. Because the product is exact, fma(d, q, m) gives the same bits as the
  separate multiply and add. What a kernel must NOT do: accumulate in another precision, or
  rewrite the formula (for example d * (q + m / d)).

Encoders choose the fp16 parameters first, then for each weight the level nearest to it among
the levels the decoder will produce from those fp16 values (Kipp's rule: quantize against the
rounded parameters, so encoder and decoder agree). Ties go to the larger |q| for q8_0 and to the
larger q for the 4-bit schemes (llama.cpp's trunc(v + 0.5) convention). See `error_bound`.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from kipp.errors import QuantError

GGML_F32 = 0
GGML_Q4_0 = 2
GGML_Q4_1 = 3
GGML_Q8_0 = 8
GGML_BF16 = 30

BLOCK = 32  # weights per quantization block (GGML's QK)
FP16_MAX = 65504.0

# GGML type id -> (weights per block, bytes per block), for the types Kipp writes or reads.
GGML_TYPE_LAYOUT = {
    GGML_F32: (1, 4),
    GGML_BF16: (1, 2),
    GGML_Q8_0: (BLOCK, 34),
    GGML_Q4_0: (BLOCK, 18),
    GGML_Q4_1: (BLOCK, 20),
}
GGML_TYPE_NAMES = {
    GGML_F32: "F32",
    GGML_BF16: "BF16",
    GGML_Q8_0: "Q8_0",
    GGML_Q4_0: "Q4_0",
    GGML_Q4_1: "Q4_1",
}

_CHUNK_ELEMENTS = 1 << 20  # quantize this many weights at a time: float64 scratch stays ~10s of MiB


def ggml_type_bytes(ggml_type: int, n_elements: int) -> int:
    """Bytes `n_elements` values take in GGML type `ggml_type` (F32, BF16, Q8_0, Q4_0, Q4_1)."""
    if ggml_type not in GGML_TYPE_LAYOUT:
        known = ", ".join(f"{name}={t}" for t, name in GGML_TYPE_NAMES.items())
        raise QuantError(f"unsupported GGML tensor type {ggml_type}; Kipp handles {known}")
    block_weights, block_bytes = GGML_TYPE_LAYOUT[ggml_type]
    if n_elements < 0 or n_elements % block_weights:
        raise QuantError(
            f"{GGML_TYPE_NAMES[ggml_type]}: {n_elements} elements is not a whole number "
            f"of {block_weights}-weight blocks"
        )
    return n_elements // block_weights * block_bytes


@dataclass(frozen=True)
class WeightScheme:
    """One weight scheme: its name in Kipp and its GGML encoding."""

    name: str  # value of the kipp.quant.scheme metadata key
    ggml_type: int  # GGML tensor type of the quantized projections
    block_weights: int
    block_bytes: int
    file_type: int  # llama.cpp general.file_type (llama_ftype) of an artifact using this scheme

    def row_bytes(self, cols: int) -> int:
        """Bytes one row of `cols` weights takes; `cols` must fill whole blocks."""
        if cols < 0:
            raise QuantError(f"{self.name}: cols {cols} is negative")
        if cols % self.block_weights:
            raise QuantError(f"{self.name}: cols {cols} is not a multiple of {self.block_weights}")
        return cols // self.block_weights * self.block_bytes


SCHEMES: dict[str, WeightScheme] = {
    s.name: s
    for s in (
        WeightScheme("bf16", GGML_BF16, 1, 2, file_type=32),  # LLAMA_FTYPE_MOSTLY_BF16
        WeightScheme("q8_0", GGML_Q8_0, BLOCK, 34, file_type=7),  # LLAMA_FTYPE_MOSTLY_Q8_0
        WeightScheme("affine4_gs32", GGML_Q4_1, BLOCK, 20, file_type=3),  # MOSTLY_Q4_1
        WeightScheme("scale4_gs32", GGML_Q4_0, BLOCK, 18, file_type=2),  # MOSTLY_Q4_0
    )
}
SCHEMES_BY_GGML_TYPE: dict[int, WeightScheme] = {s.ggml_type: s for s in SCHEMES.values()}


def scheme(name: str) -> WeightScheme:
    """The weight scheme called `name`; QuantError names the valid ones otherwise."""
    try:
        return SCHEMES[name]
    except (KeyError, TypeError):
        raise QuantError(f"unknown weight scheme {name!r}; valid: {', '.join(SCHEMES)}") from None


def _as_scheme(s: WeightScheme | str) -> WeightScheme:
    return s if isinstance(s, WeightScheme) else scheme(s)


def quantize(weights: np.ndarray, scheme: WeightScheme | str) -> np.ndarray:
    """Encode float32 or bfloat16 weights [rows, cols] as uint8 [rows, scheme.row_bytes(cols)].

    Raises QuantError for a wrong dtype or shape, a non-finite weight (naming its row), or a
    block whose fp16 parameters would overflow (naming its row and block).
    """
    s = _as_scheme(scheme)
    x = _checked_weights(weights, s)
    rows, cols = x.shape
    out = np.empty((rows, s.row_bytes(cols)), np.uint8)
    if out.size == 0:
        return out
    if s.name == "bf16":
        return _encode_bf16(x, out)
    encode = _BLOCK_ENCODERS[s.name]
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    for r0 in range(0, rows, step):
        chunk = x[r0 : r0 + step].astype(np.float64).reshape(-1, cols // BLOCK, BLOCK)
        out[r0 : r0 + step] = encode(chunk, r0).reshape(len(chunk), -1)
    return out


def _checked_weights(weights, s: WeightScheme) -> np.ndarray:
    """The weights as float32 [rows, cols] (exact for bfloat16 input), after every check."""
    if not isinstance(weights, np.ndarray) or weights.ndim != 2:
        shape = getattr(weights, "shape", type(weights).__name__)
        raise QuantError(f"{s.name}: weights must be a 2-D array [rows, cols], got {shape}")
    if weights.dtype not in (np.float32, ml_dtypes.bfloat16):
        raise QuantError(f"{s.name}: weights must be float32 or bfloat16, got {weights.dtype}")
    if weights.shape[1] % s.block_weights:
        raise QuantError(
            f"{s.name}: weights of shape {weights.shape}: cols {weights.shape[1]} "
            f"is not a multiple of {s.block_weights}"
        )
    x = np.ascontiguousarray(weights, dtype=np.float32)  # C order: the byte views need it
    finite = np.isfinite(x)
    if not finite.all():
        row, col = np.argwhere(~finite)[0]
        bad = x[row, col]
        raise QuantError(f"{s.name}: row {row} holds a non-finite weight ({bad}) at column {col}")
    return x


def _encode_bf16(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (nearest, ties to even, via ml_dtypes) and store little-endian."""
    b = x.astype(ml_dtypes.bfloat16)
    overflow = ~np.isfinite(b.astype(np.float32))
    if overflow.any():
        row, col = np.argwhere(overflow)[0]
        raise QuantError(f"bf16: row {row}, column {col}: {x[row, col]} overflows bfloat16")
    out[:] = b.view(np.uint16).astype("<u2").view(np.uint8)
    return out


def _encode_q8_0(x: np.ndarray, row0: int) -> np.ndarray:
    """x: float64 [rows, blocks, 32] -> Q8_0 blocks uint8 [rows, blocks, 34]."""
    amax = np.abs(x).max(axis=-1, keepdims=True)  # [rows, blocks, 1]
    d = _fp16_scale(amax / 127, amax, 0.0, 127.5, "q8_0", row0)
    # Quantize |x| and restore the sign: ties round away from zero and q(-x) == -q(x).
    # q stays in [-127, 127]: _fp16_scale guarantees amax <= 127.5 d, and a tie at exactly
    # 127.5 d is clipped to 127 (error d/2, still within the bound). -128 is never written: the
    # symmetric range keeps negation exact and the largest |q| at 127, which the idempotence
    # argument in the tests relies on. The decoder still accepts -128 (any byte is valid Q8_0).
    mag = _nearest_level(np.abs(x), 0.0, d.astype(np.float64), 128, flat_level=0)
    q = np.where(np.signbit(x), -mag, mag).astype(np.int8)
    return np.concatenate([_fp16_bytes(d), q.view(np.uint8)], axis=-1)


def _encode_scale4(x: np.ndarray, row0: int) -> np.ndarray:
    """x: float64 [rows, blocks, 32] -> Q4_0 blocks uint8 [rows, blocks, 18].

    As llama.cpp's Q4_0: `big` is the block's first element of largest magnitude, sign kept, and
    d = fp16(big / -8), so big sits on level q = 0 (-8 d) and the other sign reaches only 7 |d|.
    """
    first = np.abs(x).argmax(axis=-1)[..., None]
    big = np.take_along_axis(x, first, axis=-1)  # [rows, blocks, 1]
    d = _fp16_scale(big / -8, np.abs(big), 0.0, 8.5, "scale4_gs32", row0).astype(np.float64)
    q = _nearest_level(x, -8 * d, d, 16, flat_level=8)  # flat block: q = 8 decodes to 0
    return np.concatenate([_fp16_bytes(d), _pack_nibbles(q)], axis=-1)


def _encode_affine4(x: np.ndarray, row0: int) -> np.ndarray:
    """x: float64 [rows, blocks, 32] -> Q4_1 blocks uint8 [rows, blocks, 20].

    m is the block minimum rounded DOWN to fp16 (llama.cpp rounds to nearest). Rounding down
    keeps every weight at or above level 0, so no weight saturates below and the bound is the
    uniform d/2; a constant block whose value is not an fp16 then gets d > 0 and lands within
    d/2 of it, instead of sitting up to half an fp16 ulp away.
    d = fp16((max - m) / 15) is measured from the rounded m, so level 15 lands on max.
    """
    lo = x.min(axis=-1, keepdims=True)
    m = _fp16_floor(lo)
    too_low = f"min weight is below -{FP16_MAX:g}, fp16's range"
    _reject(~np.isfinite(m), row0, "affine4_gs32", too_low)
    m = np.where(m == 0, 0.0, m.astype(np.float64))  # +0, never -0: the decoder's 0 + -0 is +0
    hi = x.max(axis=-1, keepdims=True)
    d = _fp16_scale((hi - m) / 15, hi, m, 15.5, "affine4_gs32", row0).astype(np.float64)
    q = _nearest_level(x, m, d, 16, flat_level=0)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(m), _pack_nibbles(q)], axis=-1)


_BLOCK_ENCODERS = {
    "q8_0": _encode_q8_0,
    "scale4_gs32": _encode_scale4,
    "affine4_gs32": _encode_affine4,
}


def _fp16_scale(target, extreme, origin, reach, name: str, row0: int) -> np.ndarray:
    """fp16 scale d: `target` rounded to nearest fp16, bumped one fp16 step away from zero where
    the levels would stop more than half a level short of the block's extreme weight, that is
    where extreme > origin + reach * |d| (reach = levels past the origin + 1/2). Both sides are
    exact in float64 (origin is 0 or the fp16 m), so this test is exact.

    The bump only happens when d is an fp16 subnormal (|d| < 2**-14) or 0: there rounding can
    lose most of the scale's precision, and without the bump the extreme weights would saturate
    with an error up to ~127 * 2**-25. For normal d, rounding moves d by at most 2**-11
    relative, so the extreme lands within 0.07 d of the end level and no bump is needed (for
    q8_0 and scale4, d is then llama.cpp's choice). One bump always suffices (target is within
    half a subnormal step of d). A target too large for fp16 (above 65504 after rounding) is a
    QuantError: clamping d to 65504 would silently saturate every weight past it.
    """
    with np.errstate(over="ignore"):
        d = target.astype(np.float16)
    overflow = f"block scale overflows fp16 (max {FP16_MAX:g}); such weights are rejected"
    _reject(np.isinf(d), row0, name, overflow)
    short = extreme > origin + reach * np.abs(d.astype(np.float64))
    toward = np.where(target < 0, -np.inf, np.inf).astype(np.float16)
    with np.errstate(over="ignore"):  # nextafter(65504) is inf, but never where `short`
        d = np.where(short, np.nextafter(d, toward), d)
    return np.where(d == 0, np.float16(0), d)  # +0, never -0: a zero block decodes to +0.0


def _fp16_floor(v: np.ndarray) -> np.ndarray:
    """The largest fp16 <= v (float64 in); -inf where none is finite."""
    with np.errstate(over="ignore"):
        h = v.astype(np.float16)
        return np.where(h.astype(np.float64) > v, np.nextafter(h, np.float16(-np.inf)), h)


def _nearest_level(x, first, step, n_levels: int, flat_level: int) -> np.ndarray:
    """Index q in [0, n_levels) of the level `first + step * q` nearest to x; ties to larger q.

    x, first, step: float64 broadcasting to [rows, blocks, 32]; first and step are exact
    fp16-derived values, step may be negative (scale4), and step == 0 means every level is the
    same, so q = flat_level. The float64 estimate rint((x - first) / step) is off by at most one
    (its error is ~2**-52 relative, far below a level). It is then corrected by comparing x with
    the midpoints first + step * (q + 0.5), which are exact in float64 (fp16 d and m carry 11
    significant bits and quanta >= 2**-25, and every level is below 2**21 in magnitude), so
    the comparison, and hence the choice of level, is exact.
    """
    flat = step == 0
    safe_step = np.where(flat, 1.0, step)
    q = np.clip(np.rint((x - first) / safe_step), 0, n_levels - 1).astype(np.int64)
    toward = np.sign(safe_step)

    def beyond_midpoint(k):  # x lies at or past the midpoint between levels k and k + 1
        return toward * (x - (first + step * (k + 0.5))) >= 0

    q += (q < n_levels - 1) & beyond_midpoint(q)  # the estimate was one too low
    q -= (q > 0) & ~beyond_midpoint(q - 1)  # the estimate was one too high
    return np.where(flat, flat_level, q)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q: ints 0..15 [..., 32] -> [..., 16] bytes: element j low nibble, element j + 16 high."""
    q = q.astype(np.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    """v: [..., 1] -> its fp16 little-endian bytes [..., 2]."""
    return v.astype("<f2").view(np.uint8)


def _reject(bad: np.ndarray, row0: int, name: str, why: str) -> None:
    """Raise QuantError naming the first block flagged in `bad` [rows, blocks, 1]."""
    if bad.any():
        row, block, _ = np.argwhere(bad)[0]
        cols = f"{block * BLOCK}..{block * BLOCK + BLOCK - 1}"
        raise QuantError(f"{name}: row {row0 + row}, block {block} (columns {cols}): {why}")


def dequantize(raw: np.ndarray, scheme: WeightScheme | str, cols: int) -> np.ndarray:
    """Decode uint8 [rows, scheme.row_bytes(cols)] into float32 [rows, cols].

    The float32 arithmetic is exactly the module docstring's; kernels must match it bitwise.
    """
    s = _as_scheme(scheme)
    row_bytes = s.row_bytes(cols)
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
        found = f"{raw.dtype} {raw.shape}" if isinstance(raw, np.ndarray) else type(raw).__name__
        raise QuantError(f"{s.name}: raw must be a 2-D uint8 array [rows, row bytes], got {found}")
    if raw.shape[1] != row_bytes:
        raise QuantError(
            f"{s.name}: {cols} cols take {row_bytes} bytes per row, found {raw.shape[1]} "
            f"(raw shape {raw.shape})"
        )
    if s.name == "bf16":
        bits = np.ascontiguousarray(raw).view("<u2").astype(np.uint32) << 16
        return bits.view(np.float32)
    d, m, q = _unpack(raw, s)
    if s.name == "q8_0":
        w = d * q  # exact
    elif s.name == "scale4_gs32":
        w = d * (q - np.float32(8))  # q - 8 exact; product exact
    else:
        w = d * q + m  # product exact; one rounding in the add
    return w.reshape(len(raw), cols)


def _unpack(raw: np.ndarray, s: WeightScheme):
    """Block fields as float32: d [rows, blocks, 1], m (affine4; else None), q [rows, blocks, 32].

    q is the stored integer: int8 for q8_0, the 0..15 nibble for the 4-bit schemes.
    """
    blocks = np.ascontiguousarray(raw).reshape(len(raw), -1, s.block_bytes)
    d = _fp16_field(blocks, 0)
    m = _fp16_field(blocks, 2) if s.name == "affine4_gs32" else None
    if s.name == "q8_0":
        return d, m, blocks[..., 2:].view(np.int8).astype(np.float32)
    nibbles = blocks[..., s.block_bytes - 16 :]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    return d, m, q.astype(np.float32)


def _fp16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view("<f2").astype(np.float32)


def error_bound(weights: np.ndarray, raw: np.ndarray, scheme: WeightScheme | str) -> np.ndarray:
    """Largest |w - dequantize(quantize(w))| Kipp's encoder allows: float64 per block
    [rows, cols // 32] (per weight [rows, cols] for bf16), given the stored fp16 parameters.

    Block schemes: the encoder picks the level nearest each weight, so the exact bound is
        B = max(|d| / 2, x_max - top_level, bottom_level - x_min)
    where the levels are q8_0: d * [-127, 127]; affine4: m + d * [0, 15]; scale4:
    d * [-8, 7]. What the encoder guarantees on top (derived in `_fp16_scale`):
    - q8_0: x_max and x_min are always within d/2 of the end levels, so B == d / 2.
    - affine4: likewise B == d / 2, plus the float32 rounding of the decoder's add: half a
      float32 ulp of the largest |level|, included in the returned value.
    - scale4: the side of `big` (largest magnitude) is within |d| / 2; the other side reaches
      only 7 |d|, so a weight there beyond 7.5 |d| saturates: error up to amax - 7 |d|, which is
      <= |d| (1 + 2**-8) for normal d and <= 1.5 |d| always.
    bf16: round to nearest even, error <= 2**-8 |w| (2**-134 below bf16's normal range).
    """
    s = _as_scheme(scheme)
    x = _checked_weights(weights, s).astype(np.float64)
    if s.name == "bf16":
        return np.maximum(np.abs(x) * 2.0**-8, 2.0**-134)
    d, m, _ = _unpack(raw, s)
    d = d.astype(np.float64)
    if s.name == "q8_0":
        bottom, top = -127 * d, 127 * d
    elif s.name == "scale4_gs32":
        bottom, top = np.minimum(-8 * d, 7 * d), np.maximum(-8 * d, 7 * d)
    else:
        bottom, top = m.astype(np.float64), m + 15 * d
    blocks = x.reshape(len(x), -1, BLOCK)
    saturated_hi = blocks.max(-1, keepdims=True) - top
    saturated_lo = bottom - blocks.min(-1, keepdims=True)
    bound = np.maximum.reduce([np.abs(d) / 2, saturated_hi, saturated_lo])
    if s.name == "affine4_gs32":
        largest = np.maximum(np.abs(bottom), np.abs(top)).astype(np.float32)
        bound = bound + np.spacing(largest).astype(np.float64) / 2
    return bound[..., 0]
