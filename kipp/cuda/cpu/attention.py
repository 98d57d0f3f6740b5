"""Attention on XLA's CPU through Kipp's own kernel, read straight from the paged BF16 slab: one
query per sequence (decode_attention) or several (attention: prefill chunks, mixed rounds).

Why: the jax.numpy twin (kipp.cuda.pallas.prefill_attention.paged_attention_reference) gathers
every sequence's rows, widens them and runs two batched dots over every position, masked or
not, which on XLA's CPU made a batched decode step grow with context (the batch-scaling
records, bench/results/*-batch_scaling-*.json) and a 512-token prefill spend more time in
attention than in its matmuls. The kernel (attention.cc, an XLA FFI handler in the library
kipp.cuda.cpu.matmul builds) takes one sequence, one KV head and up to 32 queries per unit of
work, reads each K and V row a query sees once for all the query heads that share it, and
skips the masked ones. The JAX backend's twins use it on one CPU device for every round over a
BF16 slab; float32 like the twin, summed in another order (tests/test_cpu_attention.py), a
query's bits the same in a prefill chunk as in a decode round. `available()` says why when it
cannot be built; KIPP_JAX_CPU_ATTENTION=0 turns it off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kipp.cuda.cpu import matmul as cpu_matmul

TARGET = "kipp_cpu_decode_attention"
PREFILL_TARGET = "kipp_cpu_attention"
ENV = "KIPP_JAX_CPU_ATTENTION"


def available() -> tuple[bool, str]:
    """(True, how it was built) once the kernel is registered with XLA, else (False, why)."""
    return cpu_matmul.library(ENV)


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     query_pos: jax.Array, block_tables: jax.Array, layer=None) -> jax.Array:
    """One query per sequence: q [S, H, 128] float32 at position query_pos [S] (-1 for a
    padding row: zeros) over positions 0..query_pos of its sequence, read through
    block_tables [S, B] from the slab's K and V, uint16 BF16 bits [blocks, 32, 8, 128] (or
    stacked [layers, blocks, 32, 8, 128], read at `layer`) -> [S, H, 128] float32."""
    return _call(TARGET, q, k_cache, v_cache, query_pos, block_tables, layer)


def attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, query_pos: jax.Array,
              block_tables: jax.Array, layer=None) -> jax.Array:
    """Several queries per sequence (a prefill chunk, or a round mixing chunks and decode
    rows): q [S, Tq, H, 128] float32 at positions query_pos [S, Tq] (-1: padding, zeros), each
    over positions 0..its own of its sequence, as decode_attention reads them -> [S, Tq, H,
    128] float32. A query's result is bitwise decode_attention's for it at that position."""
    return _call(PREFILL_TARGET, q, k_cache, v_cache, query_pos, block_tables, layer)


def _call(target, q, k_cache, v_cache, query_pos, block_tables, layer):
    ok, why = cpu_matmul.library()  # built and registered (the switch is the backend's choice)
    if not ok:
        raise RuntimeError(f"Kipp's CPU attention is unavailable: {why}")
    if layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    i32 = jnp.int32
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k_cache, v_cache, jnp.asarray(layer, i32).reshape(1),
        query_pos.astype(i32), block_tables.astype(i32))
