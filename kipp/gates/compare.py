"""How a gate compares logits: NMSE, argmax up to numerical near-ties, and the GateResult."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class GateResult:
    name: str
    passed: bool
    metric: float  # the measured error (NMSE unless `measure` says otherwise)
    bound: float
    detail: str = ""
    measure: str = "NMSE"
    gating: bool = True  # False: a report row, never a failure

    @property
    def verdict(self) -> str:
        if not self.gating:
            return "INFO"
        return "PASS" if self.passed else "FAIL"


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    """sum((a - b)^2) / sum(b^2), in float64; b is the oracle."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sum((a - b) ** 2) / np.sum(b ** 2))


def argmax_check(got: np.ndarray, want: np.ndarray) -> tuple[int, int]:
    """(positions whose argmax differs, how many of those are numerical ties).

    A differing position is a tie when the oracle's logit of our pick is within twice the row's
    largest error elsewhere (every logit but the two in question) of the oracle's maximum: noise
    of the size seen across the row could swap them. An error that lands on the two logits
    alone, larger than anywhere else in the row, is a real disagreement. (The row's largest
    error including the two would excuse every swap: a swap needs the two errors to differ by
    more than the gap.)
    """
    got, want = np.atleast_2d(got), np.atleast_2d(want)
    ours, theirs = got.argmax(-1), want.argmax(-1)
    differ = np.flatnonzero(ours != theirs)
    ties = 0
    for i in differ:
        error = np.abs(got[i].astype(np.float64) - want[i])
        error[[ours[i], theirs[i]]] = 0.0
        ties += bool(want[i, theirs[i]] - want[i, ours[i]] <= 2 * float(error.max()))
    return len(differ), ties


def compare(name, got, want, limit, detail="") -> GateResult:
    """NMSE of the worst row within `limit` and identical argmax (up to near-ties)."""
    got, want = np.atleast_2d(got), np.atleast_2d(want)
    worst = max(nmse(g, w) for g, w in zip(got, want))
    differ, ties = argmax_check(got, want)
    exact = limit == 0.0
    bits = int(np.sum(got.view(np.uint32) != want.view(np.uint32))) if exact else 0
    passed = differ == ties and (bits == 0 if exact else worst <= limit)
    note = f"{detail} argmax identical at {len(want) - differ}/{len(want)}"
    if differ:
        note += f" ({ties} of {differ} others are near-ties within the measured error)"
    if exact:
        note += f"; {bits} of {got.size} floats differ bitwise"
    return GateResult(name, passed, worst, limit, note.strip(), "worst-row NMSE")


def gate_rows(name: str, got: Sequence[np.ndarray], want: Sequence[np.ndarray],
              bound: float) -> GateResult:
    """Row by row (each row a position's logits): NMSE within `bound` and an identical argmax
    (up to near-ties, see argmax_check). The result holds the worst row's NMSE and names it
    and the first failing rows."""
    worst, where, failures = -1.0, "", []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        error = nmse(g, w)
        differ, ties = argmax_check(g, w)
        if error > worst:
            worst, where = error, f"row {i}"
        if error > bound or differ != ties:
            failures.append(f"row {i}: NMSE {error:.2e}"
                            + ("" if differ == ties else ", argmax differs beyond a near-tie"))
    detail = f"worst at {where} of {len(want)}"
    if failures:
        detail = f"{'; '.join(failures[:3])} ({len(failures)} rows fail); {detail}"
    return GateResult(name, not failures, worst, bound, detail, "worst-row NMSE")


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(p || q) per row, in nats, from logits."""
    p = _log_softmax(np.asarray(p_logits, np.float64))
    q = _log_softmax(np.asarray(q_logits, np.float64))
    return np.sum(np.exp(p) * (p - q), axis=-1)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.sum(np.exp(x), -1, keepdims=True))
