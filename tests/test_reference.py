"""The reference backend against its oracles, and the session and generation contracts."""

import numpy as np
import pytest

import kipp
from kipp import gates
from kipp.backend import EvalError, EvalItem
from kipp.cli import main as cli_main
from kipp.engine.blocks import PoolExhausted
from kipp.engine.session import SessionError
from kipp.errors import ArtifactError, RegistryError
from kipp.formats.artifact import open_artifact
from kipp.model import ChatReply, GenerationError, load
from kipp.reference import ops

TINY = "kipp-synthetic/qwen3-tiny"
UNTIED = "kipp-synthetic/qwen3-tiny-untied"
BASE = "kipp-synthetic/qwen3-tiny-base"


def _bits_equal(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_linear_rows_do_not_depend_on_their_batch(artifacts):
    """The property batched-equals-isolated rests on (see kipp.reference.ops)."""
    w = open_artifact(artifacts(UNTIED, "q8_0")).weights.layers[0].q
    rng = np.random.default_rng(0)
    x = rng.standard_normal((37, w.shape[1])).astype(np.float32)
    full = ops.linear(x, w)
    for start, stop in [(0, 1), (5, 6), (3, 20), (30, 37), (0, 37)]:
        assert _bits_equal(ops.linear(x[start:stop], w), full[start:stop])


@pytest.mark.parametrize("checkpoint_id", [TINY, UNTIED, BASE])
def test_reference_matches_transformers(models, synthetic_dir, checkpoint_id):
    result = gates.gate_transformers(models(checkpoint_id), synthetic_dir(checkpoint_id))
    print(gates.format_table([result]))
    assert result.passed, result


def test_with_unrounded_kv_the_reference_matches_transformers_to_rounding_noise(
        artifacts, synthetic_dir):
    """BF16 K/V storage is the only designed difference from the FP32 oracle."""
    from kipp.model import Model
    from kipp.reference.backend import ReferenceBackend

    artifact = open_artifact(artifacts(UNTIED))
    model = Model(artifact, ReferenceBackend(artifact, 64, kv_dtype=np.float32))
    tokens = [model.tokenizer.encode(p) for p in gates.DEFAULT_PROMPTS]
    want = gates.transformers_logits(synthetic_dir(UNTIED), tokens)
    for t, w in zip(tokens, want):
        got = gates.all_position_logits(model, t)
        assert gates.nmse(got, w) < 1e-10
        assert np.array_equal(got.argmax(-1), w.argmax(-1))


@pytest.mark.parametrize("checkpoint_id", [TINY, UNTIED])
def test_cached_decode_matches_recompute(models, checkpoint_id):
    result = gates.gate_cached_decode(models(checkpoint_id))
    assert result.passed, result


@pytest.mark.parametrize("checkpoint_id,scheme", [(TINY, "bf16"), (UNTIED, "scale4_gs32")])
def test_scrambled_block_table_is_bitwise_identity(models, checkpoint_id, scheme):
    result = gates.gate_scrambled_table(models(checkpoint_id, scheme))
    assert result.passed, result


@pytest.mark.parametrize("checkpoint_id,scheme", [  # CI's longest default checks run the second
    (TINY, "bf16"), pytest.param(UNTIED, "q8_0", marks=pytest.mark.slow)])
def test_batched_mixed_lengths_bitwise_equal_isolated(models, checkpoint_id, scheme):
    result = gates.gate_batched(models(checkpoint_id, scheme))
    assert result.passed, result


def test_multi_row_logits_equal_per_position(models):
    model = models(TINY)
    tokens = model.tokenizer.encode(gates.DEFAULT_PROMPTS[1])
    all_rows = gates.all_position_logits(model, tokens)
    for n in (1, 7, len(tokens)):
        with model.session() as s:
            prefix = tokens[:-n]
            if prefix:
                s.eval(prefix)
            rows = s.eval(tokens[len(prefix):], logits_rows=n)
        assert _bits_equal(rows, all_rows[-n:])


def test_truncate_then_reeval_equals_fresh_session(models):
    model = models(TINY)
    tokens = model.tokenizer.encode(gates.DEFAULT_PROMPTS[2])
    assert len(tokens) > 40
    with model.session() as fresh:
        want = fresh.eval(tokens[:40], logits_rows=3)
    with model.session() as s:
        s.eval(tokens)
        s.truncate(35)
        assert s.length == 35 and len(s.block_table) == 2
        got = s.eval(tokens[35:40], logits_rows=3)
    assert _bits_equal(got, want)


def test_prefix_adoption_is_bitwise_equal_to_an_unshared_run(models):
    model = models(UNTIED)
    tokens = model.tokenizer.encode(gates.DEFAULT_PROMPTS[2] * 4)
    assert len(tokens) > 100
    with model.session() as unshared:
        want = unshared.eval(tokens, logits_rows=2)
    hits = model.pool.stats()["hit_tokens"]
    with model.session() as second:
        adopted = second.match_prefix(tokens)  # the full blocks, then the closed run's tail
        full = (len(tokens) - 1) // 32 * 32
        assert adopted == len(tokens) - 1 and full >= 96 and second.shared_blocks == full // 32
        assert model.pool.stats()["hit_tokens"] - hits == adopted
        got = second.eval(tokens[adopted:])  # the last token only
        # Rolling back into an adopted (shared, immutable) block rebuilds it privately.
        second.truncate(full - 5)
        again = second.eval(tokens[full - 5:], logits_rows=2)
    assert _bits_equal(got, want[-1:])
    assert _bits_equal(again, want)
    model.pool.check()


def test_repeated_prompt_adopts_the_tail_and_stays_bitwise(models):
    """A finished sequence leaves its partial last block cached: the same prompt again adopts
    all but its last token and evaluates that one, with bitwise the unshared logits; a prompt
    that continues differently inside the tail keeps only the tokens that agree."""
    model = models(UNTIED)
    tokens = model.tokenizer.encode(gates.DEFAULT_PROMPTS[1] * 3)
    assert 2 < len(tokens) % 32 < 30  # room for two more tokens in the tail block
    with model.session() as unshared:
        want = unshared.eval(tokens, logits_rows=2)
    with model.session() as again:
        assert again.match_prefix(tokens) == len(tokens) - 1
        got = again.eval(tokens[-1:])
        again.eval([11, 13])  # continue in the adopted block, then publish it as a tail
    assert _bits_equal(got, want[-1:])
    other = tokens[:-2] + [7, tokens[-1]]  # the cached tail now ends ..., tokens[-1], 11, 13
    with model.session() as s:
        assert s.match_prefix(other) == len(tokens) - 2
        got_other = s.eval(other[len(tokens) - 2:], logits_rows=2)
    with model.session() as fresh:  # no match_prefix: nothing adopted
        want_other = fresh.eval(other, logits_rows=2)
    assert _bits_equal(got_other, want_other)
    model.pool.check()


def test_pool_exhaustion_fails_cleanly(artifacts):
    model = load(artifacts(TINY), backend="reference", kv_tokens=64, progress=False)
    tokens = model.tokenizer.encode(gates.DEFAULT_PROMPTS[2] * 3)
    with model.session() as a:
        a.eval(tokens[:40])  # 2 of the 2 blocks
        with model.session() as b:
            with pytest.raises(PoolExhausted):
                b.eval(tokens[:5])
            assert b.length == 0 and b.block_table == []
        before = (a.length, list(a.block_table))
        with pytest.raises(PoolExhausted):
            a.eval(tokens[40:70])
        assert (a.length, a.block_table) == before
        a.eval(tokens[40:64])  # still usable up to its blocks
    model.pool.check()
    assert model.pool.stats()["in_use"] == 0


# Quantization noise of each scheme vs BF16 on the tiny checkpoint: NMSE over every position of
# DEFAULT_PROMPTS[1] (the quality report), measured and held with room, as a report of how much
# a scheme changes the model; the designed greedy tokens survive every scheme.
QUALITY_NMSE = {"q8_0": 2e-4, "affine4_gs32": 3e-2, "scale4_gs32": 3e-2}


# each report is among the default suite's longest tests: CI's longest default checks
@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["q8_0", "affine4_gs32", "scale4_gs32"])
def test_quantized_quality_report(models, scheme):
    result = gates.quality_report(models(TINY, scheme), models(TINY, "bf16"))
    print(gates.format_table([result]))
    assert not result.gating and "identical" in result.detail, result
    assert result.metric <= QUALITY_NMSE[scheme], result


def test_generate_greedy_repeats_and_streams(models):
    model = models(TINY)
    text = model.generate("The quick brown fox", max_tokens=12, temperature=0)
    stream = model.generate("The quick brown fox", max_tokens=12, temperature=0, stream=True)
    pieces = list(stream)
    assert "".join(pieces) == text and text
    assert stream.stats.completion_tokens == 12 and stream.stats.finish_reason == "length"
    assert model.tokenizer.decode(stream.stats.tokens) == text


def test_seeded_sampling_repeats(models):
    model = models(TINY)
    a = model.generate("Once upon a time", max_tokens=10, temperature=0.9, top_p=0.95, seed=7)
    b = model.generate("Once upon a time", max_tokens=10, temperature=0.9, top_p=0.95, seed=7)
    assert a == b


def test_stop_string_ends_generation_and_is_not_emitted(models):
    model = models(TINY)
    full = model.generate("The quick brown fox", max_tokens=12, temperature=0)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop
    got = model.generate("The quick brown fox", max_tokens=12, temperature=0, stop=[stop])
    assert got == full[: full.index(stop)]


def test_chat_needs_an_instruct_checkpoint(models):
    reply = models(TINY).chat([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    assert isinstance(reply, ChatReply) and isinstance(reply.content, str)
    with pytest.raises(GenerationError, match="base checkpoint"):
        models(BASE).chat([{"role": "user", "content": "Hi"}], max_tokens=4)


def test_bad_input_is_a_clear_error_and_changes_nothing(models, tmp_path):
    model = models(TINY)
    with pytest.raises(GenerationError, match="prompt is empty"):
        model.generate("", max_tokens=4)
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        model.generate([1, 2, 151936], max_tokens=4)
    with pytest.raises(GenerationError, match="exceeds the context length"):
        model.generate("hi", max_tokens=model.entry.context_length)
    with model.session(capacity=8) as s:
        s.eval([1, 2, 3])
        with pytest.raises(SessionError, match="do not fit"):
            s.eval(list(range(10)))
        with pytest.raises(SessionError, match="outside the vocabulary"):
            s.eval([5, -1])
        assert s.tokens == [1, 2, 3] and len(s.block_table) == 1
    with pytest.raises(SessionError, match="capacity"):
        model.session(capacity=model.entry.context_length + 1)
    with pytest.raises(EvalError):
        model.backend.eval([EvalItem((1,), 0, (10**6,))])
    assert model.pool.stats()["in_use"] == 0
    with pytest.raises(RegistryError, match="not in Kipp's checkpoint registry"):
        kipp.load("Qwen/Qwen3-1B", progress=False)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(ArtifactError):
        kipp.load(broken, progress=False)


def test_cli_run_prints_text_and_speeds(artifacts, capsys):
    path = str(artifacts(TINY))
    assert cli_main(["run", path, "--prompt", "Hello", "--max-tokens", "6",
                     "--temperature", "0", "--backend", "reference"]) == 0
    captured = capsys.readouterr()
    model_text = load(path, backend="reference", progress=False).generate(
        "Hello", max_tokens=6, temperature=0)
    assert captured.out.strip() == model_text.strip()
    assert "prefill" in captured.err and "decode" in captured.err


def test_backend_gate_passes_a_twin_and_names_the_first_bad_step(artifacts):
    """gate_backends on two reference backends passes exactly; a backend whose decode logits
    are nudged at one position fails there, by name, and a swapped argmax fails too."""
    from kipp.reference.backend import ReferenceBackend

    artifact = open_artifact(artifacts(TINY))
    oracle, twin = ReferenceBackend(artifact, 8), ReferenceBackend(artifact, 8)
    tokens = np.random.default_rng(0).integers(0, 151_643, 30)
    same = gates.gate_backends(oracle, twin, tokens, (5, 1, 6), logits_rows=4, decode_steps=3)
    assert same.passed and same.metric == 0.0
    assert same.bound == gates.calibrated_bound("reference", "reference") == 0.0

    class Nudged(ReferenceBackend):
        def eval(self, items):
            out = super().eval(items)
            if items[0].start_position == 32:  # the third decode step
                out[0] = out[0] + 0.05 * np.abs(out[0]).max()  # ~1e-3 NMSE, argmax kept
            return out

    bad = gates.gate_backends(oracle, Nudged(artifact, 8), tokens, (5, 1, 6), decode_steps=3)
    assert not bad.passed and bad.metric > 0.0
    assert "decode position 32" in bad.name and "row 0" in bad.detail
    logits = oracle.eval([EvalItem(tuple(int(t) for t in tokens), 0, (5, 1, 6), 2)])[0]
    swapped = logits.copy()
    top = logits.argmax(-1)
    swapped[:, top] = logits.min()  # the oracle's top token becomes the least likely
    rows = gates.gate_rows("swapped", swapped, logits, bound=1.0)
    assert not rows.passed and "argmax differs" in rows.detail
    assert gates.argmax_check(swapped, logits) == (2, 0)


def test_argmax_ties_are_judged_by_the_error_elsewhere_in_the_row():
    rng = np.random.default_rng(1)
    want = rng.standard_normal(1000)
    want[:2] = 10.0, 10.0 - 1e-3  # a near-tie at the top
    got = want + rng.normal(0, 1e-2, 1000)  # noise across the row that can swap the two
    got[1] = got[0] + 1e-4
    assert gates.argmax_check(got, want) == (1, 1)
    got = want.copy()
    got[1] = 10.5  # the swap is the only error in the row: a real disagreement
    assert gates.argmax_check(got, want) == (1, 0)


@pytest.mark.slow  # one of the default suite's longest (CI: 'longest default checks')
def test_cli_gates_prints_a_passing_table(artifacts, synthetic_dir, capsys):
    code = cli_main(["gates", str(artifacts(TINY, "q8_0")), "--source", str(synthetic_dir(TINY))])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "vs transformers" in out and "q8_0 vs bf16" in out and "FAIL" not in out


@pytest.mark.slow
def test_reference_matches_transformers_at_the_0_6b_shape(synthetic_dir, tmp_path):
    checkpoint_id = "kipp-synthetic/qwen3-0.6b-shape"
    from kipp.formats.convert import convert

    source = synthetic_dir(checkpoint_id)
    path = convert(checkpoint_id, source, "bf16", tmp_path / "bf16.gguf", progress=False)
    model = load(path, backend="reference", kv_tokens=1024, progress=False)
    result = gates.gate_transformers(model, source, prompts=gates.DEFAULT_PROMPTS[:2])
    print(gates.format_table([result]))
    assert result.passed, result
