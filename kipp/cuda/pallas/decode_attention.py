"""Decode attention: one query per sequence over its paged KV, split along the context.

`q [S, H, 128]`, one layer's slab `[blocks, 32, 8, 128]` BF16 (or q8_0 planes, dequantized per
tile: prefill_attention.kv_tile), `lengths [S]` (positions each query sees: its own position
+ 1; 0 for a padding sequence) and `block_tables [S, B]`.

Kernel: Pallas, Triton lowering (kipp.cuda.pallas.quant_matmul says why). One program per
(sequence, KV head) would leave most of a GPU idle on long contexts, so the context is split
into ranges of `blocks_per_split` KV blocks (split-K, "flash decoding"), one program per
(sequence, KV head, range). Each runs an online softmax over its blocks and writes an
unnormalised partial output with its running max and denominator; the wrapper merges the
partials exactly as the online softmax would. The query heads sharing a KV head are the rows of
one tile (padded to 16 for Triton's dot), so each KV block is read once per group; the dots are
prefill_attention's `attend_block`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kipp.backend import KV_BLOCK
from kipp.cuda.pallas.prefill_attention import (
    MASKED,
    attend_block,
    kv_refs,
    kv_tile,
    paged_attention_reference,
)
from kipp.formats.registry import HEAD_DIM, KV_HEADS


def _decode_kernel(tables_ref,  # [S, B] int32 block tables
                   lengths_ref,  # [S] int32 visible positions per sequence
                   q_ref,  # [1, 1, rows, 128] bfloat16: the group's query heads (padded)
                   *refs,  # kv_refs (one layer's K and V slab), then o_ref, m_ref, l_ref:
                   # o [1, 1, 1, rows, 128] f32: unnormalised partial output; m [1, 1, 1, rows]
                   # f32: running max of the scores; l [1, 1, 1, rows] f32: softmax denominator
                   blocks_per_split: int):
    *kv, o_ref, m_ref, l_ref = refs
    s, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = q_ref.shape[2]
    q = q_ref[0, 0, :, :]  # [rows, 128]
    length = lengths_ref[s]
    first = c * blocks_per_split
    # lax.div: truncating integer division, which Triton lowers directly (lengths are >= 0)
    stop = jnp.minimum(first + blocks_per_split, jax.lax.div(length + KV_BLOCK - 1, KV_BLOCK))
    offsets = jax.lax.broadcasted_iota(jnp.int32, (1, KV_BLOCK), 1)  # [1, 32]

    def block(j, carry):
        k, v = kv_tile(kv, tables_ref[s, j], h)  # [32, 128] each
        return attend_block(q, k, v, j * KV_BLOCK + offsets < length, carry)

    init = (jnp.zeros((rows, HEAD_DIM), jnp.float32), jnp.full((rows, 1), MASKED, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32))
    acc, m, l = jax.lax.fori_loop(first, jnp.maximum(stop, first), block, init)
    o_ref[0, 0, 0, :, :] = acc
    m_ref[0, 0, 0, :] = m.reshape(rows)  # reshape, not m[:, 0]: Triton has no slice lowering
    l_ref[0, 0, 0, :] = l.reshape(rows)


@functools.partial(jax.jit, static_argnames=("interpret", "blocks_per_split"))
def decode_attention(q: jax.Array, k_cache, v_cache, lengths: jax.Array,
                     block_tables: jax.Array, *, interpret: bool = False,
                     blocks_per_split: int = 16) -> jax.Array:
    """q [S, H, 128] f32 -> [S, H, 128] f32: attention over each sequence's first
    `lengths[s]` positions of the paged slab (module docstring); the caches are BF16 arrays
    or QuantizedKV planes."""
    from jax.experimental.pallas import triton as pltriton

    s, h, d = q.shape
    g = h // KV_HEADS
    rows = max(16, pl.next_power_of_2(g))
    bps = min(blocks_per_split, block_tables.shape[1])
    splits = pl.cdiv(block_tables.shape[1], bps)
    qg = jnp.pad(q.reshape(s, KV_HEADS, g, d), ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    qg = qg.astype(jnp.bfloat16)  # the tensor cores' operand type
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j, c: (0,) * a.ndim)  # noqa: E731
    part = (s, KV_HEADS, splits, rows)
    slab = kv_refs(k_cache, v_cache)
    acc, m, l = pl.pallas_call(
        functools.partial(_decode_kernel, blocks_per_split=bps),
        out_shape=(jax.ShapeDtypeStruct(part + (d,), jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32)),
        grid=(s, KV_HEADS, splits),
        in_specs=[whole(block_tables), whole(lengths),
                  pl.BlockSpec((1, 1, rows, d), lambda i, j, c: (i, j, 0, 0)),
                  *[whole(a) for a in slab]],
        out_specs=(pl.BlockSpec((1, 1, 1, rows, d), lambda i, j, c: (i, j, c, 0, 0)),
                   pl.BlockSpec((1, 1, 1, rows), lambda i, j, c: (i, j, c, 0)),
                   pl.BlockSpec((1, 1, 1, rows), lambda i, j, c: (i, j, c, 0))),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="kipp_decode_attention",
    )(block_tables, lengths, qg, *slab)
    return _merge_splits(acc, m, l)[:, :, :g].reshape(s, h, d)


def _merge_splits(acc, m, l):
    """Combine split partials [S, 8, splits, rows(, 128)] into [S, 8, rows, 128]."""
    top = jnp.max(m, axis=2, keepdims=True)
    weight = jnp.exp(m - top)  # [S, 8, splits, rows]; empty splits: exp(MASKED - top) = 0
    total = jnp.sum(acc * weight[..., None], axis=2)
    denominator = jnp.sum(l * weight, axis=2)[..., None]
    return total / jnp.maximum(denominator, 1e-30)


def decode_attention_reference(q: jax.Array, k_cache, v_cache, lengths: jax.Array,
                               block_tables: jax.Array) -> jax.Array:
    """The jax.numpy twin: the general paged attention with one query at position length-1."""
    out = paged_attention_reference(q[:, None], k_cache, v_cache, (lengths - 1)[:, None],
                                    block_tables)
    return out[:, 0]
