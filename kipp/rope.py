"""RoPE's frequencies and angle tables, shared by every backend and the synthetic circuit.

Qwen3 uses rotate-half (NEOX) RoPE: dims i and i + 64 of a head rotate together by
position * theta ** (-2i / 128). The angles are computed in float64 and the tables rounded to
float32 once, so the reference, JAX and MLX backends start from bitwise the same cos and sin.
"""

from __future__ import annotations

import numpy as np

from kipp.formats.registry import HEAD_DIM


def inverse_frequencies(theta: float) -> np.ndarray:
    """theta ** (-2i / 128) of the 64 rotation pairs i, float64."""
    return 1.0 / theta ** (np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)


def rope_tables(positions: np.ndarray, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [T, 128] for rotate-half (NEOX) RoPE; angles in float64, tables float32."""
    inv_freq = inverse_frequencies(theta)  # [64]
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, 64]
    angles = np.concatenate([angles, angles], axis=-1)  # [T, 128]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
