"""Kipp's Metal kernels, run here: the exact source MLX generates for each kernel call, compiled
as C++ against the Metal emulator (tools/metal_emulator) and run on the CPU, one fiber per GPU
thread, under AddressSanitizer + UndefinedBehaviorSanitizer, against the MLX-op twin and the
numpy reference (float64 on kipp.formats.quant's dequantized weights / kipp.formats.kvquant's KV).

Default suite: every kernel and format at small shapes, planted faults. Slow (.ci/run): one
real registry shape per kernel, ThreadSanitizer over every kernel, the whole model on the
emulated kernels (one configuration), and the whole-model gates (every scheme, vs transformers,
cached decode, scrambled table, batched, q8_0 KV) through the emulated kernels.

What this proves and what only a Mac can: tools/metal_emulator/README.md.
"""

import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"),
    reason="the Metal emulator's fiber switch is written for x86-64; on Apple silicon the "
           "kernels run on Metal itself (bench/mac_check.sh)")

from metal_emulator import CompileError, Emulator, KernelFault, check_strict  # noqa: E402

from kipp import gates  # noqa: E402
from kipp.apple import attention, layout, linear, repack  # noqa: E402
from kipp.apple.backend import MLXBackend  # noqa: E402
from kipp.backend import EvalItem  # noqa: E402
from kipp.errors import KippError  # noqa: E402
from kipp.formats import kvquant, quant
from kipp.formats.artifact import open_artifact  # noqa: E402
from kipp.model import Model  # noqa: E402
from kipp.reference.backend import ReferenceBackend  # noqa: E402

TINY = "kipp-synthetic/qwen3-tiny"
UNTIED = "kipp-synthetic/qwen3-tiny-untied"
SCHEMES = ["bf16", "q8_0", "affine4_gs32", "scale4_gs32"]
BLOCKS = 12
# Calibrated bounds (NMSE, gates.nmse), about 5x the largest error these tests print (pytest
# -s tests/test_metal_kernels.py): linear kernels vs the float64 reference <= 9.1e-14, vs the
# twin <= 1.8e-13 (the twin's float32 sums in another order; they differ from the reference
# more than the kernel does); decode attention vs the reference <= 2.3e-15, vs the twin
# <= 1.9e-14.
LINEAR_NMSE = 1e-12
ATTENTION_NMSE = 1e-13
# At the registry shapes float32 rounding grows with the sums' length (slow tests below): linear
# (K up to 3072) vs the twin <= 1.0e-12, vs the reference <= 3.3e-13; attention over 2,000
# positions vs the twin <= 7.9e-13, vs the reference <= 2.7e-13.
REGISTRY_LINEAR_NMSE = 5e-12
REGISTRY_ATTENTION_NMSE = 5e-12

ASAN = Emulator("asan")
FAST = Emulator("fast")


# ---- cases -------------------------------------------------------------------------------


def _weights(fmt, rows, cols, seed=3):
    """(kernel Linear, twin Linear, dense float32) of one random weight in `fmt`, rows at
    magnitudes 2^-8 .. 2^2 (inside every scheme's fp16 scale range)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-8, 3, (rows, 1)))
    raw = quant.quantize(w.astype(np.float32), fmt)
    dense = quant.dequantize(raw, fmt, cols)
    if fmt == "bf16":
        kernel = layout.Linear("bf16", rows, cols, planes=(mx.array(raw.view("<u2")),))
        return kernel, layout.twin_of(dense, "f32", cols), dense
    p = repack.to_planes(raw, fmt, cols)
    planes = tuple(mx.array(a) for a in (p.q, p.d, p.m) if a is not None)
    return layout.Linear(fmt, rows, cols, planes=planes), layout.twin_of(raw, fmt, cols), dense


@dataclass
class Measured:
    vs_reference: float  # NMSE
    vs_twin: float
    max_abs_reference: float
    max_abs_twin: float
    seconds: float  # running the kernel binary (compiles excluded)


def _run_seconds(emulator) -> float:
    return sum(t.seconds for t in emulator.timings.values())


def linear_case(kind, fmt, m, n, k, emulator=ASAN, seed=0) -> Measured:
    """One kernel call on the emulator vs the twin and x @ W^T in float64."""
    w, twin, dense = _weights(fmt, n, k)
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    call = linear.matvec if kind == "matvec" else linear.matmul
    start = _run_seconds(emulator)
    got = np.array(call(mx.array(x), w, runner=emulator))
    seconds = _run_seconds(emulator) - start
    want = x.astype(np.float64) @ dense.astype(np.float64).T
    twin_out = np.array(linear.linear_twin(mx.array(x), twin))
    assert got.shape == (m, n)
    assert np.isfinite(got).all(), "linear kernel output not finite"
    return Measured(gates.nmse(got, want), gates.nmse(got, twin_out),
                    float(np.abs(got - want).max()), float(np.abs(got - twin_out).max()), seconds)


def _kv(kv_scheme, slots, seed, kv_heads=8):
    """(kernel planes as numpy, dense K, dense V float32 [slots, kv_heads, 128])."""
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal((slots, kv_heads, 128)).astype(np.float32) for _ in range(2))
    if kv_scheme == "bf16":
        bits = [np.array(mx.array(a).astype(mx.bfloat16).view(mx.uint16)) for a in (k, v)]
        dense = [(b.astype(np.uint32) << 16).view(np.float32) for b in bits]
        return tuple(bits), dense[0], dense[1]
    (kq, kd), (vq, vd) = kvquant.quantize(k), kvquant.quantize(v)
    planes = (kq, kd.view(np.uint16), vq, vd.view(np.uint16))
    return planes, kvquant.dequantize(kq, kd), kvquant.dequantize(vq, vd)


def attention_case(kv_scheme, heads, lengths, blocks_per_split, emulator=ASAN,
                   seed=0, kv_heads=8) -> Measured:
    """Split-K decode attention over scrambled tables (one sequence per length) vs the twin
    (SDPA on the gathered rows) and a float64 softmax; `kv_heads`: the slab's KV heads (a
    tensor-parallel rank holds a share of the 8)."""
    rng = np.random.default_rng(seed)
    width = max(-(-n // 32) for n in lengths)
    blocks = len(lengths) * width + 2
    planes, keys, values = _kv(kv_scheme, blocks * 32, seed, kv_heads)
    tables = rng.permutation(blocks)[:len(lengths) * width].reshape(len(lengths), width)
    tables = tables.astype(np.int32)
    q = rng.standard_normal((len(lengths), heads, 128)).astype(np.float32)
    start = _run_seconds(emulator)
    got = np.array(attention.decode_attention(
        mx.array(q), tuple(mx.array(p) for p in planes), mx.array(tables),
        mx.array(np.array(lengths, np.int32)), kv_scheme, blocks_per_split, runner=emulator))
    seconds = _run_seconds(emulator) - start
    want, twin = np.zeros_like(got, np.float64), np.zeros_like(got)
    group = heads // kv_heads
    for s, length in enumerate(lengths):
        pos = np.arange(length)
        slots = tables[s, pos // 32] * 32 + pos % 32
        k, v = keys[slots], values[slots]
        twin[s] = np.array(attention.attention_twin(mx.array(q[s:s + 1]), mx.array(k),
                                                    mx.array(v)))[0]
        for h in range(heads):
            scores = k[:, h // group].astype(np.float64) @ q[s, h] * attention.SCALE
            p = np.exp(scores - scores.max())
            want[s, h * 128:(h + 1) * 128] = (p / p.sum()) @ v[:, h // group]
    assert np.isfinite(got).all(), "attention kernel output not finite"
    return Measured(gates.nmse(got, want), gates.nmse(got, twin), float(np.abs(got - want).max()),
                    float(np.abs(got - twin).max()), seconds)


# ---- every kernel, every format, small shapes (ASan + UBSan) ------------------------------


@pytest.mark.parametrize("fmt", linear.FORMATS)
@pytest.mark.parametrize("kind, m", [("matvec", 3), ("matmul", 45)])
def test_linear_kernel_on_emulator(kind, fmt, m):
    """N = 96 (three 32-output tiles), K = 256; matmul's 45 tokens pad to two token tiles."""
    r = linear_case(kind, fmt, m, 96, 256)
    print(f"{kind} {fmt} M={m}: NMSE vs reference {r.vs_reference:.1e}, vs twin "
          f"{r.vs_twin:.1e}; max abs error vs reference {r.max_abs_reference:.1e}, vs twin "
          f"{r.max_abs_twin:.1e} ({r.seconds:.2f} s)")
    assert r.vs_reference <= LINEAR_NMSE and r.vs_twin <= LINEAR_NMSE


@pytest.mark.parametrize("kv_scheme", ["bf16", "q8_0"])
@pytest.mark.parametrize("heads", [16, 40])  # GQA groups 2 and 5
def test_decode_attention_kernel_on_emulator(kv_scheme, heads):
    """Lengths 1 (every split but the first empty), 33 (across a block edge) and 300 (five
    splits of 2 blocks, the last partial)."""
    r = attention_case(kv_scheme, heads, [1, 33, 300], blocks_per_split=2)
    print(f"decode attention {kv_scheme} H={heads}: NMSE vs reference {r.vs_reference:.1e}, "
          f"vs twin {r.vs_twin:.1e}; max abs error vs reference {r.max_abs_reference:.1e}, vs "
          f"twin {r.max_abs_twin:.1e} ({r.seconds:.2f} s)")
    assert r.vs_reference <= ATTENTION_NMSE and r.vs_twin <= ATTENTION_NMSE


@pytest.mark.parametrize("kv_scheme", ["bf16", "q8_0"])
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_decode_attention_kernel_on_a_tensor_parallel_share(kv_scheme, ranks):
    """A rank of a tensor-parallel group holds 8 / ranks KV heads and the query heads that
    share them (Qwen3-0.6B's 16 query heads: 8, 4, 2): its slab rows are that many heads wide."""
    r = attention_case(kv_scheme, 16 // ranks, [1, 33, 300], blocks_per_split=2,
                       kv_heads=8 // ranks)
    print(f"decode attention {kv_scheme} over {ranks} ranks: NMSE vs reference "
          f"{r.vs_reference:.1e}, vs twin {r.vs_twin:.1e}")
    assert r.vs_reference <= ATTENTION_NMSE and r.vs_twin <= ATTENTION_NMSE


def test_decode_attention_refuses_a_slab_its_heads_do_not_group_over():
    planes, _, _ = _kv("bf16", 64, 0, kv_heads=3)
    with pytest.raises(attention.AttentionError, match="the slab's 3 KV heads"):
        attention.decode_attention(mx.zeros((1, 6, 128)), tuple(map(mx.array, planes)),
                                   mx.zeros((1, 2), mx.int32), mx.ones((1,), mx.int32),
                                   runner=ASAN)


@pytest.mark.parametrize("kind", ["matvec", "matmul"])
def test_linear_sources_pass_strict_address_spaces(kind):
    """clang with Metal's address spaces accepts every linear kernel source as MLX emits it."""
    for fmt in linear.FORMATS:
        check_strict(_mlx_source(linear.kernel_spec(kind, fmt), _linear_call(kind, fmt)))


def test_attention_sources_pass_strict_address_spaces():
    for kv_scheme in ("bf16", "q8_0"):
        check_strict(_mlx_source(attention.kernel_spec(kv_scheme), _attention_call(kv_scheme)))


def _mlx_source(spec, call):
    inputs, kwargs = call
    return ASAN(spec).source(inputs, kwargs)


def _linear_call(kind, fmt, n=64, k=256):
    w, _, _ = _weights(fmt, n, k)
    m = 3 if kind == "matvec" else 32
    x = mx.zeros((m, k))
    template = [("M", m), ("N", n), ("K", k)] if kind == "matvec" else [("N", n), ("K", k)]
    return [x, *w.planes], dict(template=template, grid=(32, n, 1), threadgroup=(32, 4, 1),
                                output_shapes=[(m, n)], output_dtypes=[mx.float32])


def _attention_call(kv_scheme):
    planes, _, _ = _kv(kv_scheme, 64, 0)
    inputs = [mx.zeros((1, 16, 128)), *map(mx.array, planes), mx.zeros((1, 2), mx.int32),
              mx.ones((1,), mx.int32)]
    template = [("H", 16), ("KVH", 8), ("G", 2), ("B", 2), ("BPS", 1), ("SPLITS", 2)]
    return inputs, dict(template=template, grid=(32, 2, 16), threadgroup=(32, 2, 1),
                        output_shapes=[(1, 16, 2, 128), (1, 16, 2, 2)],
                        output_dtypes=[mx.float32, mx.float32])


# ---- one real registry shape per kernel (slow) ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fmt", linear.FORMATS)
@pytest.mark.parametrize("kind, m, n, k", [
    ("matvec", 1, 1024, 3072),   # Qwen3-0.6B down_proj, one decode token
    ("matmul", 40, 3072, 1024),  # Qwen3-0.6B gate_proj, a 40-token prefill chunk
])
def test_linear_kernel_at_registry_shape(kind, fmt, m, n, k):
    r = linear_case(kind, fmt, m, n, k)
    print(f"{kind} {fmt} M={m} N={n} K={k}: NMSE vs reference {r.vs_reference:.1e}, vs twin "
          f"{r.vs_twin:.1e}; max abs error vs reference {r.max_abs_reference:.1e}, vs twin "
          f"{r.max_abs_twin:.1e} ({r.seconds:.1f} s)")
    assert r.vs_reference <= REGISTRY_LINEAR_NMSE and r.vs_twin <= REGISTRY_LINEAR_NMSE


@pytest.mark.slow
@pytest.mark.parametrize("kv_scheme", ["bf16", "q8_0"])
@pytest.mark.parametrize("heads", [16, 40])  # Qwen3-0.6B / 1.7B and Qwen3-14B
def test_decode_attention_at_registry_shape(kv_scheme, heads):
    """2,000 positions in the production split (16 blocks per split: 4 splits)."""
    r = attention_case(kv_scheme, heads, [2000, 517], attention.BLOCKS_PER_SPLIT)
    print(f"decode attention {kv_scheme} H={heads} over 2000: NMSE vs reference "
          f"{r.vs_reference:.1e}, vs twin {r.vs_twin:.1e}; max abs error vs reference "
          f"{r.max_abs_reference:.1e}, vs twin {r.max_abs_twin:.1e} ({r.seconds:.1f} s)")
    assert r.vs_reference <= REGISTRY_ATTENTION_NMSE and r.vs_twin <= REGISTRY_ATTENTION_NMSE


# ---- ThreadSanitizer over every kernel (slow) ----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fmt", linear.FORMATS)
@pytest.mark.parametrize("kind, m", [("matvec", 3), ("matmul", 45)])
def test_linear_kernel_has_no_races(kind, fmt, m):
    r = linear_case(kind, fmt, m, 96, 256, emulator=Emulator("tsan", workers=2))
    assert r.vs_reference <= LINEAR_NMSE


@pytest.mark.slow
@pytest.mark.parametrize("kv_scheme", ["bf16", "q8_0"])
def test_decode_attention_kernel_has_no_races(kv_scheme):
    r = attention_case(kv_scheme, 16, [1, 70, 130], 2, emulator=Emulator("tsan", workers=2))
    assert r.vs_reference <= ATTENTION_NMSE


# ---- planted faults -------------------------------------------------------------------------
# Each fault is planted in a kernel's Metal source (or its dispatch) by monkeypatching, then the
# check named in `caught_by` must fail. FAULT_CATALOGUE (below the tests) lists them all for the
# project's fault catalogue.


@dataclass(frozen=True)
class MetalFault:
    name: str
    where: str  # kipp.apple module and attribute (with [key] for a dict entry) holding the text
    old: str  # text replaced ...
    new: str  # ... by this
    caught_by: str  # the check that fails, and how
    expect: str  # regex the failure's message must match

    def plant(self, monkeypatch):
        module, attribute, *key = self.where.replace("]", "").replace("[", ".").split(".")
        module = {"linear": linear, "attention": attention}[module]
        holder = getattr(module, attribute)
        text = holder[key[0]] if key else holder
        assert text.count(self.old) >= 1, f"{self.name}: {self.old!r} is not in {self.where}"
        changed = text.replace(self.old, self.new, 1)
        if key:
            monkeypatch.setitem(holder, key[0], changed)
        else:
            monkeypatch.setattr(module, attribute, changed)


def _check_matvec(fmt="q8_0", emulator=ASAN, k=256):
    r = linear_case("matvec", fmt, 3, 96, k, emulator)
    assert r.vs_reference <= LINEAR_NMSE, f"NMSE vs reference {r.vs_reference:.2e}"


def _check_matmul(fmt="q8_0", emulator=ASAN):
    r = linear_case("matmul", fmt, 45, 96, 256, emulator)
    assert r.vs_reference <= LINEAR_NMSE, f"NMSE vs reference {r.vs_reference:.2e}"


def _check_attention(kv_scheme="q8_0", emulator=ASAN):
    r = attention_case(kv_scheme, 16, [1, 33, 300], 2, emulator)
    assert r.vs_reference <= ATTENTION_NMSE, f"NMSE vs reference {r.vs_reference:.2e}"


def _check_attention_share(kv_scheme="bf16", emulator=ASAN):
    r = attention_case(kv_scheme, 8, [1, 33, 300], 2, emulator, kv_heads=4)
    assert r.vs_reference <= ATTENTION_NMSE, f"NMSE vs reference {r.vs_reference:.2e}"


def _check_strict_matvec():
    check_strict(_mlx_source(linear.kernel_spec("matvec", "bf16"), _linear_call("matvec", "bf16")))


METAL_FAULTS = [
    (MetalFault("matvec index off by one: a lane reads one block past the row",
                "linear.MATVEC_SOURCE", "b < KB; b += 32", "b <= KB; b += 32",
                "ASan heap-buffer-overflow on w (the last row's extra block)",
                "AddressSanitizer: heap-buffer-overflow"), _check_matvec),
    (MetalFault("matmul barrier removed: simdgroups read the tiles before they are staged",
                "linear.MATMUL_SOURCE",
                "        threadgroup_barrier(mem_flags::mem_threadgroup);\n        for (uint kk",
                "        for (uint kk",
                "the threadgroup arrays' NaN fill reaches the output (finite check)",
                "not finite"), _check_matmul),
    (MetalFault("matmul tile loaded with the wrong row stride (33 for 32)",
                "linear.MATMUL_SOURCE", "simdgroup_load(a0, xs + (sm + 0) * 32 + kk, 32);",
                "simdgroup_load(a0, xs + (sm + 0) * 32 + kk, 33);",
                "NMSE vs the float64 reference", "NMSE vs reference"), _check_matmul),
    (MetalFault("q8_0 weight scale read at the next block's offset",
                "linear._BLOCK_LOAD[q8_0]", "d[size_t(n) * KB + b]", "d[size_t(n) * KB + b + 1]",
                "ASan heap-buffer-overflow on d (the last block of the last row)",
                "AddressSanitizer: heap-buffer-overflow"), _check_matvec),
    (MetalFault("q8_0 KV scale read at the next block's offset",
                "attention._LOAD_ROW[q8_0]", "d[row * 4 + dim / 32]", "d[row * 4 + dim / 32 + 1]",
                "NMSE vs the float64 reference", "NMSE vs reference"), _check_attention),
    (MetalFault("decode attention reads one position past the sequence",
                "attention.DECODE_SOURCE", "min(first + BPS * 32, length)",
                "min(first + BPS * 32, length + 1)",
                "NMSE vs the float64 reference", "NMSE vs reference"), _check_attention),
    (MetalFault("decode attention strides the slab 8 KV heads wide whatever it holds",
                "attention.DECODE_SOURCE", "size_t(slot) * KVH + kvh", "size_t(slot) * 8 + kvh",
                "on a rank's slab of 4 KV heads the rows past its first half are read past "
                "the slab's end: ASan's SEGV, or the emulator's NaN fill in the output",
                "AddressSanitizer|not finite"), _check_attention_share),
    (MetalFault("simd_sum reached by half the lanes",
                "linear.MATVEC_SOURCE", "const float total = simd_sum(acc[r]);",
                "const float total = lane < 16 ? simd_sum(acc[r]) : 0.0f;",
                "NMSE vs the float64 reference at K = 1024, where every lane holds a partial sum "
                "(the other lanes have finished, so the sum covers the active lanes only, as "
                "Metal defines it; at K = 256 only lanes 0-7 hold data and the result is right)",
                "NMSE vs reference"), lambda: _check_matvec(k=1024)),
    (MetalFault("barrier in divergent control flow (half the threadgroup skips it)",
                "linear.MATMUL_SOURCE",
                "        threadgroup_barrier(mem_flags::mem_threadgroup);\n        for (uint kk",
                "        if (tid < 64) threadgroup_barrier(mem_flags::mem_threadgroup);\n"
                "        for (uint kk",
                "the emulator's divergence detector", "divergent"), _check_matmul),
    (MetalFault("an output row never written",
                "linear.MATVEC_SOURCE", "if (lane == 0) y[", "if (lane == 0 && n > 0) y[",
                "the output poison check", "never written"), _check_matvec),
    (MetalFault("constant-space pointer to device memory (compiles with the address spaces gone)",
                "linear._BLOCK_LOAD[bf16]", "const device uint16_t* src",
                "const constant uint16_t* src",
                "strict mode: clang with Metal's address spaces", "address space"),
     _check_strict_matvec),
]


@pytest.mark.parametrize("fault, check", METAL_FAULTS, ids=[f.name for f, _ in METAL_FAULTS])
def test_planted_fault_is_caught(monkeypatch, fault, check):
    fault.plant(monkeypatch)
    with pytest.raises((KernelFault, CompileError, AssertionError), match=fault.expect):
        check()


def _whole_threadgroups_without_bounds_check(monkeypatch):
    """The dispatch fault: matvec as whole threadgroups of 3 rows over N = 96 + 32 = 128 rows
    (not a multiple of 3): the partial last threadgroup's missing rows run anyway and the
    kernel, which has no n < N check, reads w and writes y past their ends."""
    real = linear.kernel

    def faulty(kind, fmt, runner=None):
        k = real(kind, fmt, runner)
        if kind != "matvec":
            return k

        def call(**kw):
            rows = kw["grid"][1]
            return k(**{**kw, "grid": (32, -(-rows // 3) * 3, 1), "threadgroup": (32, 3, 1)})
        return call
    monkeypatch.setattr(linear, "kernel", faulty)


def test_planted_dispatch_fault_is_caught(monkeypatch):
    """Missing bounds check on a partial threadgroup: ASan sees the rows past the end."""
    _whole_threadgroups_without_bounds_check(monkeypatch)
    with pytest.raises(KernelFault, match="AddressSanitizer: heap-buffer-overflow"):
        linear_case("matvec", "bf16", 1, 128, 256)


@pytest.mark.slow
def test_planted_race_is_caught_by_tsan(monkeypatch):
    """The second barrier removed: the next K step's staging overwrites the tiles while other
    simdgroups still read them (ThreadSanitizer: a data race on the threadgroup arrays)."""
    MetalFault("matmul second barrier removed", "linear.MATMUL_SOURCE",
               "        }\n        threadgroup_barrier(mem_flags::mem_threadgroup);\n    }",
               "        }\n    }", "ThreadSanitizer", "").plant(monkeypatch)
    assert linear.MATMUL_SOURCE.count("threadgroup_barrier") == 1
    with pytest.raises(KernelFault, match="ThreadSanitizer: data race"):
        linear_case("matmul", "q8_0", 45, 96, 256, emulator=Emulator("tsan"))


# ---- the whole model on the emulated kernels ------------------------------------------------


def _emulated(artifacts, checkpoint_id, scheme, emulator, **options):
    """(reference backend, MLXBackend whose kernel path runs on `emulator`) on one artifact."""
    artifact = open_artifact(artifacts(checkpoint_id, scheme))
    ref_options = {"kv_scheme": options["kv_scheme"]} if "kv_scheme" in options else {}
    # fallback off: a kernel failing its load probe must fail the test, not run its twin
    mb = MLXBackend(artifact, BLOCKS, kernel_runner=emulator, fallback=False, **options)
    assert mb.choice.kernels and "Metal emulator" in mb.describe()
    return ReferenceBackend(artifact, BLOCKS, **ref_options), mb


def _gate(ref, mb, prompt_len=30, decode_steps=3, rows=3, seed=0):
    """Prefill (its last `rows` logits: up to 8 rows the head runs on the matvec kernel), then
    decode across the 31/32/33 block edge, on a scrambled block table."""
    table = np.random.default_rng(seed).permutation(BLOCKS)[:3]
    tokens = np.random.default_rng(seed).integers(0, 151_643, prompt_len)
    start = time.perf_counter()
    result = gates.gate_backends(ref, mb, tokens, table, logits_rows=rows,
                                 decode_steps=decode_steps)
    print(f"{mb.describe()}: {result.name} NMSE {result.metric:.1e} "
          f"({time.perf_counter() - start:.1f} s)")
    assert result.passed, result.detail


@pytest.mark.slow  # one of the default suite's longest (CI: the metal emulator step)
def test_whole_model_on_emulated_kernels(artifacts):
    """The kernel path end to end on the real Metal sources (no sanitizer, for time): the
    untied checkpoint (GQA group 5, its own BF16 head) with q8_0 weights: prefill on the matmul
    kernels, decode on matvec and split-K decode attention."""
    ref, mb = _emulated(artifacts, UNTIED, "q8_0", FAST)
    _gate(ref, mb)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_whole_model_every_scheme_under_asan(artifacts, scheme):
    ref, mb = _emulated(artifacts, UNTIED, scheme, ASAN)
    _gate(ref, mb, prompt_len=40)


@pytest.mark.slow
def test_whole_model_with_q8_0_kv(artifacts):
    ref, mb = _emulated(artifacts, TINY, "affine4_gs32", ASAN, kv_scheme="q8_0")
    assert "q8_0 KV" in mb.describe()
    _gate(ref, mb, prompt_len=40)


@pytest.mark.slow
def test_whole_model_matches_transformers(artifacts, synthetic_dir):
    """Every position of two prompts (the head on the matmul kernel) vs `transformers`."""
    artifact = open_artifact(artifacts(TINY, "bf16"))
    model = Model(artifact, MLXBackend(artifact, 64, kernel_runner=FAST, fallback=False))
    result = gates.gate_transformers(model, synthetic_dir(TINY), prompts=gates.DEFAULT_PROMPTS[:2])
    print(gates.format_table([result]))
    assert result.passed, result


@pytest.mark.slow
def test_whole_model_cached_decode_scrambled_and_batched(artifacts):
    artifact = open_artifact(artifacts(UNTIED, "scale4_gs32"))
    model = Model(artifact, MLXBackend(artifact, 64, kernel_runner=FAST, fallback=False))
    results = [gates.gate_cached_decode(model, steps=4), gates.gate_scrambled_table(model),
               gates.gate_batched(model, gates.DEFAULT_PROMPTS[:3])]
    print(gates.format_table(results))
    assert all(r.passed for r in results), results


def test_a_kernel_runner_means_the_kernel_path(artifacts):
    """kernel_runner (kipp.apple.metal's hook) puts MLXBackend on the kernel path without
    Metal; asking for the twins as well is a contradiction, refused."""
    artifact = open_artifact(artifacts(TINY, "bf16"))
    mb = MLXBackend(artifact, 4, kernel_runner=FAST, fallback=False)
    assert mb.choice.kernels and mb.ops.runner is FAST and "Metal emulator (fast)" in mb.describe()
    with pytest.raises(KippError, match="path='twins'"):
        MLXBackend(artifact, 4, path="twins", kernel_runner=FAST)


@pytest.mark.slow  # CI's metal emulator step
def test_decode_batch_on_emulated_kernels_equals_isolated(artifacts):
    """Three sequences decoding in one round (matvec M = 3, attention S = 3) give each one's
    isolated logits bit for bit: rows never mix in the kernels."""
    _, mb = _emulated(artifacts, TINY, "q8_0", FAST)
    prompts = [tuple(range(100 + i, 100 + i + n)) for i, n in enumerate((5, 33, 12))]
    tables = [(0,), (1, 2), (3,)]
    for p, t in zip(prompts, tables):
        mb.eval([EvalItem(p, 0, t)])
    steps = [EvalItem((7,), len(p), t) for p, t in zip(prompts, tables)]
    together = mb.eval(steps)
    alone = [mb.eval([s])[0] for s in steps]
    for a, b in zip(together, alone):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _catalogue():
    """Every planted Metal fault: name, where, how it is planted, what catches it, the test."""
    rows = [dict(name=f.name, where=f"kipp.apple.{f.where}", how=f"{f.old!r} -> {f.new!r}",
                 caught_by=f.caught_by, test="test_planted_fault_is_caught")
            for f, _ in METAL_FAULTS]
    rows.append(dict(
        name="missing bounds check on a partial threadgroup",
        where="kipp.apple.linear.matvec's dispatch",
        how="grid (32, N, 1) / threadgroup (32, 4, 1) -> whole threadgroups of 3 rows, "
            "grid rounded up to (32, 3 * ceil(N / 3), 1), N = 128",
        caught_by="ASan heap-buffer-overflow on w (rows past N)",
        test="test_planted_dispatch_fault_is_caught"))
    rows.append(dict(
        name="matmul second barrier removed (next K step overwrites the tiles being read)",
        where="kipp.apple.linear.MATMUL_SOURCE",
        how="the threadgroup_barrier closing the K loop deleted",
        caught_by="ThreadSanitizer data race on the threadgroup arrays (slow, .ci/run)",
        test="test_planted_race_is_caught_by_tsan"))
    return rows


FAULT_CATALOGUE = _catalogue()


def test_fault_catalogue_names_the_tests_that_plant_them():
    assert len(FAULT_CATALOGUE) == len(METAL_FAULTS) + 2
    for row in FAULT_CATALOGUE:
        assert callable(globals()[row["test"]]) and row["caught_by"], row["name"]


@pytest.mark.slow  # CI's metal emulator step
@pytest.mark.parametrize("ranks", [2, 4])
def test_tensor_parallel_ranks_on_emulated_kernels(artifacts, ranks):
    """Every rank of a tensor-parallel group (kipp.apple.distributed's Emulation: the group's
    shards in one process) runs the real Metal sources on its own shard: its projections' rows
    and columns, and decode attention over a slab of 8 / ranks KV heads, each probed at those
    shapes. The group's logits are within the MLX cached-decode bound of the unsharded twins,
    and its greedy tokens equal theirs."""
    from kipp.apple import distributed
    from kipp.gates.bounds import calibrated_bound

    artifact = open_artifact(artifacts(TINY, "q8_0"))
    group = distributed.Emulation(artifact, BLOCKS, ranks, "tensor", kernel_runner=FAST,
                                  fallback=False)
    for rank in group.ranks:
        assert rank.choice.kernels and not rank.ops.twins
        assert rank.ops.kv_heads == 8 // ranks
        assert "decode_attention/bf16" in rank.kernel_report().running
    got = distributed.check_steps(group, prompt_len=12, decode_steps=2)
    want = distributed.check_steps(MLXBackend(artifact, BLOCKS), prompt_len=12, decode_steps=2)
    bound = calibrated_bound("mlx", "cached_decode")
    for step in ("step0", "step1", "step2"):
        error = gates.nmse(got[step], want[step])
        print(f"{ranks} ranks, {step}: NMSE {error:.1e} (bound {bound:.0e})")
        assert error <= bound
    assert np.array_equal(got["tokens"], want["tokens"])
