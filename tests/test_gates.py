"""`kipp gates`: every gate passes on every correct backend and scheme, and a source folder
that no longer matches the artifact fails it."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kipp import gates
from kipp.cli import main as cli_main

TINY = "kipp-synthetic/qwen3-tiny"
TINY_IDS = ["kipp-synthetic/qwen3-tiny", "kipp-synthetic/qwen3-tiny-base",
            "kipp-synthetic/qwen3-tiny-untied"]
SCHEMES = ["bf16", "q8_0", "affine4_gs32", "scale4_gs32"]
BACKENDS = ["reference", "jax", "mlx"]


def perturbed_copy(source, out, layer: int = 1, factor: float = 1.03):
    """A copy of a single-file source folder with every weight of one layer scaled by 3%."""
    shutil.copytree(source, out)
    path = out / "model.safetensors"
    tensors = load_file(path)
    prefix = f"model.layers.{layer}."
    for name in tensors:
        if name.startswith(prefix):
            tensors[name] = (tensors[name].astype(np.float32) * factor).astype(ml_dtypes.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})
    return out


def _gates(capsys, checkpoint, backend, scheme, *extra):
    pytest.importorskip({"jax": "jax", "mlx": "mlx.core"}.get(backend, "numpy"))
    code = cli_main(["gates", checkpoint, "--backend", backend, "--scheme", scheme, *extra])
    return code, capsys.readouterr().out


def test_every_row_prints_an_error_measure_and_a_bound():
    rows = [gates.GateResult("a", True, 1.5e-9, 2e-7, "x", "worst-row NMSE"),
            gates.GateResult("b", False, 3.0, 0.0, "y", "prompts off the design"),
            gates.GateResult("c", True, 0.01, float("nan"), "z", gating=False)]
    table = gates.format_table(rows).splitlines()
    assert "PASS" in table[1] and "1.500e-09" in table[1] and "2.0e-07" in table[1]
    assert "FAIL" in table[2] and "prompts off the design" in table[2]
    assert "INFO" in table[3] and "report" in table[3]


def test_bounds_are_calibrated_per_backend():
    for backend in BACKENDS:
        for gate in ("transformers", "cached_decode", "batched"):
            assert 0.0 <= gates.calibrated_bound(backend, gate) < 1e-4, (backend, gate)
    assert gates.calibrated_bound("reference", "batched") == 0.0  # the reference promises bitwise
    assert gates.calibrated_bound("jax", "reference") > 0.0
    with pytest.raises(KeyError, match="no calibrated"):
        gates.calibrated_bound("reference", "nope")
    # a Backend object finds its row by name, and the kernel path by its own "-kernels" row
    twins = SimpleNamespace(name="jax", choice=SimpleNamespace(kernels=False))
    kernels = SimpleNamespace(name="jax", choice=SimpleNamespace(kernels=True))
    assert gates.bound_key(twins) == "jax" and gates.bound_key(kernels) == "jax-kernels"
    assert gates.calibrated_bound(kernels, "reference") == gates.BOUNDS["jax-kernels"]["reference"]
    assert gates.bound_key(SimpleNamespace(name="reference")) == "reference"
    # the int8 dot of the stored CPU matmul has its own row and a rounding oracle; the opt-in
    # BF16 dots (alone or with int8) are held to the float32 dot's row
    for dot, key, rounds in (("int8", "jax-int8", True), ("f32", "jax", False),
                             ("int8+bf16", "jax", True), ("bf16", "jax", False)):
        backend = SimpleNamespace(name="jax", choice=SimpleNamespace(kernels=False), cpu_dot=dot)
        assert gates.bound_key(backend) == key and gates.rounds_to_int8(backend) == rounds, dot
    assert gates.calibrated_bound("jax-int8", "reference") < 1e-4


@pytest.mark.slow  # CI's longest default checks
def test_gates_fail_when_the_source_is_perturbed(artifacts, synthetic_dir, tmp_path, capsys):
    """The artifact made from the source, checked against a source with one layer 3% off:
    the source gate and transformers see it (test_reference passes the unperturbed one)."""
    bad = perturbed_copy(synthetic_dir(TINY), tmp_path / "perturbed")
    code, out = _gates(capsys, str(artifacts(TINY)), "reference", "bf16", "--source", str(bad))
    assert code == 1, out
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines()[2:]}
    assert "FAIL" in rows["artifact = source"] and "FAIL" in rows["vs transformers (bf16)"], out


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("checkpoint", TINY_IDS)
def test_kipp_gates_pass_on_every_backend_and_scheme(capsys, checkpoint, backend, scheme):
    code, out = _gates(capsys, checkpoint, backend, scheme)
    print(out)
    assert code == 0, out
    assert "FAIL" not in out and "greedy = designed rule" in out


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scheme", ["bf16", "affine4_gs32"])
def test_kipp_gates_fail_on_a_perturbed_source(synthetic_dir, tmp_path, capsys, backend, scheme):
    bad = perturbed_copy(synthetic_dir(TINY), tmp_path / "perturbed")
    code, out = _gates(capsys, TINY, backend, scheme, "--source", str(bad))
    print(out)
    assert code == 1, out


def test_int8_activations_take_the_synthetic_circuits_off_their_design(artifacts, monkeypatch):
    """Why the stored CPU matmul's int8 dot is not the default (kipp.cuda.cpu.stored_matmul.
    DEFAULT_DOT): the numpy reference rounding each quantized projection's input as that dot
    does follows the designed greedy rule on none of the tiny checkpoint's designed prompts,
    where the unrounded reference follows it on all. The first layer's o_proj alone does it:
    its input's SCALE - SELF difference, e^-10 of either, is the circuit's temperature
    measurement (docs/backends.md); every other projection rounded keeps the rule."""
    from kipp.model import load
    from kipp.reference import ops

    model = load(artifacts(TINY, "q8_0"), backend="reference", kv_tokens=1024, progress=False)
    prompts = len(gates.designed_prompts(model.entry))
    assert gates.gate_designed(model).passed
    model.backend.int8_activations = True
    result = gates.gate_designed(model)
    assert result.metric == prompts, result.detail

    first_o = model.backend.weights.layers[0].o
    plain_rows, plain_linear = ops.int8_rows, ops.linear
    for rounds_first_o, off in [(False, 0), (True, prompts)]:
        inputs = {}  # id of a rounded input -> (it, the input before rounding)
        took_rounded = []  # the projections that multiplied a rounded input

        def int8_rows(x):
            y = plain_rows(x)
            inputs[id(y)] = (y, x)
            return y

        def linear(x, w, keep=rounds_first_o):
            if id(x) in inputs:
                y, x = inputs.pop(id(x))
                if (w is first_o) == keep:
                    x = y
                    took_rounded.append(w)
            return plain_linear(x, w)

        monkeypatch.setattr(ops, "int8_rows", int8_rows)
        monkeypatch.setattr(ops, "linear", linear)
        result = gates.gate_designed(model)
        monkeypatch.undo()
        assert took_rounded and any(w is first_o for w in took_rounded) == rounds_first_o
        assert result.metric == off, (rounds_first_o, result.detail)


def test_the_int8_dot_is_gated_against_a_reference_that_rounds(artifacts, monkeypatch):
    """KIPP_JAX_CPU_DOT=int8 on a quantized artifact: the backend says it runs the int8 dot,
    takes the "jax-int8" bounds, and gate_vs_reference's oracle rounds the same activations
    and passes; planted, an oracle that does not round fails it (its first step already). On
    a BF16 artifact the setting changes nothing."""
    pytest.importorskip("jax")
    from kipp.cuda.cpu import stored_matmul
    from kipp.gates import consistency
    from kipp.model import load

    if not stored_matmul.available()[0]:
        pytest.skip(stored_matmul.available()[1])
    monkeypatch.setenv(stored_matmul.DOT_ENV, "int8")
    model = load(artifacts(TINY, "scale4_gs32"), backend="jax", kv_tokens=1024, progress=False,
                 weight_memory="stored")
    assert model.backend.cpu_dot == "int8" and "(int8 dot)" in model.backend.describe()
    assert gates.bound_key(model.backend) == "jax-int8"
    result = gates.gate_vs_reference(model)
    assert result.passed and result.bound == gates.BOUNDS["jax-int8"]["reference"], result
    monkeypatch.setattr(consistency, "rounds_to_int8", lambda backend: False)
    unrounded = gates.gate_vs_reference(model)
    assert not unrounded.passed and unrounded.metric > 10 * result.metric, unrounded
    # a BF16 artifact under the same setting runs the float32 dot (the int8 dot meets no
    # weight of it): it says so and keeps the float32 dot's bounds
    bf16 = load(artifacts(TINY, "bf16"), backend="jax", kv_tokens=1024, progress=False,
                weight_memory="stored")
    assert bf16.backend.cpu_dot == "f32" and "dot)" not in bf16.backend.describe()
    assert gates.bound_key(bf16.backend) == "jax"
