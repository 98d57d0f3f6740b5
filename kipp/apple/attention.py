"""Causal grouped-query attention over the paged KV slab: a Metal decode kernel and the MLX twin.

Twin (every path's prefill, and decode without Metal): per piece of a round, gather the visible
slots through the block table into dense [8, P, 128] float32 K and V and run
`mx.fast.scaled_dot_product_attention` with the "causal" mask, which MLX aligns lower-right
(the last query sees the last key). On Metal that is MLX's own fused kernel, so prefill has no
Kipp kernel. Kernel `decode_attention` (Metal): one query per sequence, split along the context
(split-K, "flash decoding"), which is what pays on long contexts: grid (32 lanes, G query heads
of a KV head, S sequences x KVH KV heads x splits; KVH is 8, or a tensor-parallel rank's
share of them); a threadgroup is the G simdgroups sharing one
KV head and one range of `blocks_per_split` blocks, so each K/V row serves the whole group. A
lane holds 4 of the 128 dims; each simdgroup writes its range's unnormalised output, running
max and denominator, and the wrapper merges the ranges as the online softmax does. Variants:
BF16 KV (uint16 bits) and q8_0 KV (int8 q and fp16 d planes, d * q).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from kipp.apple import metal
from kipp.apple.linear import on_stream
from kipp.backend import KV_BLOCK
from kipp.errors import KippError
from kipp.formats.kvquant import ROW_BLOCKS
from kipp.formats.registry import HEAD_DIM, KV_HEADS

SCALE = HEAD_DIM ** -0.5
BLOCKS_PER_SPLIT = 16  # 512 positions per split


class AttentionError(KippError, ValueError):
    """A kernel call with arrays of the wrong shape or dtype; nothing ran."""



def attention_twin(q: mx.array, keys: mx.array, values: mx.array, streams=(None,)) -> mx.array:
    """q [n, H, 128] (the last n of P positions); keys, values [P, 8, 128] (or a rank's
    share of the KV heads and the matching query heads) -> [n, H * 128].

    With several CPU streams the KV heads are split into contiguous ranges, one per stream
    (a KV head and its G query heads stay together), each its own SDPA call: the same
    per-head arithmetic, so bitwise the one-call result, on every core."""
    n, heads = q.shape[0], q.shape[1]
    kv_heads = keys.shape[1]  # fewer than KV_HEADS on a tensor-parallel rank
    group = heads // kv_heads
    bounds = [(kv_heads * i // len(streams), kv_heads * (i + 1) // len(streams))
              for i in range(len(streams))]
    outs = []
    for stream, (lo, hi) in zip(streams, bounds):
        if hi == lo:
            continue
        with on_stream(stream):
            out = mx.fast.scaled_dot_product_attention(
                q[:, lo * group:hi * group].transpose(1, 0, 2)[None],
                keys[:, lo:hi].transpose(1, 0, 2)[None], values[:, lo:hi].transpose(1, 0, 2)[None],
                scale=SCALE, mask="causal" if n > 1 else None)
            outs.append(out[0].transpose(1, 0, 2).reshape(n, -1))  # [n, (hi - lo) G * 128]
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)


_LOAD_ROW = {
    # 4 consecutive dims of one head-row: `row` is (slot * KVH + kv head), `dim` the first dim
    "bf16": """
        inline float4 load_k(const device uint16_t* k, size_t row, uint dim) {
            const device uint16_t* p = k + row * 128 + dim;
            return float4(kipp_bf16(p[0]), kipp_bf16(p[1]), kipp_bf16(p[2]), kipp_bf16(p[3]));
        }""",
    "q8_0": """
        inline float4 load_q8(const device int8_t* q, const device uint16_t* d, size_t row,
                              uint dim) {
            const float scale = kipp_fp16(d[row * 4 + dim / 32]);  // dim..dim+3 share a block
            const device int8_t* p = q + row * 128 + dim;
            return scale * float4(float(p[0]), float(p[1]), float(p[2]), float(p[3]));
        }""",
}
_INPUTS = {"bf16": ("q", "k", "v", "tables", "lengths"),
           "q8_0": ("q", "kq", "kd", "vq", "vd", "tables", "lengths")}
_READ = {"bf16": ("load_k(k, row, dim)", "load_k(v, row, dim)"),
         "q8_0": ("load_q8(kq, kd, row, dim)", "load_q8(vq, vd, row, dim)")}

HEADER = """
inline float kipp_bf16(uint16_t bits) { return as_type<float>(uint(bits) << 16); }
inline float kipp_fp16(uint16_t bits) { return float(as_type<half>(bits)); }
{LOAD_ROW}
"""

# Template constants: H (query heads), KVH (KV heads in the slab: 8, fewer on a tensor-parallel
# rank), G (= H / KVH), B (table width), BPS (blocks per split), SPLITS. Inputs: q float32
# [S, H, 128]; the layer's slab planes [slots, KVH, ...]; tables int32 [S, B];
# lengths int32 [S] (visible positions: the query's position + 1). Outputs: o float32
# [S, H, SPLITS, 128], ml float32 [S, H, SPLITS, 2] (running max, denominator).
DECODE_SOURCE = """
    constexpr float SCALE = {SCALE}f;  // 128 ** -0.5
    constexpr float MASKED = -1e30f;  // finite: exp(MASKED - x) is 0 in any math mode
    const uint lane = thread_index_in_simdgroup;
    const uint g = thread_position_in_grid.y;
    const uint z = thread_position_in_grid.z;
    const uint c = z % SPLITS;
    const uint kvh = (z / SPLITS) % KVH;
    const uint s = z / (SPLITS * KVH);
    const uint h = kvh * G + g;
    const uint dim = lane * 4;
    const int length = lengths[s];
    const float4 qv = float4(q[(size_t(s) * H + h) * 128 + dim + 0],
                             q[(size_t(s) * H + h) * 128 + dim + 1],
                             q[(size_t(s) * H + h) * 128 + dim + 2],
                             q[(size_t(s) * H + h) * 128 + dim + 3]) * SCALE;
    float m = MASKED;
    float l = 0.0f;
    float4 acc = float4(0.0f);
    const int first = int(c) * BPS * 32;
    const int stop = min(first + BPS * 32, length);
    for (int p = first; p < stop; ++p) {
        const int slot = tables[size_t(s) * B + p / 32] * 32 + p % 32;
        const size_t row = size_t(slot) * KVH + kvh;
        const float score = simd_sum(dot(qv, {READ_K}));
        const float m_new = max(m, score);
        const float alpha = exp(m - m_new);  // 0 on the first position (m = MASKED)
        const float weight = exp(score - m_new);
        acc = acc * alpha + weight * {READ_V};
        l = l * alpha + weight;
        m = m_new;
    }
    const size_t out = (size_t(s) * H + h) * SPLITS + c;
    o[out * 128 + dim + 0] = acc.x;
    o[out * 128 + dim + 1] = acc.y;
    o[out * 128 + dim + 2] = acc.z;
    o[out * 128 + dim + 3] = acc.w;
    if (lane == 0) {
        ml[out * 2 + 0] = m;
        ml[out * 2 + 1] = l;
    }
"""


def kernel_source(kv_scheme: str) -> tuple[str, str]:
    """(header, body) of the decode kernel for BF16 or q8_0 KV."""
    if kv_scheme not in _INPUTS:
        raise AttentionError(f"no decode attention kernel for kv_scheme {kv_scheme!r}")
    read_k, read_v = _READ[kv_scheme]
    body = (DECODE_SOURCE.replace("{READ_K}", read_k).replace("{READ_V}", read_v)
            .replace("{SCALE}", repr(SCALE)))
    return HEADER.replace("{LOAD_ROW}", _LOAD_ROW[kv_scheme]), body


def input_names(kv_scheme: str) -> tuple[str, ...]:
    return _INPUTS[kv_scheme]


def kernel_spec(kv_scheme: str) -> metal.KernelSpec:
    """What the decode kernel for `kv_scheme` is built from (kipp.apple.metal), cached on the
    source texts (as linear.kernel_spec)."""
    return _spec(kv_scheme, DECODE_SOURCE, HEADER, _LOAD_ROW.get(kv_scheme), _READ.get(kv_scheme))


@functools.lru_cache(maxsize=None)
def _spec(kv_scheme: str, *texts) -> metal.KernelSpec:
    header, body = kernel_source(kv_scheme)
    return metal.KernelSpec(f"kipp_decode_attention_{kv_scheme}", _INPUTS[kv_scheme],
                            ("o", "ml"), body, header)


def kernel(kv_scheme: str, runner=None):
    """The decode attention kernel object for `kv_scheme`, built once per process per runner
    (None: MLX)."""
    return metal.kernel(kernel_spec(kv_scheme), runner)


def check_decode_call(q, planes, tables, lengths, kv_scheme: str
                      ) -> tuple[int, int, int, int]:
    """(S, H, KVH, B) after checking every array's dtype and shape against the kernel's
    contract. KVH, the slab's KV heads, is Qwen3's 8 or a tensor-parallel rank's share."""
    if kv_scheme not in _INPUTS:
        raise AttentionError(f"no decode attention kernel for kv_scheme {kv_scheme!r}")
    if q.dtype != mx.float32 or q.ndim != 3 or q.shape[2] != HEAD_DIM:
        raise AttentionError(f"q must be float32 [S, H, {HEAD_DIM}], got {q.dtype} "
                             f"{tuple(q.shape)}")
    s, h, _ = q.shape
    want = ((mx.uint16, HEAD_DIM),) if kv_scheme == "bf16" else (
        (mx.int8, HEAD_DIM), (mx.uint16, ROW_BLOCKS))
    if len(planes) != 2 * len(want):
        raise AttentionError(f"{kv_scheme} KV takes {2 * len(want)} planes (K then V), got "
                             f"{len(planes)}")
    slots = planes[0].shape[0]
    kvh = planes[0].shape[1] if planes[0].ndim == 3 else 0
    if not 1 <= kvh <= KV_HEADS or KV_HEADS % kvh or h % kvh:
        raise AttentionError(f"the slab's {kvh} KV heads: expected {KV_HEADS} or a share of them "
                             f"(1, 2 or 4) over which the {h} query heads group")
    if slots % KV_BLOCK:
        raise AttentionError(f"the slab's {slots} slots are not whole {KV_BLOCK}-slot blocks")
    for i, plane in enumerate(planes):
        dtype, last = want[i % len(want)]
        if plane.dtype != dtype or tuple(plane.shape) != (slots, kvh, last):
            raise AttentionError(f"KV plane {i} must be {dtype} [{slots}, {kvh}, {last}], "
                                 f"got {plane.dtype} {tuple(plane.shape)}")
    if tables.dtype != mx.int32 or tables.ndim != 2 or tables.shape[0] != s:
        raise AttentionError(f"tables must be int32 [{s}, B], got {tables.dtype} "
                             f"{tuple(tables.shape)}")
    if lengths.dtype != mx.int32 or tuple(lengths.shape) != (s,):
        raise AttentionError(f"lengths must be int32 [{s}], got {lengths.dtype} "
                             f"{tuple(lengths.shape)}")
    return s, h, kvh, tables.shape[1]


def decode_attention(q: mx.array, planes: tuple, tables: mx.array, lengths: mx.array,
                     kv_scheme: str = "bf16", blocks_per_split: int = BLOCKS_PER_SPLIT,
                     runner=None) -> mx.array:
    """q [S, H, 128] -> [S, H * 128]: each sequence's query over its first `lengths[s]`
    positions through `tables` (module docstring). `planes`: K's then V's kernel planes
    (KVSlab.kernel_planes). Table entries past a sequence's length are never read, but must be
    valid slab blocks (pad with 0). `runner`: who runs the Metal source (kipp.apple.metal)."""
    s, h, kvh, b = check_decode_call(q, planes, tables, lengths, kv_scheme)
    bps = max(1, min(blocks_per_split, b))
    splits = -(-b // bps)
    g = h // kvh
    o, ml = kernel(kv_scheme, runner)(
        inputs=[q, *planes, tables, lengths],
        template=[("H", h), ("KVH", kvh), ("G", g), ("B", b), ("BPS", bps), ("SPLITS", splits)],
        grid=(32, g, s * kvh * splits), threadgroup=(32, g, 1),
        output_shapes=[(s, h, splits, HEAD_DIM), (s, h, splits, 2)],
        output_dtypes=[mx.float32, mx.float32])
    return merge_splits(o, ml[..., 0], ml[..., 1]).reshape(s, h * HEAD_DIM)


def merge_splits(o: mx.array, m: mx.array, l: mx.array) -> mx.array:
    """Combine split-K partials: o [S, H, C, 128] unnormalised, m and l [S, H, C] -> [S, H, 128]."""
    top = mx.max(m, axis=-1, keepdims=True)  # finite: split 0 always holds position 0
    weight = mx.exp(m - top)  # 0 for an empty split (m = MASKED = -1e30)
    total = mx.sum(weight * l, axis=-1, keepdims=True)
    return mx.sum(o * weight[..., None], axis=-2) / total

