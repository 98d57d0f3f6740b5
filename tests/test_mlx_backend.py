"""MLXBackend's gates against the reference backend, its exact repacking, and its Metal kernels.

Without Metal (Linux, mlx[cpu]) the backend runs its MLX-op twins; these are gated here against
the reference on the synthetic checkpoints, every weight scheme, with DESIGN.md's bounds:
identical argmax (up to numerical near-ties, gates.argmax_check) and NMSE <= 1e-4 at every
prefill and decode position; a scrambled block table bitwise equal to the identity table;
batched mixed-length eval equal to isolated within the bound. The Metal kernels' Python-side
checks and source strings are tested everywhere; their Metal sources run here on the Metal
emulator (tests/test_metal_kernels.py). The tests below marked needs_metal run them on the GPU
and are skipped here: bench/mac_check.sh runs this file on a Mac, where those tests execute.
"""

import re
import threading

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from kipp import gates  # noqa: E402
from kipp.apple import attention, layout, linear, repack, select  # noqa: E402
from kipp.apple.backend import MLXBackend  # noqa: E402
from kipp.apple.kvcache import dequantize_q8_0, quantize_q8_0  # noqa: E402
from kipp.backend import (  # noqa: E402
    KV_BLOCK,  # noqa: E402
    EvalError,
    EvalItem,
)
from kipp.errors import KippError  # noqa: E402
from kipp.formats import kvquant, quant
from kipp.formats.artifact import open_artifact  # noqa: E402
from kipp.reference.backend import ReferenceBackend  # noqa: E402

TINY = "kipp-synthetic/qwen3-tiny"
UNTIED = "kipp-synthetic/qwen3-tiny-untied"
SCHEMES = ["bf16", "q8_0", "affine4_gs32", "scale4_gs32"]
QUANTIZED = ["q8_0", "affine4_gs32", "scale4_gs32"]
BLOCKS = 12
BOUND = 1e-4
METAL = mx.metal.is_available()
needs_metal = pytest.mark.skipif(not METAL, reason="needs Metal (mx.metal.is_available() is "
                                 "False); bench/mac_check.sh runs these on Apple silicon")


def _backends(artifacts, checkpoint_id, scheme, **options):
    artifact = open_artifact(artifacts(checkpoint_id, scheme))
    ref_options = {"kv_scheme": options["kv_scheme"]} if "kv_scheme" in options else {}
    return (ReferenceBackend(artifact, BLOCKS, **ref_options),
            MLXBackend(artifact, BLOCKS, **options))


def _tokens(seed, n):
    return tuple(int(t) for t in np.random.default_rng(seed).integers(0, 151_643, n))


def _check_rows(got, want, what, bound=BOUND):
    result = gates.gate_rows(what, got, want, bound)
    assert result.passed, f"{what}: {result.detail}"


def _gate(ref, mb, prompt_len=30, decode_steps=4, seed=0, rows=10):
    """Prefill (the last `rows` positions' logits; the 151,936-row head dominates a tiny
    model's time), then decode across the 31/32/33 block boundary, on a scrambled table; the
    reference sees the same items."""
    table = np.random.default_rng(seed).permutation(BLOCKS)[:3]
    result = gates.gate_backends(ref, mb, _tokens(seed, prompt_len), table, logits_rows=rows,
                                 decode_steps=decode_steps, bound=BOUND)
    assert result.passed, result.detail


# ---- whole model, twin path --------------------------------------------------------------


@pytest.mark.parametrize("checkpoint_id, scheme", [(TINY, s) for s in SCHEMES] + [
    (UNTIED, "bf16"), (UNTIED, "scale4_gs32")])
def test_mlx_matches_reference(artifacts, checkpoint_id, scheme):
    """This machine's default path (twins, unless Metal is there) vs the numpy oracle: every
    scheme on the tied checkpoint (GQA group 2), and the untied one (its own head, GQA group 5,
    two shards) in BF16 and the 4-bit scheme with the largest rounding error."""
    ref, mb = _backends(artifacts, checkpoint_id, scheme)
    assert mb.describe().startswith("mlx (") and scheme in mb.describe()
    _gate(ref, mb, rows=30 if scheme == "bf16" and checkpoint_id == TINY else 10)


@pytest.mark.parametrize("streams", ["1", "3"])
def test_stream_splits_match_reference(artifacts, monkeypatch, streams):
    """The twins' split over CPU streams (row shards, tensor-parallel FFN) whatever the core
    count of the machine: one stream, and three (uneven shards)."""
    monkeypatch.setenv(select.STREAMS_ENV, streams)
    ref, mb = _backends(artifacts, TINY, "affine4_gs32", path="twins")
    assert len(mb.ops.streams) == int(streams)
    assert len(mb.weights.layers[0]["ffn"].down) == int(streams)
    _gate(ref, mb, prompt_len=12, decode_steps=1, rows=4)


def test_evaluates_on_threads_other_than_the_loading_one(artifacts, monkeypatch):
    """A server loads the model on one thread and evaluates on others; MLX binds a stream to
    the thread that made it, so each thread must get its own (several streams: the twins'
    split). The second thread's logits equal the loading thread's, bit for bit."""
    monkeypatch.setenv(select.STREAMS_ENV, "2")
    _, mb = _backends(artifacts, TINY, "q8_0", path="twins")
    prompt = _tokens(1, 20)
    [here] = mb.eval([EvalItem(prompt, 0, (0,), 4)])
    there, failure = [], []

    def worker():
        try:
            there.extend(mb.eval([EvalItem(prompt, 0, (1,), 4)]))
        except Exception as e:  # reported below, on the test's thread
            failure.append(e)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not failure, failure
    assert np.array_equal(here.view(np.uint32), there[0].view(np.uint32))


def test_scrambled_block_table_is_bitwise_identity(artifacts):
    _, mb = _backends(artifacts, TINY, "q8_0")
    prompt = _tokens(1, 70)
    identity, scrambled = (0, 1, 2, 3), (9, 4, 7, 1)
    [a] = mb.eval([EvalItem(prompt, 0, identity, 4)])
    [b] = mb.eval([EvalItem(prompt, 0, scrambled, 4)])
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    [a] = mb.eval([EvalItem((5,), 70, identity)])
    [b] = mb.eval([EvalItem((5,), 70, scrambled)])
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_batched_mixed_lengths_equal_isolated(artifacts):
    _, mb = _backends(artifacts, UNTIED, "scale4_gs32")
    lengths = (37, 5, 1, 20)
    prompts = [_tokens(10 + i, n) for i, n in enumerate(lengths)]
    tables = [(0, 1), (2,), (3,), (4,)]
    alone = [mb.eval([EvalItem(p, 0, t, min(2, len(p)))])[0] for p, t in zip(prompts, tables)]
    moved = [(5, 6), (7,), (8,), (9,)]  # the same content in other blocks
    together = mb.eval([EvalItem(p, 0, t, min(2, len(p))) for p, t in zip(prompts, moved)])
    for a, b in zip(together, alone):
        _check_rows(a, b, "batched prefill")
    steps = [EvalItem((int(a[-1].argmax()),), n, t) for a, n, t in zip(alone, lengths, tables)]
    alone = [mb.eval([item])[0] for item in steps]
    together = mb.eval([EvalItem(s.tokens, s.start_position, t) for s, t in zip(steps, moved)])
    for a, b in zip(together, alone):
        _check_rows(a, b, "batched decode")


def test_rounds_split_long_items_and_rows(artifacts):
    """A 45-token item under a 16-token round budget, logits rows spanning rounds, and a second
    item waiting for budget: equal to one round within the bound."""
    artifact = open_artifact(artifacts(TINY, "bf16"))
    wide, narrow = MLXBackend(artifact, BLOCKS), MLXBackend(artifact, BLOCKS, max_round_tokens=16)
    items = [EvalItem(_tokens(3, 45), 0, (0, 1), 8), EvalItem(_tokens(4, 9), 0, (2,), 3)]
    for a, b in zip(narrow.eval(items), wide.eval(items)):
        _check_rows(a, b, "split rounds")


def test_bad_items_are_rejected_before_any_work(artifacts):
    _, mb = _backends(artifacts, TINY, "bf16")
    before = np.array(mb.k_cache.arrays()[0].view(mx.uint16))
    with pytest.raises(EvalError):
        mb.eval([EvalItem((1,), 0, (BLOCKS,))])
    with pytest.raises(EvalError):
        mb.eval([EvalItem((151_936,), 0, (0,))])
    assert np.array_equal(np.array(mb.k_cache.arrays()[0].view(mx.uint16)), before)


def test_kipp_load_runs_mlx_and_names_the_path(artifacts, models):
    import kipp

    model = kipp.load(artifacts(TINY, "q8_0"), backend="mlx", kv_tokens=256, progress=False)
    described = model.backend.describe()
    assert model.backend.name == "mlx" and "q8_0" in described
    assert ("Metal kernels" in described) if METAL else ("twins" in described)
    prompt = model.tokenizer.encode("The capital of France is")
    want = models(TINY, "q8_0").generate(prompt, max_tokens=6, temperature=0)
    assert model.generate(prompt, max_tokens=6, temperature=0) == want


# ---- exact repacking ---------------------------------------------------------------------


def _weights(rows=48, cols=256, seed=0):
    """Rows at very different magnitudes (fp16-subnormal to large scales), one zero block,
    blocks whose largest magnitude is negative (scale4's d < 0) and constant blocks."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-24, 9, (rows, 1)))
    if rows >= 4:
        w[0, :32] = 0.0
        w[1, 32:64] = 0.75
        w[2, :32] = -np.abs(w[2, :32])
        w[3, 5] = -1000 * np.abs(w[3]).max()
    return w.astype(np.float32)


@pytest.mark.parametrize("scheme", QUANTIZED)
def test_affine_repack_dequantizes_bitwise(scheme):
    """mx.dequantize of the repack == kipp.formats.quant.dequantize, bit for bit; the one exception,
    scale4's -0.0 (d < 0, q = 8) where MLX's 8 d + (-8 d) is +0.0, is counted exactly."""
    w = _weights()
    raw = quant.quantize(w, scheme)
    want = quant.dequantize(raw, scheme, w.shape[1])
    a = repack.to_affine(raw, scheme, w.shape[1])
    assert a.scales.dtype == np.float32 and a.biases.dtype == np.float32
    got = np.array(mx.dequantize(mx.array(a.w), mx.array(a.scales), mx.array(a.biases),
                                 group_size=32, bits=a.bits))
    assert got.dtype == np.float32 and np.array_equal(got, want)  # equal values
    differ = got.view(np.uint32) != want.view(np.uint32)
    negative_zero = (want == 0) & np.signbit(want)
    assert np.array_equal(differ, negative_zero & ~np.signbit(got))
    if scheme != "scale4_gs32":
        assert not differ.any()
    else:
        assert negative_zero.any()  # the weights above exercise the exception


@pytest.mark.parametrize("scheme", QUANTIZED)
def test_kernel_planes_hold_the_artifact_bytes(scheme):
    """The kernels' planes, decoded with the kernels' arithmetic, are kipp.formats.quant's bit
    for bit."""
    w = _weights(seed=1)
    raw = quant.quantize(w, scheme)
    p = repack.to_planes(raw, scheme, w.shape[1])
    want = quant.dequantize(raw, scheme, w.shape[1])
    assert np.array_equal(repack.dequantize_planes(p).view(np.uint32), want.view(np.uint32))
    bytes_per_block = (p.q.nbytes + p.d.nbytes + (p.m.nbytes if p.m is not None else 0)) / (
        w.size // 32)
    assert bytes_per_block == quant.scheme(scheme).block_bytes  # exactly the file's bytes


def test_float32_scales_hold_what_fp16_cannot():
    """q8_0's bias -128 d overflows fp16 for d > 511 and bf16 drops d's low bits: the repack
    keeps both exact in float32, and a block at d ~ 1000 still decodes exactly."""
    w = np.full((1, 32), 127_000.0, np.float32)
    w[0, 1] = -3.0
    raw = quant.quantize(w, "q8_0")
    a = repack.to_affine(raw, "q8_0", 32)
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(a.biases[0, 0])) and np.isfinite(a.biases[0, 0])
    d = np.float32(1000.5)  # an fp16 value whose bf16 rounding differs
    assert np.float32(d.astype(np.float16)) == d and np.float32(
        mx.array(d).astype(mx.bfloat16).astype(mx.float32).item()) != d
    got = np.array(mx.dequantize(mx.array(a.w), mx.array(a.scales), mx.array(a.biases),
                                 group_size=32, bits=8))
    assert np.array_equal(got, quant.dequantize(raw, "q8_0", 32))


def test_repack_rejects_wrong_bytes():
    raw = quant.quantize(_weights(rows=4, cols=64), "q8_0")
    with pytest.raises(KippError, match="bytes"):
        repack.to_affine(raw[:, :-1], "q8_0", 64)
    with pytest.raises(KippError, match="not a quantized scheme"):
        repack.to_planes(raw, "bf16", 64)


# ---- q8_0 KV cache -----------------------------------------------------------------------


def test_q8_0_kv_encoder_is_bitwise_kvquant():
    """Hard rows: zeros, fp16-subnormal scales, amax exactly at 127 x an fp16 midpoint (the
    rounding tie), huge and tiny magnitudes."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((600, 8, 128)) *
         np.exp(rng.standard_normal((600, 8, 1)) * 3)).astype(np.float32)
    x[0, 0] = 0.0
    x[1, 0, :32] = 1e-30
    x[2, 0, 3] = -1e-6
    mids = ((np.arange(1, 129) * 2.0 ** -10 + 2.0 ** -11 + 1) * 127).astype(np.float32)
    x[3, :, :] = mids  # one tie per block's amax
    x[4, :, ::2] = -x[4, :, ::2]
    q, d = kvquant.quantize(x)
    mq, md = quantize_q8_0(mx.array(x))
    assert np.array_equal(np.array(mq), q)
    assert np.array_equal(np.array(md).view(np.uint16), d.view(np.uint16))
    back = np.array(dequantize_q8_0(mq, md))
    assert np.array_equal(back.view(np.uint32), kvquant.dequantize(q, d).view(np.uint32))


def test_q8_0_kv_gates(artifacts):
    """q8_0 KV vs BF16 KV on the same backend: identical argmax, NMSE reported (near-lossless);
    vs the reference with q8_0 KV: the standard bound; scrambled table bitwise equal."""
    artifact = open_artifact(artifacts(UNTIED, "bf16"))
    bf16_kv = MLXBackend(artifact, BLOCKS)
    q8_kv = MLXBackend(artifact, BLOCKS, kv_scheme="q8_0")
    assert "q8_0 KV" in q8_kv.describe()
    assert q8_kv.k_cache.nbytes * 256 == bf16_kv.k_cache.nbytes * 136  # 136 vs 256 bytes a row
    prompt, table, rows = _tokens(7, 40), (5, 2), 8
    [a] = q8_kv.eval([EvalItem(prompt, 0, table, rows)])
    [b] = bf16_kv.eval([EvalItem(prompt, 0, table, rows)])
    print(f"q8_0 KV vs BF16 KV, last {rows} of 40 positions: NMSE {gates.nmse(a, b):.3e}")
    _check_rows(a, b, "q8_0 KV vs BF16 KV", bound=1e-3)
    [c] = q8_kv.eval([EvalItem(prompt, 0, (9, 0), rows)])
    assert np.array_equal(a.view(np.uint32), c.view(np.uint32))
    [got] = q8_kv.eval([EvalItem((11,), 40, table)])  # decode reads the stored q8_0 rows
    ref = ReferenceBackend(artifact, BLOCKS, kv_scheme="q8_0")
    [want] = ref.eval([EvalItem(prompt, 0, table, rows)])
    _check_rows(a, want, "q8_0 KV vs reference q8_0 KV")
    [want] = ref.eval([EvalItem((11,), 40, table)])
    _check_rows(got, want, "q8_0 KV decode")


# ---- path selection ----------------------------------------------------------------------


def test_path_selection_and_twins_switch(monkeypatch):
    monkeypatch.delenv(select.TWINS_ENV, raising=False)
    assert not select.choose_path("auto", metal=False).kernels
    assert "no Metal" in select.choose_path("auto", metal=False).reason
    assert select.choose_path("auto", metal=True).kernels
    with pytest.raises(KippError, match="need Metal"):
        select.choose_path("kernels", metal=False)
    monkeypatch.setenv(select.TWINS_ENV, "1")
    choice = select.choose_path("auto", metal=True)
    assert not choice.kernels and select.TWINS_ENV in choice.reason
    assert select.choose_path("kernels", metal=True).kernels  # an explicit request wins
    with pytest.raises(KippError, match="unknown MLX path"):
        select.choose_path("fast")


def test_cpu_streams_setting(monkeypatch):
    monkeypatch.setenv(select.STREAMS_ENV, "3")
    assert select.cpu_streams(False) == 3 and select.cpu_streams(True) == 1
    monkeypatch.setenv(select.STREAMS_ENV, "0")
    with pytest.raises(KippError):
        select.cpu_streams(False)


def test_describe_names_the_path_for_the_bench(artifacts, monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))  # bench/ is no package
    from bench.fallback import FallbackError, check_kernel_path

    _, mb = _backends(artifacts, TINY, "q8_0", path="twins")
    described = mb.describe()
    assert "twins" in described and "q8_0" in described
    with pytest.raises(FallbackError):  # a twin run is refused as a kernel measurement
        check_kernel_path("mlx", "q8_0", described)
    assert check_kernel_path("mlx", "q8_0", described, ("twin",)) == described


def test_auto_picks_mlx_on_apple_silicon(monkeypatch):
    import kipp.cuda
    from kipp import chooser as backends

    monkeypatch.setattr(kipp.cuda, "jax_sees_gpu", lambda: False)
    monkeypatch.setattr(backends, "apple_silicon", lambda: True)
    choice = backends.choose_backend("auto")
    assert choice.name == "mlx" and "mlx" in choice.reason and "Metal" in choice.reason
    monkeypatch.setattr("kipp.apple.mlx_usable", lambda: (False, "mlx does not import"))
    monkeypatch.setattr(kipp.cuda, "jax_usable", lambda: (False, "jax does not import"))
    choice = backends.choose_backend("auto")
    assert choice.name == "reference" and "does not import" in choice.reason


def test_make_backend_without_mlx_is_a_clear_error(artifacts, monkeypatch):
    from kipp.apple import backend

    monkeypatch.setattr(backend, "_MLX_MISSING", ImportError("No module named 'mlx'"))
    with pytest.raises(KippError, match="needs the mlx package"):
        backend.make_backend(open_artifact(artifacts(TINY, "bf16")), 4)


# ---- Metal kernels: sources and Python-side checks (everywhere) --------------------------


def _balanced(source: str) -> bool:
    depth = 0
    for ch in source:
        depth += {"{": 1, "}": -1, "(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


@pytest.mark.parametrize("kind", ["matvec", "matmul"])
@pytest.mark.parametrize("fmt", linear.FORMATS)
def test_linear_kernel_sources_are_well_formed(kind, fmt):
    body = linear.kernel_source(kind, fmt)
    assert "{" + "BLOCK_LOAD}" not in body and "{" + "ELEMENT}" not in body
    assert _balanced(body) and _balanced(linear.HEADER)
    for name in linear.input_names(fmt) + ("y",):
        assert re.search(rf"\b{name}\b", body), f"{kind}/{fmt} never uses {name}"
    for constant in ("N", "K") + (("M",) if kind == "matvec" else ()):
        assert re.search(rf"\b{constant}\b", body)
    assert linear.kernel(kind, fmt) is linear.kernel(kind, fmt)  # built once


@pytest.mark.parametrize("kv_scheme", ["bf16", "q8_0"])
def test_attention_kernel_sources_are_well_formed(kv_scheme):
    header, body = attention.kernel_source(kv_scheme)
    assert _balanced(header) and _balanced(body) and "{READ" not in body
    for name in attention.input_names(kv_scheme) + ("o", "ml"):
        assert re.search(rf"\b{name}\b", body), f"decode attention never uses {name}"
    assert "simd_sum" in body and "MASKED" in body and "INFINITY" not in body
    assert attention.kernel(kv_scheme) is attention.kernel(kv_scheme)


def _planes(scheme, rows=64, cols=128):
    """(kernel Linear, twin Linear, dense float32 weights) of one random weight in `scheme`:
    rows at magnitudes 2^-8 .. 2^2, inside every scheme's fp16 scale range."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-8, 3, (rows, 1))))
    raw = quant.quantize(w.astype(np.float32), scheme)
    dense = quant.dequantize(raw, scheme, cols)
    if scheme == "bf16":
        kernel = layout.Linear("bf16", rows, cols, planes=(mx.array(raw.view("<u2")),))
        return kernel, layout.twin_of(dense, "f32", cols), dense
    p = repack.to_planes(raw, scheme, cols)
    planes = tuple(mx.array(a) for a in (p.q, p.d, p.m) if a is not None)
    kernel = layout.Linear(scheme, rows, cols, planes=planes)
    return kernel, layout.twin_of(raw, scheme, cols), dense


@pytest.mark.parametrize("fmt", linear.FORMATS)
def test_linear_twin_matches_the_numpy_dequantizer(fmt):
    """The twin on either side of DEQUANTIZE_ROWS (quantized matmul below, transient dequantize
    from there) and over two row shards == x @ W^T on kipp.formats.quant's dequantized weights."""
    _, one, dense = _planes(fmt, rows=96, cols=256)
    if fmt == "bf16":
        two = layout.twin_of(dense, "f32", 256, n_shards=2)
    else:
        raw = quant.quantize(dense, fmt)  # the dequantized weights are a fixed point
        assert np.array_equal(quant.dequantize(raw, fmt, 256), dense)
        two = layout.twin_of(raw, fmt, 256, n_shards=2)
    assert len(one.shards) == 1 and len(two.shards) == 2
    for m in (1, linear.DEQUANTIZE_ROWS - 1, linear.DEQUANTIZE_ROWS, 45):
        x = np.random.default_rng(m).standard_normal((m, 256)).astype(np.float32)
        want = x.astype(np.float64) @ dense.astype(np.float64).T
        for w in (one, two):
            got = np.array(linear.linear_twin(mx.array(x), w, streams=(None,)))
            assert got.shape == (m, 96) and gates.nmse(got, want) <= 1e-12, (fmt, m)


@pytest.mark.parametrize("fmt", linear.FORMATS)
def test_linear_kernel_arguments_are_checked_before_the_call(fmt):
    w, _, _ = _planes(fmt)
    x = mx.ones((2, 128))
    assert linear.check_call(x, w) == (2, 64, 128)
    with pytest.raises(linear.LinearError, match="float32"):
        linear.matvec(x.astype(mx.float16), w)
    with pytest.raises(linear.LinearError, match="columns"):
        linear.matvec(mx.ones((2, 96)), w)
    with pytest.raises(linear.LinearError, match="at most"):
        linear.matvec(mx.ones((9, 128)), w)
    broken = layout.Linear(fmt, 64, 128, planes=(w.planes[0].astype(mx.float32),) + w.planes[1:])
    with pytest.raises(linear.LinearError, match="plane 0"):
        linear.matmul(x, broken)
    with pytest.raises(linear.LinearError, match="multiples"):
        linear.check_call(mx.ones((2, 100)), layout.Linear(fmt, 64, 100, planes=w.planes))
    with pytest.raises(linear.LinearError, match="twins"):
        linear.matvec(x, layout.Linear("f32", 64, 128, shards=((mx.ones((128, 64)),),)))


def _kv(scheme, slots=96, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((slots, 8, 128)).astype(np.float32)
    v = rng.standard_normal((slots, 8, 128)).astype(np.float32)
    if scheme == "bf16":
        return tuple(mx.array(a).astype(mx.bfloat16).view(mx.uint16) for a in (k, v))
    (kq, kd), (vq, vd) = kvquant.quantize(k), kvquant.quantize(v)
    return (mx.array(kq), mx.array(kd.view(np.uint16)), mx.array(vq), mx.array(vd.view(np.uint16)))


@pytest.mark.parametrize("kv_scheme", ["bf16", "q8_0"])
def test_attention_kernel_arguments_are_checked_before_the_call(kv_scheme):
    planes = _kv(kv_scheme)
    q = mx.ones((2, 16, 128))
    tables, lengths = mx.array([[0, 1], [2, 0]], dtype=mx.int32), mx.array([40, 20], mx.int32)
    assert attention.check_decode_call(q, planes, tables, lengths, kv_scheme) == (2, 16, 8, 2)
    with pytest.raises(attention.AttentionError, match="q must"):
        attention.decode_attention(q.astype(mx.bfloat16), planes, tables, lengths, kv_scheme)
    with pytest.raises(attention.AttentionError, match="group"):
        attention.decode_attention(mx.ones((2, 12, 128)), planes, tables, lengths, kv_scheme)
    with pytest.raises(attention.AttentionError, match="lengths"):
        attention.decode_attention(q, planes, tables, lengths.astype(mx.int64), kv_scheme)
    with pytest.raises(attention.AttentionError, match="tables"):
        attention.decode_attention(q, planes, tables[:1], lengths, kv_scheme)
    with pytest.raises(attention.AttentionError, match="planes"):
        attention.decode_attention(q, planes[:-1], tables, lengths, kv_scheme)
    with pytest.raises(attention.AttentionError, match="plane"):
        attention.decode_attention(q, (planes[0][:64],) + planes[1:], tables, lengths,
                                   kv_scheme)


@pytest.mark.skipif(METAL, reason="checks the no-Metal error path")
def test_checked_kernel_calls_reach_mlx_without_metal():
    w, _, _ = _planes("q8_0")
    with pytest.raises(RuntimeError, match="Metal"):
        mx.eval(linear.matvec(mx.ones((1, 128)), w))


@pytest.mark.parametrize("heads", [16, 40])  # GQA groups 2 and 5
@pytest.mark.parametrize("n", [1, 7])
def test_attention_twin_split_over_streams_is_bitwise_one_call(heads, n):
    """KV-head ranges on 2 and 3 CPU streams (uneven: 2, 3, 3 heads) give the one-call SDPA
    bit for bit, and the reference's attention within float32 noise."""
    from kipp.reference import ops

    rng = np.random.default_rng(heads + n)
    q = rng.standard_normal((n, heads, 128)).astype(np.float32)
    k, v = (rng.standard_normal((40, 8, 128)).astype(np.float32) for _ in range(2))
    one = np.array(attention.attention_twin(mx.array(q), mx.array(k), mx.array(v)))
    for count in (2, 3):
        streams = tuple(mx.new_stream(mx.cpu) for _ in range(count))
        split = np.array(attention.attention_twin(mx.array(q), mx.array(k), mx.array(v), streams))
        assert np.array_equal(split.view(np.uint32), one.view(np.uint32)), count
    for i in range(n):  # query i sits at position 40 - n + i: sees keys 0 .. 40 - n + i
        visible = 40 - n + i + 1
        want = ops.attend(q[i].reshape(8, -1, 128), k[:visible], v[:visible]).reshape(-1)
        assert gates.nmse(one[i], want) <= 1e-10


def test_split_k_merge_equals_one_softmax():
    """The wrapper's merge of per-range partials (what the kernel writes) is the full softmax,
    including an empty range (max MASKED = -1e30, zero denominator)."""
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((2, 3, 70)).astype(np.float32) * 4
    values = rng.standard_normal((70, 128)).astype(np.float32)
    ranges = [(0, 32), (32, 64), (64, 70), (70, 70)]
    o, m, l = [], [], []
    for lo, hi in ranges:
        part = scores[..., lo:hi]
        top = part.max(-1) if hi > lo else np.full(part.shape[:-1], -1e30, np.float32)
        p = np.exp(part - top[..., None]) if hi > lo else part
        o.append(p @ values[lo:hi])
        m.append(top)
        l.append(p.sum(-1))
    merged = attention.merge_splits(mx.array(np.stack(o, -2)), mx.array(np.stack(m, -1)),
                                    mx.array(np.stack(l, -1)))
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    want = (weights / weights.sum(-1, keepdims=True)) @ values
    assert np.allclose(np.array(merged), want, rtol=1e-5, atol=1e-6)


def test_decode_round_packs_tables_for_the_kernel(artifacts):
    """What the kernel path feeds decode attention: 0-padded tables, lengths = position + 1."""
    artifact = open_artifact(artifacts(TINY, "bf16"))
    mb = MLXBackend(artifact, BLOCKS, path="twins")
    mb.choice = select.Choice(True, "test")
    from kipp.cuda.rounds import plan_rounds

    items = [EvalItem((1,), 40, (3, 5)), EvalItem((2,), 3, (7,))]
    r, dests = mb._pack(items, plan_rounds(items, 512)[0])
    order = [p for p in plan_rounds(items, 512)[0]]
    assert r.decode_only and dests == [(p.item, 0) for p in order]
    want = {0: ([3, 5], 41), 1: ([7, 0], 4)}
    for s, p in enumerate(order):
        assert np.array(r.tables)[s].tolist() == want[p.item][0]
        assert int(np.array(r.lengths)[s]) == want[p.item][1]


# ---- Metal kernels: execution (Apple silicon only) ---------------------------------------


@needs_metal
@pytest.mark.parametrize("fmt", linear.FORMATS)
@pytest.mark.parametrize("m", [1, 3, 8, 45])
def test_linear_kernels_match_twin_and_reference(fmt, m):
    kernel, twin, dense = _planes(fmt, rows=96, cols=256)
    x = np.random.default_rng(m).standard_normal((m, 256)).astype(np.float32)
    got = np.array(linear.linear_kernel(mx.array(x), kernel))
    want = x.astype(np.float64) @ dense.astype(np.float64).T  # the numpy dequantizer's weights
    assert gates.nmse(got, want) <= 1e-12
    assert gates.nmse(np.array(linear.linear_twin(mx.array(x), twin)), want) <= 1e-12


@needs_metal
@pytest.mark.parametrize("kv_scheme", ["bf16", "q8_0"])
@pytest.mark.parametrize("length", [1, 33, 700])
def test_decode_attention_kernel_matches_twin(kv_scheme, length):
    """Split-K over 16-block ranges (700 positions: 2 ranges), a scrambled table."""
    blocks = -(-length // 32)
    slots = (blocks + 3) * 32
    planes = _kv(kv_scheme, slots)
    table = np.random.default_rng(length).permutation(blocks + 3)[:blocks].astype(np.int32)
    q = np.random.default_rng(1).standard_normal((1, 16, 128)).astype(np.float32)
    got = attention.decode_attention(mx.array(q), planes, mx.array(table[None]),
                                     mx.array([length], mx.int32), kv_scheme)
    visible = mx.array((table[np.arange(length) // 32] * 32 + np.arange(length) % 32)
                       .astype(np.int32))
    half = len(planes) // 2
    k, v = (_rows(planes[i * half:(i + 1) * half], visible, kv_scheme) for i in (0, 1))
    want = attention.attention_twin(mx.array(q), k, v)
    assert gates.nmse(np.array(got), np.array(want)) <= 1e-10


def _rows(planes, slots, kv_scheme):
    if kv_scheme == "bf16":
        return planes[0][slots].view(mx.bfloat16).astype(mx.float32)
    return dequantize_q8_0(planes[0][slots], planes[1][slots].view(mx.float16))


@needs_metal
@pytest.mark.parametrize("scheme", SCHEMES)
def test_whole_model_on_kernels_matches_reference(artifacts, scheme):
    ref, mb = _backends(artifacts, UNTIED, scheme, path="kernels")
    assert "Metal kernels" in mb.describe()
    _gate(ref, mb, decode_steps=3)


@needs_metal
def test_whole_model_kernels_with_q8_0_kv(artifacts):
    artifact = open_artifact(artifacts(TINY, "q8_0"))
    twin = MLXBackend(artifact, BLOCKS, path="twins", kv_scheme="q8_0")
    kern = MLXBackend(artifact, BLOCKS, path="kernels", kv_scheme="q8_0")
    _gate(twin, kern, decode_steps=3)


# ---- the kernel path's Python glue, with numpy stand-ins for the Metal kernels -----------


def _emulated_linear(kind, fmt):
    """What the matvec / matmul kernels compute, from the same inputs, in numpy: x @ W^T on
    the planes decoded by kipp.apple.repack (BF16 bits widened). Checks the wrapper's call."""
    def call(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        t = dict(template)
        x, planes = np.array(inputs[0]), [np.array(p) for p in inputs[1:]]
        if fmt == "bf16":
            dense = (planes[0].astype(np.uint32) << 16).view(np.float32)
        else:
            m = planes[2] if len(planes) == 3 else None
            dense = repack.dequantize_planes(repack.Planes(planes[0], planes[1], m, fmt))
        assert dense.shape == (t["N"], t["K"]) and x.shape[1] == t["K"]
        assert kind == ("matvec" if x.shape[0] <= linear.MATVEC_ROWS else "matmul")
        y = np.zeros(output_shapes[0], np.float32)
        y[:x.shape[0]] = x.astype(np.float64) @ dense.astype(np.float64).T
        return [mx.array(y)]
    return call


def _emulated_decode_attention(kv_scheme):
    """What the split-K decode kernel writes, in numpy: per (sequence, query head, split)
    the unnormalised output and its (max, denominator); an empty split MASKED, 0, zeros."""
    def call(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        t = dict(template)
        q, tables, lengths = (np.array(inputs[i]) for i in (0, -2, -1))
        planes = [np.array(p) for p in inputs[1:-2]]
        half = len(planes) // 2

        def rows(p, slots):
            if kv_scheme == "bf16":
                return (p[0][slots].astype(np.uint32) << 16).view(np.float32)
            heads = p[0].shape[1]  # 8, or a tensor-parallel rank's share
            d = p[1][slots].view(np.float16).astype(np.float32)  # [P, heads, 4]
            return (p[0][slots].astype(np.float32).reshape(*slots.shape, heads, 4, 32)
                    * d[..., None]).reshape(*slots.shape, heads, 128)
        o = np.zeros(output_shapes[0], np.float32)
        ml = np.zeros(output_shapes[1], np.float32)
        span = t["BPS"] * KV_BLOCK
        for s in range(q.shape[0]):
            for c in range(t["SPLITS"]):
                pos = np.arange(c * span, min((c + 1) * span, int(lengths[s])))
                if len(pos) == 0:
                    ml[s, :, c, 0] = -1e30  # the kernel's MASKED
                    continue
                slots = tables[s, pos // KV_BLOCK] * KV_BLOCK + pos % KV_BLOCK
                k, v = rows(planes[:half], slots), rows(planes[half:], slots)
                for h in range(t["H"]):
                    scores = k[:, h // t["G"]] @ q[s, h] * attention.SCALE
                    w = np.exp(scores - scores.max())
                    o[s, h, c] = w @ v[:, h // t["G"]]
                    ml[s, h, c] = scores.max(), w.sum()
        return [mx.array(o), mx.array(ml)]
    return call


def _standin_runner(spec):
    """A kernel runner (kipp.apple.metal) whose kernels are the numpy stand-ins above."""
    if spec.name.startswith("kipp_decode_attention_"):
        return _emulated_decode_attention(spec.name.removeprefix("kipp_decode_attention_"))
    _, kind, fmt = spec.name.split("_", 2)
    return _emulated_linear(kind, fmt)


@pytest.fixture
def emulated_kernels():
    """MLXBackend options running the kernel path on the numpy stand-ins (the real Metal
    sources run on the Metal emulator: tests/test_metal_kernels.py), with kernel fallback off
    (a stand-in failing its load probe fails the test instead of running its twin)."""
    return {"kernel_runner": _standin_runner, "fallback": False}


@pytest.mark.parametrize("scheme", [s if s in ("bf16", "scale4_gs32") else  # CI: longest
                                    pytest.param(s, marks=pytest.mark.slow) for s in SCHEMES])
def test_kernel_path_glue_with_emulated_kernels(artifacts, emulated_kernels, scheme):
    """The kernel path end to end (weights as stored, three Q/K/V calls, the FFN and head on
    the kernels, decode rounds through tables and lengths, split-K merge) with numpy standing
    in for Metal: whatever is wrong outside the Metal sources fails here, on any machine."""
    ref, mb = _backends(artifacts, UNTIED, scheme, **emulated_kernels)
    assert mb.choice.kernels and "as stored" in mb.describe()
    _gate(ref, mb, prompt_len=40, decode_steps=2, rows=3)


def test_kernel_path_glue_with_q8_0_kv(artifacts, emulated_kernels):
    ref, mb = _backends(artifacts, TINY, "q8_0", kv_scheme="q8_0", **emulated_kernels)
    assert mb.choice.kernels and "q8_0 KV" in mb.describe()
    _gate(ref, mb, prompt_len=40, decode_steps=2, rows=3)
