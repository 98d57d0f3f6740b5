"""The numpy operations of the reference forward pass, FP32 throughout.

`linear` is where exactness is decided. The reference must give every token row bitwise the same
result whatever batch it arrives in (batched eval, prefix adoption and chunked prefill are gated
bitwise). BLAS does not promise that for matrix products: a row's summation order can change
with the number of rows in the call. So each row is its own matrix-vector product against
weight chunks whose shape depends only on the weight: the same calls, in the same order,
whatever else is in the batch. The chunk (~4 MiB of float32) stays in cache across the rows of
a prefill, which keeps this close to a blocked matrix product, and decode pays no padding.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kipp.errors import KippError
from kipp.formats.artifact import Tensor
from kipp.formats.quant import BLOCK, GGML_BF16, GGML_F32
from kipp.formats.registry import HEAD_DIM, RMS_NORM_EPS
from kipp.rope import rope_tables  # noqa: F401  (step (4) calls ops.rope_tables)

_CHUNK_FLOATS = 1 << 20  # weight elements converted at once: ~4 MiB of float32


def weight_rows(w: Tensor, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of a 2-D weight in float32, dequantized per block when quantized."""
    if w.ggml_type == GGML_BF16:
        return w.raw.view(ml_dtypes.bfloat16).reshape(w.shape)[start:stop].astype(np.float32)
    if w.ggml_type == GGML_F32:
        return w.raw.view("<f4").reshape(w.shape)[start:stop]
    return w.dequantize_rows(start, stop)


def chunk_rows(w: Tensor) -> int:
    """Weight rows per chunk: a function of the weight's shape only (see module docstring)."""
    return max(1, _CHUNK_FLOATS // w.shape[1])


def linear(x: np.ndarray, w: Tensor) -> np.ndarray:
    """x [M, in] @ w[out, in]^T -> [M, out], float32, row-independent (module docstring)."""
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    step = chunk_rows(w)
    for r0 in range(0, w.shape[0], step):
        chunk = weight_rows(w, r0, r0 + step)  # [rows, in]
        for i, row in enumerate(x):
            out[i, r0:r0 + chunk.shape[0]] = chunk @ row
    return out


def int8_rows(x: np.ndarray) -> np.ndarray:
    """x [M, K] as the int8 dot of Kipp's stored CPU matmul multiplies it, in float32: each
    32-block scaled by dx = max |x| / 127, q = x / dx rounded half to even and clamped to +-127
    (llama.cpp's q8_0 activation), then q * dx. A block of zeros stays zeros; a NaN or inf
    makes its block NaN, as the kernel's whole row is."""
    m, k = x.shape
    blocks = np.asarray(x, np.float32).reshape(m, k // BLOCK, BLOCK)
    with np.errstate(invalid="ignore", divide="ignore"):
        dx = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
        q = np.clip(np.rint(np.where(dx != 0, blocks / dx, np.float32(0))), -127, 127)
        return (q * dx).astype(np.float32).reshape(m, k)


def bf16_rows(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16 (to nearest even) and back to float32, as the BF16 dot of Kipp's
    stored CPU matmul and a GPU's tensor cores take it."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


# The roundings a dot of Kipp's stored CPU matmul applies to x, by the weights it meets:
# "q" the quantized formats (int8 per 32-block), "bf16" BF16 weights.
_DOT_ROUNDING = {"f32": {}, "int8": {"q": int8_rows}, "bf16": {"bf16": bf16_rows}}


def activation_rounding(dots: str) -> dict:
    """{"q" | "bf16": rounding of x} for a $KIPP_JAX_CPU_DOT-style value ("int8+bf16"): each
    weight kind takes the first named dot that rounds it; a name it does not know raises."""
    out: dict = {}
    for part in dots.split("+"):
        if part not in _DOT_ROUNDING:
            raise KippError(f"activations {dots!r}: expected {', '.join(_DOT_ROUNDING)}, "
                            "or several joined by '+'")
        for kind, fn in _DOT_ROUNDING[part].items():
            out.setdefault(kind, fn)
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, float32."""
    mean_square = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return x * (1.0 / np.sqrt(mean_square + np.float32(RMS_NORM_EPS))) * weight


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, 128]: pairs (i, i + 64) rotate by the position's angle."""
    half = HEAD_DIM // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """One query position over its visible keys, grouped-query.

    q [kv_heads, group, 128]; k, v [positions, kv_heads, 128] (positions 0..p) -> [kv_heads *
    group * 128]. Computed per token so its shapes depend only on p, never on the batch.
    """
    scores = np.matmul(q, k.transpose(1, 2, 0)) * np.float32(HEAD_DIM ** -0.5)  # [kv, g, p+1]
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.matmul(weights, v.transpose(1, 0, 2)).reshape(-1)  # [kv, g, 128] flattened
