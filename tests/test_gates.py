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
from kipp.synthetic.rule import rule as designed_rule

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
    # each rounding dot of the stored CPU matmul (alone or joined) has its own row, and the
    # reference oracle rounds as it does
    for dot, key in (("int8", "jax-int8"), ("f32", "jax"), ("int8+bf16", "jax-int8+bf16"),
                     ("bf16", "jax-bf16")):
        backend = SimpleNamespace(name="jax", choice=SimpleNamespace(kernels=False), cpu_dot=dot)
        assert gates.bound_key(backend) == key and gates.activation_dots(backend) == dot, dot
        assert set(gates.BOUNDS[key]) == set(gates.GATES), key
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


_ROUNDED = [(TINY, "bf16"), (TINY, "q8_0"),
            *(pytest.param(c, s, marks=pytest.mark.slow) for c in TINY_IDS for s in SCHEMES
              if (c, s) not in ((TINY, "bf16"), (TINY, "q8_0")))]


@pytest.mark.parametrize("checkpoint_id, scheme", _ROUNDED)
def test_rounded_activations_keep_the_designed_rule_and_see_its_fault(artifacts, monkeypatch,
                                                                       checkpoint_id, scheme):
    """The fast CPU dots round each projection's input (int8 per 32-block for quantized
    weights, bf16 for BF16 ones and the head). The synthetic circuits' temperature measurement
    survives it (kipp.synthetic.circuit): the numpy reference rounding as those dots do follows
    the designed greedy rule on every designed prompt, and the fault the measurement is there
    to see, an attention scale 10% off, still changes at least 6 of the 8 under the rounding."""
    import faults
    from kipp.model import load

    model = load(artifacts(checkpoint_id, scheme), backend="reference", kv_tokens=1024,
                 progress=False)
    model.backend.activations = "int8+bf16"
    assert "int8+bf16 activations" in model.backend.describe()
    result = gates.gate_designed(model)
    assert result.passed, result.detail
    prompts = gates.designed_prompts(model.entry)
    rule = designed_rule(model.entry)
    expected = [rule.continuation(p, gates.DESIGNED_STEPS) for p in prompts]
    faults.get("attention-scale-1.1").plant(monkeypatch)
    got = gates.greedy_tokens(model, prompts, gates.DESIGNED_STEPS, expected)
    changed = [g != e for g, e in zip(got, expected)]
    assert sum(changed) >= 6, changed


def test_the_reference_names_the_dots_it_rounds_as(artifacts):
    from kipp.errors import KippError
    from kipp.formats.artifact import open_artifact
    from kipp.reference.backend import ReferenceBackend

    artifact = open_artifact(artifacts(TINY, "q8_0"))
    with pytest.raises(KippError, match="activations 'int4'"):
        ReferenceBackend(artifact, 4, activations="int4")


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
    monkeypatch.setattr(consistency, "activation_dots", lambda backend: "f32")
    unrounded = gates.gate_vs_reference(model)
    assert not unrounded.passed and unrounded.metric > 10 * result.metric, unrounded
    # a BF16 artifact under the same setting runs the float32 dot (the int8 dot meets no
    # weight of it): it says so and keeps the float32 dot's bounds
    bf16 = load(artifacts(TINY, "bf16"), backend="jax", kv_tokens=1024, progress=False,
                weight_memory="stored")
    assert bf16.backend.cpu_dot == "f32" and "dot)" not in bf16.backend.describe()
    assert gates.bound_key(bf16.backend) == "jax"
