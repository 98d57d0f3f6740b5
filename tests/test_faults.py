"""The fault catalogue (faults): every planted fault is caught by the checks it names,
and every check passes on the unplanted code.

The checks are small, named versions of Kipp's gates and contract tests, on the tiny synthetic
checkpoint (whose greedy tokens follow a designed rule that needs attention: kipp.synthetic.writer).
docs/faults.md is the catalogue as a table; test_the_docs_table_is_the_catalogue keeps it in
step (regenerate it: `PYTHONPATH=. python tests/test_faults.py > docs/faults.md`).
The full plant-and-check run takes several minutes on 2 cores: it is `slow` (.ci/run runs it).
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

import faults
from kipp import gates
from kipp.backend import KV_BLOCK
from kipp.engine.blocks import BlockPool
from kipp.errors import KippError
from kipp.model import load
from kipp.text.sampling import Sampler, SamplingParams, adjusted_logits

TINY = "kipp-synthetic/qwen3-tiny"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "faults.md"
# The 2nd crosses a KV block; the 3rd (289 tokens) reaches the long offsets where a RoPE base
# 5% off shows: its worst row 2.6e-4 on the reference at BF16, 7.5e-7 unplanted (bound 2e-5).
TRANSFORMERS_PROMPTS = (gates.DEFAULT_PROMPTS[0], gates.DEFAULT_PROMPTS[2],
                        " ".join(gates.DEFAULT_PROMPTS) * 2)


class Env:
    """What the checks run on, built lazily and shared (models are loaded fresh per check:
    a planted fault may corrupt one's KV or pool)."""

    def __init__(self, artifacts, synthetic_dir):
        self._artifacts = artifacts
        self.path = artifacts(TINY)
        self.source = synthetic_dir(TINY)
        self._want = {}

    def reference(self, kv_tokens: int = 2048):
        return load(self.path, backend="reference", kv_tokens=kv_tokens, progress=False)

    def jax(self, scheme: str = "bf16", cpu_dot: str | None = None):
        """`cpu_dot`: $KIPP_JAX_CPU_DOT while it loads (read at load), else as set."""
        pytest.importorskip("jax")
        dot = {} if cpu_dot is None else {"KIPP_JAX_CPU_DOT": cpu_dot}
        with mock.patch.dict(os.environ, dot):
            return load(self._artifacts(TINY, scheme), backend="jax", kv_tokens=1024,
                        progress=False)

    def transformers_logits(self, model):
        """transformers on the model's artifact weights (dequantized for a quantized one)."""
        scheme = model.artifact.scheme.name
        if scheme not in self._want:
            tokens = [model.tokenizer.encode(p) for p in TRANSFORMERS_PROMPTS]
            self._want[scheme] = np.concatenate(gates.transformers_logits(self.source, tokens,
                                                                          scheme))
        return self._want[scheme]


def _vs_transformers(env, model):
    tokens = [model.tokenizer.encode(p) for p in TRANSFORMERS_PROMPTS]
    got = np.concatenate([gates.all_position_logits(model, t) for t in tokens])
    return gates.compare("vs transformers", got, env.transformers_logits(model),
                          gates.calibrated_bound(model.backend, "transformers")).passed


def check_transformers(env) -> bool:
    return _vs_transformers(env, env.reference())


def check_designed_greedy(env) -> bool:
    return gates.gate_designed(env.reference()).passed


def check_cached_decode(env) -> bool:
    return gates.gate_cached_decode(env.reference()).passed


def check_jax_vs_reference(env) -> bool:
    return gates.gate_vs_reference(env.jax()).passed


def check_jax_vs_transformers(env) -> bool:
    return _vs_transformers(env, env.jax())


def check_jax_affine4_vs_transformers(env) -> bool:
    """On a 4-bit artifact, where bf16-vs-quantized noise (~1e-2) once hid formula bugs. On
    the float32 dot: the int8 one's rounding (its bound 5e-4 against transformers) would hide
    the small faults this check is for, and the formulas are the same code under either."""
    return _vs_transformers(env, env.jax("affine4_gs32", cpu_dot="f32"))


def check_pool(env) -> bool:
    """A workload of sessions sharing a prefix, on the pool alone: the invariants after every
    operation, and every block back (free or cached) at the end."""
    pool = BlockPool(6)
    a = [int(t) for t in np.arange(100, 100 + 3 * KV_BLOCK + 5)]
    try:
        first = pool.allocate(4)
        pool.check()
        pool.publish(a, first)
        pool.release(first)
        pool.check()
        adopted = pool.match_prefix(a, max_blocks=3)
        tail = pool.allocate(1)
        pool.check()
        other = pool.allocate(pool.num_available - pool.reserved)  # evicts what is cached
        pool.check()
        pool.release(other)
        pool.release(adopted + tail)
        pool.check()
        return len(adopted) == 3 and pool.num_in_use == 0 and pool.num_available == 6
    except (AssertionError, ValueError, KeyError):
        return False


def check_sampling(env) -> bool:
    """Top-k's kept set over 3000 draws is exactly the k largest; the penalties equal their
    formula over the whole window."""
    n, k = 1000, 20
    rng = np.random.default_rng(0)
    logits = rng.permutation(np.linspace(0.0, 3.0, n)).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=k, seed=3), vocab_size=n)
    drawn = {sampler.sample(logits) for _ in range(3000)}
    kept = drawn == set(np.argsort(-logits)[:k].tolist())
    recent = [5, 7, 7, 9, 11]  # 11, the most recent, appears once
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)
    want = logits.astype(np.float64).copy()
    ids, counts = np.unique(recent, return_counts=True)
    v = want[ids]
    v = np.where(v > 0, v / 1.3, v * 1.3) - (counts * 0.5 + 0.25)
    want[ids] = v
    penalties = np.allclose(adjusted_logits(logits, recent, params), want, atol=1e-6)
    return kept and penalties


def check_spec(env) -> bool:
    """Speculative greedy on copy-like prompts emits the designed greedy tokens."""
    from kipp.synthetic.writer import designed_rule, live_token_ids

    model = env.reference()
    rule = designed_rule(model.entry)
    rng = np.random.default_rng(5)
    head = [int(t) for t in rng.choice(live_token_ids(model.entry), 3, replace=False)]
    chain = head + rule.continuation(head, 40)
    noise = [int(t) for t in rng.integers(0, 151_643, 8)]
    edited = [t for i in range(0, 30, 5) for t in chain[i:i + 4] + [noise[i % 8]]]
    ok = True
    for prompt in (noise + chain + noise[:3] + chain[:3], noise[:4] + edited + chain[:3]):
        generation = model.generate(prompt, 12, stream=True, temperature=0, speculative=True)
        try:
            list(generation)
        except KippError:  # the engine's own checks refused the corrupted session
            return False
        ok &= generation.stats.tokens == rule.continuation(prompt, 12)
    return ok


def check_scheduler(env) -> bool:
    """Three greedy requests scheduled together, prefill in 8-token chunks: each emits the
    designed greedy tokens."""
    from kipp.engine.scheduler import Request, Scheduler, collect
    from kipp.synthetic.writer import designed_rule

    model = env.reference()
    rule = designed_rule(model.entry)
    prompts = gates.designed_prompts(model.entry)[:3]
    scheduler = Scheduler(model, prefill_chunk=8)
    tickets = [scheduler.submit(Request(prompt=p, max_tokens=8,
                                        sampling=SamplingParams(temperature=0)))
               for p in prompts]
    scheduler.run_until_idle()
    return all(collect(t)[0][0] == rule.continuation(p, 8) for t, p in zip(tickets, prompts))


def check_kv_disk(env) -> bool:
    """A prompt's blocks written to a disk tier and restored by a second model on the same
    folder: the continuation's logits equal an uncached run's bitwise (reference backend), and a
    block file with one payload byte flipped is refused and counted, its block recomputed."""
    import tempfile

    prompt = [int(t) for t in np.random.default_rng(8).integers(1, 100_000, 3 * KV_BLOCK + 7)]
    plain = env.reference().session()
    plain.eval(prompt[:-1])
    want = plain.eval(prompt[-1:])
    with tempfile.TemporaryDirectory() as folder:
        first = load(env.path, backend="reference", kv_tokens=1024, progress=False,
                     kv_cache_dir=folder)
        with first.session() as s:
            s.eval(prompt)
        first.kv_disk.tier.flush()
        files = sorted(first.kv_disk.tier.dir.glob("[0-9a-f]*.kvb"))
        if len(files) != 3:
            return False
        victim = files[0]  # one of the three full blocks, flipped mid-payload
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x10
        victim.write_bytes(bytes(data))
        second = load(env.path, backend="reference", kv_tokens=1024, progress=False,
                      kv_cache_dir=folder)
        s = second.session()
        n = s.match_prefix(prompt[:-1])
        s.eval(prompt[n:-1])
        got = s.eval(prompt[-1:])
        s.close()
        # the second model writes the blocks it recomputed: done before the folder goes, or
        # its writer and the folder's removal race (a file made while rmtree runs)
        second.kv_disk.tier.flush()
        stats = second.kv_disk.stats()
    return np.array_equal(got, want) and stats["bad_blocks"] == 1 and stats["hits"] >= 1


CHECKS = {
    "gate: vs transformers": check_transformers,
    "gate: greedy = designed rule": check_designed_greedy,
    "gate: cached decode vs recompute": check_cached_decode,
    "gate: jax vs reference": check_jax_vs_reference,
    "gate: jax vs transformers": check_jax_vs_transformers,
    "gate: jax vs transformers (affine4_gs32)": check_jax_affine4_vs_transformers,
    "block pool: invariants, no leaked blocks": check_pool,
    "sampling: kept set and penalties vs a sorting oracle": check_sampling,
    "speculative greedy = plain greedy": check_spec,
    "scheduler: concurrent greedy = designed rule": check_scheduler,
    "disk tier: restored prefix = uncached, a flipped byte refused": check_kv_disk,
}
CATALOGUE = faults.catalogue()


def metal_catalogue() -> list[dict]:
    """The Metal-kernel faults, planted and caught in tests/test_metal_kernels.py (on the Metal
    emulator, in the default suite there): its FAULT_CATALOGUE rows, or [] where that module
    cannot run (no MLX)."""
    import importlib

    try:
        return importlib.import_module("test_metal_kernels").FAULT_CATALOGUE
    except (ImportError, pytest.skip.Exception):
        return []


def faults_table() -> str:
    """docs/faults.md: the catalogue as a markdown table."""
    lines = ["# Fault catalogue", "",
             "Bugs planted on purpose (tests/faults/), each of which the named checks must "
             "catch; `pytest -m slow tests/test_faults.py` plants every one and runs its "
             "checks, and runs every check on the unplanted code. Generated from the "
             "catalogue by `tests/test_faults.py::faults_table`.", "",
             "| family | fault | where | what it does | caught by |",
             "| --- | --- | --- | --- | --- |"]
    for f in CATALOGUE:
        lines.append(f"| {f.family} | `{f.name}` | `{f.where}` | {f.description} | "
                     f"{'; '.join(f.caught_by)} |")
    metal = metal_catalogue()
    if metal:
        lines += ["", "Metal kernels (planted in the kernels' Metal source or dispatch and run on "
                  "the Metal emulator by the named test of tests/test_metal_kernels.py):", "",
                  "| fault | where | planted as | caught by | test |",
                  "| --- | --- | --- | --- | --- |"]
        for row in metal:
            how = row["how"].replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {row['name']} | `{row['where']}` | `{how}` | {row['caught_by']} | "
                         f"`{row['test']}` |")
    families = {}
    for f in CATALOGUE:
        for check in f.caught_by:
            families.setdefault(check, set()).add(f.family)
    lines += ["", "Which gate family catches which fault family:", "",
              "| check | fault families |", "| --- | --- |"]
    for check in CHECKS:
        lines.append(f"| {check} | {', '.join(sorted(families.get(check, ())))} |")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def env(artifacts, synthetic_dir):
    return Env(artifacts, synthetic_dir)


def test_every_fault_names_known_checks_and_families_are_covered():
    assert len(CATALOGUE) >= 12  # besides the Metal faults of tests/test_metal_kernels.py
    for fault in CATALOGUE:
        assert set(fault.caught_by) <= set(CHECKS), fault.name
    covered = {f.family for f in CATALOGUE}
    assert {"forward pass", "KV addressing", "block pool", "sampling", "speculation",
            "scheduler"} <= covered


def test_the_docs_table_is_the_catalogue():
    if not metal_catalogue():
        pytest.skip("the table lists tests/test_metal_kernels.py's faults: that needs MLX")
    assert DOCS.read_text(encoding="utf-8") == faults_table()


def test_the_attention_replica_is_the_shipped_attention(artifacts):
    """faults.forward plants its attention faults through a copy of the reference's
    _attention; unchanged, that copy must be bitwise the original."""
    from faults.forward import attention_variant
    from kipp.reference import backend

    model = load(artifacts(TINY), backend="reference", kv_tokens=256, progress=False)
    tokens = model.tokenizer.encode(gates.DEFAULT_PROMPTS[2])[:40]
    want = gates.all_position_logits(model, tokens)
    with faults.Patcher() as patch:
        patch.setattr(backend.ReferenceBackend, "_attention", attention_variant())
        got = gates.all_position_logits(model, tokens)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.slow
@pytest.mark.parametrize("check", list(CHECKS))
def test_every_check_passes_on_the_unplanted_code(env, check):
    assert CHECKS[check](env), check


@pytest.mark.slow
@pytest.mark.parametrize("fault", CATALOGUE, ids=[f.name for f in CATALOGUE])
def test_every_planted_fault_is_caught(env, monkeypatch, fault):
    fault.plant(monkeypatch)
    missed = [check for check in fault.caught_by if CHECKS[check](env)]
    assert not missed, f"{fault.name} passed {missed}"


if __name__ == "__main__":
    print(faults_table(), end="")
