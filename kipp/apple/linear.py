"""y = x @ W^T for every prepared weight format: two Metal kernels, their MLX-op twin, a dispatcher.

`x` is float32 [M, K]; W [N, K] is one prepared projection (kipp.apple.layout.Linear). Output
float32 [M, N]. Twins (no Metal, KIPP_MLX_TWINS=1, or a kernel that failed its probe): one
matmul per shard, each on its CPU stream (`linear_twin`, `ffn_twin`), and `planes_twin`, the
same product read from the kernels' own planes. Kernels (Metal), on the artifact's own bytes:
- `matvec` for decode (M <= MATVEC_ROWS): one simdgroup per output row; each lane walks the
  row's 32-weight blocks (lane, lane + 32, ...), dequantizes a block into registers once for
  all M rows, and `simd_sum` reduces the lanes. Decode is byte-bound: it stays scalar.
- `matmul` for prefill: a 32-token x 32-output tile per threadgroup of 4 simdgroups (2 x 2
  simdgroup_float8x8 accumulators each), X and the dequantized W staged in threadgroup memory
  per 32-wide K step, so each weight block is dequantized once per tile; tokens padded to 32.
Dequantization is kipp.formats.quant's arithmetic (d * q exact; affine4 d * q + m, one
rounding). Off Apple hardware the kernels' exact source runs on the Metal emulator
(tests/test_metal_kernels.py).
"""

from __future__ import annotations

import contextlib
import functools

import mlx.core as mx

from kipp.apple import metal, repack
from kipp.apple.layout import CHUNK_ELEMENTS, Linear, LinearError, SplitFFN
from kipp.formats.quant import BLOCK

DEQUANTIZE_ROWS = 8  # twin: from this many tokens, dequantize a shard for one BLAS matmul
MATVEC_ROWS = 8  # decode rounds up to this many tokens use the matvec kernel
MATVEC_ROWS_PER_GROUP = 4  # simdgroups (output rows) per threadgroup
TILE = 32  # matmul tile: tokens and outputs per threadgroup
FORMATS = ("bf16", "q8_0", "scale4_gs32", "affine4_gs32")


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
        # MLX's CPU quantized matmul costs one matvec per token: from DEQUANTIZE_ROWS tokens the
        # BLAS multiplies a transiently dequantized shard faster (a GPU keeps the quantized one)
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
    -> [M, N] float32, W's rows dequantized (kipp.formats.quant's arithmetic) CHUNK_ELEMENTS
    weights at a time. A kernel that fails its probe is replaced by this, with no second weight
    copy."""
    step = max(1, CHUNK_ELEMENTS // w.cols)
    return _in_order(x, [lambda r=r: _plane_rows(w, r, min(r + step, w.rows))
                         for r in range(0, w.rows, step)], transposed=True)


def _in_order(x: mx.array, chunks: list, transposed: bool) -> mx.array:
    """x @ each widened chunk (chunk^T when `transposed`), concatenated. Each widened chunk
    gets a +0.0 computed from the previous product (from x for the first) added: left free,
    MLX evaluates every widening of the graph before the products that use them (a BF16 head
    widened whole); tied this way, one chunk is float32 at a time, and only once its layer runs.
    (`mx.depends` on the chunk's source did not hold the peak down.)"""
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


def low_rank(x: mx.array, pair, rows: mx.array):
    """s * B (A x) of each row's LoRA adapter: x [T, in] float32, pair (A [N, r, in], B^T [N, r,
    out], s folded into B) of the round's N adapters, rows [T, N] one-hot (all zero: the base
    weights). Each adapter's A x is computed and masked (N is small); None when no adapter
    targets this projection."""
    if pair is None:
        return None
    a, b = pair
    xa = mx.einsum("ti,sri->tsr", x, a) * rows[:, :, None]  # [T, S, r]
    return mx.einsum("tsr,sro->to", xa, b)


def plus(y: mx.array, delta) -> mx.array:
    return y if delta is None else y + delta


def ffn_twin_lora(h: mx.array, ffn: SplitFFN, lora: dict, rows: mx.array,
                  streams=(None,)) -> mx.array:
    """ffn_twin with LoRA on gate, up and down: the shards' gate and up outputs are joined
    (intermediate order), adapted and activated whole; each shard's down takes its columns, and
    down's low-rank term reads the whole activation."""
    gates, ups = [], []
    for i, gate_up in enumerate(ffn.gate_up):
        y = _shard_matmul(h, gate_up.shards[0], gate_up.fmt, streams[i % len(streams)])
        gate, up = mx.split(y, 2, axis=-1)
        gates.append(gate)
        ups.append(up)
    gate = plus(mx.concatenate(gates, axis=-1), low_rank(h, lora.get("gate"), rows))
    up = plus(mx.concatenate(ups, axis=-1), low_rank(h, lora.get("up"), rows))
    act = gate / (1.0 + mx.exp(-gate)) * up
    out, lo = None, 0
    for i, down in enumerate(ffn.down):
        width = gates[i].shape[-1]
        part = _shard_matmul(act[:, lo:lo + width], down.shards[0], down.fmt,
                             streams[i % len(streams)])
        out = part if out is None else out + part
        lo += width
    return plus(out, low_rank(act, lora.get("down"), rows))
