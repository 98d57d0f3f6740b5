"""y = x @ W^T for every prepared weight format: two Metal kernels, their MLX-op twin, a dispatcher.

`x` is float32 [M, K]; W [N, K] is one prepared projection (`Linear`). Output float32 [M, N].

Twin (no Metal, KIPP_MLX_TWINS=1, or a kernel that failed its probe at load): three layouts.
- float32 (weight_memory "float32", a CPU's default when the copy fits; kipp.memory): BF16
  widened once at load (exact), stored transposed, W^T [K, N] contiguous, one `mx.matmul`.
- stored (weight_memory "stored", and always on a GPU): BF16 kept as BF16 W^T, widened to
  float32 one chunk of CHUNK_ELEMENTS weights at a time inside the matmul (exact, and the
  transient is one chunk, never a copy of the weight). MLX's own promotion of a BF16 operand
  widens the whole weight per call: the 151,936-row head at 0.6B is a 622 MB transient.
- quantized schemes, in both modes: `mx.quantized_matmul` on the affine repack
  (kipp.apple.repack), never widened in memory.
And `planes_twin`, the per-kernel fallback on Metal: the same product read from the kernels'
own planes (dequantized per chunk), so a kernel that fails its probe costs no second copy.
Measured on this 2-core box, [3072, 1024]:
- Transposed storage: the Linux wheel's CPU matmul is the reference BLAS, whose sgemm walks B
  with a unit stride only when B is not transposed. One stream, x @ W.T 3.9 ms vs x @ W^T
  stored 2.1 ms at one token; 495 ms vs 227 ms at 128 tokens.
- Quantized, from DEQUANTIZE_ROWS tokens on the CPU (prefill, batched decode): MLX's CPU
  quantized matmul costs one matvec per token (8-bit, 128 tokens: 405 ms), so the shard is
  dequantized transiently and multiplied as W @ x^T by the BLAS (220-250 ms; at 8 tokens 22
  vs 29 ms). On a GPU the quantized matmul stays.
- CPU streams, each its own thread: the BLAS runs one thread, so the work is split over MLX
  CPU streams to put the other cores to work (the matvec above: 2.7 ms on one stream, 1.4 ms
  on two). Q, K and V are one stacked weight split by rows (one matmul per stream), O and the
  head likewise, each stream's rows concatenated after; the feed-forward block is split
  tensor-parallel (`SplitFFN`): a stream runs its share of the intermediate dims through gate,
  up, SiLU and down, and the streams meet once to add.
- Why float32 when it fits, on the CPU: MLX promotes a BF16 weight to float32 for a float32
  activation, a full copy per call (the 151,936-row head, one stream, one token: 600 ms that
  way, against 89 ms for the stored float32 W^T). The stored twin pays the widening per
  chunk instead: bench/README.md has its decode speed and peak RSS at the 0.6B shape.

Kernels (Metal; the artifact's own bytes, kipp.apple.repack's planes; BF16 stays BF16):
- `matvec` for decode (M <= MATVEC_ROWS): one simdgroup per output row, each lane walks the
  row's 32-weight blocks (lane, lane + 32, ...), dequantizes a block into registers once and
  uses it for all M activation rows; `simd_sum` reduces the lanes. Adjacent lanes read adjacent
  blocks, so a simdgroup streams one contiguous run of the row. The seeds measured this kind of
  decode as byte-bound (vectorising the dequant loop did not pay), so it stays scalar and
  simple.
- `matmul` for prefill: a 32-token x 32-output tile per threadgroup of 4 simdgroups (each a
  16 x 16 quarter as 2 x 2 simdgroup_float8x8 accumulators). Per 32-wide K step the X tile and
  the dequantized W tile are staged in threadgroup memory (8 KiB), so each weight block is
  dequantized once per 32-token tile (the seeds' rule for quantized prefill). FP32 accumulate.
  Tokens are padded to a multiple of 32 by the wrapper (zero rows), so every output element
  is written: nothing relies on uninitialised memory.
Dequantization is kipp.formats.quant's arithmetic (d * q exact; affine4 d * q + m, one rounding).
The kernels are built once per format (kipp.apple.metal's cache) and specialised by template
constants (M, N, K), which MLX compiles once per value. Checked off Apple hardware by running
their exact source on the Metal emulator (tests/test_metal_kernels.py; what that proves and
what it cannot: the package docstring).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from kipp.apple import metal, repack
from kipp.errors import KippError
from kipp.formats.artifact import Tensor
from kipp.formats.quant import BLOCK, GGML_BF16, GGML_F32, SCHEMES_BY_GGML_TYPE

DEQUANTIZE_ROWS = 8  # twin: from this many tokens, dequantize a shard for one BLAS matmul
CHUNK_ELEMENTS = 1 << 22  # stored twins widen this many weights at a time (16 MiB of float32)
MATVEC_ROWS = 8  # decode rounds up to this many tokens use the matvec kernel
MATVEC_ROWS_PER_GROUP = 4  # simdgroups (output rows) per threadgroup
TILE = 32  # matmul tile: tokens and outputs per threadgroup
FORMATS = ("bf16", "q8_0", "scale4_gs32", "affine4_gs32")


class LinearError(KippError, ValueError):
    """A kernel call with arrays of the wrong shape or dtype; nothing ran."""


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


# ---- twin --------------------------------------------------------------------------------


def linear_twin(x: mx.array, w: Linear, streams=(None,)) -> mx.array:
    """The MLX-op twin: one matmul / quantized_matmul per shard, shard i on streams[i]
    (None: the default stream); the shards' outputs are concatenated."""
    outs = []
    for i, shard in enumerate(w.shards):
        outs.append(_shard_matmul(x, shard, w.fmt, streams[i % len(streams)]))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)


def ffn_twin(h: mx.array, ffn: SplitFFN, streams=(None,)) -> mx.array:
    """down(SiLU(gate(h)) * up(h)): each stream runs its share of the intermediate dims end to
    end; the partial outputs are added in shard order (a fixed order: batch-independent)."""
    partials = []
    for i, (gate_up, down) in enumerate(zip(ffn.gate_up, ffn.down)):
        stream = streams[i % len(streams)]
        y = _shard_matmul(h, gate_up.shards[0], gate_up.fmt, stream)  # [T, 2 I_s]
        with on_stream(stream):
            gate, up = mx.split(y, 2, axis=-1)
            act = gate / (1.0 + mx.exp(-gate)) * up
        partials.append(_shard_matmul(act, down.shards[0], down.fmt, stream))
    out = partials[0]
    for partial in partials[1:]:
        out = out + partial
    return out


def _shard_matmul(x: mx.array, shard: tuple, fmt: str, stream) -> mx.array:
    with on_stream(stream):
        if fmt == "f32":
            return mx.matmul(x, shard[0])  # stored W^T
        if fmt == "bf16":
            return _chunked(x, shard[0])
        q, scales, biases = shard
        bits = repack.BITS[fmt]
        if x.shape[0] < DEQUANTIZE_ROWS or not _on_cpu(stream):
            return mx.quantized_matmul(x, q, scales, biases, transpose=True, group_size=BLOCK,
                                       bits=bits)
        w = mx.dequantize(q, scales, biases, group_size=BLOCK, bits=bits)  # [N, K], transient
        return (w @ mx.contiguous(x.T)).T


def _chunked(x: mx.array, wt: mx.array) -> mx.array:
    """x [M, K] float32 @ W^T [K, N] BF16, widening CHUNK_ELEMENTS weights at a time (exact:
    float32 holds every BF16 value)."""
    step = max(1, CHUNK_ELEMENTS // wt.shape[0])
    return _in_order(x, [lambda c=c: wt[:, c:c + step].astype(mx.float32)
                         for c in range(0, wt.shape[1], step)], transposed=False)


def planes_twin(x: mx.array, w: Linear) -> mx.array:
    """The twin of the matvec and matmul kernels, on their own planes: x [M, K] float32 @ W^T
    -> [M, N] float32, W's rows dequantized (kipp.formats.quant's arithmetic) CHUNK_ELEMENTS weights at
    a time. A kernel that fails its probe is replaced by this, with no second weight copy."""
    step = max(1, CHUNK_ELEMENTS // w.cols)
    return _in_order(x, [lambda r=r: _plane_rows(w, r, min(r + step, w.rows))
                         for r in range(0, w.rows, step)], transposed=True)


def _in_order(x: mx.array, chunks: list, transposed: bool) -> mx.array:
    """x @ each widened chunk (chunk^T when `transposed`), concatenated. Each widened chunk
    gets a +0.0 computed from the previous product (from x for the first) added: left free,
    MLX evaluates every widening of the graph before the products that use them (a BF16 head
    at 0.6B: 622 MB of float32 at once, peak RSS +430 MB in a prefill); tied this way, one chunk
    is float32 at a time, and only once its layer runs (measured: no rise over the load peak).
    `mx.depends` on the chunk's source did not hold the peak (+200 MB)."""
    outs, after = [], x
    for chunk in chunks:
        wide = chunk() + _zero(after)
        outs.append(x @ (wide.T if transposed else wide))
        after = outs[-1]
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)


def _zero(a: mx.array) -> mx.array:
    """+0.0 computed from a[0, 0], whatever it holds (|finite| * 0 is +0; adding it changes
    no weight but a -0.0, which changes no product's sum)."""
    v = a[0, 0]
    return mx.abs(mx.where(mx.isfinite(v), v, 0.0)) * 0.0


def _plane_rows(w: Linear, start: int, stop: int) -> mx.array:
    """Rows [start, stop) of a kernel-planes Linear as float32 [rows, K] (exact decode)."""
    q = w.planes[0][start:stop]
    if w.fmt == "bf16":
        return (q.astype(mx.uint32) << 16).view(mx.float32)
    n = stop - start
    d = w.planes[1][start:stop].view(mx.float16).astype(mx.float32)[..., None]  # [n, K/32, 1]
    if w.fmt == "q8_0":
        return (d * q.astype(mx.float32).reshape(n, -1, BLOCK)).reshape(n, w.cols)
    nibbles = q.reshape(n, -1, BLOCK // 2)  # byte j: element j low, j + 16 high
    levels = mx.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(mx.float32)
    if w.fmt == "scale4_gs32":
        return (d * (levels - 8.0)).reshape(n, w.cols)
    m = w.planes[2][start:stop].view(mx.float16).astype(mx.float32)[..., None]
    return (d * levels + m).reshape(n, w.cols)


def _on_cpu(stream) -> bool:
    return (stream.device if stream is not None else mx.default_device()) == mx.cpu


def on_stream(stream):
    """A context running ops on `stream` (None: leave the default stream)."""
    return mx.stream(stream) if stream is not None else contextlib.nullcontext()


# ---- kernels -----------------------------------------------------------------------------

HEADER = """
#include <metal_simdgroup_matrix>
// Exact widening of the stored 16-bit fields (kipp.formats.quant's decode arithmetic).
inline float kipp_bf16(uint16_t bits) { return as_type<float>(uint(bits) << 16); }
inline float kipp_fp16(uint16_t bits) { return float(as_type<half>(bits)); }
"""

# Per format: the extra inputs after `x, w`, and two snippets. BLOCK_LOAD fills wv[0..31] with
# block b of output row n (matvec). ELEMENT sets `value` to element e (0..31) of block b of row n
# (matmul staging). K and KB (= K / 32) are template constants.
_INPUTS = {"bf16": ("w",), "q8_0": ("w", "d"), "scale4_gs32": ("w", "d"),
           "affine4_gs32": ("w", "d", "m")}
_BLOCK_LOAD = {
    "bf16": """
        const device uint16_t* src = w + size_t(n) * K + b * 32;
        for (int j = 0; j < 32; ++j) wv[j] = kipp_bf16(src[j]);""",
    "q8_0": """
        const float dd = kipp_fp16(d[size_t(n) * KB + b]);
        const device int8_t* src = w + size_t(n) * K + b * 32;
        for (int j = 0; j < 32; ++j) wv[j] = dd * float(src[j]);""",
    "scale4_gs32": """
        const float dd = kipp_fp16(d[size_t(n) * KB + b]);
        const device uint8_t* src = w + size_t(n) * (K / 2) + b * 16;
        for (int j = 0; j < 16; ++j) {
            const uint byte = src[j];  // element j low nibble, element j + 16 high
            wv[j] = dd * (float(byte & 15u) - 8.0f);
            wv[j + 16] = dd * (float(byte >> 4) - 8.0f);
        }""",
    "affine4_gs32": """
        const float dd = kipp_fp16(d[size_t(n) * KB + b]);
        const float mm = kipp_fp16(m[size_t(n) * KB + b]);
        const device uint8_t* src = w + size_t(n) * (K / 2) + b * 16;
        for (int j = 0; j < 16; ++j) {
            const uint byte = src[j];
            wv[j] = dd * float(byte & 15u) + mm;  // exact product, one rounded add
            wv[j + 16] = dd * float(byte >> 4) + mm;
        }""",
}
_ELEMENT = {
    "bf16": "value = kipp_bf16(w[size_t(n) * K + b * 32 + e]);",
    "q8_0": "value = kipp_fp16(d[size_t(n) * KB + b]) * float(w[size_t(n) * K + b * 32 + e]);",
    "scale4_gs32": """{
            const uint byte = w[size_t(n) * (K / 2) + b * 16 + (e & 15u)];
            const uint q = e < 16 ? (byte & 15u) : (byte >> 4);
            value = kipp_fp16(d[size_t(n) * KB + b]) * (float(q) - 8.0f);
        }""",
    "affine4_gs32": """{
            const uint byte = w[size_t(n) * (K / 2) + b * 16 + (e & 15u)];
            const uint q = e < 16 ? (byte & 15u) : (byte >> 4);
            value = kipp_fp16(d[size_t(n) * KB + b]) * float(q) + kipp_fp16(m[size_t(n) * KB + b]);
        }""",
}

# grid (32, N, 1), threadgroup (32, MATVEC_ROWS_PER_GROUP, 1): simdgroup = output row n.
MATVEC_SOURCE = """
    constexpr uint KB = K / 32;
    const uint lane = thread_index_in_simdgroup;
    const uint n = thread_position_in_grid.y;
    float acc[M];
    for (int r = 0; r < M; ++r) acc[r] = 0.0f;
    for (uint b = lane; b < KB; b += 32) {
        float wv[32];
        {BLOCK_LOAD}
        for (int r = 0; r < M; ++r) {
            const device float* xr = x + size_t(r) * K + b * 32;
            float s = 0.0f;
            for (int j = 0; j < 32; ++j) s = fma(wv[j], xr[j], s);
            acc[r] += s;
        }
    }
    for (int r = 0; r < M; ++r) {
        const float total = simd_sum(acc[r]);
        if (lane == 0) y[size_t(r) * N + n] = total;
    }
"""

# grid (128 * N / 32, MP / 32, 1), threadgroup (128, 1, 1); x is [MP, K] (MP: tokens padded
# to 32), y is [MP, N]. Simdgroup sg owns rows sm..sm+15, columns sn..sn+15 of the tile.
MATMUL_SOURCE = """
    constexpr uint KB = K / 32;
    threadgroup float xs[32 * 32];  // [token][k] of this K step
    threadgroup float ws[32 * 32];  // [output][k], dequantized
    const uint tid = thread_index_in_threadgroup;
    const uint sg = simdgroup_index_in_threadgroup;
    const uint n0 = threadgroup_position_in_grid.x * 32;
    const uint m0 = threadgroup_position_in_grid.y * 32;
    const uint sm = (sg / 2) * 16;
    const uint sn = (sg % 2) * 16;
    simdgroup_float8x8 c00 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_float8x8 c01 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_float8x8 c10 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_float8x8 c11 = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (uint b = 0; b < KB; ++b) {
        for (uint i = tid; i < 32 * 32; i += 128) {
            xs[i] = x[size_t(m0 + i / 32) * K + b * 32 + i % 32];
        }
        {
            const uint r = tid / 4;              // output row of the tile
            const uint n = n0 + r;
            for (uint e = (tid % 4) * 8; e < (tid % 4) * 8 + 8; ++e) {
                float value;
                {ELEMENT}
                ws[r * 32 + e] = value;
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint kk = 0; kk < 32; kk += 8) {
            simdgroup_float8x8 a0, a1, b0, b1;
            simdgroup_load(a0, xs + (sm + 0) * 32 + kk, 32);
            simdgroup_load(a1, xs + (sm + 8) * 32 + kk, 32);
            simdgroup_load(b0, ws + (sn + 0) * 32 + kk, 32, ulong2(0, 0), true);  // W^T
            simdgroup_load(b1, ws + (sn + 8) * 32 + kk, 32, ulong2(0, 0), true);
            simdgroup_multiply_accumulate(c00, a0, b0, c00);
            simdgroup_multiply_accumulate(c01, a0, b1, c01);
            simdgroup_multiply_accumulate(c10, a1, b0, c10);
            simdgroup_multiply_accumulate(c11, a1, b1, c11);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    device float* out = y + size_t(m0 + sm) * N + n0 + sn;
    simdgroup_store(c00, out, N);
    simdgroup_store(c01, out + 8, N);
    simdgroup_store(c10, out + 8 * N, N);
    simdgroup_store(c11, out + 8 * N + 8, N);
"""


def kernel_source(kind: str, fmt: str) -> str:
    """The Metal body of `kind` ("matvec" or "matmul") for weight format `fmt`."""
    if fmt not in FORMATS:
        raise LinearError(f"no Metal kernel for weight format {fmt!r}")
    if kind == "matvec":
        return MATVEC_SOURCE.replace("{BLOCK_LOAD}", _BLOCK_LOAD[fmt])
    if kind == "matmul":
        return MATMUL_SOURCE.replace("{ELEMENT}", _ELEMENT[fmt])
    raise LinearError(f"unknown kernel kind {kind!r}")


def input_names(fmt: str) -> tuple[str, ...]:
    return ("x",) + _INPUTS[fmt]


def kernel_spec(kind: str, fmt: str) -> metal.KernelSpec:
    """What the (kind, fmt) kernel is built from (kipp.apple.metal). Cached on the source
    texts themselves: a decode step asks for hundreds of kernels, and a test that plants a
    fault in a text gets a new spec."""
    return _spec(kind, fmt, MATVEC_SOURCE, MATMUL_SOURCE, _BLOCK_LOAD.get(fmt),
                 _ELEMENT.get(fmt), HEADER)


@functools.lru_cache(maxsize=None)
def _spec(kind: str, fmt: str, *texts) -> metal.KernelSpec:
    source = kernel_source(kind, fmt)
    return metal.KernelSpec(f"kipp_{kind}_{fmt}", input_names(fmt), ("y",), source, HEADER)


def kernel(kind: str, fmt: str, runner=None):
    """The kernel object for (kind, fmt), built once per process per runner (None: MLX)."""
    return metal.kernel(kernel_spec(kind, fmt), runner)


_PLANE_DTYPES = {"bf16": (mx.uint16,), "q8_0": (mx.int8, mx.uint16),
                 "scale4_gs32": (mx.uint8, mx.uint16),
                 "affine4_gs32": (mx.uint8, mx.uint16, mx.uint16)}


def check_call(x: mx.array, w: Linear, max_rows: int | None = None) -> tuple[int, int, int]:
    """(M, N, K) after checking every array's dtype and shape against the kernel's contract."""
    if w.fmt not in FORMATS or not w.planes:
        raise LinearError(f"weight format {w.fmt!r} has no kernel planes (prepared for twins?)")
    if x.dtype != mx.float32 or x.ndim != 2:
        raise LinearError(f"x must be float32 [M, K], got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    n = w.rows
    if k != w.cols:
        raise LinearError(f"x has {k} columns, the weight {w.cols}")
    if n % TILE or k % TILE or m < 1:
        raise LinearError(f"kernel shapes need N and K multiples of {TILE}, M >= 1: "
                          f"M={m} N={n} K={k}")
    if max_rows is not None and m > max_rows:
        raise LinearError(f"matvec takes at most {max_rows} rows, got {m}")
    want_dtypes = _PLANE_DTYPES[w.fmt]
    shapes = [(n, k if w.fmt in ("bf16", "q8_0") else k // 2)] + [(n, k // BLOCK)] * 2
    if len(w.planes) != len(want_dtypes):
        raise LinearError(f"{w.fmt} takes {len(want_dtypes)} planes, got {len(w.planes)}")
    for i, (plane, dtype, shape) in enumerate(zip(w.planes, want_dtypes, shapes)):
        if plane.dtype != dtype or tuple(plane.shape) != shape:
            raise LinearError(f"{w.fmt} plane {i} must be {dtype} {shape}, got "
                              f"{plane.dtype} {tuple(plane.shape)}")
    return m, n, k


def matvec(x: mx.array, w: Linear, runner=None) -> mx.array:
    """Decode kernel: x float32 [M <= MATVEC_ROWS, K] -> float32 [M, N]. `runner`: who runs
    the Metal source (kipp.apple.metal; None: MLX)."""
    m, n, k = check_call(x, w, MATVEC_ROWS)
    return kernel("matvec", w.fmt, runner)(
        inputs=[x, *w.planes], template=[("M", m), ("N", n), ("K", k)],
        grid=(32, n, 1), threadgroup=(32, MATVEC_ROWS_PER_GROUP, 1),
        output_shapes=[(m, n)], output_dtypes=[mx.float32])[0]


def matmul(x: mx.array, w: Linear, runner=None) -> mx.array:
    """Prefill kernel: x float32 [M, K] -> float32 [M, N] (tokens padded to 32 inside)."""
    m, n, k = check_call(x, w)
    padded = -(-m // TILE) * TILE
    if padded != m:
        x = mx.pad(x, [(0, padded - m), (0, 0)])
    y = kernel("matmul", w.fmt, runner)(
        inputs=[x, *w.planes], template=[("N", n), ("K", k)],
        grid=(128 * (n // TILE), padded // TILE, 1), threadgroup=(128, 1, 1),
        output_shapes=[(padded, n)], output_dtypes=[mx.float32])[0]
    return y[:m] if padded != m else y


def linear_kernel(x: mx.array, w: Linear, runner=None) -> mx.array:
    """The kernel path's dispatcher: matvec for decode-sized rounds, matmul otherwise."""
    return matvec(x, w, runner) if x.shape[0] <= MATVEC_ROWS else matmul(x, w, runner)
