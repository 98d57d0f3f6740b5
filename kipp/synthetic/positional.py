"""The positional attention heads of a synthetic checkpoint's first and last layer.

Their query and key read only the constant BIAS dimension, so after the per-head RMSNorm they
are constant vectors and the score is a fixed function of the offset delta = key position -
query position, a trigonometric sum over RoPE's 64 frequency pairs:

    score(delta) = sum_i A_i cos(theta_i delta) + B_i sin(theta_i delta)

tools/design_rope_profiles.py designs the coefficients of each profile (self, scale, prev) for
one RoPE base and stores them in kipp/data/; `positional_qk` turns them into the pre-norm query
and key vectors that kipp.synthetic.circuit writes into q_proj and k_proj.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

import numpy as np

from kipp.formats.registry import HEAD_DIM
from kipp.rope import inverse_frequencies

_PROFILES = Path(__file__).parent.parent / "data" / "synthetic_rope_profiles.json"


@lru_cache(maxsize=1)
def _profile_data() -> dict:
    return json.loads(_PROFILES.read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def rope_profiles(theta: float) -> dict[str, np.ndarray]:
    """{self, scale, prev: complex [64] coefficients A_i + i B_i} of the positional scores
    (module docstring) under RoPE base `theta`; the stored profiles hold their margins only at
    the base they were designed for, so another `theta` is a ValueError."""
    data = _profile_data()
    if theta != data["rope_theta"]:
        raise ValueError(f"rope_theta {theta:g}: the positional profiles are designed for "
                         f"{data['rope_theta']:g} (tools/design_rope_profiles.py)")
    out = {}
    for kind, p in data["profiles"].items():
        c = np.zeros(HEAD_DIM // 2, complex)
        c[:len(p["cos"])] = np.array(p["cos"]) + 1j * np.array(p["sin"])
        out[kind] = c
    return out


def profile_scores(c: np.ndarray, deltas: np.ndarray, theta: float) -> np.ndarray:
    """score(delta) of profile coefficients c (float64) under RoPE base `theta`."""
    angles = np.outer(np.asarray(deltas, np.float64), inverse_frequencies(theta))
    return np.cos(angles) @ c.real + np.sin(angles) @ c.imag


def positional_qk(profiles: list[np.ndarray], q_norm: np.ndarray, k_norm: np.ndarray):
    """(k_pre [128], [q_pre [128] per profile]): pre-norm key and queries (each RMS 1) whose
    per-head RMSNorm with weights q_norm / k_norm and RoPE give score(delta) of each profile.

    Pair i of the key is (kappa_i, 0), kappa_i^2 proportional to the profiles' summed
    amplitude there; pair i of a query is sqrt(128) c_i / kappa_i. Leftover energy (RMSNorm
    makes every vector RMS 1) goes to pair 62 for queries and pair 63 for the key, where the
    other side is zero.
    """
    half = HEAD_DIM // 2
    weight = sum(np.abs(c) for c in profiles)
    used = weight > 0
    k_target = np.zeros(HEAD_DIM)
    q_targets = [np.zeros(HEAD_DIM) for _ in profiles]
    # Balance: key energy K^2 sum(weight) and query energy 128 sum(|c|^2/weight) / K^2.
    k_energy = np.sum(weight[used] / k_norm[:half][used] ** 2)
    q_energy = max(np.sum(np.abs(c[used]) ** 2 / weight[used] / q_norm[:half][used] ** 2)
                   for c in profiles)
    scale2 = math.sqrt(HEAD_DIM * q_energy / k_energy)
    kappa = np.sqrt(scale2 * weight)
    k_target[:half] = kappa
    for c, q in zip(profiles, q_targets):
        z = np.where(used, math.sqrt(HEAD_DIM) * c / np.where(used, kappa, 1.0), 0)
        q[:half], q[half:] = z.real, z.imag
    k_pre = _with_dump(k_target / k_norm, half - 1)
    q_pres = [_with_dump(q / q_norm, half - 2) for q in q_targets]
    return k_pre, q_pres


def _with_dump(v: np.ndarray, pair: int) -> np.ndarray:
    """v with its leftover energy (to RMS 1 over 128 dims) in dimension `pair`."""
    energy = float(np.sum(v ** 2))
    if energy > 0.97 * HEAD_DIM:
        raise ValueError(f"positional profile needs energy {energy:.1f} > {HEAD_DIM}: raise "
                         "kipp.synthetic.circuit.STRUCTURED_QK_GAIN")
    out = v.copy()
    out[pair] = math.sqrt(HEAD_DIM - energy)
    return out
