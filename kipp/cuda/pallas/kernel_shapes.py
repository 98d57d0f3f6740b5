"""Every Pallas kernel call at the shapes the registry's checkpoints give it, as compile cases.

The deviceless H200 compile (kipp.cuda.aot) of these is what the tests and `python -m bench
kernels` run. Per Hugging Face checkpoint of the registry (0.6B to 32B; synthetic ones reuse
their widths) and per weight format of the GPU layout (bf16, q8_0, scale4_gs32, affine4_gs32),
the projections (q, k/v, o, gate/up, down, and the BF16 output head) at M = 1, 8 and 512 rows;
per query-head count and KV scheme, decode attention for 1 and 8 sequences over 2,048
positions and prefill attention for a 512-token chunk. Each case carries the work the kernel
must do: its FLOPs and the bytes it must move at least (weights as stored, activations in and
out, the KV it reads), for the roofline (`python -m bench kernels`).

Also the whole step's arguments as specs (`step_specs`), for compiling forward.step at a
checkpoint's shapes without its weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from kipp.backend import KV_BLOCK
from kipp.formats import registry
from kipp.formats.registry import HEAD_DIM, KV_HEADS, QUANT_BLOCK, VOCAB_SIZE

WEIGHT_FORMATS = ("bf16", "q8_0", "scale4_gs32", "affine4_gs32")
KV_SCHEMES = ("bf16", "q8_0")
ROWS = (1, 8, 512)
DECODE_CONTEXT = 2048  # positions each decode sequence attends over
PREFILL_TOKENS = 512  # one chunk at positions 0..511
# bytes per weight as stored: q8_0 34 per 32, scale4 18, affine4 20 (kipp.formats.quant)
WEIGHT_BYTES = {"f32": 4.0, "bf16": 2.0, "q8_0": 34 / 32, "scale4_gs32": 18 / 32,
                "affine4_gs32": 20 / 32}
KV_BYTES = {"bf16": 2.0, "q8_0": 136 / 128}  # per K or V element (kipp.formats.kvquant)


@dataclass(frozen=True)
class Case:
    """One kernel call: `build()` gives (function, argument specs) to compile."""

    kernel: str  # "matmul", "decode_attention", "prefill_attention"
    variant: str  # weight format or KV scheme
    shape: str  # e.g. "M=512 N=3072 K=1024" or "S=8 H=16 L=2048"
    where: str  # which projection of which checkpoints, e.g. "gate/up 0.6B"
    flops: int
    bytes: int
    build: Callable[[], tuple[Callable, tuple]]

    @property
    def id(self) -> str:
        return f"{self.kernel} {self.variant} {self.shape}"


def hub_checkpoints() -> list[registry.Checkpoint]:
    return [c for c in registry.REGISTRY.values() if not c.is_synthetic]


def short_name(c: registry.Checkpoint) -> str:
    return c.id.split("Qwen3-")[-1].split("-")[0]  # "Qwen/Qwen3-4B-Base" -> "4B"


def projections(c: registry.Checkpoint) -> dict[str, tuple[int, int]]:
    """{projection: (N rows out, K columns in)} of one checkpoint, the head included."""
    return {"q": (c.attention_width, c.hidden), "k/v": (c.kv_width, c.hidden),
            "o": (c.hidden, c.attention_width), "gate/up": (c.intermediate, c.hidden),
            "down": (c.hidden, c.intermediate), "head": (VOCAB_SIZE, c.hidden)}


def matmul_cases(formats=WEIGHT_FORMATS, rows=ROWS, checkpoints=None) -> list[Case]:
    """quant_matmul at every distinct (N, K) of the checkpoints (the head only in BF16)."""
    uses: dict[tuple[int, int], list[str]] = {}
    for c in checkpoints or hub_checkpoints():
        for name, nk in projections(c).items():
            label = f"{name} {short_name(c)}"
            if label not in uses.setdefault(nk, []):
                uses[nk].append(label)
    cases = []
    for (n, k), labels in uses.items():
        where = _where(labels)
        head = where.startswith("head")
        for fmt in ("bf16",) if head else formats:
            for m in rows:
                cases.append(Case("matmul", fmt, f"M={m} N={n} K={k}", where, 2 * m * n * k,
                                  int(n * k * WEIGHT_BYTES[fmt]) + 4 * m * (n + k),
                                  _matmul_builder(fmt, m, n, k)))
    return cases


def _where(labels: list[str]) -> str:
    """"gate/up 0.6B", "gate/up 0.6B,1.7B" (one projection name, several checkpoints)."""
    name = labels[0].split(" ")[0]
    sizes = [label.split(" ")[1] for label in labels if label.startswith(name + " ")]
    return f"{name} {','.join(dict.fromkeys(sizes))}"


def linear_spec(fmt: str, n: int, k: int, spec=jax.ShapeDtypeStruct):
    """A layout.Linear of specs [N, K] in `fmt` (kipp.cuda.layout's planes)."""
    from kipp.cuda.layout import Linear

    g = k // QUANT_BLOCK
    if fmt in ("f32", "bf16"):
        return Linear(spec((n, k), jnp.float32 if fmt == "f32" else jnp.bfloat16), fmt=fmt)
    width, dtype = (32, jnp.int8) if fmt == "q8_0" else (16, jnp.uint8)
    m = spec((n, g), jnp.float16) if fmt == "affine4_gs32" else None
    return Linear(spec((n, g, width), dtype), spec((n, g), jnp.float16), m, fmt=fmt)


def _matmul_builder(fmt, m, n, k):
    def build():
        from kipp.cuda.pallas.quant_matmul import quant_matmul

        x = jax.ShapeDtypeStruct((m, k), jnp.float32)
        return (lambda x, w: quant_matmul(x, w)), (x, linear_spec(fmt, n, k))
    return build


def attention_cases(schemes=KV_SCHEMES, checkpoints=None) -> list[Case]:
    """Decode (1 and 8 sequences) and prefill attention per query-head count and KV scheme."""
    heads: dict[int, list[str]] = {}
    for c in checkpoints or hub_checkpoints():
        heads.setdefault(c.query_heads, [])
        if short_name(c) not in heads[c.query_heads]:
            heads[c.query_heads].append(short_name(c))
    cases = []
    for h, names in heads.items():
        where = f"attention {','.join(names)}"
        for scheme in schemes:
            for s in (1, 8):
                flops = 4 * s * h * HEAD_DIM * DECODE_CONTEXT
                kv = 2 * s * DECODE_CONTEXT * KV_HEADS * HEAD_DIM * KV_BYTES[scheme]
                cases.append(Case("decode_attention", scheme, f"S={s} H={h} L={DECODE_CONTEXT}",
                                  where, flops, int(kv) + 8 * s * h * HEAD_DIM,
                                  _decode_builder(scheme, s, h)))
            t = PREFILL_TOKENS
            flops = 4 * h * HEAD_DIM * t * (t + 1) // 2  # causal: query p sees p + 1 keys
            kv = 2 * t * KV_HEADS * HEAD_DIM * KV_BYTES[scheme]
            cases.append(Case("prefill_attention", scheme, f"S=1 H={h} T={t}", where, flops,
                              int(kv) + 8 * t * h * HEAD_DIM, _prefill_builder(scheme, t, h)))
    return cases


def slab_spec(scheme: str, blocks: int, spec=jax.ShapeDtypeStruct):
    """One layer's K or V slab [blocks, 32, 8, 128] in `scheme` (GPU dtypes)."""
    from kipp.cuda.kvcache import QuantizedKV

    shape = (blocks, KV_BLOCK, KV_HEADS, HEAD_DIM)
    if scheme == "q8_0":
        return QuantizedKV(spec(shape, jnp.int8), spec(shape[:-1] + (4,), jnp.float16))
    return spec(shape, jnp.bfloat16)


def _decode_builder(scheme, s, h):
    def build():
        from kipp.cuda.pallas.decode_attention import decode_attention

        width = DECODE_CONTEXT // KV_BLOCK
        slab = slab_spec(scheme, s * width)
        i32 = jnp.int32
        args = (jax.ShapeDtypeStruct((s, h, HEAD_DIM), jnp.float32), slab, slab,
                jax.ShapeDtypeStruct((s,), i32), jax.ShapeDtypeStruct((s, width), i32))
        return (lambda *a: decode_attention(*a)), args
    return build


def _prefill_builder(scheme, t, h):
    def build():
        from kipp.cuda.pallas.prefill_attention import prefill_attention

        width = t // KV_BLOCK
        slab = slab_spec(scheme, width)
        i32 = jnp.int32
        args = (jax.ShapeDtypeStruct((1, t, h, HEAD_DIM), jnp.float32), slab, slab,
                jax.ShapeDtypeStruct((1, t), i32), jax.ShapeDtypeStruct((1, width), i32))
        return (lambda *a: prefill_attention(*a)), args
    return build


def all_cases(checkpoints=None) -> list[Case]:
    return matmul_cases(checkpoints=checkpoints) + attention_cases(checkpoints=checkpoints)


def step_specs(c: registry.Checkpoint, scheme: str, kv_scheme: str = "bf16", *, tokens: int,
               seqs: int, queries: int, blocks: int = 64, num_blocks: int = 256):
    """(params, kv, rope, round arrays) of forward.step as ShapeDtypeStructs at checkpoint
    `c`'s shapes: weights in the GPU layout of `scheme` (layout.prepare_weights' tree), a KV
    slab of `num_blocks` blocks per layer, and a round of `tokens` token rows in `seqs`
    sequences of up to `queries` queries each, with one logits row per sequence."""
    from kipp.cuda.forward import RoundArrays
    from kipp.cuda.layout import NORMS, PROJECTIONS

    S = jax.ShapeDtypeStruct
    widths = projections(c)
    shapes = {"q": widths["q"], "k": widths["k/v"], "v": widths["k/v"], "o": widths["o"],
              "gate": widths["gate/up"], "up": widths["gate/up"], "down": widths["down"]}
    norms = {"attn_norm": c.hidden, "q_norm": HEAD_DIM, "k_norm": HEAD_DIM, "ffn_norm": c.hidden}
    layers = []
    for _ in range(c.layers):
        layer = {p: linear_spec(scheme, *shapes[p]) for p in PROJECTIONS}
        layer.update({n: S((norms[n],), jnp.float32) for n in NORMS})
        layers.append(layer)
    table = S((VOCAB_SIZE, c.hidden), jnp.bfloat16)
    params = {"embed": table, "head": None if c.tied else table,
              "output_norm": S((c.hidden,), jnp.float32), "layers": layers}
    slab = slab_spec(kv_scheme, num_blocks)
    kv = tuple((slab, slab) for _ in range(c.layers))
    rope = (S((c.context_length, HEAD_DIM), jnp.float32),) * 2
    rows = {"tokens": (tokens,), "positions": (tokens,), "slots": (tokens,),
            "query_index": (seqs, queries), "query_pos": (seqs, queries),
            "token_query": (tokens,), "block_tables": (seqs, blocks), "logit_rows": (seqs,),
            "adapter_slots": (tokens,), "adapter_active": (0,)}
    arrays = RoundArrays(**{f: S(shape, jnp.int32) for f, shape in rows.items()})
    return params, kv, rope, arrays
