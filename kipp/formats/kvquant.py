"""The q8_0 KV cache format in numpy: the oracle every backend's KV store and attention follow.

With `kv_scheme="q8_0"` a backend stores each (token, KV head) row of 128 K or V values as four
Q8_0 blocks of 32, kipp.formats.quant's q8_0 weight encoding applied to the row: an fp16 scale d
chosen first (amax / 127, rounded to fp16, bumped where rounding would saturate), then each
value's level q in [-127, 127] nearest to it against that rounded d (ties away from zero).
Attention reads d * q in float32, which is exact (11 x 8 significant bits), so every backend
that follows this file dequantizes bitwise alike; only their attention arithmetic differs.

    q, d = quantize(k)            # k float32 [..., 128] -> int8 [..., 128], float16 [..., 4]
    k_hat = dequantize(q, d)      # float32 [..., 128]; |k_hat - k| <= d / 2 per block
    pack(q, d)                    # uint8 [..., 136]: GGML's Q8_0 bytes (d, then 32 x int8)

Backends keep q and d as two planes (int8 `[..., 8, 128]`, fp16 `[..., 8, 4]`): 136 bytes per
head-row against BF16's 256. K/V are quantized from float32 (after RoPE for K), never from their
BF16 rounding, so q8_0 KV is one rounding away from the float32 values, like BF16 KV.
"""

from __future__ import annotations

import numpy as np

from kipp.errors import KippError
from kipp.formats import quant
from kipp.formats.registry import HEAD_DIM, KV_HEADS

SCHEMES = ("bf16", "q8_0")
ROW_BLOCKS = HEAD_DIM // quant.BLOCK  # 4 Q8_0 blocks per 128-value head-row
ROW_BYTES = {"bf16": HEAD_DIM * 2, "q8_0": ROW_BLOCKS * 34}  # 256 and 136


def row_bytes(scheme: str) -> int:
    """Bytes one (token, KV head) row of K or V takes in `scheme`."""
    if scheme not in ROW_BYTES:
        raise KippError(f"unknown kv_scheme {scheme!r}; choose from {', '.join(SCHEMES)}")
    return ROW_BYTES[scheme]


def bytes_per_token(layers: int, scheme: str) -> int:
    """KV bytes one token takes across `layers`: K and V, 8 KV heads each."""
    return layers * 2 * KV_HEADS * row_bytes(scheme)


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [..., 128] -> (q int8 [..., 128], d float16 [..., 4]): quant's q8_0.

    Raises kipp.errors.QuantError for a non-finite value or a block beyond fp16's range.
    """
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim < 1 or x.shape[-1] != HEAD_DIM:
        raise KippError(f"q8_0 KV rows must be float32 [..., {HEAD_DIM}], got {x.dtype} "
                        f"{x.shape}")
    raw = quant.quantize(x.reshape(-1, HEAD_DIM), "q8_0")  # [rows, 4 * 34]
    q, d = unpack(raw)
    lead = x.shape[:-1]
    return q.reshape(lead + (HEAD_DIM,)), d.reshape(lead + (ROW_BLOCKS,))


def dequantize(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """(q int8 [..., 128], d float16 [..., 4]) -> float32 [..., 128]: d * q, exact."""
    blocks = q.reshape(q.shape[:-1] + (ROW_BLOCKS, quant.BLOCK)).astype(np.float32)
    return (blocks * d.astype(np.float32)[..., None]).reshape(q.shape)


def pack(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The planes as GGML Q8_0 bytes: uint8 [..., 136], per block fp16 d then 32 int8."""
    blocks = q.reshape(q.shape[:-1] + (ROW_BLOCKS, quant.BLOCK)).view(np.uint8)
    scales = d.astype("<f2")[..., None].view(np.uint8)  # [..., 4, 2]
    return np.concatenate([scales, blocks], axis=-1).reshape(q.shape[:-1] + (ROW_BYTES["q8_0"],))


def unpack(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGML Q8_0 bytes uint8 [..., 136] -> (q int8 [..., 128], d float16 [..., 4])."""
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[:-1] + (ROW_BLOCKS, 34))
    d = np.ascontiguousarray(blocks[..., :2]).view("<f2")[..., 0].astype(np.float16)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    return q.reshape(raw.shape[:-1] + (HEAD_DIM,)), d
