"""MLXBackend's KV slab: allocated once, written in place through slot indices, read by gather.

Per layer, K and V are each one MLX array over the physical slots (block * 32 + offset):
- "bf16": bfloat16 [slots, 8, 128], rounded from float32 on store (MLX's cast rounds to nearest
  even, as ml_dtypes and the reference do);
- "q8_0": kipp.formats.kvquant's two planes, q int8 [slots, 8, 128] and d float16 [slots, 8, 4]:
  136 bytes per head-row against 256, quantized on store by `quantize_q8_0` (bitwise
  kipp.formats.kvquant.quantize) and dequantized exactly (d * q) when read.

A store is `slab[slots] = rows`: MLX turns it into a scatter that reuses the slab's buffer when
nothing else holds it (the backend evaluates every slab after each round, so the graph never
grows). Reads gather the visible slots, so a scrambled block table reads the same values in the
same order as the identity table.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kipp.backend import KV_BLOCK
from kipp.errors import KippError
from kipp.formats.kvquant import ROW_BLOCKS, SCHEMES
from kipp.formats.quant import BLOCK
from kipp.formats.registry import HEAD_DIM, KV_HEADS


class KVSlab:
    """One layer stack of K or V (see module docstring)."""

    def __init__(self, layers: int, slots: int, scheme: str = "bf16", kv_heads: int = KV_HEADS):
        if scheme not in SCHEMES:
            raise KippError(f"unknown kv_scheme {scheme!r}; choose from {', '.join(SCHEMES)}")
        self.scheme = scheme
        shape = (slots, kv_heads, HEAD_DIM)  # a tensor-parallel rank holds its KV heads only
        if scheme == "bf16":
            self.data = [mx.zeros(shape, mx.bfloat16) for _ in range(layers)]
            self.scales = None
        else:
            self.data = [mx.zeros(shape, mx.int8) for _ in range(layers)]
            self.scales = [mx.zeros((slots, kv_heads, ROW_BLOCKS), mx.float16)
                           for _ in range(layers)]
        mx.eval(self.arrays())

    def arrays(self) -> list[mx.array]:
        """Every buffer of the slab (to evaluate after a round)."""
        return self.data + (self.scales or [])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def block_bytes(self, block: int) -> bytes:
        """Every layer's rows of one 32-slot block, data then scales (a copy, taken now)."""
        rows = slice(block * KV_BLOCK, (block + 1) * KV_BLOCK)
        parts = [a[rows] for a in self.arrays()]
        mx.eval(parts)
        return b"".join(np.asarray(_bits(a)).tobytes() for a in parts)

    def set_block(self, block: int, data: bytes) -> None:
        """The inverse of block_bytes."""
        rows, at = slice(block * KV_BLOCK, (block + 1) * KV_BLOCK), 0
        for buffers in ([self.data] if self.scales is None else [self.data, self.scales]):
            for layer, a in enumerate(buffers):
                shape = (KV_BLOCK,) + tuple(a.shape[1:])
                bits = mx.uint16 if a.dtype in (mx.bfloat16, mx.float16) else a.dtype
                width = 1 if a.dtype == mx.int8 else 2
                size = int(np.prod(shape)) * width
                host = np.frombuffer(data, np.int8 if width == 1 else np.uint16,
                                     size // width, at).reshape(shape)
                value = mx.array(host)
                buffers[layer][rows] = value if bits == a.dtype else value.view(a.dtype)
                at += size
        mx.eval(self.arrays())

    def store(self, layer: int, rows: mx.array, slots: mx.array) -> None:
        """Write float32 rows [T, 8, 128] at slab rows `slots` [T] int32, in the slab's format."""
        if self.scheme == "bf16":
            self.data[layer][slots] = rows.astype(mx.bfloat16)
        else:
            q, d = quantize_q8_0(rows)
            self.data[layer][slots] = q
            self.scales[layer][slots] = d

    def rows(self, layer: int, slots: mx.array) -> mx.array:
        """float32 [P, 8, 128] of slab rows `slots` [P]."""
        if self.scheme == "bf16":
            return self.data[layer][slots].astype(mx.float32)
        return dequantize_q8_0(self.data[layer][slots], self.scales[layer][slots])

    def kernel_planes(self, layer: int) -> tuple[mx.array, ...]:
        """The layer's buffers as the attention kernel reads them: (bits uint16,) for bf16,
        (q int8, d bits uint16) for q8_0. Views, no copies."""
        if self.scheme == "bf16":
            return (self.data[layer].view(mx.uint16),)
        return (self.data[layer], self.scales[layer].view(mx.uint16))


def _bits(a: mx.array) -> mx.array:
    """16-bit floats as their uint16 bits (numpy has no bfloat16)."""
    return a.view(mx.uint16) if a.dtype in (mx.bfloat16, mx.float16) else a


def dequantize_q8_0(q: mx.array, d: mx.array) -> mx.array:
    """q int8 [..., 128], d float16 [..., 4] -> float32 [..., 128]: d * q, exact."""
    blocks = q.astype(mx.float32).reshape(*q.shape[:-1], ROW_BLOCKS, BLOCK)
    return (blocks * d.astype(mx.float32)[..., None]).reshape(q.shape)


def quantize_q8_0(x: mx.array) -> tuple[mx.array, mx.array]:
    """float32 rows [..., 128] -> (q int8 [..., 128], d float16 [..., 4]), bitwise
    kipp.formats.kvquant.quantize for finite rows whose block scales fit fp16 (|x| < 8.3e6).

    Every decision is exact in float32: fp16(amax / 127) is settled by comparing amax with 127 x
    the neighbouring fp16 midpoints (12 + 7 significant bits, exact), the subnormal bump by
    comparing amax with 127.5 d, and each level by comparing |x| with d (k + 1/2) (11 + 8 bits);
    so float32 picks the d and q that kipp.formats.quant's float64 arithmetic picks.
    """
    blocks = x.reshape(*x.shape[:-1], ROW_BLOCKS, BLOCK)
    mag = mx.abs(blocks)
    amax = mx.max(mag, axis=-1, keepdims=True)  # [..., 4, 1]
    d = _fp16_nearest(amax)
    d = mx.where(amax > 127.5 * d, _fp16_step(d, 1), d)  # kipp.formats.quant._fp16_scale's bump
    flat = d == 0
    step = mx.where(flat, 1.0, d)
    level = mx.clip(mx.round(mag / step), 0, 127)

    def beyond_midpoint(k):  # |x| at or past the midpoint between levels k and k + 1
        return mag >= d * (k + 0.5)

    level = level + ((level < 127) & beyond_midpoint(level)).astype(mx.float32)  # ties: away
    level = level - ((level > 0) & ~beyond_midpoint(level - 1)).astype(mx.float32)
    level = mx.where(flat, 0.0, level)
    q = mx.where(blocks < 0, -level, level).astype(mx.int8)
    return q.reshape(x.shape), d[..., 0].astype(mx.float16)


def _fp16_step(d: mx.array, n: int) -> mx.array:
    """The fp16 value n steps from non-negative fp16 values d (float32), through the bits."""
    bits = d.astype(mx.float16).view(mx.uint16).astype(mx.int32)
    bits = mx.clip(bits + n, 0, 0x7C00).astype(mx.uint16)  # 0x7C00: +inf
    return bits.view(mx.float16).astype(mx.float32)


def _fp16_nearest(amax: mx.array) -> mx.array:
    """fp16(amax / 127) correctly rounded (ties to even), as float32, for amax >= 0.

    The float32 quotient rounds to an fp16 at most one step from the right one; the exact
    midpoint comparisons move it there.
    """
    d = (amax / 127).astype(mx.float16).astype(mx.float32)
    up, down = _fp16_step(d, 1), _fp16_step(d, -1)

    def even(v):
        return (v.astype(mx.float16).view(mx.uint16) & 1) == 0

    mid_up, mid_down = 127 * ((d + up) / 2), 127 * ((d + down) / 2)
    go_up = (amax > mid_up) | ((amax == mid_up) & even(up))
    go_down = (d > 0) & ((amax < mid_down) | ((amax == mid_down) & even(down)))
    return mx.where(go_up, up, mx.where(go_down, down, d))
