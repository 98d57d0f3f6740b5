"""The jax.numpy twin of quant_matmul as the step runs it: y = x @ W^T on any prepared layout,
with a stored-format weight widened (BF16) or dequantized when and where its matmul runs.

A float32 layout is one dot. A stored layout (BF16, q8_0, the 4-bit planes) must be widened for
the dot, and left to itself XLA widens every weight of the step at its start (the conversions
depend only on the parameters, so its scheduler may run them first, and hoists them out of a
loop over blocks): a prefill then holds every projection in float32 at once. So the stored
values are tied to the activation they multiply: a zero computed from x (and the block index)
is added to their integers (`_anchored`), which no compiler pass can fold, hoist or move a
conversion across. A weight then widens when its layer runs, at most CHUNK_ELEMENTS weights at
a time for a large one (the head; 8B-class FFN weights), inside a `lax.map`. A single row
(decode) skips all of it: XLA fuses the widening into a one-row dot and never materialises the
weight. Numerics are quant_matmul_reference's exactly: adding 0 to an integer changes nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kipp.cuda.layout import Linear, widen_bf16
from kipp.cuda.pallas.quant_matmul import HIGHEST, dequantize_reference

CHUNK_ELEMENTS = 1 << 22  # widened weights per block: 16 MiB of float32


def linear(x: jax.Array, w: Linear) -> jax.Array:
    """x [M, K] float32 @ w[N, K]^T -> [M, N] float32 (module docstring)."""
    if w.fmt == "f32":
        return jnp.dot(x, w.w.T, precision=HIGHEST)
    n, k = w.shape
    rows = block_rows(n, k)
    if rows == n:
        if x.shape[0] == 1:  # fused into the dot, never materialised
            return jnp.dot(x, dense(w).T, precision=HIGHEST)
        return jnp.dot(x, dense(_anchored(w, x, 0, n)).T, precision=HIGHEST)

    def block(i):  # [M, rows]: rows [i * rows, (i + 1) * rows) of W, widened here only
        return jnp.dot(x, dense(_anchored(w, x, i, rows)).T, precision=HIGHEST)

    out = jax.lax.map(block, jnp.arange(n // rows))  # [N / rows, M, rows]
    return out.transpose(1, 0, 2).reshape(x.shape[0], n)


def dense(w: Linear) -> jax.Array:
    """The weight as float32 [N, K]: BF16 (or its bits) widened, else dequantized."""
    return widen_bf16(w.w) if w.fmt == "bf16" else dequantize_reference(w)


def _anchored(w: Linear, x: jax.Array, i, rows: int) -> Linear:
    """Rows [i * rows, (i + 1) * rows) of `w`, sliced and offset by 0 as integers (16-bit
    floats as their bit patterns), the 0 computed from x[0, 0] and i: the same values, which
    exist only once x does, inside block i."""
    v = x[0, 0] + jnp.asarray(i, jnp.float32)
    zero = (jnp.abs(jnp.where(jnp.isfinite(v), v, 0.0)) * 0.0).astype(jnp.int32)  # no fold

    def tie(a):
        integer = jnp.issubdtype(a.dtype, jnp.integer)
        bits = a if integer else jax.lax.bitcast_convert_type(a, jnp.uint16)  # BF16, fp16
        bits = jax.lax.dynamic_slice_in_dim(bits, i * rows, rows, 0) + zero.astype(bits.dtype)
        return bits if integer else jax.lax.bitcast_convert_type(bits, a.dtype)

    return jax.tree.map(tie, w)


def block_rows(n: int, k: int) -> int:
    """Rows per block: the largest divisor of n whose block holds at most CHUNK_ELEMENTS."""
    limit = max(1, CHUNK_ELEMENTS // k)
    if n <= limit:
        return n
    return max(d for d in range(1, limit + 1) if n % d == 0)
