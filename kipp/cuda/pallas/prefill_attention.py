"""Causal grouped-query attention of a round's queries over the paged KV slab (prefill chunks,
and the general case of any number of queries per sequence).

Queries come grouped by sequence, `q [S, Tq, H, 128]`, each with its position (`query_pos`, -1
for padding); K and V are read from one layer's slab `[blocks, 32, 8, 128]` through each
sequence's block table, position p at `block_tables[s, p // 32] * 32 + p % 32`. A query at
position p sees positions 0..p of its own sequence (the step stores this round's K and V first).

Kernel: Pallas, Triton lowering (kipp.cuda.pallas.quant_matmul says why). One program per
(sequence, KV head, tile of `block_q` queries) walks the sequence's KV blocks up to its last
query with an online softmax (flash attention); the query heads sharing the KV head are folded
into the tile, so each KV tile is read once per group. A q8_0 slab's tiles are dequantized right
after loading (`kv_tile`). Both dots (`attend_block`) take BF16 operands on the tensor cores with
float32 accumulation, as flash attention does; the softmax stays float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kipp.backend import KV_BLOCK
from kipp.cuda.kvcache import QuantizedKV, dequantize_kv, kv_rows
from kipp.formats.registry import HEAD_DIM, KV_HEADS

HIGHEST = jax.lax.Precision.HIGHEST
SCALE = HEAD_DIM ** -0.5
MASKED = -1e30  # a finite "minus infinity": fully masked padding rows stay finite
# Decode rounds on the twin score every query head against every KV head's rows up to this many
# scores (16 MiB of float32): see _one_query_all_pairs.
ALL_PAIRS_MAX_SCORES = 1 << 22
ROWS = 64  # query rows (queries x group heads) per program: no spills at any registry shape


def kv_refs(k_cache, v_cache) -> tuple:
    """The slab arrays a kernel takes for one layer's K and V (see kv_tile)."""
    if isinstance(k_cache, QuantizedKV):
        return (k_cache.q, k_cache.d, v_cache.q, v_cache.d)
    return (k_cache, v_cache)


def kv_tile(refs, bid, h) -> tuple[jax.Array, jax.Array]:
    """K and V tiles [32, 128] BF16 of block `bid`, KV head `h`, from `kv_refs`' refs, as the
    tensor-core dots take them: (k, v) [blocks, 32, 8, 128] bf16 (or its uint16 bits in
    interpret mode on a CPU), or (k_q, k_d, v_q, v_d) with q int8 [blocks, 32, 8, 128] and d
    fp16 [blocks, 32, 8, 4], dequantized exactly in float32, then rounded to BF16."""
    if len(refs) == 2:
        return _as_bf16(refs[0][bid, :, h, :]), _as_bf16(refs[1][bid, :, h, :])
    k_q, k_d, v_q, v_d = refs
    return (dequantize_kv(k_q[bid, :, h, :], k_d[bid, :, h, :]).astype(jnp.bfloat16),
            dequantize_kv(v_q[bid, :, h, :], v_d[bid, :, h, :]).astype(jnp.bfloat16))


def _as_bf16(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return x


def attend_block(q, k, v, visible, carry):
    """One online-softmax step over a 32-position KV block: q [rows, 128] BF16, k and v
    [32, 128] BF16, visible [rows, 32] bool; carry (acc [rows, 128], max [rows, 1], denominator
    [rows, 1]) float32. Both dots are BF16 tensor-core dots accumulating in float32; the
    probabilities are rounded to BF16 for the second, as flash attention does."""
    acc, m, l = carry
    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32) * SCALE
    scores = jnp.where(visible, scores, MASKED)  # [rows, 32]
    m_new = jnp.maximum(m, jnp.max(scores, axis=1, keepdims=True))
    p = jnp.exp(scores - m_new)
    alpha = jnp.exp(m - m_new)
    acc = acc * alpha + jnp.dot(p.astype(jnp.bfloat16), v, preferred_element_type=jnp.float32)
    return acc, m_new, l * alpha + jnp.sum(p, axis=1, keepdims=True)


def _prefill_kernel(tables_ref,  # [S, B] int32 block tables
                    pos_ref,  # [1, bq] int32: positions of this tile's queries (-1: padding)
                    q_ref,  # [1, bq, 1, g, 128] bfloat16
                    *refs,  # kv_refs (one layer's K and V slab), then o_ref [1, bq, 1, g, 128]
                    ):
    *kv, o_ref = refs
    s, h = pl.program_id(0), pl.program_id(1)
    bq, g = q_ref.shape[1], q_ref.shape[3]
    rows = bq * g
    q = q_ref[0, :, 0, :, :].reshape(rows, HEAD_DIM)  # [rows, 128]
    pos = jnp.broadcast_to(pos_ref[0, :][:, None], (bq, g)).reshape(rows, 1)  # [rows, 1]
    last = jnp.max(pos_ref[0, :])
    offsets = jax.lax.broadcasted_iota(jnp.int32, (1, KV_BLOCK), 1)  # [1, 32]

    def block(j, carry):
        k, v = kv_tile(kv, tables_ref[s, j], h)  # [32, 128] each
        return attend_block(q, k, v, j * KV_BLOCK + offsets <= pos, carry)

    init = (jnp.zeros((rows, HEAD_DIM), jnp.float32), jnp.full((rows, 1), MASKED, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32))
    # blocks covering positions 0..last (none for an all-padding tile, last = -1)
    acc, _, l = jax.lax.fori_loop(0, jax.lax.div(last + KV_BLOCK, KV_BLOCK), block, init)
    out = acc / jnp.maximum(l, 1e-30)
    o_ref[0, :, 0, :, :] = out.reshape(bq, g, HEAD_DIM)


@functools.partial(jax.jit, static_argnames=("interpret", "block_q"))
def prefill_attention(q: jax.Array, k_cache, v_cache, query_pos: jax.Array,
                      block_tables: jax.Array, *, interpret: bool = False,
                      block_q: int | None = None) -> jax.Array:
    """q [S, Tq, H, 128] f32 -> [S, Tq, H, 128] f32 over the paged slab (module docstring);
    the caches are BF16 arrays or QuantizedKV planes."""
    from jax.experimental.pallas import triton as pltriton

    s, tq, h, d = q.shape
    g = h // KV_HEADS
    gp = pl.next_power_of_2(g)  # Triton tiles are powers of two: pad the group
    # rows = queries x group: about ROWS per tile (the float32 accumulator [rows, 128] is 64
    # registers per thread at 4 warps), and >= 16, the minimum of Triton's dot
    bq = max(min(block_q or max(1, ROWS // gp), pl.next_power_of_2(tq)), 16 // min(gp, 16))
    tq_pad = pl.cdiv(tq, bq) * bq
    qg = q.reshape(s, tq, KV_HEADS, g, d)
    qg = jnp.pad(qg, ((0, 0), (0, tq_pad - tq), (0, 0), (0, gp - g), (0, 0)))
    qg = qg.astype(jnp.bfloat16)  # the tensor cores' operand type (`attend_block`)
    pos = jnp.pad(query_pos, ((0, 0), (0, tq_pad - tq)), constant_values=-1)
    tile = pl.BlockSpec((1, bq, 1, gp, d), lambda i, j, t: (i, t, j, 0, 0))
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j, t: (0,) * a.ndim)  # noqa: E731
    slab = kv_refs(k_cache, v_cache)
    out = pl.pallas_call(
        _prefill_kernel,
        out_shape=jax.ShapeDtypeStruct(qg.shape, jnp.float32),
        grid=(s, KV_HEADS, tq_pad // bq),
        in_specs=[whole(block_tables), pl.BlockSpec((1, bq), lambda i, j, t: (i, t)), tile,
                  *[whole(a) for a in slab]],
        out_specs=tile,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="kipp_prefill_attention",
    )(block_tables, pos, qg, *slab)
    return out[:, :tq, :, :g].reshape(s, tq, h, d)


def paged_attention_reference(q: jax.Array, k_cache, v_cache, query_pos: jax.Array,
                              block_tables: jax.Array, layer=None) -> jax.Array:
    """The jax.numpy twin: gather each sequence's blocks, mask causally, softmax, weigh V.

    q [S, Tq, H, 128] f32; caches [blocks, 32, 8, 128] BF16 (or its uint16 bits), or
    QuantizedKV planes (with `layer`: stacked [layers, blocks, ...], read at that layer);
    query_pos [S, Tq] (-1: padding); block_tables [S, B] -> [S, Tq, H, 128] f32.
    """
    s, tq, h, d = q.shape
    positions = block_tables.shape[1] * KV_BLOCK
    keys = kv_rows(k_cache, block_tables, layer).reshape(s, positions, KV_HEADS, d)
    values = kv_rows(v_cache, block_tables, layer).reshape(s, positions, KV_HEADS, d)
    if tq == 1 and s * h * positions * KV_HEADS <= ALL_PAIRS_MAX_SCORES:
        return _one_query_all_pairs(q, keys, values, query_pos)
    qg = q.reshape(s, tq, KV_HEADS, h // KV_HEADS, d)
    scores = jnp.einsum("sqkgd,spkd->skgqp", qg, keys, precision=HIGHEST) * jnp.float32(SCALE)
    visible = jnp.arange(positions)[None, None, :] <= query_pos[:, :, None]  # [S, Tq, P]
    scores = jnp.where(visible[:, None, None], scores, MASKED)
    scores = scores - jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("skgqp,spkd->sqkgd", weights, values, precision=HIGHEST)
    return out.reshape(s, tq, h, d)


def _one_query_all_pairs(q, keys, values, query_pos):
    """paged_attention_reference for one query per sequence, without transposing the gathered
    rows: the batched dots of the grouped form need keys and values as [S, KV head, P, 128],
    and the fusion that gathers, widens and transposes them on XLA's CPU was most of a batched
    decode step's growth with context (bench/results/*-batch_scaling-*.json).
    Here every query head meets the rows of all 8 KV heads in the slab's own order [S, P * 8,
    128], and a mask keeps each head's own KV head: 8x the products of a tiny dot, no copy.
    q [S, 1, H, 128]; keys, values [S, P, 8, 128] f32 -> [S, 1, H, 128]."""
    s, _, h, d = q.shape
    positions = keys.shape[1]
    rows = positions * KV_HEADS
    scores = jnp.einsum("sxd,sjd->sxj", q.reshape(s, h, d), keys.reshape(s, rows, d),
                        precision=HIGHEST) * jnp.float32(SCALE)  # [S, H, P * 8]
    scores = scores.reshape(s, KV_HEADS, h // KV_HEADS, positions, KV_HEADS)
    own = jnp.arange(KV_HEADS)[:, None] == jnp.arange(KV_HEADS)[None, :]  # [head's KV, row's]
    visible = jnp.arange(positions)[None, :] <= query_pos  # [S, P]
    keep = own[None, :, None, None, :] & visible[:, None, None, :, None]
    scores = jnp.where(keep, scores, MASKED)
    scores = scores - jnp.max(scores, axis=(3, 4), keepdims=True)
    weights = jnp.exp(scores)  # masked: exp(-1e30 - max) is exactly 0
    weights = weights / jnp.sum(weights, axis=(3, 4), keepdims=True)
    out = jnp.einsum("sxj,sjd->sxd", weights.reshape(s, h, rows), values.reshape(s, rows, d),
                     precision=HIGHEST)
    return out.reshape(s, 1, h, d)
