"""MLXBackend's projections, prepared once at load in the path's layout (numpy -> MLX).

Kernels: the artifact's own bytes as the Metal kernels' planes (kipp.apple.repack; BF16 stays
BF16), also what a kernel that fails its probe runs its twin on (`linear.planes_twin`).
Twins, by weight_memory (kipp.memory) and scheme:
- "float32" (a CPU's default when the copy fits): BF16 widened once (exact) and stored
  transposed, W^T [K, N] contiguous: the Linux wheel's reference BLAS walks B with a unit
  stride only when B is not transposed. MLX would otherwise promote a BF16 weight to float32
  for a float32 activation, a whole copy per call.
- "stored" (always on a GPU): BF16 kept as BF16 W^T, widened one chunk at a time inside the
  matmul (kipp.apple.linear).
- quantized schemes, in both modes: MLX's affine group-32 repack (kipp.apple.repack).
A twin weight's rows are split into one shard per CPU stream (kipp.apple.select: the BLAS runs
one thread); the feed-forward block is split tensor-parallel instead (`SplitFFN`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from kipp.apple import repack
from kipp.errors import KippError
from kipp.formats.artifact import Tensor
from kipp.formats.quant import BLOCK, GGML_BF16, GGML_F32, SCHEMES_BY_GGML_TYPE

CHUNK_ELEMENTS = 1 << 22  # weights copied (and, by the stored twins, widened) at a time: 16 MiB


class LinearError(KippError, ValueError):
    """A kernel call with arrays of the wrong shape or dtype, or a projection the kernels
    cannot take; nothing ran."""


@dataclass(frozen=True)
class Linear:
    """One prepared projection W [rows, cols] for one path.

    fmt: "f32" (twin, widened BF16), "bf16" (kernel planes, or stored twin shards), or a
      quantized scheme.
    shards (twin): per CPU stream, (w^T,) float32 or bfloat16 [cols, rows_s], or (w, scales,
      biases) MLX affine [rows_s, ...]; the rows of W split over the shards.
    planes (kernel): (w,) BF16 bits uint16 [rows, cols]; (q, d) or (q, d, m) (repack.Planes).
    """

    fmt: str
    rows: int
    cols: int
    shards: tuple = ()
    planes: tuple = ()

    def arrays(self) -> list:
        return [a for shard in self.shards for a in shard] + list(self.planes)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


@dataclass(frozen=True)
class SplitFFN:
    """The twins' feed-forward block, tensor-parallel over the CPU streams: shard s holds its
    share of gate's and up's rows stacked ([2 I_s, hidden], one matmul) and the matching
    columns of down ([hidden, I_s]), so a stream runs its whole share of the block and the
    streams meet once, to add the partial outputs."""

    gate_up: tuple  # per shard: a one-shard Linear [2 * I_s, hidden]
    down: tuple  # per shard: a one-shard Linear [hidden, I_s]

    def arrays(self) -> list:
        return [a for lin in self.gate_up + self.down for a in lin.arrays()]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


def prepare(t: Tensor, kernels: bool, n_shards: int = 1) -> Linear:
    """A projection tensor of the artifact in the path's layout (module docstring)."""
    rows, cols = t.shape
    if not kernels:
        return prepare_twin([t], n_shards)
    if t.ggml_type == GGML_BF16:
        bits = np.ascontiguousarray(t.bf16().view(np.uint16))
        return Linear("bf16", rows, cols, planes=(mx.array(bits),))
    if t.ggml_type == GGML_F32:
        raise LinearError(f"{t.name}: the kernels take BF16 or quantized projections")
    scheme = SCHEMES_BY_GGML_TYPE[t.ggml_type]
    p = repack.to_planes(t.quantized_rows(0, rows), scheme, cols)
    planes = tuple(mx.array(a) for a in (p.q, p.d, p.m) if a is not None)
    return Linear(scheme.name, rows, cols, planes=planes)


def prepare_twin(tensors: list[Tensor], n_shards: int = 1, stored: bool = False,
                 release: Callable[[np.ndarray], None] | None = None) -> Linear:
    """The twins' layout of `tensors` stacked by rows (one matmul for Q, K and V), split into
    `n_shards` row shards: float32 (BF16 widened, exact), BF16 as stored (`stored`), or the MLX
    affine repack. `release(rows)` (Artifact.release_view) is called on the rows of the
    artifact's mapping as soon as they are copied."""
    fmt = _twin_format(tensors[0], stored)
    parts = [_twin_rows(t, fmt) for t in tensors]
    stacked = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return twin_of(stacked, fmt, tensors[0].shape[1], n_shards, release)


def twin_of(rows: np.ndarray, fmt: str, cols: int, n_shards: int = 1,
            release: Callable[[np.ndarray], None] | None = None) -> Linear:
    """The twin Linear of W [len(rows), cols] given as float32 or BF16 (ml_dtypes) rows (fmt
    "f32": held as float32; "bf16": held as BF16) or a scheme's quantized row bytes [rows,
    row_bytes], its rows split into `n_shards` shards; `release` as in prepare_twin."""
    release = release or (lambda rows: None)
    shards = tuple(_twin_shard(part, fmt, cols, release) for part in _split(rows, n_shards))
    return Linear(fmt, len(rows), cols, shards=shards)


def prepare_ffn_twin(gate: Tensor, up: Tensor, down: Tensor, n_shards: int,
                     stored: bool = False) -> SplitFFN:
    """The feed-forward block as SplitFFN: intermediate dims split in n_shards ranges."""
    fmt, inter = _twin_format(gate, stored), gate.shape[0]
    g, u, d = (_twin_rows(t, fmt) for t in (gate, up, down))
    gate_up, downs = [], []
    for lo, hi in _bounds(inter, n_shards):
        gate_up.append(twin_of(np.concatenate([g[lo:hi], u[lo:hi]]), fmt, gate.shape[1]))
        columns = d[:, lo:hi] if fmt in ("f32", "bf16") else d[:, _byte_range(down, lo, hi)]
        downs.append(twin_of(np.ascontiguousarray(columns), fmt, hi - lo))
    return SplitFFN(tuple(gate_up), tuple(downs))


def _twin_format(t: Tensor, stored: bool = False) -> str:
    if t.ggml_type == GGML_BF16 and stored:
        return "bf16"
    if t.ggml_type in (GGML_BF16, GGML_F32):
        return "f32"
    return SCHEMES_BY_GGML_TYPE[t.ggml_type].name


def _twin_rows(t: Tensor, fmt: str) -> np.ndarray:
    """The rows as stored: BF16 (widened to float32 per chunk by _transposed, fmt "f32") or
    float32, or the quantized rows' bytes [rows, row_bytes]; views of the mapping, never
    copies."""
    if fmt == "f32" and t.ggml_type == GGML_F32:
        return t.f32()
    return t.bf16() if fmt in ("f32", "bf16") else t.quantized_rows(0, t.shape[0])


def _byte_range(t: Tensor, lo: int, hi: int) -> slice:
    """The bytes of columns [lo, hi) (multiples of 32) in each quantized row of `t`."""
    block_bytes = SCHEMES_BY_GGML_TYPE[t.ggml_type].block_bytes
    return slice(lo // BLOCK * block_bytes, hi // BLOCK * block_bytes)


def _twin_shard(rows: np.ndarray, fmt: str, cols: int,
                release: Callable[[np.ndarray], None]) -> tuple:
    if fmt in ("f32", "bf16"):
        return (_transposed(rows, fmt, release),)
    a = repack.to_affine(rows, fmt, cols)
    shard = (mx.array(a.w), mx.array(a.scales), mx.array(a.biases))
    mx.eval(shard)
    release(rows)
    return shard


def _transposed(rows: np.ndarray, fmt: str, release: Callable[[np.ndarray], None]) -> mx.array:
    """W^T [cols, n] from BF16 (or float32) rows [n, cols], as float32 (fmt "f32", widened
    exactly) or BF16: filled in place CHUNK_ELEMENTS at a time, each chunk's mapped rows
    released once copied. A whole transposed or widened copy beside the array, or the whole of
    the file's rows resident beside it, would double the shard at load (the 0.6B head: 297 MiB
    of BF16 rows, 594 MiB widened). BF16 bits travel as uint16 (numpy's bfloat16 is not
    MLX's)."""
    n, cols = rows.shape
    out = mx.zeros((cols, n), mx.float32 if fmt == "f32" else mx.bfloat16)
    step = max(1, CHUNK_ELEMENTS // cols)
    for r in range(0, n, step):
        if fmt == "f32":
            piece = mx.array(np.ascontiguousarray(rows[r:r + step].T, np.float32))
        else:
            bits = np.ascontiguousarray(rows[r:r + step].T).view(np.uint16)
            piece = mx.array(bits).view(mx.bfloat16)
        out[:, r:r + step] = piece
        mx.eval(out)  # the slab's buffer is reused: nothing else holds it
        release(rows[r:r + step])
    return out


def _bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges splitting n into `parts`, each a multiple of 32 where possible."""
    if parts <= 1 or n < 2 * BLOCK:
        return [(0, n)]
    edges = [round(n * i / parts / BLOCK) * BLOCK for i in range(parts + 1)]
    edges[-1] = n
    return [(lo, hi) for lo, hi in zip(edges, edges[1:]) if hi > lo]


def _split(a: np.ndarray, n: int) -> list[np.ndarray]:
    """Row shards (see _bounds)."""
    return [a[lo:hi] for lo, hi in _bounds(len(a), n)]
