"""Design the positional attention profiles of the synthetic checkpoints (writes kipp/data/).

    python tools/design_rope_profiles.py        # needs scipy (dev only); rewrites the JSON

A positional head (kipp.synthetic.positional) scores the key `delta` positions away by a fixed
trigonometric sum over the 64 RoPE frequency pairs, score(delta) = sum_i A_i cos(theta_i delta)
+ B_i sin(theta_i delta). Each profile below is the one with the smallest total amplitude
sum_i (|A_i| + |B_i|) (so the smallest BF16 rounding noise in the keys) that meets its
constraints for every delta from -MAX_CONTEXT to +1, found by linear programming (HiGHS through
scipy). The two lowest frequency pairs are left out: the generator parks the leftover query and
key energy there. The result is rounded to 1e-4; tests/test_synthetic.py re-checks the margins.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from kipp.formats.registry import REGISTRY
from kipp.rope import inverse_frequencies

SYNTHETIC = [e for e in REGISTRY.values() if e.is_synthetic]
MAX_CONTEXT = max(e.context_length for e in SYNTHETIC)  # 40,960: the 0.6B-shaped entry's
ROPE_THETA = SYNTHETIC[0].rope_theta  # every synthetic entry's (kipp.synthetic.circuit checks)
SUPPRESS = 22.0  # every other visible position at least this far below the target
SCALE_GAP = 4.0  # the "scale" profile: the previous position exactly this far below self
                 # (kipp.synthetic.circuit's temperature measurement, weight about e^-4)
SCALE_RAMP = (8.0, 12.0, 16.0, 19.0)  # and 2, 3, 4, 5 back at least this far, then SUPPRESS:
                                      # 57 of amplitude, where falling to SUPPRESS at 2 takes 190
LEAD = 4.0  # self and scale: the next (never visible) position this far ABOVE self
PAIRS = 62  # pairs 62 and 63 are kept free
OUT = Path(__file__).resolve().parent.parent / "kipp" / "data" / "synthetic_rope_profiles.json"


def _basis(deltas: np.ndarray) -> np.ndarray:
    angles = np.outer(deltas.astype(np.float64), inverse_frequencies(ROPE_THETA)[:PAIRS])
    return np.hstack([np.cos(angles), np.sin(angles)])  # score = basis @ [A, B]


def _constraints(kind: str):
    """(rows of 'score(a) - score(b) >= v' as (a, b, v), equalities as (a, b, v))."""
    past = range(-MAX_CONTEXT, 1)
    if kind == "self":  # attend to the query's own position
        return [(0, d, SUPPRESS) for d in past if d != 0] + [(1, 0, LEAD)], []
    if kind == "scale":  # self, with the previous position exactly SCALE_GAP below
        ramp = [(0, -2 - i, drop) for i, drop in enumerate(SCALE_RAMP)]
        return ([(0, d, SUPPRESS) for d in past if d < -1 - len(SCALE_RAMP)] + ramp
                + [(1, 0, LEAD)], [(0, -1, SCALE_GAP)])
    if kind == "prev":  # attend to the previous position
        return [(-1, d, SUPPRESS) for d in past if d != -1], []
    raise ValueError(kind)


def design(kind: str) -> np.ndarray:
    from scipy.optimize import linprog

    inequalities, equalities = _constraints(kind)
    deltas = np.arange(-MAX_CONTEXT, 2)
    basis = _basis(deltas)
    row = {int(d): i for i, d in enumerate(deltas)}

    def differences(pairs):
        a = np.array([row[p[0]] for p in pairs])
        b = np.array([row[p[1]] for p in pairs])
        return basis[a] - basis[b], np.array([p[2] for p in pairs])

    g, lower = differences(inequalities)
    n = basis.shape[1]
    options = {}
    if equalities:
        e, value = differences(equalities)
        options = {"A_eq": np.hstack([e, -e]), "b_eq": value}
    result = linprog(np.ones(2 * n), A_ub=-np.hstack([g, -g]), b_ub=-lower, bounds=(0, None),
                     method="highs", **options)
    if result.status != 0:
        raise RuntimeError(f"{kind}: {result.message}")
    x = result.x[:n] - result.x[n:]
    return np.round(x, 4)


def main() -> int:
    profiles = {}
    for kind in ("self", "scale", "prev"):
        x = design(kind)
        profiles[kind] = {"cos": x[:PAIRS].tolist(), "sin": x[PAIRS:].tolist()}
        print(f"{kind}: total amplitude {np.abs(x).sum():.1f}", file=sys.stderr)
    data = {"max_context": MAX_CONTEXT, "rope_theta": ROPE_THETA, "suppress": SUPPRESS,
            "scale_gap": SCALE_GAP, "scale_ramp": list(SCALE_RAMP), "lead": LEAD,
            "profiles": profiles}
    OUT.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
