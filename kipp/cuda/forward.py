"""Qwen3's forward pass as one jitted step over a packed round, in jax.numpy.

The nine steps of kipp.reference, in order, on float32 activations: (1) RMSNorm; (2) Q, K, V
projections; (3) per-head RMSNorm on Q and K; (4) RoPE; (5) store this round's K and V in the
slab, then causal GQA over the paged slab; (6) output projection and residual; (7) RMSNorm;
(8) down(SiLU(gate(x)) * up(x)); (9) residual. Then the final RMSNorm and the output head for
the requested rows only.

`Ops` decides how projections and attention run: Pallas kernels (a GPU, or interpret mode in
tests) or their jax.numpy twins, and on one CPU device Kipp's CPU kernels (kipp.cuda.cpu). The
slab (kipp.cuda.kvcache) is donated to the step, so XLA updates it in place. When the
parameters' "layers" are stacked (a dict of `[layers, ...]` arrays, kipp.cuda.layout) the slab
is one stacked (K, V) pair and the step is a `lax.scan` of one layer, the slab carried through.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from kipp.cuda import twin_matmul
from kipp.cuda.cpu import attention as cpu_attention
from kipp.cuda.cpu import matmul as cpu_matmul
from kipp.cuda.cpu import stored_matmul as cpu_stored
from kipp.cuda.kvcache import QuantizedKV, store_kv
from kipp.cuda.layout import Linear, widen_bf16
from kipp.cuda.pallas import decode_attention as decode_mod
from kipp.cuda.pallas import prefill_attention as prefill_mod
from kipp.cuda.pallas import quant_matmul as matmul_mod
from kipp.cuda.rounds import RoundArrays
from kipp.formats.registry import HEAD_DIM, KV_HEADS, RMS_NORM_EPS


@dataclass(frozen=True)
class Ops:
    """How the step runs its projections and attention (hashable: part of the program key)."""

    kernels: bool = False  # Pallas kernels instead of the jax.numpy twins
    interpret: bool = False  # run the kernels in Pallas interpret mode (CPU tests)
    twins: frozenset = frozenset()  # kernel variants that failed their probe (kipp.cuda.probe)
    cpu_attention: bool = False  # twins' attention on Kipp's CPU kernel (one CPU device)
    cpu_stored: bool = False  # twins' stored-format projections on Kipp's CPU matmul (one CPU)
    cpu_dot: str = "f32"  # that matmul's dots (kipp.cuda.cpu.stored_matmul.dots), fixed at load
    pipeline: object = None  # a Mesh with a "pp" axis: stacked layers in stages (_pipeline)

    def linear(self, x: jax.Array, w: Linear, head: bool = False, layer=None) -> jax.Array:
        """x @ w^T; `layer`: w is stacked over layers and read at that layer by Kipp's CPU
        kernels (the scanned step, `reads_stacked`); every other weight arrives sliced."""
        if w.fmt == "f32p":  # the CPU layout: only Kipp's CPU matmul reads panels
            return cpu_matmul.matmul(x, w.w, layer)
        if self.cpu_stored and w.fmt in cpu_stored.FORMATS:  # the stored planes, on a CPU
            return cpu_stored.matmul(x, w, layer, self.cpu_dot)
        # Interpret mode pays per program: the 151,936-row head would take minutes, so there
        # it runs its twin (the BF16 kernel is checked on its own in the kernel tests).
        if self.kernels and not (head and self.interpret) and \
                kernel_name(x.shape[0], w.fmt) not in self.twins:
            return matmul_mod.quant_matmul(x, w, interpret=self.interpret)
        return twin_matmul.linear(x, w)  # quant_matmul_reference, widening chunk by chunk

    def reads_stacked(self, w) -> bool:
        """Whether `linear` takes weight `w` stacked over layers, with the layer index (Kipp's
        CPU kernels index the stack; a slice of it would be copied first)."""
        return isinstance(w, Linear) and (
            w.fmt == "f32p" or (self.cpu_stored and w.fmt in cpu_stored.FORMATS))

    def attention(self, q, k_cache, v_cache, r: RoundArrays, layer=None) -> jax.Array:
        """q [S, Tq, H, 128] -> [S, Tq, H, 128] over the paged slab (layer `layer` of a
        stacked one: the twins only)."""
        kind = "decode_attention" if q.shape[1] == 1 else "prefill_attention"
        kv = "q8_0" if isinstance(k_cache, QuantizedKV) else "bf16"
        if not self.kernels or f"{kind}/{kv}" in self.twins:
            if self.cpu_attention and kv == "bf16" and k_cache.dtype == jnp.uint16:
                if q.shape[1] == 1:  # a decode round over the CPU's BF16 bits
                    return cpu_attention.decode_attention(q[:, 0], k_cache, v_cache,
                                                          r.query_pos[:, 0], r.block_tables,
                                                          layer)[:, None]
                return cpu_attention.attention(q, k_cache, v_cache, r.query_pos,
                                               r.block_tables, layer)
            return prefill_mod.paged_attention_reference(q, k_cache, v_cache, r.query_pos,
                                                         r.block_tables, layer)
        if layer is not None:
            raise ValueError("the attention kernels take one layer's slab, not a stacked one")
        if q.shape[1] == 1:  # a decode-only round
            out = decode_mod.decode_attention(q[:, 0], k_cache, v_cache, r.query_pos[:, 0] + 1,
                                              r.block_tables, interpret=self.interpret)
            return out[:, None]
        return prefill_mod.prefill_attention(q, k_cache, v_cache, r.query_pos, r.block_tables,
                                             interpret=self.interpret)


def kernel_name(rows: int, fmt: str) -> str:
    """The quant_matmul variant a call of `rows` rows in weight format `fmt` runs: the
    multiply-reduce body for a few rows, the tile dot otherwise."""
    return f"{'matvec' if rows <= matmul_mod.MATVEC_ROWS else 'matmul'}/{fmt}"


def rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    mean_square = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * (1.0 / jnp.sqrt(mean_square + jnp.float32(RMS_NORM_EPS))) * weight


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, 128]; cos, sin [T, 128]: rotate-half (NEOX) pairs (i, i + 64)."""
    half = HEAD_DIM // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def step(params, kv, rope, r: RoundArrays, *, ops: Ops, lora_rank: int = 0):
    """One round: (logits [R, vocab] float32, the updated KV slab). `lora_rank`: the ranks of
    the stacked LoRA adapters this round reads (the largest of r.adapter_active's)."""
    x = _embed(params["embed"], r.tokens)  # [T, hidden]
    cos, sin = rope[0][r.positions], rope[1][r.positions]  # [T, 128]
    lora = _round_lora(params.get("lora"), r, lora_rank)
    if isinstance(params["layers"], dict) and ops.pipeline is not None:
        x, new_kv = _pipeline(x, params["layers"], kv, cos, sin, r, ops)
    elif isinstance(params["layers"], dict):  # stacked layers: one layer's code, scanned
        x, new_kv = _scanned(x, params["layers"], kv, cos, sin, r, ops, lora)
    else:
        new_kv = []
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(params["layers"], kv)):
            x, k_cache, v_cache = _layer(x, layer, k_cache, v_cache, cos, sin, r, ops,
                                         lora=_lora_at(lora, i))
            new_kv.append((k_cache, v_cache))
        new_kv = tuple(new_kv)
    h = rms_norm(x[r.logit_rows], params["output_norm"])  # [R, hidden]
    return ops.linear(h, _head(params), head=True), new_kv


def _round_lora(lora, r: RoundArrays, rank: int):
    """The round's view of the stacked LoRA adapters {projection: (A [layers, S, R, in],
    B^T [layers, S, R, out])}: "active" (the slots it reads), "rank" (the ranks it reads) and
    "rows" (each token's one-hot index into active [T, N], all zero: the base weights); None
    when no item of the round names an adapter, so the base alone reads none of them."""
    if lora is None or r.adapter_active.shape[0] == 0:
        return None
    n = r.adapter_active.shape[0]
    rows = (r.adapter_slots[:, None] == jnp.arange(n)).astype(jnp.float32)
    return {"weights": lora, "active": r.adapter_active, "rank": rank, "rows": rows}


def _lora_at(lora, i):
    """Layer i's {projection: (A [N, rank, in], B^T [N, rank, out])} of the round's adapters,
    with "rows"; or None."""
    if lora is None:
        return None
    sel, rank = lora["active"], lora["rank"]
    # one gather each, of only the round's slots and ranks (no copy of the layer's whole stack)
    layer = {name: (a[i, sel, :rank], b[i, sel, :rank])
             for name, (a, b) in lora["weights"].items()}
    return dict(layer, rows=lora["rows"])


def _scanned(x, layers, kv, cos, sin, r: RoundArrays, ops: Ops, lora=None):
    """Every stacked layer in order, one layer's code scanned: (x, the updated (K, V))."""
    def body(carry, i):
        x, k_cache, v_cache = carry
        # Kipp's CPU matmuls index a stacked weight themselves; the rest is sliced
        p = {name: w if ops.reads_stacked(w) else jax.tree.map(lambda a: a[i], w)
             for name, w in layers.items()}
        return _layer(x, p, k_cache, v_cache, cos, sin, r, ops, layer=i,
                      lora=_lora_at(lora, i)), None

    count = jax.tree.leaves(layers)[0].shape[0]
    (x, k_cache, v_cache), _ = jax.lax.scan(body, (x, *kv), jnp.arange(count))
    return x, (k_cache, v_cache)


def _pipeline(x, layers, kv, cos, sin, r: RoundArrays, ops: Ops):
    """Pipeline parallel: the stacked layers and slab split into contiguous ranges over the
    mesh's "pp" axis (kipp.cuda.sharding.PIPELINE). Stage s runs its range when the hidden
    state reaches it (a `cond`: the other stages stream no weights meanwhile), then
    `ppermute` hands the state to stage s + 1; the last stage's output is shared with every
    stage (a psum of it and zeros: exact) for the final norm and head."""
    from jax.sharding import PartitionSpec as P

    mesh = ops.pipeline
    stages = mesh.shape["pp"]

    def stage(x, layers, kv, cos, sin, r):
        me = jax.lax.axis_index("pp")

        def run(x, kv):
            return _scanned(x, layers, kv, cos, sin, r, ops)

        for s in range(stages):
            x, kv = jax.lax.cond(me == s, run, lambda x, kv: (x, kv), x, kv)
            if s < stages - 1:
                x = jax.lax.ppermute(x, "pp", [(j, j + 1) for j in range(stages - 1)])
        x = jax.lax.psum(jnp.where(me == stages - 1, x, jnp.zeros_like(x)), "pp")
        return x, kv

    stacked = jax.tree.map(lambda _: P("pp"), (layers, kv))
    return jax.shard_map(stage, mesh=mesh, axis_names={"pp"}, check_vma=False,
                         in_specs=(P(), stacked[0], stacked[1], P(), P(), P()),
                         out_specs=(P(), stacked[1]))(x, layers, kv, cos, sin, r)


def _embed(table, tokens: jax.Array) -> jax.Array:
    """Embedding rows [T, hidden] float32 of a [vocab, hidden] table or the tied head's panels."""
    if isinstance(table, Linear):
        return cpu_matmul.rows(table.w, tokens)
    return widen_bf16(table[tokens])


def _head(params) -> Linear:
    head = params["head"] if params["head"] is not None else params["embed"]
    if isinstance(head, Linear):  # the panels layout (kipp.cuda.cpu.matmul)
        return head
    fmt = "f32" if head.dtype == jnp.float32 else "bf16"  # BF16, or its bits (uint16)
    return Linear(head, fmt=fmt)


def _layer(x, p, k_cache, v_cache, cos, sin, r: RoundArrays, ops: Ops, layer=None,
           lora=None):
    """One layer; `layer`: its index into stacked slabs (the scanned step), else the slabs are
    this layer's own. `lora`: this layer's adapters (step's lora_at), or None."""
    t = x.shape[0]

    def linear(x, name):
        y = ops.linear(x, p[name], layer=layer)
        if lora is not None and name in lora:  # W x + s * B (A x), the slot's adapter per row
            y = y + low_rank(x, *lora[name], lora["rows"])
        return y

    h = rms_norm(x, p["attn_norm"])                                        # (1)
    q = linear(h, "q").reshape(t, -1, HEAD_DIM)                             # (2) [T, H, 128]
    k = linear(h, "k").reshape(t, KV_HEADS, HEAD_DIM)                       #     [T, 8, 128]
    v = linear(h, "v").reshape(t, KV_HEADS, HEAD_DIM)
    q = apply_rope(rms_norm(q, p["q_norm"]), cos, sin)                      # (3), (4)
    k = apply_rope(rms_norm(k, p["k_norm"]), cos, sin)
    k_cache = store_kv(k_cache, k, r.slots, layer)                          # (5)
    v_cache = store_kv(v_cache, v, r.slots, layer)
    grouped = q[r.query_index]                                              # [S, Tq, H, 128]
    attn = ops.attention(grouped, k_cache, v_cache, r, layer)
    attn = attn.reshape(-1, q.shape[1] * HEAD_DIM)[r.token_query]           # [T, H * 128]
    x = x + linear(attn, "o")                                               # (6)
    h = rms_norm(x, p["ffn_norm"])                                          # (7)
    ffn = _silu(linear(h, "gate")) * linear(h, "up")                        # (8)
    return x + linear(ffn, "down"), k_cache, v_cache                        # (9)


def low_rank(x, a, b, rows) -> jax.Array:
    """s * B (A x) of each row's adapter: x [T, in], a [N, r, in], b = B^T [N, r, out] (s folded
    in) of the round's N adapters, rows [T, N] one-hot (all zero: the base weights). Each of
    the N adapters' A x is computed and masked (N is small), float32 at full precision, never
    TF32 or BF16 passes."""
    highest = jax.lax.Precision.HIGHEST
    xa = jnp.einsum("ti,sri->tsr", x, a, precision=highest) * rows[:, :, None]  # [T, S, r]
    return jnp.einsum("tsr,sro->to", xa, b, precision=highest)


def _silu(x: jax.Array) -> jax.Array:
    return x / (1.0 + jnp.exp(-x))
