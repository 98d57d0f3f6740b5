"""y = x @ W^T with W in any prepared layout (float32, BF16, q8_0, scale4_gs32, affine4_gs32),
dequantizing inside the kernel: the weights cross memory packed, exactly as stored.

Two bodies. More than MATVEC_ROWS rows (prefill, batched decode): BF16 tensor-core dots with
float32 accumulation, x rounded to BF16 once and the weights exact: BF16 as stored, or a group's
stored integers (exact in BF16) dotted and then scaled by the group's fp16 d in float32
(affine4 adds m * sum(x)). Up to MATVEC_ROWS rows (decode): float32 multiply-reduce on the CUDA
cores over weights widened exactly, where a dot would pad to Triton's 16-row minimum and the
weight stream is the bound. The f32 format (the CPU layout's) keeps IEEE float32 dots. The grid
is (row tiles, column tiles, K splits): K is split when the first two give few programs (a
decode matvec), so the GPU streams the weights at full bandwidth; XLA adds the partial sums.
Lowering: Pallas' Triton backend (`quant_matmul`'s comment says why). The tests compile every
kernel for an H200 (sm_90a) on a CPU at every registry shape (tests/test_cuda_compile.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kipp.cuda.layout import Linear
from kipp.formats.quant import BLOCK

HIGHEST = jax.lax.Precision.HIGHEST
MATVEC_ROWS = 4  # up to this many rows use the multiply-reduce kernel
TARGET_PROGRAMS = 512  # split K until the grid has about this many programs (~4 per H200 SM)


def _widen_tile(w_ref, d_ref, m_ref, g0, groups: int, fmt: str):
    """The weight tile for groups [g0, g0 + groups) as float32 pieces, each [bn, width], with
    the x-columns each piece multiplies: a list of (tile, half) where half is None (all 32
    columns of each group) or 0 / 1 (the low / high 16 of each group, for nibble formats)."""
    if fmt in ("f32", "bf16"):
        tile = w_ref[:, pl.ds(g0 * BLOCK, groups * BLOCK)]  # [bn, bk]
        return [(tile.astype(jnp.float32), None)]
    d = d_ref[:, pl.ds(g0, groups)].astype(jnp.float32)[:, :, None]  # [bn, groups, 1]
    bn = d.shape[0]
    if fmt == "q8_0":
        q = w_ref[:, pl.ds(g0, groups), :].astype(jnp.float32)  # [bn, groups, 32]
        return [((q * d).reshape(bn, groups * BLOCK), None)]
    nibbles = w_ref[:, pl.ds(g0, groups), :]  # [bn, groups, 16] uint8
    pieces = []
    for half, q in ((0, nibbles & 15), (1, nibbles >> 4)):
        q = q.astype(jnp.float32)
        if fmt == "scale4_gs32":
            w = d * (q - 8.0)
        else:
            w = d * q + m_ref[:, pl.ds(g0, groups)].astype(jnp.float32)[:, :, None]
        pieces.append((w.reshape(bn, groups * 16), half))
    return pieces


def _x_piece(x_ref, g0, groups: int, half):
    """x columns matching a weight piece: x_ref [bm, K/32, 32] -> [bm, width]."""
    if half is None:
        tile = x_ref[:, pl.ds(g0, groups), :]  # [bm, groups, 32]
        return tile.reshape(tile.shape[0], groups * BLOCK)
    tile = x_ref[:, pl.ds(g0, groups), pl.ds(half * 16, 16)]  # [bm, groups, 16]
    return tile.reshape(tile.shape[0], groups * 16)


def _matvec_kernel(x_ref,  # [bm, K/32, 32] float32
                   w_ref,  # [bn, K] (f32/bf16) or [bn, K/32, 32|16] (packed)
                   *refs,  # d_ref [bn, K/32] fp16 (packed), m_ref [bn, K/32] (affine4), then
                           # o_ref [1, bm, bn] float32: this K split's partial sum
                   fmt: str, block_k: int, splits: int):
    """A few rows (decode): float32 multiply-reduce on the CUDA cores, weights widened exactly;
    bandwidth-bound, so the 16-row minimum of a tensor-core dot would only waste registers."""
    *scales, o_ref = refs
    d_ref, m_ref = (scales + [None, None])[:2]
    groups = block_k // BLOCK
    steps = x_ref.shape[1] // groups // splits
    first = pl.program_id(2) * steps

    def step(kb, acc):  # acc [bm, bn, width]: products summed over K steps, reduced once
        g0 = kb * groups
        for w, half in _widen_tile(w_ref, d_ref, m_ref, g0, groups, fmt):
            x = _x_piece(x_ref, g0, groups, half)  # [bm, 1, width] * [1, bn, width]
            acc += x[:, None, :] * w[None, :, :]
        return acc

    width = block_k if fmt in ("f32", "bf16", "q8_0") else block_k // 2
    acc = jnp.zeros(o_ref.shape[1:] + (width,), jnp.float32)
    # summing over k inside the loop would cost a warp-shuffle reduction per step
    o_ref[0, :, :] = jnp.sum(jax.lax.fori_loop(first, first + steps, step, acc), axis=2)


def _dot_kernel(x_ref,  # [bm, K] bfloat16 (float32 for fmt "f32")
                w_ref,  # [bn, K] (f32/bf16) or [bn, K/32, 32|16] (packed)
                *refs,  # d_ref, m_ref as in _matvec_kernel, then o_ref [1, bm, bn] float32
                fmt: str, block_k: int, splits: int):
    """Tiles of rows (prefill, batched decode): BF16 tensor-core dots, float32 accumulation."""
    *scales, o_ref = refs
    d_ref, m_ref = (scales + [None, None])[:2]
    steps = x_ref.shape[1] // block_k // splits
    first = pl.program_id(2) * steps

    def step(kb, acc):
        if fmt in ("f32", "bf16"):
            x = x_ref[:, pl.ds(kb * block_k, block_k)]  # [bm, bk]
            w = w_ref[:, pl.ds(kb * block_k, block_k)]  # [bn, bk]
            return acc + jax.lax.dot_general(
                x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                precision=HIGHEST if fmt == "f32" else None)
        for i in range(block_k // BLOCK):
            acc += _group_dot(x_ref, w_ref, d_ref, m_ref, kb * (block_k // BLOCK) + i, fmt)
        return acc

    acc = jnp.zeros(o_ref.shape[1:], jnp.float32)
    o_ref[0, :, :] = jax.lax.fori_loop(first, first + steps, step, acc)


def _group_dot(x_ref, w_ref, d_ref, m_ref, g, fmt: str) -> jax.Array:
    """x's 32 columns of group g times the group's weights, [bm, bn] float32.

    The stored integers (int8, or nibbles minus 8 for scale4) are exact in BF16, so the dot
    runs on them and the fp16 scale multiplies its float32 result: d * (x . q), and for affine4
    + m * sum(x), the dequantizer's values without rounding the weights."""
    d = d_ref[:, g].astype(jnp.float32)[None, :]  # [1, bn]
    if fmt == "q8_0":
        q = w_ref[:, g, :].astype(jnp.bfloat16)  # [bn, 32]
        return _dot_t(x_ref[:, pl.ds(g * BLOCK, BLOCK)], q) * d
    nibbles = w_ref[:, g, :]  # [bn, 16] uint8: element j low, j + 16 high
    part = None
    for half, q in ((0, nibbles & 15), (1, nibbles >> 4)):
        q = q.astype(jnp.float32) - (8.0 if fmt == "scale4_gs32" else 0.0)
        x = x_ref[:, pl.ds(g * BLOCK + half * 16, 16)]  # [bm, 16]
        dot = _dot_t(x, q.astype(jnp.bfloat16))
        part = dot if part is None else part + dot
    part = part * d
    if fmt == "affine4_gs32":
        x = x_ref[:, pl.ds(g * BLOCK, BLOCK)].astype(jnp.float32)  # [bm, 32]
        part += jnp.sum(x, axis=1)[:, None] * m_ref[:, g].astype(jnp.float32)[None, :]
    return part


def _dot_t(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [bm, k] @ w [bn, k]^T -> [bm, bn] float32 (BF16 operands: tensor cores)."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _block_k(k: int, cap: int) -> int:
    bk = _block_n(k, cap)
    if bk < BLOCK:
        raise ValueError(f"input width {k} is not a multiple of {BLOCK}")
    return bk


def _block_n(n: int, cap: int) -> int:
    """The largest of cap, cap / 2, cap / 4, ... that divides n."""
    bn = cap
    while n % bn:
        bn //= 2
    return bn


@functools.partial(jax.jit, static_argnames=("interpret", "block_n", "block_k"))
def quant_matmul(x: jax.Array, w: Linear, *, interpret: bool = False,
                 block_n: int | None = None, block_k: int | None = None) -> jax.Array:
    """x [M, K] float32 @ w[N, K]^T -> [M, N] float32, dequantizing `w` tile by tile."""
    # Triton, chosen explicitly (a bare pallas_call on a GPU goes to Mosaic GPU since JAX 0.10):
    # these block-level array programs are scheduled and laid out by Triton on every NVIDIA GPU
    # since Ampere, while Mosaic GPU wants explicit Hopper-only warpgroup/TMA programming that
    # cannot be checked without a GPU. A kernel that fails to compile falls back to its twin.
    from jax.experimental.pallas import triton as pltriton

    m_rows, k = x.shape
    n = w.shape[0]
    matvec = m_rows <= MATVEC_ROWS
    bm = pl.next_power_of_2(m_rows) if matvec else (16 if m_rows < 64 else 64)
    bn = _block_n(n, block_n or (32 if matvec else 64))
    # tiles free of register spills at every registry shape on the H200: matvec's [bm, bn, bk]
    # product tile stays at 4,096 float32 (32 registers per thread); 16-row dots take 128-wide
    # K steps (at 64, affine4 spilled)
    bk = _block_k(k, block_k or (128 // bm if matvec else 128 if bm == 16 else 64))
    padded = pl.cdiv(m_rows, bm) * bm
    splits = _splits(k // bk, (padded // bm) * (n // bn))
    x = jnp.pad(x, ((0, padded - m_rows), (0, 0)))
    if matvec:
        kernel, x, x_spec = _matvec_kernel, x.reshape(padded, k // BLOCK, BLOCK), \
            pl.BlockSpec((bm, k // BLOCK, BLOCK), lambda i, j, c: (i, 0, 0))
    else:  # BF16 activations for the tensor cores (the f32 format keeps IEEE float32)
        kernel, x_spec = _dot_kernel, pl.BlockSpec((bm, k), lambda i, j, c: (i, 0))
        x = x if w.fmt == "f32" else x.astype(jnp.bfloat16)
    scales = [a for a in (w.d, w.m) if a is not None]
    w_spec = (pl.BlockSpec((bn, k), lambda i, j, c: (j, 0)) if w.w.ndim == 2 else
              pl.BlockSpec((bn,) + w.w.shape[1:], lambda i, j, c: (j, 0, 0)))
    scale_spec = pl.BlockSpec((bn, k // BLOCK), lambda i, j, c: (j, 0))
    out = pl.pallas_call(
        functools.partial(kernel, fmt=w.fmt, block_k=bk, splits=splits),
        out_shape=jax.ShapeDtypeStruct((splits, padded, n), jnp.float32),
        grid=(padded // bm, n // bn, splits),
        in_specs=[x_spec, w_spec] + [scale_spec] * len(scales),
        out_specs=pl.BlockSpec((1, bm, bn), lambda i, j, c: (c, i, j)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name=f"kipp_matmul_{w.fmt}",
    )(x, w.w, *scales)
    return (out[0] if splits == 1 else jnp.sum(out, axis=0))[:m_rows]


def _splits(k_steps: int, programs: int) -> int:
    """K splits (a divisor of k_steps) that bring the grid near TARGET_PROGRAMS programs: a
    decode matvec over a 1024-row weight would otherwise run on a few dozen programs."""
    want = max(1, TARGET_PROGRAMS // programs)
    return max(d for d in range(1, k_steps + 1) if k_steps % d == 0 and d <= want)


def dequantize_reference(w: Linear) -> jax.Array:
    """The prepared weight as float32 [N, K]: kipp.formats.quant.dequantize's arithmetic in
    jax.numpy."""
    if w.fmt in ("f32", "bf16"):
        return w.w.astype(jnp.float32)
    n, k = w.shape
    d = w.d.astype(jnp.float32)[..., None]  # [N, K/32, 1]
    if w.fmt == "q8_0":
        return (d * w.w.astype(jnp.float32)).reshape(n, k)
    q = jnp.concatenate([w.w & 15, w.w >> 4], axis=-1).astype(jnp.float32)  # [N, K/32, 32]
    if w.fmt == "scale4_gs32":
        return (d * (q - 8.0)).reshape(n, k)
    return (d * q + w.m.astype(jnp.float32)[..., None]).reshape(n, k)


def quant_matmul_reference(x: jax.Array, w: Linear) -> jax.Array:
    """The jax.numpy twin: x [M, K] float32 @ dequantize(w)^T -> [M, N] float32."""
    dense = w.w if w.fmt == "f32" else dequantize_reference(w)
    return jnp.dot(x, dense.T, precision=HIGHEST)
