"""The unmerged low-rank term, per row: y[i] += s * B (A x[i]) for the rows of each adapter.

Rows are grouped by adapter (as vLLM's punica kernels and SGLang do): a batch may mix rows of
several adapters and rows of none, and each group pays only its own adapter's two small
products. `row_groups` is the one place a batch's items become those groups.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def row_groups(items: Sequence, adapters: dict) -> list[tuple[object, np.ndarray]]:
    """[(adapter, token rows)] of a packed batch of `items` (EvalItems, in order), one entry per
    adapter that some item names; rows of items without an adapter are in none."""
    rows: dict[str, list[int]] = {}
    at = 0
    for item in items:
        n = len(item.tokens)
        if item.adapter is not None:
            rows.setdefault(item.adapter, []).extend(range(at, at + n))
        at += n
    return [(adapters[name], np.asarray(r, np.int64)) for name, r in rows.items()]


def add_low_rank(y: np.ndarray, x: np.ndarray, groups, layer: int, proj: str) -> np.ndarray:
    """y [T, out] += s * B (A x) for each group's rows of x [T, in]; row by row, so a row's
    result does not depend on the rest of the batch (the reference's contract, kipp.reference.ops).
    A group whose adapter leaves this projection alone adds nothing."""
    for adapter, rows in groups:
        pair = adapter.weights.get((layer, proj))
        if pair is None:
            continue
        a, b = pair  # [r, in], [out, r]
        scale = np.float32(adapter.scale)
        for i in rows:
            y[i] += scale * (b @ (a @ x[i]))
    return y


def round_adapters(names: Sequence, slots: dict[str, int], ranks: dict[int, int],
                   ) -> tuple[list[int], int]:
    """What one round reads of the stacked adapters: the slots of the adapters its pieces name
    (`names`, None for the base weights) in first-seen order, and the largest of their ranks
    (0 for none). A round of the base alone reads no adapter weights, and a round under one
    rank-8 adapter reads 8 of the stacked ranks of that one slot, whatever else is loaded."""
    active = list(dict.fromkeys(slots[n] for n in names if n is not None))
    return active, max((ranks[s] for s in active), default=0)


def stack_adapters(adapters: dict, entry) -> tuple[dict[str, int], dict]:
    """The accelerated backends' layout of the loaded adapters: (name -> slot, {projection:
    (A [layers, S, r, in], B^T [layers, S, r, out])}) float32, the scale folded into B, ranks
    zero-padded to the largest (zero rows and columns add exact zeros; a round reads only its
    adapters' slots and ranks, round_adapters). Only projections some adapter targets are
    present; ({}, {}) with no adapters."""
    from kipp.lora.adapter import PROJECTIONS, projection_shape

    names = sorted(adapters)
    if not names:
        return {}, {}
    rank = max(adapters[n].rank for n in names)
    stacked = {}
    for proj in PROJECTIONS:
        if not any(proj in adapters[n].targets for n in names):
            continue
        out, inp = projection_shape(entry, proj)
        a = np.zeros((entry.layers, len(names), rank, inp), np.float32)
        # B transposed: a round's first ranks are contiguous rows of both, as A's are
        b = np.zeros((entry.layers, len(names), rank, out), np.float32)
        for s, name in enumerate(names):
            adapter = adapters[name]
            for layer in range(entry.layers):
                pair = adapter.weights.get((layer, proj))
                if pair is not None:
                    a[layer, s, :adapter.rank] = pair[0]
                    b[layer, s, :adapter.rank] = np.float32(adapter.scale) * pair[1].T
        stacked[proj] = (a, b)
    return {name: s for s, name in enumerate(names)}, stacked
