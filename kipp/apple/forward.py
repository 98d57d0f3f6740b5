"""Qwen3's forward pass on MLX for one packed round, and the dispatcher between kernels and twins.

The nine steps of kipp.reference in order, float32 activations: (1) RMSNorm; (2) Q, K, V
projections; (3) per-head RMSNorm on Q and K; (4) RoPE (rotate-half, the reference's own float64
angle tables); (5) store this round's K and V in the slab, then causal GQA over the paged
slab, per piece; (6) output projection and residual; (7) RMSNorm; (8) down(SiLU(gate(x)) *
up(x)); (9) residual. Then the final RMSNorm and the output head for the requested rows only.

A round packs one piece (a prefill chunk or a decode token) of each item: every projection
runs once over all the round's tokens, so the weights are read once per step for every
sequence in it. MLX is lazy: `step` only builds the graph; the backend evaluates the logits
and the slab together.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kipp.apple import attention, linear
from kipp.apple.kvcache import KVSlab
from kipp.apple.layout import Linear
from kipp.formats.registry import HEAD_DIM, KV_HEADS, RMS_NORM_EPS


def kernel_name(rows: int, fmt: str) -> str:
    """The linear kernel variant a call of `rows` tokens in weight format `fmt` runs."""
    return f"{'matvec' if rows <= linear.MATVEC_ROWS else 'matmul'}/{fmt}"


@dataclass
class Ops:
    """How projections and attention run: Metal kernels or MLX-op twins (kipp.apple.select),
    and on the kernel path, the kernel variants that failed their probe and run their twins."""

    kernels: bool
    stream_count: int = 1  # twin projections: one shard per CPU stream
    runner: object = None  # who runs the kernels' Metal source (kipp.apple.metal; None: MLX)
    twins: frozenset = frozenset()  # kernel variants replaced by twins ("matvec/q8_0", ...)
    kv_heads: int = KV_HEADS  # KV heads this process holds (fewer on a tensor-parallel rank)

    @property
    def streams(self) -> tuple:
        """This thread's CPU streams: MLX binds a stream to the thread that made it, and a
        server evaluates on its own threads."""
        return thread_streams(self.stream_count)

    def linear(self, x: mx.array, w: Linear) -> mx.array:
        if not self.kernels:
            return linear.linear_twin(x, w, self.streams)
        if kernel_name(x.shape[0], w.fmt) in self.twins:
            return linear.planes_twin(x, w)
        return linear.linear_kernel(x, w, self.runner)

    def qkv(self, h: mx.array, p: dict) -> tuple[mx.array, mx.array, mx.array]:
        """Q [T, H * 128], K and V [T, 8 * 128]: three kernel calls, or one stacked twin."""
        if self.kernels:
            return self.linear(h, p["q"]), self.linear(h, p["k"]), self.linear(h, p["v"])
        qkv = self.linear(h, p["qkv"])
        kv = self.kv_heads * HEAD_DIM
        return mx.split(qkv, [qkv.shape[-1] - 2 * kv, qkv.shape[-1] - kv], axis=-1)

    def ffn(self, h: mx.array, p: dict) -> mx.array:
        """down(SiLU(gate(h)) * up(h))."""
        if self.kernels:
            gate = self.linear(h, p["gate"])
            return self.linear(gate / (1.0 + mx.exp(-gate)) * self.linear(h, p["up"]), p["down"])
        return linear.ffn_twin(h, p["ffn"], self.streams)

    def ffn_lora(self, h: mx.array, p: dict, lora: dict, rows: mx.array) -> mx.array:
        """ffn with the LoRA terms of gate, up and down (kipp.apple.linear.low_rank)."""
        if not self.kernels:
            return linear.ffn_twin_lora(h, p["ffn"], lora, rows, self.streams)
        gate = linear.plus(self.linear(h, p["gate"]), linear.low_rank(h, lora.get("gate"), rows))
        up = linear.plus(self.linear(h, p["up"]), linear.low_rank(h, lora.get("up"), rows))
        act = gate / (1.0 + mx.exp(-gate)) * up
        return linear.plus(self.linear(act, p["down"]), linear.low_rank(act, lora.get("down"),
                                                                        rows))

    def attention(self, q, k: KVSlab, v: KVSlab, layer: int, r: "Round") -> mx.array:
        """q [T, H, 128] of the round -> [T, H * 128]."""
        if self.kernels and r.decode_only and f"decode_attention/{k.scheme}" not in self.twins:
            planes = k.kernel_planes(layer) + v.kernel_planes(layer)
            return attention.decode_attention(q, planes, r.tables, r.lengths, k.scheme,
                                              runner=self.runner)
        outs = []
        for row, n, visible in r.pieces:
            keys, values = k.rows(layer, visible), v.rows(layer, visible)
            outs.append(attention.attention_twin(q[row:row + n], keys, values, self.streams))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


_THREAD = threading.local()


def thread_streams(n: int) -> tuple:
    """n CPU streams (each its own worker thread in MLX), made once per calling thread;
    (None,), the default stream, for one."""
    if n <= 1:
        return (None,)
    made = getattr(_THREAD, "streams", None)
    if made is None:
        made = _THREAD.streams = {}
    if n not in made:
        made[n] = tuple(mx.new_stream(mx.cpu) for _ in range(n))
    return made[n]


@dataclass
class Round:
    """One round's inputs as MLX arrays (built by kipp.apple.backend.pack_round)."""

    x: mx.array  # [T, hidden] float32 embeddings
    cos: mx.array  # [T, 128]
    sin: mx.array  # [T, 128]
    slots: mx.array  # [T] int32: slab rows this round's K/V go to
    pieces: list  # (first token row, tokens, visible slots int32 [P]) per piece
    logit_rows: mx.array  # [R] int32 token rows whose logits are returned
    decode_only: bool  # every piece is one token (the decode kernel's case)
    tables: mx.array | None = None  # [S, B] int32, decode rounds only
    lengths: mx.array | None = None  # [S] int32, decode rounds only
    adapter_rows: mx.array | None = None  # [T, N] one-hot index into adapter_active
    adapter_active: mx.array | None = None  # [N] stacked LoRA slots the round reads
    adapter_rank: int = 0  # the stacked ranks it reads (the largest of its adapters')


@dataclass
class Weights:
    layers: list  # per layer: norms, and Linear / SplitFFN weights (backend._prepare's keys)
    output_norm: mx.array
    head: Linear
    # per layer {projection: (A [S, r, in], B^T [S, r, out])} of the loaded LoRA adapters
    lora: list | None = None


def rms_norm(x: mx.array, weight: mx.array) -> mx.array:
    return mx.fast.rms_norm(x, weight, RMS_NORM_EPS)


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x [T, heads, 128]; cos, sin [T, 128]: rotate-half (NEOX) pairs (i, i + 64)."""
    half = HEAD_DIM // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def step(w: Weights, k: KVSlab, v: KVSlab, r: Round, ops: Ops) -> mx.array:
    """The round's logits [R, vocab] float32 (lazy); stores the round's K/V in the slabs."""
    return head(w, layers(w, k, v, r, ops, r.x), r, ops)


def layers(w: Weights, k: KVSlab, v: KVSlab, r: Round, ops: Ops, x: mx.array,
           reduce=None) -> mx.array:
    """The hidden state [T, hidden] after this process's layers (w.layers; the slabs hold
    just those), from `x`. `reduce` adds a block's partial output over the tensor-parallel
    ranks (kipp.apple.distributed); None: the output is whole."""
    for index, layer in enumerate(w.layers):
        lora = (_round_lora(w.lora[index], r) if w.lora is not None
                and r.adapter_rows is not None else None)
        x = _layer(index, layer, x, k, v, r, ops, lora, reduce)
    return x


def head(w: Weights, x: mx.array, r: Round, ops: Ops) -> mx.array:
    """The final norm and the output head for the round's logit rows: [R, vocab]."""
    h = rms_norm(x[r.logit_rows], w.output_norm)
    return ops.linear(h, w.head)


def _round_lora(layer: dict, r: Round) -> dict:
    """One layer's stacked adapters {projection: (A [S, R, in], B^T [S, R, out])} cut to the
    round's: its slots and ranks only ([N, rank, in], [N, rank, out])."""
    sel, rank = r.adapter_active, r.adapter_rank
    return {name: (a[sel, :rank], b[sel, :rank]) for name, (a, b) in layer.items()}


def _layer(index: int, p: dict, x, k: KVSlab, v: KVSlab, r: Round, ops: Ops, lora=None,
           reduce=None):
    """One layer; `lora`: this layer's adapters (Weights.lora), their rows in r.adapter_rows."""
    reduce = reduce or (lambda y: y)
    x = x + reduce(attention_out(index, p, x, k, v, r, ops, lora))           # (6)
    return x + reduce(ffn_out(p, x, r, ops, lora))                           # (9)


def _adapted(y, x, name, lora, r: Round):
    """W x + s * B (A x) for the rows of each adapter."""
    return y if lora is None else linear.plus(y, linear.low_rank(x, lora.get(name),
                                                                 r.adapter_rows))


def attention_out(index: int, p: dict, x, k: KVSlab, v: KVSlab, r: Round, ops: Ops,
                  lora=None) -> mx.array:
    """Steps (1) to (6) but the residual: the output projection of the layer's attention
    (over this process's heads only on a tensor-parallel rank: a partial sum)."""
    t = x.shape[0]
    h = rms_norm(x, p["attn_norm"])                                             # (1)
    q, kk, vv = ops.qkv(h, p)                                                   # (2)
    q, kk, vv = (_adapted(q, h, "q", lora, r), _adapted(kk, h, "k", lora, r),
                 _adapted(vv, h, "v", lora, r))
    q = q.reshape(t, -1, HEAD_DIM)                                              # [T, H, 128]
    kk, vv = kk.reshape(t, -1, HEAD_DIM), vv.reshape(t, -1, HEAD_DIM)           # [T, 8, 128]
    q = apply_rope(rms_norm(q, p["q_norm"]), r.cos, r.sin)                      # (3), (4)
    kk = apply_rope(rms_norm(kk, p["k_norm"]), r.cos, r.sin)
    k.store(index, kk, r.slots)                                                 # (5)
    v.store(index, vv, r.slots)
    attn = ops.attention(q, k, v, index, r)                                     # [T, H * 128]
    return _adapted(ops.linear(attn, p["o"]), attn, "o", lora, r)


def ffn_out(p: dict, x, r: Round, ops: Ops, lora=None) -> mx.array:
    """Steps (7) and (8): the feed-forward block's output (a partial sum on a rank)."""
    h = rms_norm(x, p["ffn_norm"])                                              # (7)
    if lora is not None and any(name in lora for name in ("gate", "up", "down")):
        return ops.ffn_lora(h, p, lora, r.adapter_rows)                         # (8)
    return ops.ffn(h, p)


def as_int32(values) -> mx.array:
    return mx.array(np.asarray(values, np.int32))
