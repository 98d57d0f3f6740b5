"""JaxBackend's kernel probes: every Pallas kernel variant a checkpoint will use, compiled and run
once at load on a small input against the jax.numpy twin that would replace it (kipp.probe runs
and judges them).

Variants: quant_matmul's two bodies, "matvec/<fmt>" (a few rows) and "matmul/<fmt>" (tile dot),
per weight format the step feeds it (kipp.cuda.plan's probe_formats); "decode_attention/<kv>"
and "prefill_attention/<kv>" for the KV scheme. Inputs are seeded random weights in the
layout's own format, activations, and a 4-block slab over scrambled block tables (two sequences
of 40 and 9 positions; the prefill probe's padding queries are left out of the comparison).
Each kernel runs through the step's own entry point on the backend's device, so a compile error
(Triton, ptxas), a launch error or a wrong result shows here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kipp.backend import KV_BLOCK
from kipp.cuda import kvcache, layout, twin_matmul
from kipp.cuda.pallas import decode_attention as decode_mod
from kipp.cuda.pallas import prefill_attention as prefill_mod
from kipp.cuda.pallas import quant_matmul as matmul_mod
from kipp.formats import quant
from kipp.formats.artifact import Tensor
from kipp.formats.registry import HEAD_DIM, KV_HEADS
from kipp.probe import Probe

# Kernel and twin doing the same float32 arithmetic in another order sit near 1e-13; rounding
# one operand to BF16 for the tensor cores costs about 1e-6; a planted 1% scale error is 1e-4.
EXACT_BOUND = 1e-7
TILE_BOUND = 1e-5  # tile dots that may round an operand to BF16
ROWS, COLS = 64, 256
TOKENS = {"matvec": 3, "matmul": 40}
LENGTHS = (40, 9)
TABLES = ((2, 0), (1, 3))


def probes(fmts, kv_scheme: str, query_heads: int, *, interpret: bool, device,
           seed: int = 0) -> list[Probe]:
    """The probes of a step that feeds quant_matmul weights in `fmts` (layout formats: "f32",
    "bf16" or a scheme) with a `kv_scheme` slab, on `device`."""
    rng = np.random.default_rng(seed)
    found = []
    for fmt in dict.fromkeys(fmts):
        w = jax.device_put(probe_weight(fmt, rng), device)
        for kind in ("matvec", "matmul"):
            x = jax.device_put(rng.standard_normal((TOKENS[kind], COLS)).astype(np.float32),
                               device)
            found.append(Probe(
                f"{kind}/{fmt}",
                lambda x=x, w=w: np.asarray(matmul_mod.quant_matmul(x, w, interpret=interpret)),
                lambda x=x, w=w: np.asarray(twin_matmul.linear(x, w)),
                EXACT_BOUND if kind == "matvec" else TILE_BOUND))
    return found + _attention_probes(kv_scheme, query_heads, interpret, device, rng)


def probe_weight(fmt: str, rng) -> layout.Linear:
    """A seeded [ROWS, COLS] weight packed as the layout holds format `fmt` (numpy)."""
    w = (rng.standard_normal((ROWS, COLS)) * 0.05).astype(np.float32)
    if fmt == "f32":
        return layout.Linear(w, fmt="f32")
    scheme = quant.scheme(fmt)
    raw = quant.quantize(w, scheme)
    return layout.pack_linear(Tensor("probe", (ROWS, COLS), scheme.ggml_type, raw.reshape(-1)),
                              "device")


def _slab(kv_scheme: str, device, rng):
    platform = device.platform
    shape = (4, KV_BLOCK, KV_HEADS, HEAD_DIM)
    rows = rng.standard_normal((4 * KV_BLOCK, KV_HEADS, HEAD_DIM)).astype(np.float32)
    cache = kvcache.kv_zeros(shape, kv_scheme, "cpu" if platform == "cpu" else "gpu")
    cache = kvcache.store_kv(cache, jnp.asarray(rows), jnp.arange(4 * KV_BLOCK))
    return jax.device_put(cache, device)


def _attention_probes(kv_scheme: str, query_heads: int, interpret: bool, device, rng):
    k, v = _slab(kv_scheme, device, rng), _slab(kv_scheme, device, rng)
    tables = jax.device_put(np.asarray(TABLES, np.int32), device)
    lengths = jax.device_put(np.asarray(LENGTHS, np.int32), device)
    q = jax.device_put(rng.standard_normal((2, query_heads, HEAD_DIM)).astype(np.float32),
                       device)
    decode = Probe(
        f"decode_attention/{kv_scheme}",
        lambda: np.asarray(decode_mod.decode_attention(q, k, v, lengths, tables,
                                                       interpret=interpret)),
        lambda: np.asarray(decode_mod.decode_attention_reference(q, k, v, lengths, tables)),
        TILE_BOUND)  # its dots take BF16 operands on tensor cores
    queries = 8  # sequence 0: positions 32..39; sequence 1: 0..4 and three padding slots
    pos = np.array([np.arange(32, 40), [0, 1, 2, 3, 4, -1, -1, -1]], np.int32)
    valid = pos >= 0
    query_pos = jax.device_put(pos, device)
    qp = jax.device_put(rng.standard_normal((2, queries, query_heads, HEAD_DIM))
                        .astype(np.float32), device)
    prefill = Probe(
        f"prefill_attention/{kv_scheme}",
        lambda: np.asarray(prefill_mod.prefill_attention(qp, k, v, query_pos, tables,
                                                         interpret=interpret))[valid],
        lambda: np.asarray(prefill_mod.paged_attention_reference(qp, k, v, query_pos,
                                                                 tables))[valid],
        TILE_BOUND)
    return [decode, prefill]
