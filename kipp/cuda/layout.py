"""Weights prepared once, at load, in the layout the device runs fast.

Three layouts, all exact images of the artifact's values (kipp.cuda.plan picks one):
- "device": projections as stored, never widened: BF16 `[out, in]`, or the scheme's planes:
  q8_0 -> int8 `[out, in/32, 32]`; scale4_gs32 and affine4_gs32 -> uint8 nibbles
  `[out, in/32, 16]` in GGML order (byte j: element j low, j + 16 high); fp16 scales `d` (and
  affine4's `m`) `[out, in/32]`, the file's own bits. Embedding and head stay BF16. A GPU
  always runs this one; on one CPU Kipp's stored CPU matmul (kipp.cuda.cpu.stored_matmul)
  reads it as it is.
- "f32" (CPU): every projection, the embedding and the head widened to float32 (exact).
- "panels" (one CPU device): float32 packed for Kipp's CPU matmul (kipp.cuda.cpu.matmul).
Norms are float32 everywhere. `place_weights(stacked=True)` stacks each layer tensor over the
layers, `[layers, ...]`, for the scanned step (kipp.cuda.forward); otherwise "layers" is a list
of per-layer dicts.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from kipp.formats.artifact import Artifact, Tensor
from kipp.formats.quant import BLOCK, GGML_BF16, GGML_F32, SCHEMES_BY_GGML_TYPE

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
NORMS = ("attn_norm", "q_norm", "k_norm", "ffn_norm")
LAYOUTS = ("f32", "device", "panels")


@dataclass(frozen=True)
class Linear:
    """One prepared projection `[out, in]`; `fmt` says how `w` (and `d`, `m`) hold it.

    fmt "f32" / "bf16": w [out, in]. fmt "q8_0": w int8 [out, in/32, 32], d fp16 [out, in/32].
    fmt "scale4_gs32": w uint8 [out, in/32, 16] nibbles, d. fmt "affine4_gs32": w, d, m.
    fmt "f32p": w float32 panels [out/8, in, 8] (kipp.cuda.cpu.matmul).
    """

    w: Any
    d: Any = None
    m: Any = None
    fmt: str = "f32"  # static: part of the compiled program, not an array

    @property
    def shape(self) -> tuple[int, int]:
        rows = self.w.shape[0]
        if self.fmt == "f32p":
            return rows * self.w.shape[2], self.w.shape[1]
        if self.fmt in ("f32", "bf16"):
            return rows, self.w.shape[1]
        return rows, self.w.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (self.w, self.d, self.m) if a is not None)


jax.tree_util.register_dataclass(Linear, data_fields=["w", "d", "m"], meta_fields=["fmt"])


def pack_linear(t: Tensor, layout: str, bits: bool = False) -> Linear:
    """A projection tensor in the chosen layout, as numpy arrays (placed on a device later);
    `bits`: BF16 as its uint16 bit pattern (the CPU twins', `_bf16`)."""
    if layout == "f32":
        return Linear(np.ascontiguousarray(t.f32()), fmt="f32")
    if t.ggml_type == GGML_BF16:
        return Linear(_bf16(t, bits), fmt="bf16")
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


def _bf16(t: Tensor, bits: bool) -> np.ndarray:
    # XLA's CPU has no native BF16: it widens a BF16 operand it slices into a whole float32 copy
    # (hoisted out of twin_matmul's loops), while widening uint16 bits (a shift) fuses into a dot
    return t.bf16().view(np.uint16) if bits else t.bf16()


def _fp16_plane(blocks: np.ndarray, offset: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view("<f2")[..., 0]


def prepare_weights(artifact: Artifact, layout: str) -> dict[str, Any]:
    """The model's parameters as a pytree of numpy arrays in `layout` (see module docstring).

    {"embed": [vocab, hidden], "head": [vocab, hidden] or None when tied (the embed serves),
     "output_norm": [hidden], "layers": [{projection: Linear, norm: [n]} per layer]}
    """
    return place_weights(artifact, layout, lambda name, value: value)


def place_weights(artifact: Artifact, layout: str, place: Callable[[str, Any], Any],
                  bits: bool = False, stacked: bool = False) -> dict[str, Any]:
    """prepare_weights' pytree, one tensor at a time: each is packed, handed to
    `place(name, value)` (name: "embed", "head", "output_norm", a projection or a norm; it puts
    the value on a device and returns what the tree holds), then its mapped pages are released
    (Artifact.release). So the host never holds more than one packed tensor beside what is
    placed, and the file's pages and the placed copies are not resident together. `bits`: BF16
    tensors of the "device" layout as uint16 bit patterns (the CPU twins').

    `stacked`: "layers" is one {name: value} dict whose arrays are the layers' stacked
    `[layers, ...]` (the scanned step): each layer's tensor is copied into a
    fresh 64-byte aligned host stack and released, and `place` gets the whole stack once (on a
    CPU `to_device` places it without a copy: the stack is the placed array).

    "panels" (kipp.cuda.cpu.matmul): every projection and the output head as
    Linear(pack(float32), fmt="f32p"); a tied checkpoint's embedding is the head's Linear itself
    (looked up by cpu_matmul.rows), an untied one's stays a float32 [vocab, hidden]."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    w = artifact.weights
    if layout == "panels":
        from kipp.cuda.cpu import matmul as cpu_matmul

        def projection(t):
            return Linear(cpu_matmul.pack(t.f32()), fmt="f32p")
    else:
        def projection(t):
            return pack_linear(t, layout, bits)

    def put(name, tensor, value):
        placed = jax.block_until_ready(place(name, value))  # copied before the pages go
        artifact.release(tensor)
        return placed

    def table(t):  # an embedding looked up by rows
        return t.f32() if layout in ("f32", "panels") else _bf16(t, bits)

    def head(t):  # the output head (a tied embedding too): the panels layout multiplies panels
        return projection(t) if layout == "panels" else table(t)

    # (no local holds a packed value: it would stay alive, 594 MiB for the 0.6B's tied panels,
    # until every layer is placed)
    tree = {"embed": put("embed", w.token_embd,
                         head(w.token_embd) if w.tied else table(w.token_embd)), "head": None}
    if not w.tied:
        tree["head"] = put("head", w.output, head(w.output))
    if stacked:
        tree["layers"] = {name: place(name, _stack(artifact, name, projection))
                          for name in PROJECTIONS + NORMS}
    else:
        layers = []
        for layer in w.layers:
            params = {name: put(name, getattr(layer, name), projection(getattr(layer, name)))
                      for name in PROJECTIONS}
            params.update({name: place(name, getattr(layer, name).f32()) for name in NORMS})
            layers.append(params)
        tree["layers"] = layers
    tree["output_norm"] = place("output_norm", w.output_norm.f32())
    # pages the later copies' faults mapped around their own tensors, in tensors already
    # released (about 12 MiB of the 0.6B's BF16 file)
    artifact.release_file()
    return tree


def _stack(artifact: Artifact, name: str, projection: Callable[[Tensor], Any]) -> Any:
    """Every layer's `name` (a projection packed by `projection`, or a norm) in one host stack:
    each array leaf [layers, ...], filled layer by layer, each tensor's pages released once
    copied."""
    layers = artifact.weights.layers
    stack = None
    for i, layer in enumerate(layers):
        tensor = getattr(layer, name)
        value = projection(tensor) if name in PROJECTIONS else tensor.f32()
        if stack is None:
            stack = jax.tree.map(lambda a: _aligned_empty((len(layers),) + a.shape, a.dtype),
                                 value)
        for whole, part in zip(jax.tree.leaves(stack), jax.tree.leaves(value)):
            whole[i] = part
        artifact.release(tensor)
    return stack


def float32_bytes(artifact: Artifact) -> int:
    """Bytes of the "f32" layout's projections, embedding and head (what "device" saves)."""
    w = artifact.weights
    tensors = [w.token_embd] + ([] if w.tied else [w.output]) + [
        getattr(layer, name) for layer in w.layers for name in PROJECTIONS]
    return 4 * sum(t.shape[0] * t.shape[1] for t in tensors)


def _aligned_empty(shape: tuple[int, ...], dtype, align: int = 64) -> np.ndarray:
    """np.empty on an `align`-byte boundary: XLA's CPU aliases a host buffer only when it is
    64-byte aligned (numpy's own arrays are 16-byte aligned, and were copied)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(size + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + size].view(dtype).reshape(shape)


def to_device(params, device=None, shardings=None):
    """Place a prepared pytree on `device` (or per-leaf `shardings`, a matching pytree).

    XLA's CPU takes a 64-byte aligned numpy buffer as the device array itself, whatever
    device_put is told (jax 0.10 does not consult `may_alias` for numpy input): a fresh host
    array (a layer stack) is placed without a copy, and a leaf that views the artifact's file
    mapping is first copied into a fresh aligned array, so the weights are never the file's
    pages (changed by a rewrite of the file, and what Artifact.release drops)."""
    params = jax.tree.map(_off_the_file, params)
    if shardings is not None:
        return jax.tree.map(lambda a, s: jax.device_put(a, s), params, shardings)
    return jax.device_put(params, device)


def _off_the_file(a):
    """`a` itself, or an aligned copy of it if it views a memory-mapped file."""
    base = a
    while base is not None and not isinstance(base, (np.memmap, mmap.mmap)):
        base = getattr(base, "base", None)
    if base is None:
        return a
    copy = _aligned_empty(a.shape, a.dtype)
    copy[...] = a
    return copy


def widen_bf16(x: jax.Array) -> jax.Array:
    """BF16 (or its uint16 bit pattern) -> float32, exactly."""
    if x.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.uint32) << 16, jnp.float32)
    return x.astype(jnp.float32)
