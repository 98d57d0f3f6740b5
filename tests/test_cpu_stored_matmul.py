"""Kipp's CPU matmul over the stored weights (kipp/cuda/cpu/stored_matmul.*), every scheme:
kernel vs kipp.formats.quant.dequantize in float64 and vs its jax.numpy twin, rows bitwise the
same alone or batched (the twin: twin_matmul.linear, BF16 bits widened), a stacked weight read
at its layer, and bad input.

Bound: the weights are decoded exactly and the activation stays float32, so the only error is
float32 summation; against float64 it is measured relative to the row's magnitude
sum_k |x_k| |w_nk|: max 6.5e-8 (K 32 .. 4,096, every scheme, tile and row count); the twin (XLA's
float32 dot) 1.8e-7. The gate is BOUND = 4e-7. An off-by-one block index or a wrong block
scale moves outputs by ~1e-1 of that magnitude: `test_the_gate_sees_a_shifted_block_or_a_wrong_
scale` checks the gate catches both (and both, planted in the kernel, failed it).

The AMX build's BF16 dot (stored_amx.h) multiplies x as three exact bf16 parts on the tile unit
and accumulates in its own order: max 7.3e-8 of the magnitude over the same cases, inside BOUND.
Planted, two parts instead of three gave 5.4e-6, and a tile's outputs written one x row off
gave 9e-2: both failed the gate.

The int8 dot (Dot.INT8): against float64 over numpy's int8 rounding of x (_int8_rows) max
6.2e-8 of the magnitude, INT8_BOUND = 4e-7; against x itself max 3.62e-3 (the rounding),
INT8_X_BOUND = 8e-3. Through the backend against the reference with the same rounding, worst-row
NMSE 7.1e-6 to 1.27e-5 (a few x roundings flip where JAX's and numpy's float32 orders differ),
INT8_BACKEND_BOUND = 5e-5. Planted in the kernel, a long round's tile scaling both W rows by the
first one's d and a span's transpose swapping two blocks each failed the gates.

The BF16 dot (Dot.BF16, BF16 weights on a CPU with AVX-512 BF16): against float64 over numpy's
bf16 rounding of x (ml_dtypes, _bf16_rows) max 4e-8 of the magnitude, BF16_BOUND = 4e-7;
against x itself at most the rounding's half ulp, 2**-9 of the magnitude (measured 8e-4),
BF16_X_BOUND = 2e-3. Planted in the kernel, truncating x instead of rounding it and a W vector
read one block ahead each failed the gates (17 and 14 of the BF16 dot's tests), and tiles of 6
or more x rows summing their blocks backwards failed the bitwise test. Through the backend
against the reference with the same rounding, worst-row NMSE 4.2e-6 to 4.5e-6 (against the
plain reference 3.5e-4), BF16_BACKEND_BOUND = 5e-5.
"""

import os
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from kipp.cuda import twin_matmul  # noqa: E402
from kipp.cuda.cpu import stored_matmul  # noqa: E402
from kipp.cuda.layout import Linear  # noqa: E402
from kipp.formats import quant  # noqa: E402

BOUND = 4e-7
INT8_BOUND = 4e-7
INT8_X_BOUND = 8e-3
INT8_BACKEND_BOUND = 5e-5
BF16_BOUND = 4e-7
BF16_X_BOUND = 2e-3
BF16_BACKEND_BOUND = 5e-5
SCHEMES = stored_matmul.FORMATS

needs_kernel = pytest.mark.skipif(not stored_matmul.available()[0],
                                  reason=f"Kipp's stored CPU matmul: "
                                         f"{stored_matmul.available()[1]}")


@pytest.fixture(autouse=True)
def _float32_dot(monkeypatch):
    """The float32 dot unless a test names another, whatever $KIPP_JAX_CPU_DOT the suite
    runs under."""
    monkeypatch.setenv(stored_matmul.DOT_ENV, "f32")


def _planes(raw: np.ndarray, scheme: str, cols: int) -> Linear:
    """The "device" layout's planes of quantized rows `raw` (quant.py's block layout)."""
    n = len(raw)
    if scheme == "bf16":
        return Linear(np.ascontiguousarray(raw).view("<u2"), fmt="bf16")
    s = quant.scheme(scheme)
    blocks = raw.reshape(n, cols // quant.BLOCK, s.block_bytes)

    def fp16(offset):
        return np.ascontiguousarray(blocks[..., offset:offset + 2]).view("<f2")[..., 0]

    if scheme == "q8_0":
        return Linear(np.ascontiguousarray(blocks[..., 2:]).view(np.int8), fp16(0), fmt=scheme)
    m = fp16(2) if scheme == "affine4_gs32" else None
    return Linear(np.ascontiguousarray(blocks[..., s.block_bytes - 16:]), fp16(0), m,
                  fmt=scheme)


def _case(seed, scheme, m, n, k):
    """(x [m, k], Linear, the exact weights as float64 [n, k]) from normal random values."""
    rng = np.random.default_rng(seed)
    raw = quant.quantize(rng.standard_normal((n, k)).astype(np.float32), scheme)
    dense = quant.dequantize(raw, scheme, k).astype(np.float64)
    return rng.standard_normal((m, k)).astype(np.float32), _planes(raw, scheme, k), dense


def _err(got, x, dense):
    """max |got - x @ W^T| over the outputs' magnitude sum_k |x_k| |w_nk|, in float64."""
    x = x.astype(np.float64)
    scale = np.abs(x) @ np.abs(dense).T
    return float(np.max(np.abs(np.asarray(got, np.float64) - x @ dense.T) / scale))


@needs_kernel
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (1, 37, 64), (2, 16, 96), (3, 21, 128),
                                   (4, 64, 256), (5, 19, 64), (8, 200, 512), (9, 33, 96),
                                   (17, 70, 160), (64, 48, 1024), (13, 300, 256),
                                   (10, 40, 4096), (1, 256, 4096), (40, 130, 3072),
                                   (2, 24, 4160), (4, 50, 2080), (8, 45, 1056)])
def test_kernel_matches_numpy_and_the_twin(scheme, m, n, k):
    """Row counts on every tile (1..8 rows decoded into registers, more through the scratch
    in tiles of up to 6; BF16 up to 32 rows in register rounds of 8), W row counts leaving
    partial tiles and units (a long round's unit is as many W rows as fill the scratch: 16 to
    128 here), one to 130 blocks a row; a decode
    round's rows in spans of K (2 rows at 130 blocks, 4 at 65, 8 at 33: the last span one or
    two blocks); in the AMX build's BF16 dot, partial and odd tiles of 16 x rows and of 16 W
    rows."""
    x, w, dense = _case(m * 7919 + n * 31 + k, scheme, m, n, k)
    got = jax.jit(stored_matmul.matmul)(x, w)
    twin = jax.jit(twin_matmul.linear)(x, jax.tree.map(jnp.asarray, w))  # what XLA runs
    assert got.shape == (m, n) and got.dtype == jnp.float32
    assert _err(got, x, dense) <= BOUND
    assert _err(twin, x, dense) <= BOUND


@needs_kernel
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("k", [192, 2080])
def test_each_row_is_bitwise_the_same_alone_or_batched(scheme, k):
    """Every row count a round makes (registers up to 8 rows, BF16's register rounds of 8 up
    to 32 rows, the scratch past them): the same FMA chains and lane tree, so the same bits.
    At 65 blocks a row, rounds of 4 to 8 rows run in spans of K (a chain parked between spans
    and picked up again), fewer rows whole."""
    x, w, _ = _case(11, scheme, 40, 300, k)  # 300 W rows: a long round's units split them
    call = jax.jit(stored_matmul.matmul)
    alone = np.stack([np.asarray(call(x[i:i + 1], w))[0] for i in range(len(x))])
    for m in (2, 3, 4, 5, 6, 7, 8, 9, 12, 20, 32, 33, 40):
        batched = np.asarray(call(x[:m], w))
        assert np.array_equal(batched.view(np.uint32), alone[:m].view(np.uint32)), m


@needs_kernel
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_stacked_weight_is_read_at_its_layer(scheme):
    """The scanned step passes each plane stacked over layers and a traced layer index."""
    cases = [_case(20 + i, scheme, 3, 24, 64) for i in range(3)]
    x = cases[0][0]
    stack = jax.tree.map(lambda *a: np.stack(a), *[w for _, w, _ in cases])
    stacked = jax.jit(lambda i: stored_matmul.matmul(x, stack, i))
    for i, (_, w, _) in enumerate(cases):
        assert np.array_equal(np.asarray(stacked(jnp.int32(i))),
                              np.asarray(jax.jit(stored_matmul.matmul)(x, w))), i
    with pytest.raises(Exception, match="kipp_cpu_stored_matmul: layer out of range"):
        jax.block_until_ready(stacked(jnp.int32(3)))


@needs_kernel
@pytest.mark.parametrize("scheme", ("q8_0", "scale4_gs32", "affine4_gs32"))
def test_the_gate_sees_a_shifted_block_or_a_wrong_scale(scheme):
    """The bound is tight enough for the faults it is for: the kernel's output against an oracle
    whose weights read each row's next block (an off-by-one block index), or whose first block
    scale is doubled, fails the gate."""
    x, w, dense = _case(5, scheme, 2, 40, 128)
    got = jax.jit(stored_matmul.matmul)(x, w)
    assert _err(got, x, dense) <= BOUND
    blocks = dense.reshape(len(dense), -1, quant.BLOCK)
    shifted = np.roll(blocks, -1, axis=1).reshape(dense.shape)
    scaled = dense.copy()
    scaled[:, :quant.BLOCK] *= 2
    assert _err(got, x, shifted) > 100 * BOUND
    assert _err(got, x, scaled) > 100 * BOUND


def _int8_rows(x: np.ndarray) -> np.ndarray:
    """The values the int8 dot multiplies, in float64: x per 32-block as dx * q with dx =
    max |x| / 127 and q = round(x / dx) in float32 (llama.cpp's q8_0 activation rounding)."""
    m, k = x.shape
    blocks = x.reshape(m, k // quant.BLOCK, quant.BLOCK)
    dx = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
    q = np.clip(np.rint(np.divide(blocks, dx, out=np.zeros_like(blocks), where=dx != 0)),
                -127, 127)
    return (q.astype(np.float64) * dx.astype(np.float64)).reshape(m, k)


def test_the_reference_rounds_x_as_the_int8_dot():
    """kipp.reference.ops.int8_rows (the gates' oracle for the int8 dot, float32) against
    _int8_rows (float64 over the same rule): equal to float32 rounding of the products; a
    block of zeros stays zeros and a NaN makes its block NaN."""
    from kipp.reference import ops

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((7, 256)) * rng.uniform(0.01, 100, (7, 1))).astype(np.float32)
    x[2, 32:64] = 0.0
    got = ops.int8_rows(x)
    assert got.dtype == np.float32
    assert np.array_equal(got, _int8_rows(x).astype(np.float32))
    assert not got[2, 32:64].any()
    x[4, 70] = np.nan
    got = ops.int8_rows(x)
    assert np.isnan(got[4, 64:96]).all() and np.isfinite(np.delete(got[4], range(64, 96))).all()


def _int8(x, w, layer=None):
    return stored_matmul.matmul(x, w, layer, dot=stored_matmul.Dot.INT8)


INT8_SHAPES = [(1, 1, 32), (1, 37, 64), (2, 16, 96), (3, 21, 128), (4, 64, 256), (5, 19, 64),
               (8, 200, 512), (9, 33, 96), (17, 70, 160), (13, 300, 256), (1, 256, 4096),
               (2, 40, 3072)]


@needs_kernel
@pytest.mark.parametrize("scheme", stored_matmul.INT8_FORMATS)
def test_the_int8_gate_sees_a_shifted_block_or_a_wrong_scale(scheme):
    """INT8_BOUND is tight enough for the faults it is for (and both, planted in the kernel,
    failed it): an oracle reading each row's next block, or with the first scale doubled."""
    x, w, dense = _case(6, scheme, 3, 40, 192)
    got = jax.jit(_int8)(x, w)
    xq = _int8_rows(x)
    assert _err(got, xq, dense) <= INT8_BOUND
    blocks = dense.reshape(len(dense), -1, quant.BLOCK)
    shifted = np.roll(blocks, -1, axis=1).reshape(dense.shape)
    scaled = dense.copy()
    scaled[:, :quant.BLOCK] *= 2
    assert _err(got, xq, shifted) > 100 * INT8_BOUND
    assert _err(got, xq, scaled) > 100 * INT8_BOUND


@needs_kernel
@pytest.mark.parametrize("scheme", stored_matmul.INT8_FORMATS)
def test_the_int8_dot_keeps_a_nan_or_inf_in_x(scheme):
    """A NaN or inf in a row of x makes that row's outputs NaN (the float32 dot's outputs are
    not finite either), not a silently clamped int8; the other rows are untouched."""
    x, w, _ = _case(8, scheme, 3, 20, 128)
    clean = np.asarray(jax.jit(_int8)(x, w))
    x[0, 70], x[2, 5] = np.nan, np.inf
    got = np.asarray(jax.jit(_int8)(x, w))
    assert np.isnan(got[0]).all() and np.isnan(got[2]).all()
    assert np.array_equal(got[1], clean[1])
    assert not np.isfinite(np.asarray(stored_matmul.matmul(x, w, dot="f32"))[[0, 2]]).any()


@needs_kernel
def test_the_dot_switch(monkeypatch):
    """KIPP_JAX_CPU_DOT picks the dot when a call is traced, int8 where it is unset; bf16
    keeps float32 under int8; a value it does not know is an error naming the variable."""
    x, w, _ = _case(4, "bf16", 2, 24, 64)
    f32 = np.asarray(stored_matmul.matmul(x, w, dot=stored_matmul.Dot.F32))
    assert np.array_equal(np.asarray(_int8(x, w)), f32)
    xq, wq, _ = _case(4, "q8_0", 2, 24, 64)
    monkeypatch.delenv(stored_matmul.DOT_ENV)
    assert stored_matmul.dot_mode() == "int8"
    assert np.array_equal(np.asarray(stored_matmul.matmul(xq, wq)), np.asarray(_int8(xq, wq)))
    assert np.array_equal(np.asarray(stored_matmul.matmul(x, w)), f32)
    monkeypatch.setenv(stored_matmul.DOT_ENV, "f32")
    assert np.array_equal(np.asarray(stored_matmul.matmul(xq, wq)),
                          np.asarray(stored_matmul.matmul(xq, wq, dot="f32")))
    assert not np.array_equal(np.asarray(stored_matmul.matmul(xq, wq)), np.asarray(_int8(xq, wq)))
    monkeypatch.setenv(stored_matmul.DOT_ENV, "int4")
    with pytest.raises(ValueError, match="KIPP_JAX_CPU_DOT='int4': expected one of f32, int8"):
        stored_matmul.matmul(xq, wq)


@needs_kernel
def test_bad_input_is_an_error_naming_the_kernel():
    x, w, _ = _case(3, "bf16", 2, 8, 64)
    with pytest.raises(ValueError, match="reads bf16, q8_0"):
        stored_matmul.matmul(x, Linear(np.zeros((8, 64), np.float32), fmt="f32"))
    odd = Linear(np.asarray(w.w)[:, :48], fmt="bf16")  # K not a multiple of 32
    with pytest.raises(Exception, match="K a multiple of 32"):
        jax.block_until_ready(jax.jit(stored_matmul.matmul)(x[:, :48], odd))


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(stored_matmul.ENV, "0")
    assert stored_matmul.available() == (False, f"{stored_matmul.ENV}=0 turns it off")


@pytest.mark.slow  # ~25 s a scheme; test_jax_backend's packed-layout gates cover it by default
@needs_kernel
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_jax_backend_runs_every_scheme_through_it(artifacts, monkeypatch, scheme):
    """weight_memory="stored" on one CPU: the projections and the head run on the kernel, the
    weights take the artifact's bytes, and the logits pass the reference gate (NMSE 1e-4 and
    argmax, prefill and decode across a block boundary) and match XLA's own dots over the same
    planes (the switch off) within it."""
    from kipp import gates
    from kipp.cuda.backend import JaxBackend
    from kipp.formats.artifact import open_artifact
    from kipp.reference.backend import ReferenceBackend

    path = artifacts("kipp-synthetic/qwen3-tiny-untied", scheme)
    artifact = open_artifact(path)
    on = JaxBackend(artifact, 12, weight_memory="stored")
    assert on.plan.cpu_stored and "Kipp CPU stored matmul" in on.describe()
    assert on.weight_bytes <= os.path.getsize(path)  # the artifact's bytes, no float32 copy
    monkeypatch.setenv(stored_matmul.ENV, "0")
    off = JaxBackend(artifact, 12, weight_memory="stored")
    assert not off.plan.cpu_stored and "stored CPU matmul is unavailable" in off.plan.warnings[-1]
    table = np.random.default_rng(0).permutation(12)[:3]
    tokens = tuple(int(t) for t in np.random.default_rng(1).integers(0, 151_643, 30))
    for backend, want in ((on, ReferenceBackend(artifact, 12)), (on, off)):
        result = gates.gate_backends(want, backend, tokens, table, logits_rows=30,
                                     decode_steps=4, bound=1e-4)
        assert result.passed, result.detail


needs_bf16_dot = pytest.mark.skipif(not stored_matmul.bf16_dot_supported()[0],
                                    reason=f"the BF16 dot: {stored_matmul.bf16_dot_supported()[1]}")


def _bf16_rows(x: np.ndarray) -> np.ndarray:
    """The values the BF16 dot multiplies, in float64: x rounded to bf16, to nearest even."""
    import ml_dtypes

    return x.astype(ml_dtypes.bfloat16).astype(np.float64)


def _bf16(x, w, layer=None):
    return stored_matmul.matmul(x, w, layer, dot=stored_matmul.Dot.BF16)


# A dot that rounds x: what numpy's rounding of x gives in float64, its bound against that and
# its bound against x itself.
_ROUNDING = {stored_matmul.Dot.INT8: (_int8_rows, INT8_BOUND, INT8_X_BOUND),
             stored_matmul.Dot.BF16: (_bf16_rows, BF16_BOUND, BF16_X_BOUND)}


@needs_kernel
@pytest.mark.parametrize("scheme,dot", [(s, stored_matmul.Dot.INT8)
                                        for s in stored_matmul.INT8_FORMATS]
                         + [("bf16", stored_matmul.Dot.BF16)])
@pytest.mark.parametrize("m,n,k", INT8_SHAPES + [(6, 45, 2080), (8, 45, 1056), (40, 130, 3072),
                                                 (64, 48, 1024)])
def test_a_rounding_dot_matches_numpy(scheme, dot, m, n, k):
    """Against float64 over the same rounding of x (numpy's: _int8_rows, _bf16_rows): only the
    float32 products and sums differ (INT8_BOUND, BF16_BOUND); against x itself the rounding's
    own error (the X bounds). The int8 dot's block counts leave part spans of 16 blocks (its
    long rounds: tiles of 4 x rows by 2 W rows, odd N leaving one); the BF16 dot's
    decode rounds of 1 to 8 rows run in spans of K at 65 and 33 blocks, its long rounds in
    tiles of 6 x 4; partial tiles and units. A subnormal block beside normal ones: 1 / its dx
    is inf for the int8 rounding, and vdpbf16ps reads it as zero (nothing at the bound)."""
    if dot is stored_matmul.Dot.BF16 and not stored_matmul.bf16_dot_supported()[0]:
        pytest.skip(f"the BF16 dot: {stored_matmul.bf16_dot_supported()[1]}")
    rows, bound, x_bound = _ROUNDING[dot]
    x, w, dense = _case(m * 7919 + n * 31 + k, scheme, m, n, k)
    if k > quant.BLOCK:
        x[:, :quant.BLOCK] *= np.float32(1e-40)
    got = jax.jit(lambda x, w: stored_matmul.matmul(x, w, dot=dot))(x, w)
    assert got.shape == (m, n) and got.dtype == jnp.float32 and np.isfinite(got).all()
    assert _err(got, rows(x), dense) <= bound
    assert _err(got, x, dense) <= x_bound


@needs_kernel
@pytest.mark.parametrize("scheme,dot,k", [(s, stored_matmul.Dot.INT8, 224)
                                          for s in stored_matmul.INT8_FORMATS]
                         + [("bf16", stored_matmul.Dot.BF16, k) for k in (192, 2080)])
def test_a_rounding_dot_is_bitwise_the_same_alone_or_batched(scheme, dot, k):
    """Each row is rounded alone and every output is the same chain whatever the tile, so
    every row count gives the same bits: the int8 dot's decode tiles and long rounds (224: 7
    blocks, a part span), the BF16 dot's decode rounds, spans of K (at 2080) and long rounds."""
    if dot is stored_matmul.Dot.BF16 and not stored_matmul.bf16_dot_supported()[0]:
        pytest.skip(f"the BF16 dot: {stored_matmul.bf16_dot_supported()[1]}")
    x, w, _ = _case(12, scheme, 20, 300, k)
    call = jax.jit(lambda x, w: stored_matmul.matmul(x, w, dot=dot))
    alone = np.stack([np.asarray(call(x[i:i + 1], w))[0] for i in range(len(x))])
    for m in (2, 3, 4, 5, 6, 7, 8, 9, 12, 20):
        batched = np.asarray(call(x[:m], w))
        assert np.array_equal(batched.view(np.uint32), alone[:m].view(np.uint32)), m


@needs_bf16_dot
def test_the_bf16_gate_sees_a_shifted_block_or_truncated_x():
    """BF16_BOUND is tight enough for the faults it is for: an oracle reading each row's next
    block, or one whose x is truncated to bf16 instead of rounded, fails it."""
    x, w, dense = _case(7, "bf16", 3, 40, 192)
    got = jax.jit(_bf16)(x, w)
    xb = _bf16_rows(x)
    assert _err(got, xb, dense) <= BF16_BOUND
    shifted = np.roll(dense.reshape(len(dense), -1, quant.BLOCK), -1, axis=1).reshape(dense.shape)
    truncated = (x.view(np.uint32) & np.uint32(0xffff0000)).view(np.float32)
    assert _err(got, xb, shifted) > 100 * BF16_BOUND
    assert _err(got, truncated, dense) > 100 * BF16_BOUND


@needs_bf16_dot
def test_the_bf16_dot_keeps_a_nan_or_inf_in_x():
    """A NaN or inf in a row of x leaves that row's outputs not finite (rounding keeps them);
    the other rows are untouched."""
    x, w, _ = _case(9, "bf16", 3, 20, 128)
    clean = np.asarray(jax.jit(_bf16)(x, w))
    x[0, 70], x[2, 5] = np.nan, np.inf
    got = np.asarray(jax.jit(_bf16)(x, w))
    assert not np.isfinite(got[0]).any() and not np.isfinite(got[2]).any()
    assert np.array_equal(got[1], clean[1])


@needs_kernel
def test_the_bf16_dot_switch(monkeypatch):
    """KIPP_JAX_CPU_DOT=bf16 runs BF16 weights on the BF16 dot and leaves the quantized formats
    on float32; where the CPU or the build has no BF16 dot, the setting is an error naming the
    variable and why."""
    xq, wq, _ = _case(4, "q8_0", 2, 24, 64)
    supported, why = stored_matmul.bf16_dot_supported()
    if not supported:  # this CPU or build: the real reason, named
        with pytest.raises(ValueError, match=f"KIPP_JAX_CPU_DOT=bf16: {re.escape(why)}"):
            stored_matmul.matmul(xq, wq, dot="bf16")
    else:
        f32 = np.asarray(stored_matmul.matmul(xq, wq, dot=stored_matmul.Dot.F32))
        assert np.array_equal(np.asarray(stored_matmul.matmul(xq, wq, dot="bf16")), f32)
        x, w, _ = _case(4, "bf16", 2, 24, 64)
        monkeypatch.setenv(stored_matmul.DOT_ENV, "bf16")
        assert np.array_equal(np.asarray(stored_matmul.matmul(x, w)), np.asarray(_bf16(x, w)))
        assert not np.array_equal(np.asarray(_bf16(x, w)),
                                  np.asarray(stored_matmul.matmul(x, w, dot="f32")))
    monkeypatch.setenv(stored_matmul.DOT_ENV, "bf16")
    monkeypatch.setattr(stored_matmul, "bf16_dot_supported",
                        lambda: (False, "this CPU does not report AVX-512 BF16"))
    with pytest.raises(ValueError, match="KIPP_JAX_CPU_DOT=bf16: this CPU does not report "
                                         "AVX-512 BF16"):
        stored_matmul.dot_mode()
    with pytest.raises(ValueError, match="KIPP_JAX_CPU_DOT=int8\\+bf16: this CPU does not"):
        stored_matmul.dots("int8+bf16")


@needs_kernel
@needs_bf16_dot
def test_joined_dots_give_each_format_its_own(monkeypatch):
    """KIPP_JAX_CPU_DOT=int8+bf16 (either order): the quantized formats run the int8 dot and
    BF16 weights (a quantized artifact's head) the BF16 dot, each bitwise as alone; the
    backend's mode string keeps the order given; a part it does not know is an error naming
    the variable."""
    xq, wq, _ = _case(4, "q8_0", 2, 24, 64)
    x, w, _ = _case(4, "bf16", 2, 24, 64)
    int8, bf16 = np.asarray(_int8(xq, wq)), np.asarray(_bf16(x, w))
    for mode in ("int8+bf16", "bf16+int8"):
        assert np.array_equal(np.asarray(stored_matmul.matmul(xq, wq, dot=mode)), int8), mode
        assert np.array_equal(np.asarray(stored_matmul.matmul(x, w, dot=mode)), bf16), mode
    assert not np.array_equal(bf16, np.asarray(stored_matmul.matmul(x, w, dot="int8")))
    monkeypatch.setenv(stored_matmul.DOT_ENV, "int8+bf16")
    assert stored_matmul.dot_mode() == "int8+bf16"
    assert np.array_equal(np.asarray(stored_matmul.matmul(x, w)), bf16)
    with pytest.raises(ValueError, match="KIPP_JAX_CPU_DOT='int8\\+int4': expected one of"):
        stored_matmul.dots("int8+int4")


@pytest.mark.slow  # ~20 s a scheme
@needs_kernel
@pytest.mark.parametrize("scheme,mode", [(s, "int8") for s in stored_matmul.INT8_FORMATS]
                         + [("bf16", "bf16"), ("q8_0", "int8+bf16")])
def test_a_rounding_dot_at_the_backend(artifacts, monkeypatch, scheme, mode):
    """KIPP_JAX_CPU_DOT=int8 (the quantized schemes), bf16 (BF16) or int8+bf16 (a quantized
    scheme's BF16 head on the BF16 dot too) through the JAX backend, prefill and decode across
    a block boundary: against the numpy reference whose projections round x the same way where
    the dot does (_int8_rows for quantized weights, _bf16_rows for BF16 ones under the BF16
    dot) it passes INT8_BACKEND_BOUND or BF16_BACKEND_BOUND; against the plain
    reference it does not pass even the bound between backends (1e-4): the rounding itself is
    what the synthetic model amplifies, which is why the gates hold a backend on these dots
    to a reference that rounds (ReferenceBackend(activations=mode), checked here against the
    patched one)."""
    from kipp import gates
    from kipp.cuda.backend import JaxBackend
    from kipp.formats.artifact import open_artifact
    from kipp.formats.quant import GGML_BF16
    from kipp.reference import ops
    from kipp.reference.backend import ReferenceBackend

    if "bf16" in mode.split("+") and not stored_matmul.bf16_dot_supported()[0]:
        pytest.skip(f"the BF16 dot: {stored_matmul.bf16_dot_supported()[1]}")
    named = stored_matmul.dots(mode)
    artifact = open_artifact(artifacts("kipp-synthetic/qwen3-tiny-untied", scheme))
    table = np.random.default_rng(0).permutation(12)[:3]
    tokens = tuple(int(t) for t in np.random.default_rng(1).integers(0, 151_643, 30))
    # the float32 dot's steps compiled first at the same shapes: the dot is part of the shared
    # program key (kipp.cuda.backend._PROGRAMS), so the rounding backend must not reuse them
    gates.gate_backends(ReferenceBackend(artifact, 12), JaxBackend(artifact, 12,
                        weight_memory="stored"), tokens, table, logits_rows=30, decode_steps=4,
                        bound=1e-4)
    monkeypatch.setenv(stored_matmul.DOT_ENV, mode)
    backend = JaxBackend(artifact, 12, weight_memory="stored")
    assert backend.plan.cpu_stored and f"({mode} dot)" in backend.describe()
    plain = gates.gate_backends(ReferenceBackend(artifact, 12), backend, tokens, table,
                                logits_rows=30, decode_steps=4, bound=1e-4)
    linear = ops.linear
    used = set()

    def dot(w):  # the dot w's format runs (quantized: under 2 bytes a weight)
        fmt = ("bf16" if w.ggml_type == GGML_BF16
               else scheme if w.raw.size < 2 * np.prod(w.shape) else "f32")
        return stored_matmul.dot_for(fmt, named)

    def rounded(x, w):
        d = dot(w)
        used.add(d)
        return linear(_ROUNDING[d][0](x).astype(np.float32) if d in _ROUNDING else x, w)

    monkeypatch.setattr(ops, "linear", rounded)
    bound = max(INT8_BACKEND_BOUND if d is stored_matmul.Dot.INT8 else BF16_BACKEND_BOUND
                for d in named)
    same = gates.gate_backends(ReferenceBackend(artifact, 12), backend, tokens, table,
                               logits_rows=30, decode_steps=4, bound=bound)
    print(f"{scheme}: {mode} dot vs reference {plain.metric:.3g}, vs the same rounding "
          f"{same.metric:.3g} (worst-row NMSE)")
    assert set(named) <= used  # each dot named met a weight (int8+bf16: the BF16 head)
    assert same.passed, same.detail
    assert not plain.passed
    monkeypatch.setattr(ops, "linear", linear)  # the reference's own rounding: the gates' oracle
    own = gates.gate_backends(ReferenceBackend(artifact, 12, activations=mode), backend, tokens,
                              table, logits_rows=30, decode_steps=4, bound=bound)
    assert own.passed and own.metric == same.metric, (own.detail, same.metric)


_SYMBOLS = {"bf16": "Bf16", "q8_0": "Q8_0", "scale4_gs32": "Scale4", "affine4_gs32": "Affine4"}
_DOTS = [(scheme, dot) for dot in stored_matmul.Dot for scheme in stored_matmul.DOT_FORMATS[dot]]
_TAILS = {stored_matmul.Dot.F32: "", stored_matmul.Dot.INT8: "Int8",
          stored_matmul.Dot.BF16: "Bf16Dot"}
_BUILT: dict[str, str] = {}


def _register(isa: str, directory) -> str:
    """The kernel built for `isa`, its handlers registered under target names ending in
    `_{isa}` (once a process); returns that suffix."""
    import ctypes

    from kipp.cuda.cpu import matmul as cpu_matmul

    if isa not in _BUILT:
        library = ctypes.CDLL(str(cpu_matmul.build(directory, isa=isa)))
        for scheme, dot in _DOTS:
            symbol = f"KippCpuStoredMatmul{_SYMBOLS[scheme]}{_TAILS[dot]}"
            jax.ffi.register_ffi_target(
                f"kipp_cpu_stored_matmul_{scheme}_{dot.value}_{isa}",
                jax.ffi.pycapsule(getattr(library, symbol)),
                platform="cpu")
        cpu_matmul._LIBRARIES.append(library)  # keep its code mapped: XLA holds the handlers
        _BUILT[isa] = isa
    return _BUILT[isa]


def _call_build(isa, scheme, dot, x, w):
    planes = [a[None] for a in (w.w, w.d, w.m) if a is not None]
    out = jax.ShapeDtypeStruct((x.shape[0], planes[0].shape[1]), jnp.float32)
    return jax.ffi.ffi_call(f"kipp_cpu_stored_matmul_{scheme}_{dot.value}_{isa}", out)(
        x, *planes, np.zeros(1, np.int32))


@pytest.mark.slow  # extra compiles of the kernel library (~1 min each)
@needs_kernel
@pytest.mark.parametrize("isa", ["avx512_vnni", "avx2", "portable"])
def test_the_fallback_paths_give_the_same_bits(tmp_path_factory, isa):
    """The kernel built for AVX-512 + VNNI, for AVX2 + FMA, and for the baseline x86-64 set
    (plain C++ decode, std::fma), registered under its own target names: bitwise the build
    this CPU loaded (cpu_matmul.cpu_isa()), every scheme and every dot it has (the int8 dot's
    plain loop, vpmaddubsw and vpdpbusd; the BF16 dot, in the AVX-512 builds only), decode and
    prefill row counts. The AMX build's BF16 dot runs on the
    tile unit, its own numerics (test_the_amx_bf16_dot_*): its FMA-chain reference is the
    AVX-512 build. (Skipped off x86, for the loaded build and for one this CPU cannot run.)"""
    import platform

    from kipp.cuda.cpu import matmul as cpu_matmul

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 builds")
    loaded, order = cpu_matmul.cpu_isa(), cpu_matmul.X86_ORDER
    if loaded.value == isa:
        pytest.skip(f"{isa} is the build this CPU loaded")
    if order.index(cpu_matmul.Isa(isa)) > order.index(loaded):
        pytest.skip(f"this CPU runs at most {loaded.value}")
    directory = tmp_path_factory.mktemp("builds")
    suffix = _register(isa, directory)
    for scheme, dot in _DOTS:
        if dot is stored_matmul.Dot.BF16 and (isa != "avx512_vnni"
                                              or not stored_matmul.bf16_dot_supported()[0]):
            continue  # only the AVX-512 builds have the BF16 dot (the AMX build's is the same)
        tiles = loaded is cpu_matmul.Isa.AMX and scheme == "bf16" and dot is stored_matmul.Dot.F32
        if tiles and isa == "avx512_vnni":
            continue  # the AMX build's tile dot is the reference's own numerics, not these
        for m, k in ((1, 160), (3, 160), (8, 160), (13, 160), (4, 2080), (8, 2080)):
            x, w, _ = _case(m + 40, scheme, m, 37, k)  # at 2080, spans of K
            fallback = _call_build(suffix, scheme, dot, x, w)
            if tiles:
                reference = _call_build(_register("avx512_vnni", directory), scheme, dot, x, w)
            else:
                reference = jax.jit(lambda x, w: stored_matmul.matmul(x, w, dot=dot))(x, w)
            assert np.array_equal(np.asarray(fallback).view(np.uint32),
                                  np.asarray(reference).view(np.uint32)), (scheme, dot, m)


@pytest.mark.slow  # an extra compile of the kernel library (~1 min)
@needs_kernel
def test_the_amx_bf16_dot_runs_on_the_tiles(tmp_path_factory):
    """Where the AMX build loaded, its BF16 dot is not the FMA chains' (the AVX-512 build's)
    bit for bit, so the tile path is what ran, and both are inside the gate."""
    from kipp.cuda.cpu import matmul as cpu_matmul

    if cpu_matmul.cpu_isa() is not cpu_matmul.Isa.AMX:
        pytest.skip(f"the loaded build is {cpu_matmul.cpu_isa().value}, not amx")
    suffix = _register("avx512_vnni", tmp_path_factory.mktemp("builds"))
    x, w, dense = _case(3, "bf16", 13, 37, 1024)
    tiles = jax.jit(stored_matmul.matmul)(x, w)
    chains = _call_build(suffix, "bf16", stored_matmul.Dot.F32, x, w)
    assert not np.array_equal(np.asarray(tiles), np.asarray(chains))
    assert _err(tiles, x, dense) <= BOUND and _err(chains, x, dense) <= BOUND


@needs_kernel
def test_the_matvec_benchmark_reports_every_scheme_and_dot():
    """`python -m kipp.cuda.bench --matvec`, at a tiny shape: one row per scheme and dot (the
    int8 dot for the quantized schemes only), each a positive rate."""
    from kipp.cuda import bench

    lines = bench.matvec(shapes=((64, 256, 1),), repeats=1).splitlines()[1:]
    want = [(s, "f32") for s in SCHEMES] + [(s, "int8") for s in stored_matmul.INT8_FORMATS]
    assert sorted(tuple(line.split()[:2]) for line in lines) == sorted(want)
    assert all(float(line.split()[-1]) > 0 for line in lines)


@pytest.mark.slow  # CI's stored CPU matmul step
@needs_kernel
def test_the_step_matmuls_benchmark_reports_every_scheme_and_row_count():
    """`python -m kipp.cuda.bench --step-matmuls`, at the tiny shape: one line per scheme and
    dot (the float32 dot; int8 for the quantized schemes; where this CPU has the BF16 dot, bf16
    for BF16 and int8+bf16 for the quantized schemes), each row count a positive time within
    its own range."""
    import re

    from kipp.cuda import bench

    lines = bench.step_matmuls("kipp-synthetic/qwen3-tiny", m_values=(1, 3),
                               repeats=2).splitlines()[1:]
    bf16 = stored_matmul.bf16_dot_supported()[0]
    quantized = stored_matmul.INT8_FORMATS
    want = [(s, d) for s in SCHEMES for d in ("f32", "int8", "bf16", "int8+bf16")
            if d == "f32" or (d == "int8" and s in quantized) or (d == "bf16" and s == "bf16"
                                                                  and bf16)
            or (d == "int8+bf16" and s in quantized and bf16)]
    assert [tuple(line.split()[:2]) for line in lines] == want
    for line in lines:
        cells = re.findall(r"M=(\d+): +([\d.]+) \[([\d.]+)-([\d.]+)\]", line)
        assert [int(m) for m, *_ in cells] == [1, 3], line
        assert all(0 < float(lo) <= float(mid) <= float(hi) for _, mid, lo, hi in cells), line
