"""Probe at load and fall back per kernel (kipp.probe), with injected kernel failures.

No Metal and no GPU here, so the failures are injected through stand-ins at the point where the
model reaches its kernels: MLX's `linear.kernel` / `attention.kernel` factories (numpy stand-ins
from test_mlx_backend; the Metal emulator can stand in the same way), and JAX's Pallas entry
points in interpret mode. Each test plants two faults, a kernel whose compile raises and one
that returns wrong numbers, and checks: that kernel alone runs its twin, one warning line names
it, describe() and kernel_report() name it, generation is correct (greedy decoding gated step
by step against the reference; on MLX also the generated text), and with fallback off (fallback=False or KIPP_KERNEL_FALLBACK=0) the load
raises KernelError naming the kernel.
"""

import logging
from pathlib import Path

import numpy as np
import pytest

from kipp import gates, probe
from kipp.artifact import open_artifact
from kipp.model import Model
from kipp.reference.backend import ReferenceBackend

TINY = "kipp-synthetic/qwen3-tiny"
UNTIED = "kipp-synthetic/qwen3-tiny-untied"
BLOCKS = 12
BOUND = 1e-4
COMPILE_ERROR = "Unable to build metal library from source: use of undeclared identifier 'dd'"


@pytest.fixture(autouse=True)
def fresh_probes():
    probe.clear_cache()  # every test brings its own kernels
    yield
    probe.clear_cache()


def _gate(ref, backend, prompt_len=40, decode_steps=3, rows=3):
    table = np.random.default_rng(0).permutation(BLOCKS)[:3]
    tokens = tuple(int(t) for t in np.random.default_rng(1).integers(0, 151_643, prompt_len))
    result = gates.gate_backends(ref, backend, tokens, table, logits_rows=rows,
                                 decode_steps=decode_steps, bound=BOUND)
    assert result.passed, result.detail


def _same_text(artifact, backend):
    """Greedy text through the public Model on `backend` equals the reference's."""
    want = Model(artifact, ReferenceBackend(artifact, BLOCKS)).generate(
        "Hello there", max_tokens=6, temperature=0)
    assert Model(artifact, backend).generate("Hello there", max_tokens=6, temperature=0) == want


def _warnings(caplog, logger):
    return [r.getMessage() for r in caplog.records
            if r.name == logger and r.levelno == logging.WARNING]


# ---- the probe machinery ----------------------------------------------------------------


def _probe(name, kernel, bound=1e-7):
    want = np.arange(1.0, 7.0)
    return probe.Probe(name, kernel, lambda: want, bound)


def test_probe_results_and_cache(caplog):
    calls = []

    def good():
        calls.append(1)
        return np.arange(1.0, 7.0) * (1 + 1e-6)

    def broken():
        raise RuntimeError("ptxas fatal: out of registers\nmore log lines")

    checks = [_probe("a/ok", good), _probe("b/raises", broken),
              _probe("c/wrong", lambda: np.arange(1.0, 7.0) * 1.01),
              _probe("d/nan", lambda: np.full(6, np.nan)),
              _probe("e/shape", lambda: np.zeros(3))]
    log = logging.getLogger("kipp.test")
    with caplog.at_level("WARNING", logger="kipp.test"):
        report = probe.run_probes(checks, ("test",), True, log)
    assert report.running == ["a/ok"]
    assert report.fell_back["b/raises"] == "RuntimeError: ptxas fatal: out of registers"
    assert "NMSE 1.00e-04 > 1e-07" in report.fell_back["c/wrong"]
    assert report.fell_back["d/nan"] == "non-finite output"
    assert "shape" in report.fell_back["e/shape"]
    assert len(_warnings(caplog, "kipp.test")) == 4
    assert "b/raises (RuntimeError" in report.summary() and "fell back to twins" in report.summary()
    probe.run_probes(checks, ("test",), True, log)
    assert len(calls) == 1  # cached per process under the same key
    probe.run_probes(checks, ("other device",), True, log)
    assert len(calls) == 2
    with pytest.raises(probe.KernelError, match="kernel b/raises failed .*fallback .* is off"):
        probe.run_probes(checks, ("test",), False, log)


def test_fallback_switch(monkeypatch):
    monkeypatch.delenv(probe.FALLBACK_ENV, raising=False)
    assert probe.fallback_enabled() and not probe.fallback_enabled(False)
    monkeypatch.setenv(probe.FALLBACK_ENV, "0")
    assert not probe.fallback_enabled() and probe.fallback_enabled(True)
    monkeypatch.setenv(probe.FALLBACK_ENV, "maybe")
    with pytest.raises(probe.KippError, match=probe.FALLBACK_ENV):
        probe.fallback_enabled()


# ---- MLX: Metal kernels stood in for by numpy --------------------------------------------


@pytest.fixture
def mlx_stand_ins(monkeypatch):
    """The kernel path with numpy stand-ins for every Metal kernel, except two planted faults:
    matvec/q8_0 fails to compile, decode_attention/bf16 returns wrong numbers."""
    pytest.importorskip("mlx.core")
    import test_mlx_backend as stand_ins

    from kipp.apple import attention, linear, select

    calls = {}

    def linear_kernel(kind, fmt):
        run = stand_ins._emulated_linear(kind, fmt)

        def call(**kwargs):
            if (kind, fmt) == ("matvec", "q8_0"):
                raise RuntimeError(COMPILE_ERROR)
            calls[f"{kind}/{fmt}"] = calls.get(f"{kind}/{fmt}", 0) + 1
            return run(**kwargs)
        return call

    def attention_kernel(kv_scheme):
        run = stand_ins._emulated_decode_attention(kv_scheme)

        def call(**kwargs):
            o, ml = run(**kwargs)
            calls[f"decode_attention/{kv_scheme}"] = calls.get(
                f"decode_attention/{kv_scheme}", 0) + 1
            # an indexing fault: each head's 128 output dims written in reverse order
            return [o[..., ::-1], ml] if kv_scheme == "bf16" else [o, ml]
        return call

    monkeypatch.setattr(select, "choose_path",
                        lambda requested="auto", metal=None: select.Choice(True, "stand-ins"))
    monkeypatch.setattr(linear, "kernel", linear_kernel)
    monkeypatch.setattr(attention, "kernel", attention_kernel)
    return calls


def test_mlx_injected_failures_fall_back_per_kernel(artifacts, mlx_stand_ins, caplog):
    from kipp.apple.backend import MLXBackend

    artifact = open_artifact(artifacts(TINY, "q8_0"))
    with caplog.at_level("WARNING", logger="kipp.apple"):
        mb = MLXBackend(artifact, BLOCKS)
    report = mb.kernel_report()
    assert set(report.fell_back) == {"matvec/q8_0", "decode_attention/bf16"}
    assert report.running == ["matmul/q8_0", "matvec/bf16", "matmul/bf16"]
    assert COMPILE_ERROR in report.fell_back["matvec/q8_0"]
    assert "disagrees with its twin" in report.fell_back["decode_attention/bf16"]
    warned = _warnings(caplog, "kipp.apple")
    assert len(warned) == 2 and all("running its twin" in w for w in warned)
    described = mb.describe()
    assert "fell back to twins: matvec/q8_0 (RuntimeError: Unable to build" in described
    assert "decode_attention/bf16 (disagrees" in described
    mlx_stand_ins.clear()
    _gate(ReferenceBackend(artifact, BLOCKS), mb)
    # the twins replaced exactly the two failed kernels; the others kept running
    assert "decode_attention/bf16" not in mlx_stand_ins and "matvec/q8_0" not in mlx_stand_ins
    assert mlx_stand_ins.get("matmul/q8_0") and mlx_stand_ins.get("matvec/bf16")
    _same_text(artifact, mb)


def test_mlx_fallback_off_raises(artifacts, mlx_stand_ins, monkeypatch):
    from kipp.apple.backend import MLXBackend

    artifact = open_artifact(artifacts(TINY, "q8_0"))
    with pytest.raises(probe.KernelError, match="kernel matvec/q8_0 failed .*Unable to build"):
        MLXBackend(artifact, BLOCKS, fallback=False)
    monkeypatch.setenv(probe.FALLBACK_ENV, "0")
    with pytest.raises(probe.KernelError, match="matvec/q8_0"):
        MLXBackend(artifact, BLOCKS)  # cached results are judged again under the switch
    artifact = open_artifact(artifacts(TINY, "bf16"))
    with pytest.raises(probe.KernelError, match="decode_attention/bf16 failed .*disagrees"):
        MLXBackend(artifact, BLOCKS)


def test_mlx_kernels_that_pass_run_without_fallback_markers(artifacts, monkeypatch):
    """All stand-ins correct: nothing falls back, and describe() carries no word the bench
    reads as a fallback."""
    pytest.importorskip("mlx.core")
    import test_mlx_backend as stand_ins

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))  # bench/
    from bench.fallback import check_kernel_path
    from kipp.apple import attention, linear, select
    from kipp.apple.backend import MLXBackend

    monkeypatch.setattr(select, "choose_path",
                        lambda requested="auto", metal=None: select.Choice(True, "Metal"))
    monkeypatch.setattr(linear, "kernel", stand_ins._emulated_linear)
    monkeypatch.setattr(attention, "kernel", stand_ins._emulated_decode_attention)
    mb = MLXBackend(open_artifact(artifacts(UNTIED, "affine4_gs32")), BLOCKS, kv_scheme="q8_0")
    assert mb.kernel_report().fell_back == {} and len(mb.kernel_report().running) == 5
    assert check_kernel_path("mlx", "affine4_gs32", mb.describe()) == mb.describe()


# ---- JAX: Pallas kernels in interpret mode, two of them broken ---------------------------


@pytest.fixture
def jax_faults(monkeypatch):
    """Pallas kernels in interpret mode, except: matmul/q8_0 (quant_matmul's tile-dot body on
    q8_0 weights) fails to compile, decode_attention/bf16 returns wrong numbers."""
    pytest.importorskip("jax")
    from kipp.cuda import decode_attention, quant_matmul

    real_matmul, real_decode = quant_matmul.quant_matmul, decode_attention.decode_attention
    calls = {}

    def matmul(x, w, **kwargs):
        if w.fmt == "q8_0" and x.shape[0] > quant_matmul.MATVEC_ROWS:
            raise RuntimeError("Triton compilation failed: ptxas error: entry function uses "
                               "too much shared data")
        calls[w.fmt] = calls.get(w.fmt, 0) + 1  # counted while tracing
        return real_matmul(x, w, **kwargs)

    def decode(q, k, v, lengths, tables, **kwargs):
        calls["decode"] = calls.get("decode", 0) + 1
        return real_decode(q, k, v, lengths, tables, **kwargs)[..., ::-1]  # an indexing fault

    monkeypatch.setattr(quant_matmul, "quant_matmul", matmul)
    monkeypatch.setattr(decode_attention, "decode_attention", decode)
    return calls


def test_jax_injected_failures_fall_back_per_kernel(artifacts, jax_faults, caplog):
    from kipp.cuda.backend import JaxBackend

    artifact = open_artifact(artifacts(TINY, "q8_0"))
    with caplog.at_level("WARNING", logger="kipp.cuda"):
        jb = JaxBackend(artifact, BLOCKS, path="interpret", weight_memory="stored")
    report = jb.kernel_report()
    assert set(report.fell_back) == {"matmul/q8_0", "decode_attention/bf16"}
    assert report.running == ["matvec/q8_0", "prefill_attention/bf16"]
    assert "Triton compilation failed" in report.fell_back["matmul/q8_0"]
    assert "disagrees with its twin" in report.fell_back["decode_attention/bf16"]
    warned = _warnings(caplog, "kipp.cuda")
    assert len(warned) == 2 and all("running its twin" in w for w in warned)
    assert "fell back to twins: matmul/q8_0 (RuntimeError: Triton" in jb.describe()
    jax_faults.clear()
    # greedy decoding through the fallbacks: every step's argmax is the reference's (each
    # interpret-mode bucket compiles for tens of seconds, so no second generation here)
    _gate(ReferenceBackend(artifact, BLOCKS), jb, prompt_len=20, decode_steps=3)
    # the step traced the q8_0 kernel (matvec body) but never the failed ones
    assert jax_faults.get("q8_0") and "decode" not in jax_faults


def test_jax_fallback_off_raises(artifacts, jax_faults, monkeypatch):
    from kipp.cuda.backend import JaxBackend

    artifact = open_artifact(artifacts(TINY, "q8_0"))
    with pytest.raises(probe.KernelError, match="kernel matmul/q8_0 failed .*Triton"):
        JaxBackend(artifact, BLOCKS, path="interpret", weight_memory="stored", fallback=False)
    monkeypatch.setenv(probe.FALLBACK_ENV, "0")
    with pytest.raises(probe.KernelError, match="decode_attention/bf16 failed .*disagrees"):
        JaxBackend(open_artifact(artifacts(TINY, "bf16")), BLOCKS, path="interpret")


def _kernels_pass_their_probes(monkeypatch):
    """A GPU whose kernels pass their probes, on this CPU: compiled (non-interpret) Pallas
    kernels chosen, the probes reported passing."""
    from kipp.cuda import select
    from kipp.cuda.backend import JaxBackend

    monkeypatch.setattr(select, "choose_path",
                        lambda *a: select.Choice(True, False, "forced by the test"))
    monkeypatch.setattr(JaxBackend, "_probe", lambda self: probe.KernelReport(
        [probe.ProbeResult("matvec/bf16", True), probe.ProbeResult("decode_attention/bf16",
                                                                    True)]))


def test_jax_first_step_compile_error_falls_back(artifacts, monkeypatch, caplog):
    """The whole step fails to compile at load (here: Pallas cannot lower for a CPU), after
    every probe passed: the kernels still running fall back, with a warning."""
    pytest.importorskip("jax")
    from kipp.cuda.backend import JaxBackend

    _kernels_pass_their_probes(monkeypatch)
    artifact = open_artifact(artifacts(TINY, "bf16"))
    with caplog.at_level("WARNING", logger="kipp.cuda"):
        jb = JaxBackend(artifact, BLOCKS, weight_memory="stored")
    assert set(jb.kernel_report().fell_back) == {"matvec/bf16", "decode_attention/bf16"}
    assert all("the step failed to compile" in e for e in jb.kernel_report().fell_back.values())
    assert len(_warnings(caplog, "kipp.cuda")) == 1
    with pytest.raises(probe.KernelError, match="the step failed to compile"):
        JaxBackend(artifact, BLOCKS, weight_memory="stored", fallback=False)


def test_jax_first_step_runtime_error_falls_back(artifacts, monkeypatch, caplog):
    """A step that compiles but faults when it first runs (a stand-in program raising what a
    CUDA launch error raises): the kernels fall back, the slab is fresh, and eval is right."""
    pytest.importorskip("jax")
    from kipp.cuda.backend import JaxBackend

    _kernels_pass_their_probes(monkeypatch)
    real_compile = JaxBackend._compile

    def compile_(self, bucket, arrays):
        if self.kernel_report().running:  # the kernels' program: faults at run time
            def run(*args):
                raise RuntimeError("INTERNAL: CUDA error: an illegal memory access was "
                                   "encountered (CUDA_ERROR_ILLEGAL_ADDRESS)")
            return run
        return real_compile(self, bucket, arrays)

    monkeypatch.setattr(JaxBackend, "_compile", compile_)
    artifact = open_artifact(artifacts(TINY, "bf16"))
    with caplog.at_level("WARNING", logger="kipp.cuda"):
        jb = JaxBackend(artifact, BLOCKS, weight_memory="stored")
    assert jb.kernel_report().running == []
    assert all("the first step failed (RuntimeError: INTERNAL: CUDA error" in e
               for e in jb.kernel_report().fell_back.values())
    assert "fell back to twins" in jb.describe()
    _gate(ReferenceBackend(artifact, BLOCKS), jb, prompt_len=20, decode_steps=2)
    with pytest.raises(probe.KernelError, match="the first step failed"):
        JaxBackend(artifact, BLOCKS, weight_memory="stored", fallback=False)
