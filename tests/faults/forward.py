"""Faults in the forward pass and KV addressing, planted in the numpy reference backend.

The reference is the oracle the accelerated backends are held against, so its bugs are the
ones that would otherwise pass silently; the gates that catch them compare it with
`transformers` (an independent implementation) and the designed greedy rule of the synthetic
checkpoints (kipp.synthetic.circuit), and its cached decode with a full recompute.
"""

from __future__ import annotations

import numpy as np

from faults import Fault, register
from kipp.backend import KV_BLOCK, EvalItem
from kipp.formats.registry import HEAD_DIM, KV_HEADS
from kipp.reference import backend as reference
from kipp.reference import ops


def attention_variant(*, extra_visible: int = 0, exclude_self: bool = False,
                      store_decode: bool = True, read_slots=None, first_only: bool = False):
    """A copy of ReferenceBackend._attention with one change; with no change it is bitwise the
    original (tests/test_faults.py checks that, so the faults below stay faithful to it)."""
    read_slots = read_slots or EvalItem.slots

    def _attention(self, index, q, k, v, items, slots):
        out = np.empty((q.shape[0], q.shape[1] * HEAD_DIM), np.float32)
        row = 0
        for item in items:
            n = len(item.tokens)
            new = item.slots(item.start_position, item.end_position)
            if store_decode or n > 1:
                self.k_cache.store(index, new, k[row:row + n])
                self.v_cache.store(index, new, v[row:row + n])
            visible = read_slots(item, 0, item.end_position)
            keys = self.k_cache.load(index, visible)
            values = self.v_cache.load(index, visible)
            grouped = q[row:row + n].reshape(n, KV_HEADS, -1, HEAD_DIM)
            for i in range(n):
                stop = item.start_position + i + 1 + extra_visible - int(exclude_self)
                if stop <= 0:  # a query that sees nothing: a kernel would write 0 (or NaN)
                    out[row + i] = 0.0
                    continue
                stop = 1 if first_only else stop  # first_only: sees position 0 alone
                out[row + i] = ops.attend(grouped[i], keys[:stop], values[:stop])
            row += n
        return out

    return _attention


def _slots_off_by_one_at_block_start(item, start, stop):
    """Block index from p - 1 for the first position of every block but the first: a read
    of position 32k lands on the previous block's first slot."""
    positions = np.arange(start, stop)
    table = np.asarray(item.block_table, np.int64)
    block = np.where((positions % KV_BLOCK == 0) & (positions > 0),
                     (positions - 1) // KV_BLOCK, positions // KV_BLOCK)
    return table[block] * KV_BLOCK + positions % KV_BLOCK


def _plant_attention(**change):
    return lambda patch: patch.setattr(reference.ReferenceBackend, "_attention",
                                       attention_variant(**change))


def _plant_zero_attention(patch):
    original = reference.ReferenceBackend._attention

    def zeroed(self, *args):
        return np.zeros_like(original(self, *args))  # K/V still stored

    patch.setattr(reference.ReferenceBackend, "_attention", zeroed)


def _plant_rope_query_shift(patch):
    """Queries rotated for position p + 1, keys for p: every relative offset one off."""
    tables, rope = ops.rope_tables, ops.apply_rope
    keys = {}

    def shifted_tables(positions, theta):
        keys["tables"] = tables(positions, theta)
        return tables(positions + 1, theta)

    def apply(x, cos, sin):
        if x.shape[1] == KV_HEADS:
            cos, sin = keys["tables"]
        return rope(x, cos, sin)

    patch.setattr(ops, "rope_tables", shifted_tables)
    patch.setattr(ops, "apply_rope", apply)


def _plant_rope_reversed(patch):
    """Every rotation by -angle (sin negated, queries and keys alike): scores see the
    relative offset j - p instead of p - j."""
    tables = ops.rope_tables

    def reversed_tables(positions, theta):
        cos, sin = tables(positions, theta)
        return cos, -sin

    patch.setattr(ops, "rope_tables", reversed_tables)


def _scaled(module, name, factor):
    original = getattr(module, name)

    def plant(patch):
        patch.setattr(module, name, lambda x, *rest: original(x * np.float32(factor), *rest))

    return plant


def _plant_silu(patch):
    patch.setattr(ops, "silu", lambda x: x / (np.float32(1.0) + np.exp(np.float32(-1.05) * x)))


def _plant_rms_norm_weight(patch):
    original = ops.rms_norm
    patch.setattr(ops, "rms_norm", lambda x, w: original(x, w * np.float32(1.02)))


def _plant_rope_theta(patch):
    original = ops.rope_tables
    patch.setattr(ops, "rope_tables", lambda positions, theta: original(positions, theta * 1.05))


_GREEDY = "gate: greedy = designed rule"
_HF = "gate: vs transformers"
_DECODE = "gate: cached decode vs recompute"
_JAX = "gate: jax vs reference"  # the reference is the oracle: a faulty one disagrees

for fault in (
    Fault("attention-output-zeroed", "forward pass", "kipp.reference.backend._attention",
          "every attention output is 0 (K/V still stored)", _plant_zero_attention,
          (_HF, _GREEDY)),
    Fault("rope-query-shifted-by-one", "forward pass", "kipp.reference.ops.apply_rope",
          "queries rotated for position p + 1, keys for p", _plant_rope_query_shift,
          (_HF, _GREEDY)),
    Fault("rope-reversed", "forward pass", "kipp.reference.ops.rope_tables",
          "queries and keys rotated by -angle: relative offsets change sign",
          _plant_rope_reversed, (_HF, _GREEDY)),
    Fault("attention-sees-position-0-only", "forward pass", "kipp.reference.backend._attention",
          "every query attends to position 0 alone", _plant_attention(first_only=True),
          (_HF, _GREEDY)),
    Fault("causal-mask-sees-next", "forward pass", "kipp.reference.backend._attention",
          "the causal mask is j <= p + 1: a prefill token sees the next one",
          _plant_attention(extra_visible=1), (_HF, _GREEDY)),
    Fault("causal-mask-excludes-self", "forward pass", "kipp.reference.backend._attention",
          "the causal mask is j < p: a token does not see itself",
          _plant_attention(exclude_self=True), (_HF, _GREEDY)),
    Fault("attention-scale-1.1", "forward pass", "kipp.reference.ops.attend",
          "scores scaled by 1.1 / sqrt(128) instead of 1 / sqrt(128)",
          _scaled(ops, "attend", 1.1), (_HF, _GREEDY, _JAX)),
    Fault("silu-1.05", "forward pass", "kipp.reference.ops.silu",
          "SiLU computed as x * sigmoid(1.05 x)", _plant_silu, (_HF, _JAX)),
    Fault("rms-norm-weight-1.02", "forward pass", "kipp.reference.ops.rms_norm",
          "every RMSNorm weight read 2% too large", _plant_rms_norm_weight, (_HF, _JAX)),
    # Not "jax vs reference": JaxBackend builds its RoPE tables with this same function.
    Fault("rope-theta-1.05", "forward pass", "kipp.reference.ops.rope_tables",
          "RoPE base theta 5% too large", _plant_rope_theta, (_HF,)),
    Fault("decode-kv-not-stored", "KV addressing", "kipp.reference.backend._attention",
          "a one-token (decode) eval does not store its K and V",
          _plant_attention(store_decode=False), (_DECODE, _GREEDY)),
    Fault("block-table-off-by-one-at-boundary", "KV addressing",
          "kipp.backend.EvalItem.slots (attention reads)",
          "position 32k is read from the previous block's first slot",
          _plant_attention(read_slots=_slots_off_by_one_at_block_start), (_HF, _GREEDY)),
):
    register(fault)
