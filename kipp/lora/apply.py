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
