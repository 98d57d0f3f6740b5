"""Kipp's quantized blocks rearranged, once at load and in numpy, for MLX's two consumers.

Both are exact images of the artifact's values; nothing is widened to float.
- MLX affine, group 32 (the twins' `mx.quantized_matmul`): w = scale * q + bias per 32-weight
  group, q unsigned, packed little-endian into uint32 words (`to_affine`):

  | scheme       | stored                 | MLX q        | scale | bias   |
  | ------------ | ---------------------- | ------------ | ----- | ------ |
  | q8_0         | int8 q, w = d q        | q + 128      | d     | -128 d |
  | scale4_gs32  | nibble q, w = d (q-8)  | q            | d     | -8 d   |
  | affine4_gs32 | nibble q, w = d q + m  | q            | d     | m      |

- Kernel planes (the Metal kernels, `to_planes`): the artifact's own bytes in aligned planes,
  so decode streams exactly the 34 / 18 / 20 bytes per 32 weights the file stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kipp.errors import KippError
from kipp.formats.quant import BLOCK, SCHEMES_BY_GGML_TYPE, WeightScheme

QUANTIZED = ("q8_0", "scale4_gs32", "affine4_gs32")
BITS = {"q8_0": 8, "scale4_gs32": 4, "affine4_gs32": 4}


@dataclass(frozen=True)
class Affine:
    """MLX affine group-32 arrays (numpy): w uint32 [out, in * bits / 32]; scales, biases
    float32 [out, in / 32]."""

    w: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int


@dataclass(frozen=True)
class Planes:
    """The kernels' planes (numpy): q int8 [out, in] (q8_0) or uint8 nibbles [out, in / 2];
    d (and m for affine4) fp16 bits as uint16 [out, in / 32]."""

    q: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    scheme: str


def _blocks(raw: np.ndarray, scheme: WeightScheme, cols: int) -> np.ndarray:
    """GGML rows uint8 [out, row_bytes] -> [out, cols / 32, block_bytes], checked."""
    if scheme.name not in QUANTIZED:
        raise KippError(f"repack: {scheme.name} is not a quantized scheme")
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != scheme.row_bytes(cols):
        raise KippError(f"repack: {scheme.name} rows of {cols} weights take "
                        f"{scheme.row_bytes(cols)} bytes, got {raw.dtype} {raw.shape}")
    return np.ascontiguousarray(raw).reshape(len(raw), cols // BLOCK, scheme.block_bytes)


def _fp16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """An fp16 field of every block, as float32 [out, blocks] (exact)."""
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view("<f2")[..., 0].astype(
        np.float32)


def _levels(blocks: np.ndarray, scheme: WeightScheme) -> np.ndarray:
    """Stored integer levels [out, blocks, 32]: int8 for q8_0, 0..15 nibbles (uint8) else."""
    if scheme.name == "q8_0":
        return np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    nibbles = blocks[..., scheme.block_bytes - 16:]
    return np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)


def to_affine(raw: np.ndarray, scheme: WeightScheme | str, cols: int) -> Affine:
    """GGML rows of a quantized scheme -> MLX affine group-32 arrays (the module's table).

    Scales and biases are float32 (also what the CPU wheel runs fast): fp16 d and m widen to it
    exactly and -128 d, -8 d are exact there, while an fp16 -128 d overflows for d > 511 and
    bf16 would drop 3 of d's 11 significant bits. MLX's decode is then exact: d * (q + 128) is
    an exact product (11 x 9 bits) and adding -128 d gives d * q exactly (a representable sum
    of exact values); the same for scale4; affine4 is an exact product and one rounded add, as
    kipp.formats.quant decodes it. So `mx.dequantize` of the repack is kipp.formats.quant's
    dequantize bit for bit, but for scale4's d < 0, q = 8: -0.0 there, +0.0 here (equal)."""
    s = _scheme(scheme)
    blocks = _blocks(raw, s, cols)
    rows = len(blocks)
    d = _fp16(blocks, 0)
    q = _levels(blocks, s)
    if s.name == "q8_0":
        unsigned = (q.astype(np.int16) + 128).astype(np.uint8)  # [out, blocks, 32]
        words = np.ascontiguousarray(unsigned).reshape(rows, -1).view("<u4")
        bias = -128 * d
    else:
        pairs = q.reshape(rows, -1, BLOCK // 2, 2)  # consecutive elements share a byte
        packed = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
        words = np.ascontiguousarray(packed).reshape(rows, -1).view("<u4")
        bias = _fp16(blocks, 2) if s.name == "affine4_gs32" else -8 * d
    return Affine(words.astype(np.uint32), d, bias.astype(np.float32), BITS[s.name])


def to_planes(raw: np.ndarray, scheme: WeightScheme | str, cols: int) -> Planes:
    """GGML rows of a quantized scheme -> the Metal kernels' planes, split so a SIMD lane loads
    whole fields: q8_0 -> int8 q [out, in]; the 4-bit schemes -> uint8 nibbles [out, in / 2] in
    GGML order (byte j of a block: element j low, j + 16 high); fp16 d (and affine4's m)
    [out, in / 32] as uint16 bits. (The affine repack would stream 40 / 24 bytes per 32.)"""
    s = _scheme(scheme)
    blocks = _blocks(raw, s, cols)
    rows = len(blocks)
    d = np.ascontiguousarray(blocks[..., 0:2]).view("<u2")[..., 0]
    if s.name == "q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)
        return Planes(q, np.ascontiguousarray(d), None, s.name)
    nibbles = np.ascontiguousarray(blocks[..., s.block_bytes - 16:]).reshape(rows, cols // 2)
    m = (np.ascontiguousarray(np.ascontiguousarray(blocks[..., 2:4]).view("<u2")[..., 0])
         if s.name == "affine4_gs32" else None)
    return Planes(nibbles, np.ascontiguousarray(d), m, s.name)


def dequantize_planes(p: Planes) -> np.ndarray:
    """float32 [out, in] from kernel planes, with kipp.formats.quant's arithmetic: the numpy
    statement of what the Metal kernels compute per weight (tests compare it with quant's)."""
    d = p.d.view(np.float16).astype(np.float32)[..., None]  # [out, blocks, 1]
    rows = len(p.q)
    if p.scheme == "q8_0":
        q = p.q.reshape(rows, -1, BLOCK).astype(np.float32)
        return (d * q).reshape(rows, -1)
    nibbles = p.q.reshape(rows, -1, BLOCK // 2)
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.float32)
    if p.scheme == "scale4_gs32":
        return (d * (q - np.float32(8))).reshape(rows, -1)
    m = p.m.view(np.float16).astype(np.float32)[..., None]
    return (d * q + m).reshape(rows, -1)


def _scheme(scheme) -> WeightScheme:
    if isinstance(scheme, WeightScheme):
        return scheme
    for s in SCHEMES_BY_GGML_TYPE.values():
        if s.name == scheme:
            return s
    raise KippError(f"repack: unknown scheme {scheme!r}")
