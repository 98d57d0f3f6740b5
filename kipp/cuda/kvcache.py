"""The JAX backend's KV slab: per layer, K and V as `[blocks, 32, 8, 128]` buffers.

"bf16" is one array of BF16 (held as its uint16 bits on XLA's CPU, as the weights are);
"q8_0" is a `QuantizedKV` pair of planes (kipp.formats.kvquant's format: int8 rows and fp16
scales, 136 bytes per head-row against 256), quantized on store and dequantized exactly when
read. The twins on one CPU device stack the layers, `[layers, blocks, 32, 8, 128]`, for the
scanned step (kipp.cuda.forward); the Pallas kernels take one layer's slab.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kipp.backend import KV_BLOCK
from kipp.cuda.layout import widen_bf16
from kipp.formats.kvquant import ROW_BLOCKS
from kipp.formats.quant import BLOCK
from kipp.formats.registry import HEAD_DIM, KV_HEADS


class QuantizedKV(NamedTuple):
    """One layer's K (or V) slab in the q8_0 KV scheme (kipp.formats.kvquant), as two planes.

    q: int8 [blocks, 32, 8, 128]; d: fp16 scales [blocks, 32, 8, 4] (uint16 bits on XLA's CPU,
    as for BF16). A BF16 slab is a plain array; code that handles both asks `isinstance`.
    """

    q: Any
    d: Any


def kv_zeros(shape: tuple[int, ...], scheme: str, platform: str):
    """An empty K or V slab `[blocks, 32, 8, 128]` (or stacked, `[layers, blocks, 32, 8, 128]`)
    for `scheme` ("bf16" or "q8_0"), numpy-free constructors only (the caller jits it onto its
    device or sharding)."""
    bits = platform == "cpu"  # XLA's CPU widens a whole 16-bit float buffer to scatter into it
    if scheme == "q8_0":
        return QuantizedKV(jnp.zeros(shape, jnp.int8), jnp.zeros(
            shape[:-1] + (ROW_BLOCKS,), jnp.uint16 if bits else jnp.float16))
    return jnp.zeros(shape, jnp.uint16 if bits else jnp.bfloat16)


def slab_maker(layers: int, num_blocks: int, scheme: str, platform: str, stacked: bool,
               sharding=None):
    """A function that returns a fresh zeroed slab: a tuple of per-layer (K, V) buffers
    `[blocks, 32, 8, 128]`, or (`stacked`) one (K, V) pair `[layers, blocks, 32, 8, 128]`,
    placed on `sharding` (a jax.sharding.Sharding, a device, or None: the default device)."""
    shape = (num_blocks, KV_BLOCK, KV_HEADS, HEAD_DIM)
    if stacked:
        shape = (layers,) + shape
    zeros = jax.jit(lambda: kv_zeros(shape, scheme, platform),
                    out_shardings=_as_sharding(sharding))
    if stacked:
        return lambda: (zeros(), zeros())
    return lambda: tuple((zeros(), zeros()) for _ in range(layers))


def _as_sharding(target):
    if target is None or isinstance(target, jax.sharding.Sharding):
        return target
    return jax.sharding.SingleDeviceSharding(target)


def widen_f16(x: jax.Array) -> jax.Array:
    """fp16 (or its uint16 bit pattern) -> float32, exactly."""
    if x.dtype == jnp.uint16:
        x = jax.lax.bitcast_convert_type(x, jnp.float16)
    return x.astype(jnp.float32)


def dequantize_kv(q: jax.Array, d: jax.Array) -> jax.Array:
    """q8_0 KV rows: q int8 [..., 128], d fp16 [..., 4] -> float32 [..., 128], d * q (exact)."""
    blocks = q.astype(jnp.float32).reshape(q.shape[:-1] + (ROW_BLOCKS, BLOCK))
    return (blocks * widen_f16(d)[..., None]).reshape(q.shape)


def kv_rows(cache, index, layer=None) -> jax.Array:
    """Rows `cache[index]` of a BF16 or q8_0 slab, as float32 [..., 128]; of layer `layer`'s
    slab for a stacked `[layers, blocks, ...]` one (the scanned step's)."""
    at = index if layer is None else (layer, index)
    if isinstance(cache, QuantizedKV):
        return dequantize_kv(cache.q[at], cache.d[at])
    return widen_bf16(cache[at])


def round_bf16(x: jax.Array, dtype) -> jax.Array:
    """float32 -> BF16 (round to nearest even) stored as `dtype`: bfloat16 or its uint16 bits."""
    b = x.astype(jnp.bfloat16)
    return jax.lax.bitcast_convert_type(b, jnp.uint16) if dtype == jnp.uint16 else b


def store_kv(cache, new: jax.Array, slots: jax.Array, layer=None):
    """Write float32 rows [T, 8, 128] at slab rows `slots` (block * 32 + offset), rounded to the
    slab's format; out-of-range slots are dropped. `layer`: into that layer of a stacked slab.

    Indexed as (block, offset): a scatter into a flattened view makes XLA's CPU copy the whole
    donated buffer; this form (and (layer, block, offset) into a stacked slab carried through a
    scan) stays in place. A single row goes with a dropped second one: XLA rewrites a one-row
    scatter as a dynamic-update-slice, and with Kipp's CPU attention (a custom call) reading the
    slab after it, XLA's CPU copied the whole slab several times a layer.
    """
    if slots.shape[0] == 1:  # one row: a second one, dropped, keeps it a scatter (below)
        slots = jnp.concatenate([slots, jnp.full_like(slots, jnp.iinfo(slots.dtype).max)])
        new = jnp.concatenate([new, new])
    where = (slots // KV_BLOCK, slots % KV_BLOCK)
    if layer is not None:
        where = (layer,) + where
    if isinstance(cache, QuantizedKV):
        q, d = quantize_kv(new)
        d = d.astype(jnp.float16)
        if cache.d.dtype == jnp.uint16:
            d = jax.lax.bitcast_convert_type(d, jnp.uint16)
        return QuantizedKV(cache.q.at[where].set(q, mode="drop"),
                           cache.d.at[where].set(d, mode="drop"))
    return cache.at[where].set(round_bf16(new, cache.dtype), mode="drop")


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 rows [..., 128] -> (q int8 [..., 128], d [..., 4] float32 holding fp16 values),
    bitwise kipp.formats.kvquant.quantize (kipp.formats.quant's q8_0 encoder) for finite input
    whose block scales fit fp16 (|x| < 8.3e6; the numpy oracle raises beyond that).

    Every step is exact in float32: the fp16 rounding of amax / 127 is settled by comparing amax
    with 127 x the fp16 midpoints (12 + 7 significant bits), and each level by comparing |x| with
    d x (k + 1/2) (11 + 8 bits), so no float32 rounding can pick another d or q than float64 does.
    """
    blocks = x.reshape(x.shape[:-1] + (ROW_BLOCKS, BLOCK))
    mag = jnp.abs(blocks)
    amax = jnp.max(mag, axis=-1, keepdims=True)  # [..., 4, 1]
    d = _fp16_nearest(amax)
    d = jnp.where(amax > 127.5 * d, _fp16_step(d, 1), d)  # quant._fp16_scale's bump
    flat = d == 0
    step = jnp.where(flat, 1.0, d)
    level = jnp.clip(jnp.rint(mag / step), 0, 127)

    def beyond_midpoint(k):  # |x| at or past the midpoint between levels k and k + 1
        return mag >= d * (k + 0.5)

    level = level + ((level < 127) & beyond_midpoint(level))  # ties away from zero
    level = level - ((level > 0) & ~beyond_midpoint(level - 1))
    level = jnp.where(flat, 0.0, level)
    q = jnp.where(jnp.signbit(blocks), -level, level).astype(jnp.int8)
    return q.reshape(x.shape), d[..., 0]


def _fp16_step(d: jax.Array, n: int) -> jax.Array:
    """The fp16 value n steps from non-negative fp16 values d (as float32), through the bits."""
    bits = jax.lax.bitcast_convert_type(d.astype(jnp.float16), jnp.uint16).astype(jnp.int32)
    bits = jnp.clip(bits + n, 0, 0x7C00).astype(jnp.uint16)  # 0x7C00: +inf
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _fp16_nearest(amax: jax.Array) -> jax.Array:
    """fp16(amax / 127) correctly rounded (ties to even), as float32, for amax >= 0.

    The float32 quotient rounds to an fp16 at most one step from the right one; the exact
    midpoint tests then move it (float32 cannot represent amax / 127, but 127 x a midpoint it can).
    """
    d = (amax / 127).astype(jnp.float16).astype(jnp.float32)
    up, down = _fp16_step(d, 1), _fp16_step(d, -1)

    def even(v):
        return (jax.lax.bitcast_convert_type(v.astype(jnp.float16), jnp.uint16) & 1) == 0

    mid_up, mid_down = 127 * ((d + up) / 2), 127 * ((d + down) / 2)
    d = jnp.where((amax > mid_up) | ((amax == mid_up) & even(up)), up,
                  jnp.where((d > 0) & ((amax < mid_down) | ((amax == mid_down) & even(down))),
                            down, d))
    return d


# -- whole blocks in and out (kipp.engine.kv_disk) --------------------------------------------

IO_BLOCKS = 16  # blocks per gather/scatter call: one compiled shape each way, padded


def block_io(kv, stacked: bool):
    """(gather, scatter) jitted for a slab like `kv`: gather(kv, ids [IO_BLOCKS]) -> the
    blocks of every buffer (block axis 1 when `stacked`, else 0); scatter(kv, ids, parts) -> kv
    with them stored, `parts` holding for each buffer (tree order) IO_BLOCKS arrays of one block
    each (kv donated; shardings kept). The scatter is one in-place slice update per block: XLA's
    CPU scatter of the same blocks runs at a third of the speed."""
    axis = 1 if stacked else 0
    shardings = jax.tree.map(lambda a: a.sharding, kv)

    def gather(kv, ids):
        return jax.tree.map(lambda a: jnp.take(a, ids, axis=axis), kv)

    def scatter(kv, ids, parts):
        leaves, tree = jax.tree.flatten(kv)
        stored = []
        for a, blocks in zip(leaves, parts):
            for i, block in enumerate(blocks):  # a repeated id (the padding) rewrites its bytes
                a = jax.lax.dynamic_update_slice_in_dim(a, jnp.expand_dims(block, axis), ids[i],
                                                        axis)
            stored.append(a)
        return jax.tree.unflatten(tree, stored)

    return jax.jit(gather), jax.jit(scatter, donate_argnums=0, out_shardings=shardings)


def block_shapes(kv, stacked: bool) -> list[tuple[tuple[int, ...], object]]:
    """(shape of one block, dtype) of every buffer of the slab, in tree order."""
    axis = 1 if stacked else 0
    return [(a.shape[:axis] + a.shape[axis + 1:], a.dtype) for a in jax.tree.leaves(kv)]
