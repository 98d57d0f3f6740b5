"""MLXBackend's kernel probes: every Metal kernel variant a checkpoint will use, run once at load
on a small input against the twin that would replace it (kipp.probe runs and judges them).

Variants: the decode matvec and the prefill matmul in the artifact's weight format and in BF16
(the head), and decode attention for the KV scheme over the KV heads this process holds.
Inputs are seeded and small (64 x 256 weights quantized by kipp.formats.quant; 3 and 40
tokens: a partial 32-token tile past a full one; two sequences of 40 and 9 positions over a
scrambled block table). The kernels are reached
the way the model reaches them, with the backend's kernel runner (kipp.apple.metal), so
whatever runs the Metal source there is what gets probed; the twins are the ones the backend
would run instead (`linear.planes_twin`, `attention.attention_twin`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kipp.apple import attention, layout, linear, repack
from kipp.apple.kvcache import KVSlab
from kipp.backend import KV_BLOCK
from kipp.formats import quant
from kipp.formats.registry import HEAD_DIM, KV_HEADS
from kipp.probe import Probe

# Kernel and twin compute the same float32 products from the same weights in another order
# (and Metal's fast-math exp): NMSE near 1e-13; a kernel's kind of fault (a wrong scale, a stale
# tile, an index off by one) moves it by 1e-4 and more.
BOUND = 1e-7
ROWS, COLS = 64, 256  # probe weight [N, K]: two 32-output tiles, eight 32-weight blocks
TOKENS = {"matvec": 3, "matmul": 40}
LENGTHS = (40, 9)  # positions seen by the two probe sequences
TABLES = ((2, 0), (1, 3))  # their block tables (scrambled)


def probes(scheme: str, kv_scheme: str, query_heads: int, seed: int = 0,
           runner=None, kv_heads: int = KV_HEADS) -> list[Probe]:
    """The probes of a checkpoint in weight scheme `scheme` with `kv_scheme` KV, the kernels
    run by `runner` (kipp.apple.metal: None is MLX on Metal; the Metal emulator; a test's).
    `query_heads`, `kv_heads`: the heads this process attends over (a tensor-parallel rank's
    share), so decode attention is probed at the slab it will read."""
    rng = np.random.default_rng(seed)
    found = []
    for fmt in dict.fromkeys((scheme, "bf16")):  # the head is BF16 whatever the scheme
        w = probe_weight(fmt, rng)
        for kind, kernel in (("matvec", linear.matvec), ("matmul", linear.matmul)):
            x = mx.array(rng.standard_normal((TOKENS[kind], COLS)).astype(np.float32))
            found.append(Probe(f"{kind}/{fmt}",
                               lambda kernel=kernel, x=x, w=w: np.array(kernel(x, w, runner)),
                               lambda x=x, w=w: np.array(linear.planes_twin(x, w)), BOUND))
    found.append(_attention_probe(kv_scheme, query_heads, kv_heads, rng, runner))
    return found


def sources(scheme: str, kv_scheme: str) -> tuple:
    """The specs (kipp.apple.metal.KernelSpec: name and source) of every kernel probed."""
    formats = dict.fromkeys((scheme, "bf16"))
    return tuple(linear.kernel_spec(kind, fmt) for fmt in formats
                 for kind in ("matvec", "matmul")) + (attention.kernel_spec(kv_scheme),)


def probe_weight(fmt: str, rng) -> layout.Linear:
    """A seeded [ROWS, COLS] weight in `fmt`, as the kernels' planes (quant's bytes)."""
    raw = quant.quantize((rng.standard_normal((ROWS, COLS)) * 0.05).astype(np.float32), fmt)
    if fmt == "bf16":
        return layout.Linear(fmt, ROWS, COLS, planes=(mx.array(raw.view("<u2")),))
    p = repack.to_planes(raw, fmt, COLS)
    planes = tuple(mx.array(a) for a in (p.q, p.d, p.m) if a is not None)
    return layout.Linear(fmt, ROWS, COLS, planes=planes)


def _attention_probe(kv_scheme: str, query_heads: int, kv_heads: int, rng, runner) -> Probe:
    slots = 4 * KV_BLOCK
    k, v = KVSlab(1, slots, kv_scheme, kv_heads), KVSlab(1, slots, kv_scheme, kv_heads)
    everywhere = mx.array(np.arange(slots, dtype=np.int32))
    for slab in (k, v):
        rows = rng.standard_normal((slots, kv_heads, HEAD_DIM)).astype(np.float32)
        slab.store(0, mx.array(rows), everywhere)
    mx.eval(k.arrays() + v.arrays())
    q = mx.array(rng.standard_normal((len(LENGTHS), query_heads, HEAD_DIM)).astype(np.float32))
    tables = mx.array(np.asarray(TABLES, np.int32))
    lengths = mx.array(np.asarray(LENGTHS, np.int32))

    def kernel():
        planes = k.kernel_planes(0) + v.kernel_planes(0)
        return np.array(attention.decode_attention(q, planes, tables, lengths, kv_scheme,
                                                   runner=runner))

    def twin():
        outs = []
        for s, (table, length) in enumerate(zip(TABLES, LENGTHS)):
            p = np.arange(length)
            visible = mx.array((np.asarray(table)[p // KV_BLOCK] * KV_BLOCK
                                + p % KV_BLOCK).astype(np.int32))
            outs.append(attention.attention_twin(q[s:s + 1], k.rows(0, visible),
                                                 v.rows(0, visible)))
        return np.array(mx.concatenate(outs, axis=0))

    return Probe(f"decode_attention/{kv_scheme}", kernel, twin, BOUND)
