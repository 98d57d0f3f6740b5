"""LoRA on the accelerated backends: the JAX and MLX twins (every weight scheme, the low-rank part
in float32 beside the base) against the reference with the same adapters, a batch mixing two
adapters and the base against each item alone."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import numpy as np
import pytest
from test_lora import TINY, make_adapters  # noqa: E402

from kipp import gates  # noqa: E402
from kipp.backend import EvalItem  # noqa: E402
from kipp.formats.artifact import open_artifact  # noqa: E402
from kipp.lora.adapter import load_adapter  # noqa: E402
from kipp.reference.backend import ReferenceBackend  # noqa: E402

SCHEMES = ["bf16", "q8_0", "affine4_gs32", "scale4_gs32"]
BLOCKS = 12
ADAPTERS = ("alpha", None, "beta")  # one item each, in one batch
# JAX twins vs the reference with adapters: measured 1.98e-9 (q8_0; bf16 9.4e-12) over SCHEMES
# with `pytest -m slow tests/test_lora_backends.py -s`: within the base's calibrated bound
# (kipp.gates.bounds), which the gate uses unchanged.


@pytest.fixture(scope="module")
def made(tiny_dir, tmp_path_factory):
    return make_adapters(tiny_dir, tmp_path_factory.mktemp("lora"))


def _tokens(seed, n):
    return tuple(int(t) for t in np.random.default_rng(seed).integers(0, 151_643, n))


def _with_adapters(backend, made, entry):
    for name in ("alpha", "beta"):
        backend.add_adapter(load_adapter(made[name][0], entry, name))
    return backend


def _run(backend, prompts, tables, steps=2):
    """Every prompt position's logits, then `steps` decode steps, all items in each call."""
    out = [[row] for row in backend.eval([
        EvalItem(p, 0, t, len(p), a) for p, t, a in zip(prompts, tables, ADAPTERS)])]
    for step in range(steps):
        items = [EvalItem((100 + step,), len(p) + step, t, 1, a)
                 for p, t, a in zip(prompts, tables, ADAPTERS)]
        for rows, row in zip(out, backend.eval(items)):
            rows.append(row)
    return [np.concatenate(rows) for rows in out]


def _accelerated(name, artifact):
    if name == "jax":
        pytest.importorskip("jax")
        from kipp.cuda.backend import JaxBackend

        return JaxBackend(artifact, BLOCKS)
    pytest.importorskip("mlx.core")
    from kipp.apple.backend import MLXBackend

    return MLXBackend(artifact, BLOCKS)


# jax: ~40 s a scheme on two cores (the step compiles for four shapes); mlx: ~15 s; the
# default suite runs mlx on bf16
@pytest.mark.parametrize("backend, scheme", [
    (b, s) if (b, s) == ("mlx", "bf16") else pytest.param(b, s, marks=pytest.mark.slow)
    for b in ("jax", "mlx") for s in SCHEMES])
def test_adapters_match_the_reference_and_batch(artifacts, made, scheme, backend):
    artifact = open_artifact(artifacts(TINY, scheme))
    jb = _with_adapters(_accelerated(backend, artifact), made, artifact.entry)
    # the reference rounds the projections' inputs where the JAX backend's CPU dots do
    ref = _with_adapters(ReferenceBackend(artifact, BLOCKS,
                                          activations=gates.activation_dots(jb)),
                         made, artifact.entry)
    prompts = [_tokens(seed, n) for seed, n in ((1, 20), (2, 25), (3, 30))]
    tables = [(0, 1), (2, 3), (4, 5)]
    want, got = _run(ref, prompts, tables), _run(jb, prompts, tables)
    worst = 0.0
    for name, g, w in zip(ADAPTERS, got, want):
        worst = max(worst, gates.nmse(g, w))
        differ, ties = gates.argmax_check(g, w)
        assert differ == ties, (scheme, name, differ, ties)
    [base] = ref.eval([EvalItem(prompts[0], 0, (6, 7), len(prompts[0]))])
    assert gates.nmse(base, want[0][:len(prompts[0])]) > 1e-3, "the adapter matters"
    print(f"{backend} {scheme}: worst NMSE vs reference {worst:.3g}")
    assert worst <= gates.calibrated_bound(jb, "reference")
    for i, name in enumerate(ADAPTERS):  # each item alone, on other blocks
        [alone] = jb.eval([EvalItem(prompts[i], 0, (6 + i, 9 + i % 2), len(prompts[i]), name)])
        assert gates.nmse(alone, got[i][:len(prompts[i])]) <= gates.calibrated_bound(
            jb, "batched"), (scheme, name)


def test_a_jax_round_reads_only_its_adapters(artifacts, made):
    """Loaded adapters cost nothing to rows that do not use them: a round of the base alone
    compiles a step with no low-rank term, and a round under alpha (rank 4) reads one slot at
    rank 4, not both slots at beta's rank 8; both still equal the reference."""
    artifact = open_artifact(artifacts(TINY, "bf16"))
    jb = _with_adapters(_accelerated("jax", artifact), made, artifact.entry)
    ref = _with_adapters(ReferenceBackend(artifact, BLOCKS), made, artifact.entry)
    prompt = _tokens(4, 12)
    for adapter, read in ((None, (0, 0)), ("alpha", (1, 4))):
        before = set(jb._programs)
        item = EvalItem(prompt, 0, (0,), 1, adapter)
        [got], [want] = jb.eval([item]), ref.eval([item])
        assert {key[1:] for key in set(jb._programs) - before} == {read}, adapter
        assert gates.nmse(got, want) <= gates.calibrated_bound(jb, "reference"), adapter


def _kernel_path(name, artifact):
    """A backend whose projections run on Kipp's kernels, without a GPU or a Mac: the Pallas
    kernels in interpret mode, or the Metal sources on the emulator (tools/metal_emulator)."""
    if name == "pallas-interpret":
        pytest.importorskip("jax")
        from kipp.cuda.backend import JaxBackend

        jb = JaxBackend(artifact, BLOCKS, path="interpret", weight_layout="device",
                        fallback=False)
        assert "Pallas kernels (interpret mode)" in jb.describe()
        return jb
    pytest.importorskip("mlx.core")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the Metal emulator's fiber switch is written for x86-64")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from metal_emulator import Emulator

    from kipp.apple.backend import MLXBackend

    mb = MLXBackend(artifact, BLOCKS, kernel_runner=Emulator("fast"), fallback=False)
    assert mb.choice.kernels and "Metal emulator" in mb.describe()
    return mb


@pytest.mark.slow  # interpret mode and the emulator run every kernel on the CPU, slowly
@pytest.mark.parametrize("path", ["pallas-interpret", "metal-emulator"])
def test_adapters_beside_the_kernels_match_the_reference(artifacts, tiny_dir, tmp_path, path):
    """The low-rank term beside the Pallas and Metal kernels (q8_0 base): a batch of an adapter
    on all seven projections, the base and one on three, prefill then a decode step, against
    the reference with the same adapters. Alpha moves the logits (NMSE 0.04 vs the base) well
    past the Pallas kernels' bound; measured against the reference: the Pallas kernels (BF16
    operands) 5e-5..1.3e-4, the Metal kernels (float32 operands) up to 1.7e-10."""
    from test_lora import ALL, make_peft_adapter

    artifact = open_artifact(artifacts(TINY, "q8_0"))
    specs = {"alpha": (8, 16, ALL, 0.02), "beta": (4, 8, ("q_proj", "v_proj", "down_proj"),
                                                    0.005)}
    backends = [ReferenceBackend(artifact, BLOCKS), _kernel_path(path, artifact)]
    for i, (name, (rank, alpha, targets, b_std)) in enumerate(specs.items()):
        folder = tmp_path / name
        make_peft_adapter(tiny_dir, folder, rank, alpha, targets, False, 10 + i, b_std)
        for backend in backends:
            backend.add_adapter(load_adapter(folder, artifact.entry, name))
    ref, kb = backends
    prompts = [_tokens(seed, n) for seed, n in ((1, 9), (2, 12), (3, 14))]
    tables = [(0,), (2,), (4,)]
    want, got = _run(ref, prompts, tables, steps=1), _run(kb, prompts, tables, steps=1)
    bound = gates.calibrated_bound(kb, "reference")
    errors = {name: gates.nmse(g, w) for name, g, w in zip(ADAPTERS, got, want)}
    [base] = ref.eval([EvalItem(prompts[0], 0, (6,), len(prompts[0]))])
    moved = gates.nmse(base, want[0][:len(prompts[0])])
    print(f"{path}: NMSE vs reference {errors} (bound {bound:.1g}); alpha vs the base {moved:.2g}")
    assert moved > 3 * bound, "the adapter must move the logits well past the bound"
    assert all(e <= bound for e in errors.values()), (path, errors)
    for name, g, w in zip(ADAPTERS, got, want):
        differ, ties = gates.argmax_check(g, w)
        assert differ == ties, (path, name, differ, ties)
