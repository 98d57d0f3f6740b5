"""Probe at load and fall back per kernel (kipp.probe), with injected kernel failures.

No Metal and no GPU here, so the failures are injected where the model reaches its kernels:
on MLX through the backend's kernel runner (kipp.apple.metal), the Metal emulator running the
kernels' exact sources with faults planted in them; on JAX at the Pallas entry points, in
interpret mode. Each test plants two faults, a kernel whose compile raises and one that returns
wrong numbers, and checks: that kernel alone runs its twin, one warning line names it,
describe() and kernel_report() name it, generation is correct (greedy decoding gated step by
step against the reference; on MLX also the generated text), and with fallback off
(fallback=False or KIPP_KERNEL_FALLBACK=0) the load raises KernelError naming the kernel.
"""

import logging
import platform
from pathlib import Path

import numpy as np
import pytest

from kipp import gates, probe
from kipp.formats.artifact import open_artifact
from kipp.model import Model
from kipp.reference.backend import ReferenceBackend

TINY = "kipp-synthetic/qwen3-tiny"
UNTIED = "kipp-synthetic/qwen3-tiny-untied"
BLOCKS = 12
BOUND = 1e-4
COMPILE_ERROR = "Unable to build metal library from source: use of undeclared identifier 'dd'"


@pytest.fixture(autouse=True)
def fresh_probes(monkeypatch):
    monkeypatch.delenv(probe.FALLBACK_ENV, raising=False)  # fallback on unless a test says
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


# ---- MLX: the real Metal sources on the Metal emulator, two of them broken --------------


COMPILE_FAULT = ("const float dd = kipp_fp16(d[size_t(n) * KB + b]);",
                 "const float dd = kipp_fp16(dq[size_t(n) * KB + b]);")  # undeclared 'dq'
WRONG_FAULT = ("kipp_bf16(p[0]), kipp_bf16(p[1])", "kipp_bf16(p[1]), kipp_bf16(p[0])")


@pytest.fixture
def mlx_faults(monkeypatch):
    """MLXBackend options running the kernel path's exact Metal sources on the Metal emulator
    (tools/metal_emulator, no sanitizer), with two faults planted in the sources: the q8_0
    matvec does not compile (an undeclared identifier: clang's error, as Metal's compiler would
    give one), and the BF16-KV decode attention swaps two dims of every K and V row it loads
    (wrong numbers). Returns (options, calls per kernel name)."""
    pytest.importorskip("mlx.core")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the Metal emulator runs on x86-64 (on a Mac, Metal runs the kernels)")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "tools"))
    from metal_emulator import Emulator

    from kipp.apple import attention, linear

    for holder, key, (old, new) in ((linear._BLOCK_LOAD, "q8_0", COMPILE_FAULT),
                                    (attention._LOAD_ROW, "bf16", WRONG_FAULT)):
        assert old in holder[key]
        monkeypatch.setitem(holder, key, holder[key].replace(old, new))
    emulator = Emulator("fast")
    calls = {}

    def runner(spec):
        kernel = emulator(spec)

        def call(**kwargs):
            calls[spec.name] = calls.get(spec.name, 0) + 1
            return kernel(**kwargs)
        return call

    runner.label = "the Metal emulator with planted faults"
    return {"kernel_runner": runner}, calls


@pytest.mark.slow  # CI's longest default checks
def test_mlx_injected_failures_fall_back_per_kernel(artifacts, mlx_faults, caplog):
    from kipp.apple.backend import MLXBackend

    options, calls = mlx_faults
    artifact = open_artifact(artifacts(TINY, "q8_0"))
    with caplog.at_level("WARNING", logger="kipp.apple"):
        mb = MLXBackend(artifact, BLOCKS, **options)
    report = mb.kernel_report()
    assert set(report.fell_back) == {"matvec/q8_0", "decode_attention/bf16"}
    assert report.running == ["matmul/q8_0", "matvec/bf16", "matmul/bf16"]
    assert "CompileError" in report.fell_back["matvec/q8_0"]
    assert "disagrees with its twin" in report.fell_back["decode_attention/bf16"]
    warned = _warnings(caplog, "kipp.apple")
    assert len(warned) == 2 and all("running its twin" in w for w in warned)
    assert any("matvec/q8_0 failed (CompileError" in w for w in warned)
    described = mb.describe()
    assert "fell back to twins: matvec/q8_0 (CompileError" in described
    assert "decode_attention/bf16 (disagrees" in described
    calls.clear()
    _gate(ReferenceBackend(artifact, BLOCKS), mb, prompt_len=20, decode_steps=2)
    # the twins replaced exactly the two failed kernels; the others kept running
    assert set(calls) == {"kipp_matmul_q8_0", "kipp_matvec_bf16"}, calls
    _same_text(artifact, mb)


def test_mlx_fallback_off_raises(artifacts, mlx_faults, monkeypatch):
    from kipp.apple.backend import MLXBackend

    options, _ = mlx_faults
    artifact = open_artifact(artifacts(TINY, "q8_0"))
    with pytest.raises(probe.KernelError, match="kernel matvec/q8_0 failed .*CompileError"):
        MLXBackend(artifact, BLOCKS, fallback=False, **options)
    monkeypatch.setenv(probe.FALLBACK_ENV, "0")
    with pytest.raises(probe.KernelError, match="matvec/q8_0"):
        MLXBackend(artifact, BLOCKS, **options)  # cached results are judged again under the switch
    artifact = open_artifact(artifacts(TINY, "bf16"))
    with pytest.raises(probe.KernelError, match="decode_attention/bf16 failed .*disagrees"):
        MLXBackend(artifact, BLOCKS, **options)


def test_mlx_kernels_that_pass_run_without_fallback_markers(artifacts, monkeypatch):
    """All kernels correct (numpy stand-ins for Metal, test_mlx_backend): nothing falls back,
    and describe() carries no word the bench reads as a fallback."""
    pytest.importorskip("mlx.core")
    import test_mlx_backend as stand_ins

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))  # bench/
    from bench.fallback import check_kernel_path
    from kipp.apple.backend import MLXBackend

    def runner(spec):
        return stand_ins._standin_runner(spec)

    runner.label = "Metal (numpy stand-ins)"
    mb = MLXBackend(open_artifact(artifacts(UNTIED, "affine4_gs32")), BLOCKS, kv_scheme="q8_0",
                    kernel_runner=runner)
    assert mb.kernel_report().fell_back == {} and len(mb.kernel_report().running) == 5
    assert check_kernel_path("mlx", "affine4_gs32", mb.describe()) == mb.describe()


# ---- JAX: Pallas kernels in interpret mode, two of them broken ---------------------------


@pytest.fixture
def jax_faults(monkeypatch):
    """Pallas kernels in interpret mode, except: matmul/q8_0 (quant_matmul's tile-dot body on
    q8_0 weights) fails to compile, decode_attention/bf16 returns wrong numbers."""
    pytest.importorskip("jax")
    from kipp.cuda.pallas import decode_attention, quant_matmul

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


@pytest.mark.slow  # CI's longest default checks
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

    def compile_(self, bucket, arrays, lora_rank=0):
        if self.kernel_report().running:  # the kernels' program: faults at run time
            def run(*args):
                raise RuntimeError("INTERNAL: CUDA error: an illegal memory access was "
                                   "encountered (CUDA_ERROR_ILLEGAL_ADDRESS)")
            return run
        return real_compile(self, bucket, arrays, lora_rank)

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
