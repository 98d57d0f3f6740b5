"""Weights prepared once, at load, in the layout the device runs fast.

Two layouts, chosen per device (`choose_layout`), both exact images of the artifact's values:

- "device" (GPU): projections stay as stored: BF16 `[out, in]`, or the quantized scheme's
  packed planes (never widened): q8_0 -> int8 `[out, in/32, 32]`; scale4_gs32 and affine4_gs32
  -> uint8 nibbles `[out, in/32, 16]` in GGML order (byte j: element j low, j + 16 high); plus
  fp16 scales `d` (and affine4's `m`) `[out, in/32]`, the file's own bits. Embedding and
  output head stay BF16.
- "f32" (CPU): every projection, the embedding and the head widened to float32 (exact: BF16
  widening and the dequantizer's float32 arithmetic are lossless). XLA's CPU backend fuses a
  widening into a one-row dot, but for more rows it falls off its fast matrix path. Measured
  with `python -m kipp.cuda.bench --layouts` on this 2-core box, under load from other jobs
  (G weights/s for 8 x [3072, 1024]; M = rows per dot):

      layout          M=1    M=8    M=64
      float32         2.0    0.79   0.25
      BF16            4.0    0.18   0.13
      q8_0 planes     4.0    0.16   0.11
      nibble planes   0.34   0.13   0.10

  float32 is 4-6x faster for every multi-row dot (prefill, batched decode) and at most 2x
  slower for single-sequence decode, and nibble planes are slow everywhere, so the CPU pays
  4 bytes per weight in memory for one layout that is fast for both. The packed planes run on
  CPU too (layout="device"), which is how the tests check the GPU's twins here.

Norms are float32 everywhere (the artifact stores them F32). Everything is a per-layer list of
separate arrays: XLA's CPU backend copies a slice of a stacked [layers, ...] weight before a dot
(measured 0.7 GB/s stacked vs ~15 GB/s separate), and a single [layers, ...] KV buffer is copied
whole by a step that updates one layer's slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kipp.artifact import Artifact, Tensor
from kipp.quant import BLOCK, GGML_BF16, GGML_F32, SCHEMES_BY_GGML_TYPE

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
NORMS = ("attn_norm", "q_norm", "k_norm", "ffn_norm")
LAYOUTS = ("f32", "device")


@dataclass(frozen=True)
class Linear:
    """One prepared projection `[out, in]`; `fmt` says how `w` (and `d`, `m`) hold it.

    fmt "f32" / "bf16": w [out, in]. fmt "q8_0": w int8 [out, in/32, 32], d fp16 [out, in/32].
    fmt "scale4_gs32": w uint8 [out, in/32, 16] nibbles, d. fmt "affine4_gs32": w, d, m.
    """

    w: Any
    d: Any = None
    m: Any = None
    fmt: str = "f32"  # static: part of the compiled program, not an array

    @property
    def shape(self) -> tuple[int, int]:
        rows = self.w.shape[0]
        if self.fmt in ("f32", "bf16"):
            return rows, self.w.shape[1]
        return rows, self.w.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (self.w, self.d, self.m) if a is not None)


jax.tree_util.register_dataclass(Linear, data_fields=["w", "d", "m"], meta_fields=["fmt"])


def choose_layout(platform: str) -> str:
    """float32 on XLA's CPU (see the module docstring), the artifact's own layout elsewhere."""
    return "f32" if platform == "cpu" else "device"


def pack_linear(t: Tensor, layout: str) -> Linear:
    """A projection tensor in the chosen layout, as numpy arrays (placed on a device later)."""
    if layout == "f32":
        return Linear(np.ascontiguousarray(t.f32()), fmt="f32")
    if t.ggml_type == GGML_BF16:
        return Linear(t.bf16(), fmt="bf16")
    if t.ggml_type == GGML_F32:
        return Linear(t.f32(), fmt="f32")
    scheme = SCHEMES_BY_GGML_TYPE[t.ggml_type]
    out, cols = t.shape
    blocks = t.quantized_rows(0, out).reshape(out, cols // BLOCK, scheme.block_bytes)
    d = _fp16_plane(blocks, 0)
    if scheme.name == "q8_0":
        return Linear(np.ascontiguousarray(blocks[..., 2:]).view(np.int8), d, fmt="q8_0")
    nibbles = np.ascontiguousarray(blocks[..., scheme.block_bytes - 16:])
    m = _fp16_plane(blocks, 2) if scheme.name == "affine4_gs32" else None
    return Linear(nibbles, d, m, fmt=scheme.name)


def _fp16_plane(blocks: np.ndarray, offset: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view("<f2")[..., 0]


def prepare_weights(artifact: Artifact, layout: str) -> dict[str, Any]:
    """The model's parameters as a pytree of numpy arrays in `layout` (see module docstring).

    {"embed": [vocab, hidden], "head": [vocab, hidden] or None when tied (the embed serves),
     "output_norm": [hidden], "layers": [{projection: Linear, norm: [n]} per layer]}
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    w = artifact.weights
    table = w.token_embd.f32() if layout == "f32" else w.token_embd.bf16()
    head = None if w.tied else (w.output.f32() if layout == "f32" else w.output.bf16())
    layers = []
    for layer in w.layers:
        params = {name: pack_linear(getattr(layer, name), layout) for name in PROJECTIONS}
        params.update({name: getattr(layer, name).f32() for name in NORMS})
        layers.append(params)
    return {"embed": table, "head": head, "output_norm": w.output_norm.f32(), "layers": layers}


def to_device(params, device=None, shardings=None):
    """Place a prepared pytree on `device` (or per-leaf `shardings`, a matching pytree)."""
    if shardings is not None:
        return jax.tree.map(lambda a, s: jax.device_put(a, s), params, shardings)
    return jax.device_put(params, device)


def widen_bf16(x: jax.Array) -> jax.Array:
    """BF16 (or its uint16 bit pattern) -> float32, exactly."""
    if x.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.uint32) << 16, jnp.float32)
    return x.astype(jnp.float32)


def round_bf16(x: jax.Array, dtype) -> jax.Array:
    """float32 -> BF16 (round to nearest even) stored as `dtype`: bfloat16 or its uint16 bits."""
    b = x.astype(jnp.bfloat16)
    return jax.lax.bitcast_convert_type(b, jnp.uint16) if dtype == jnp.uint16 else b
