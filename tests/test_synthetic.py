"""kipp.synthetic.writer: deterministic synthetic checkpoints in the real Qwen3 Hugging Face
layout."""

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers numpy's 'bfloat16' name for safe_open)
import numpy as np
import pytest
from safetensors import safe_open

from kipp.errors import RegistryError
from kipp.formats import registry
from kipp.synthetic import circuit, layout, positional
from kipp.synthetic import writer as synthetic
from kipp.synthetic.rule import N_LIVE
from kipp.text.tokenizer_files import tokenizer_json_bytes

TINY_IDS = ["kipp-synthetic/qwen3-tiny", "kipp-synthetic/qwen3-tiny-base",
            "kipp-synthetic/qwen3-tiny-untied"]
KIPP = Path(synthetic.__file__).resolve().parent.parent  # the kipp package folder
SYNTHETIC_IDS = [c for c in registry.REGISTRY if c.startswith(registry.SYNTHETIC_PREFIX)]

# The keys of the upstream Qwen/Qwen3-0.6B config.json.
UPSTREAM_CONFIG_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id",
    "head_dim", "hidden_act", "hidden_size", "initializer_range", "intermediate_size",
    "max_position_embeddings", "max_window_layers", "model_type", "num_attention_heads",
    "num_hidden_layers", "num_key_value_heads", "rms_norm_eps", "rope_scaling", "rope_theta",
    "sliding_window", "tie_word_embeddings", "torch_dtype", "transformers_version", "use_cache",
    "use_sliding_window", "vocab_size",
}

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "東京は日本の首都です。Once upon a time, there lived a king.",
]


def read_json(path):
    return json.loads(path.read_text(encoding="utf-8"))


def weights(folder):
    """{name: array} over every safetensors file of a folder, plus each file's metadata."""
    tensors, metadata = {}, {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="numpy") as f:
            metadata[path.name] = f.metadata()
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors, metadata


@pytest.mark.parametrize("checkpoint_id", ["Qwen/Qwen3-0.6B", "kipp-synthetic/nope"])
def test_refuses_ids_that_are_not_synthetic_entries(checkpoint_id, tmp_path):
    with pytest.raises(RegistryError, match=checkpoint_id):
        synthetic.synthesize(checkpoint_id, tmp_path)


def test_refuses_a_non_empty_out_dir(tmp_path):
    (tmp_path / "stale.safetensors").write_bytes(b"")
    with pytest.raises(FileExistsError, match="not an empty folder"):
        synthetic.synthesize("kipp-synthetic/qwen3-tiny", tmp_path)


def test_an_interrupted_synthesis_leaves_no_folder(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(synthetic, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        synthetic.synthesize("kipp-synthetic/qwen3-tiny", tmp_path / "tiny")
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its partial twin


@pytest.mark.parametrize("checkpoint_id", TINY_IDS)
def test_every_layout_file_is_written(synthetic_dir, checkpoint_id):
    folder = synthetic_dir(checkpoint_id)
    assert sorted(os.listdir(folder)) == sorted(synthetic.layout_files(checkpoint_id))


def test_same_seed_gives_byte_identical_files(tiny_dir, tmp_path):
    again = synthetic.synthesize("kipp-synthetic/qwen3-tiny", tmp_path)
    for name in synthetic.layout_files("kipp-synthetic/qwen3-tiny"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_each_tensor_comes_from_its_own_seeded_streams(tiny_dir):
    entry = registry.get("kipp-synthetic/qwen3-tiny")
    stored, _ = weights(tiny_dir)
    kinds = {name: kind for name, _, kind in synthetic.tensor_specs(entry)}
    # Drawn alone, each layer's down_proj (random writes into NOISE, the circuit's units on
    # top) equals the file's copy; another seed gives other bytes.
    for name in ["model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"]:
        alone = synthetic.make_tensor(entry, name, stored[name].shape, kinds[name])
        assert alone.tobytes() == stored[name].tobytes(), name
        other_seed = synthetic.make_tensor(registry.get("kipp-synthetic/qwen3-tiny-base"), name,
                                           stored[name].shape, kinds[name])
        assert other_seed.tobytes() != alone.tobytes(), name


@pytest.mark.parametrize("checkpoint_id", SYNTHETIC_IDS)
def test_config_matches_the_registry_without_generating_weights(checkpoint_id):
    entry = registry.get(checkpoint_id)
    config = json.loads(json.dumps(synthetic.config_json(entry)))  # as read back from disk
    assert registry.config_mismatches(entry, config) == []
    assert set(config) == UPSTREAM_CONFIG_KEYS
    assert config["max_window_layers"] == entry.layers
    assert config["rope_theta"] == 1000000 and isinstance(config["rope_theta"], int)


def test_written_config_is_sorted_json_like_transformers_writes(tiny_dir):
    text = (tiny_dir / "config.json").read_text()
    entry = registry.get("kipp-synthetic/qwen3-tiny")
    assert text == json.dumps(synthetic.config_json(entry), indent=2, sort_keys=True) + "\n"


def test_generation_config_follows_the_variant(synthetic_dir):
    instruct = read_json(synthetic_dir("kipp-synthetic/qwen3-tiny") / "generation_config.json")
    assert instruct["eos_token_id"] == [151645, 151643]
    assert (instruct["do_sample"], instruct["temperature"], instruct["top_p"],
            instruct["top_k"], instruct["pad_token_id"]) == (True, 0.6, 0.95, 20, 151643)
    base = read_json(synthetic_dir("kipp-synthetic/qwen3-tiny-base") / "generation_config.json")
    assert base["eos_token_id"] == 151643 and base["do_sample"] is False
    assert "temperature" not in base


def test_tokenizer_files_are_upstream_and_consistent(synthetic_dir):
    folder = synthetic_dir("kipp-synthetic/qwen3-tiny")
    raw = tokenizer_json_bytes()
    assert (folder / "tokenizer.json").read_bytes() == raw
    packaged = KIPP / "data" / "qwen3-tokenizer" / "tokenizer_config.json"
    assert (folder / "tokenizer_config.json").read_bytes() == packaged.read_bytes()
    model = json.loads(raw)["model"]
    assert read_json(folder / "vocab.json") == model["vocab"]
    lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "#version: 0.2"
    assert lines[1:] == [" ".join(pair) for pair in model["merges"]]
    base = read_json(synthetic_dir("kipp-synthetic/qwen3-tiny-base") / "tokenizer_config.json")
    assert base["eos_token"] == "<|endoftext|>" and "chat_template" not in base


@pytest.mark.parametrize("checkpoint_id", TINY_IDS)
def test_weights_have_hf_names_shapes_and_bf16(synthetic_dir, checkpoint_id):
    entry = registry.get(checkpoint_id)
    tensors, metadata = weights(synthetic_dir(checkpoint_id))
    assert all(m == {"format": "pt"} for m in metadata.values())
    specs = {name: shape for name, shape, _ in synthetic.tensor_specs(entry)}
    assert {name: t.shape for name, t in tensors.items()} == specs
    assert ("lm_head.weight" in tensors) == (not entry.tied)
    assert all(t.dtype == ml_dtypes.bfloat16 for t in tensors.values())
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (entry.attention_width,
                                                                      entry.hidden)
    assert sum(t.size for t in tensors.values()) == entry.parameter_count


def test_weights_follow_the_circuit_layout(tiny_dir):
    entry = registry.get("kipp-synthetic/qwen3-tiny")
    dims, s = layout.Dims(entry.hidden), circuit.scales(entry)
    tensors, _ = weights(tiny_dir)
    f32 = {name: t.astype(np.float32) for name, t in tensors.items()}
    embed = f32["model.embed_tokens.weight"]
    assert not embed[synthetic.FIRST_PADDING_ID:].any()  # padding rows never win an argmax
    live = synthetic.live_token_ids(entry)
    codes = embed[live][:, dims.code]
    gram = codes @ codes.T  # exactly orthogonal (Hadamard), equal norms
    assert np.allclose(gram, np.eye(len(live)) * s.token ** 2, atol=1e-3 * s.token ** 2)
    rows = embed[:synthetic.FIRST_PADDING_ID]
    assert np.allclose(rows[:, dims.bias], s.bias)  # the constant the positional heads read
    norms = np.linalg.norm(np.delete(rows, dims.bias, axis=1), axis=1)
    assert np.allclose(norms, s.token, rtol=0.01)  # every token the same norm
    assert not rows[:, dims.channels[1:]].any()  # the circuit's channels start empty
    # Random projections: the registry's init_std; random writes only reach NOISE.
    assert f32["model.layers.0.mlp.up_proj.weight"][N_LIVE:].std() == pytest.approx(
        s.projection, rel=0.02)
    o = f32["model.layers.1.self_attn.o_proj.weight"]
    assert o[dims.noise][:, 128:].std() == pytest.approx(s.attention_write, rel=0.05)
    down = f32["model.layers.0.mlp.down_proj.weight"]
    assert down[dims.noise][:, N_LIVE:].std() == pytest.approx(s.mlp_write, rel=0.05)
    keep = np.setdiff1d(np.arange(entry.hidden), np.r_[dims.noise, dims.switch, dims.sigma2])
    assert not o[keep].any()
    norm = f32["model.layers.0.input_layernorm.weight"]
    assert np.all(norm[dims.channels] == 1.0)  # exact on the circuit's channels ...
    token = norm[dims.noise]
    assert abs(token.mean() - 1) < 0.05 and 0.05 < token.std() < 0.2  # ... near 1 elsewhere
    final = f32["model.norm.weight"]
    assert not final[dims.channels].any() and final[dims.code].min() > 0


def test_live_tokens_are_words_in_one_successor_cycle():
    entry = registry.get("kipp-synthetic/qwen3-tiny")
    live = synthetic.live_token_ids(entry)
    assert len(live) == len(set(live.tolist())) == N_LIVE
    vocab = {i: piece for piece, i in json.loads(tokenizer_json_bytes())["model"]["vocab"].items()}
    pieces = [vocab[i] for i in live.tolist()]
    assert {"\u0120the", "\u0120and", "\u010a", "."} <= set(pieces)  # the most common text pieces
    assert live.max() < registry.ENDOFTEXT_ID  # never a special token, so never an early stop
    pi = synthetic.successor(entry)
    seen, i = [], 0
    for _ in range(len(pi)):
        seen.append(i)
        i = pi[i]
    assert i == 0 and sorted(seen) == list(range(len(pi)))  # one cycle through all of them
    rule = synthetic.designed_rule(entry)
    assert set(rule.cluster_next.tolist()) <= set(live.tolist())  # every token leads to text
    assert not rule.live[1000]
    run = rule.continuation([1000], 60)  # fallback steps start three walks 21 steps apart ...
    assert len(set(run)) == 60  # ... so no token repeats for 60 tokens


def test_rope_profiles_meet_their_margins():
    """The designed positional scores over every offset a synthetic context allows."""
    entry = registry.get("kipp-synthetic/qwen3-0.6b-shape")  # the longest synthetic context
    profiles = positional.rope_profiles(entry.rope_theta)
    deltas = np.arange(-entry.context_length, 2)
    score = {k: positional.profile_scores(c, deltas, entry.rope_theta)
             for k, c in profiles.items()}
    at = {d: np.flatnonzero(deltas == d)[0] for d in (1, 0, -1)}
    self_, scale, prev = score["self"], score["scale"], score["prev"]
    assert self_[at[1]] - self_[at[0]] >= 3.99  # the never-visible next position is preferred
    assert np.delete(self_, [at[1], at[0]]).max() <= self_[at[0]] - 21.99
    assert scale[at[0]] - scale[at[-1]] == pytest.approx(4.0, abs=0.01)
    for back, drop in zip(range(2, 6), (8.0, 12.0, 16.0, 19.0)):  # the ramp, then 22
        assert scale[at[0] - back] <= scale[at[0]] - drop + 0.01
    assert scale[:at[0] - 5].max() <= scale[at[0]] - 21.99
    assert np.delete(prev, [at[1], at[-1]]).max() <= prev[at[-1]] - 21.99


def test_rope_profiles_hold_only_at_their_designed_base():
    with pytest.raises(ValueError, match="designed for 1e\\+06"):
        positional.rope_profiles(5e5)


def _head_scores(tensors, entry, layer, head, deltas):
    """Positional scores of a query head, computed from the stored weights as a model would:
    RMSNorm of an embedding row, q/k projection, per-head RMSNorm, RoPE, scaled dot."""
    from kipp.reference import ops

    f32 = {n: t.astype(np.float32) for n, t in tensors.items()}
    p = f"model.layers.{layer}."
    x = f32["model.embed_tokens.weight"][1000]  # any token: the heads read only BIAS
    h = ops.rms_norm(x[None], f32[p + "input_layernorm.weight"])
    group = entry.query_heads // 8
    q = (f32[p + "self_attn.q_proj.weight"] @ h[0])[head * 128:(head + 1) * 128]
    k = (f32[p + "self_attn.k_proj.weight"] @ h[0])[head // group * 128:][:128]
    q = ops.rms_norm(q[None, None], f32[p + "self_attn.q_norm.weight"])
    k = ops.rms_norm(k[None, None], f32[p + "self_attn.k_norm.weight"])
    positions = np.full(len(deltas), 5000)
    cq, sq = ops.rope_tables(positions, entry.rope_theta)
    ck, sk = ops.rope_tables(positions + deltas, entry.rope_theta)
    q = ops.apply_rope(np.repeat(q, len(deltas), 0), cq, sq)[:, 0]
    k = ops.apply_rope(np.repeat(k, len(deltas), 0), ck, sk)[:, 0]
    return np.sum(q * k, -1) / np.sqrt(128)


@pytest.mark.parametrize("checkpoint_id", ["kipp-synthetic/qwen3-tiny",
                                           "kipp-synthetic/qwen3-tiny-untied"])
def test_positional_heads_realise_the_designed_profiles(synthetic_dir, checkpoint_id):
    entry = registry.get(checkpoint_id)
    tensors, _ = weights(synthetic_dir(checkpoint_id))
    deltas = np.arange(-4096, 2)
    roles = layout.Roles(entry.query_heads // 8)
    for layer, head, kind in ((0, roles.self_head, "self"), (0, roles.scale_head, "scale"),
                              (0, roles.prev_head, "prev"), (1, roles.transport_head, "prev")):
        got = _head_scores(tensors, entry, layer, head, deltas)
        want = positional.profile_scores(positional.rope_profiles(entry.rope_theta)[kind],
                                         deltas, entry.rope_theta)
        # Relative to offset 0 (softmax is shift-free). BF16 weights move scores by ~0.1, well
        # inside the 22 of margin; the scale head's gap to the previous position stays 4.
        error = (got - got[-2]) - (want - want[-2])
        assert np.abs(error).max() < 0.25, (layer, head, kind, np.abs(error).max())
        if kind == "scale":
            assert got[-2] - got[-3] == pytest.approx(4.0, abs=0.1)


def test_sharded_layout_has_a_correct_index(synthetic_dir):
    entry = registry.get("kipp-synthetic/qwen3-tiny-untied")
    folder = synthetic_dir(entry.id)
    index = read_json(folder / "model.safetensors.index.json")
    shards = sorted(folder.glob("model-*-of-00002.safetensors"))
    assert [p.name for p in shards] == ["model-00001-of-00002.safetensors",
                                        "model-00002-of-00002.safetensors"]
    for path in shards:
        with safe_open(path, framework="numpy") as f:
            held = set(f.keys())
        assert held == {n for n, file in index["weight_map"].items() if file == path.name}
    assert set(index["weight_map"]) == {name for name, _, _ in synthetic.tensor_specs(entry)}
    assert index["metadata"]["total_size"] == 2 * entry.parameter_count


def test_generator_never_imports_torch(tmp_path):
    code = ("import sys; from kipp.synthetic.writer import synthesize; "
            f"synthesize('kipp-synthetic/qwen3-tiny', {str(tmp_path)!r}); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture(scope="module")
def hf_loaded(synthetic_dir):
    """hf_loaded(checkpoint_id) -> (model, loading info, tokenizer), each loaded once."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    loaded = {}

    def load(checkpoint_id):
        if checkpoint_id not in loaded:
            folder = synthetic_dir(checkpoint_id)
            model, info = transformers.Qwen3ForCausalLM.from_pretrained(
                folder, dtype=torch.float32, output_loading_info=True)
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
            loaded[checkpoint_id] = model.eval(), info, tokenizer
        return loaded[checkpoint_id]

    return load


@pytest.mark.parametrize("checkpoint_id", TINY_IDS)
def test_transformers_loads_every_weight_and_the_tokenizer(hf_loaded, checkpoint_id):
    model, info, tokenizer = hf_loaded(checkpoint_id)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info.get("mismatched_keys")
    entry = registry.get(checkpoint_id)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == entry.tied
    assert tokenizer.eos_token_id == entry.eos_token_id
    assert tokenizer("Hello world").input_ids == [9707, 1879]


def peakedness(model, tokenizer, entry):
    """Next-token statistics over every position of PROMPTS followed by 20 greedy tokens."""
    import torch

    rule = synthetic.designed_rule(entry)
    top1, gaps, spread, same, designed, main, positions, runs = [], [], [], 0, 0, 0, 0, []
    with torch.no_grad():
        for text in PROMPTS:
            ids = tokenizer(text, return_tensors="pt").input_ids
            full = model.generate(ids, max_new_tokens=20, do_sample=False,
                                  attention_mask=torch.ones_like(ids))
            runs.append(full[0, ids.shape[1]:].tolist())
            logits = model(full).logits[0]  # (T, vocab)
            best = torch.topk(logits, 2, dim=-1)
            top1 += torch.softmax(logits, -1).max(-1).values.tolist()
            gaps += (best.values[:, 0] - best.values[:, 1]).tolist()
            # ... and in units of the logits' spread over the vocabulary.
            spread += ((best.values[:, 0] - best.values[:, 1]) / logits.std(-1)).tolist()
            tokens = full[0].tolist()
            same += int((best.indices[:, 0] == full[0]).sum())
            for i in range(len(tokens)):
                designed += rule.next(tokens[:i + 1]) == int(best.indices[i, 0])
                main += rule.main_fires(tokens[:i + 1])
            positions += len(tokens)
    return {"top1": float(np.median(top1)), "gap": float(np.median(gaps)),
            "min_gap": float(np.min(gaps)), "spread_gap": float(np.median(spread)),
            "same_rate": same / positions, "designed_rate": designed / positions,
            "main_rate": main / positions, "runs": runs}


def assert_peaked_not_degenerate(model, tokenizer, entry):
    stats = peakedness(model, tokenizer, entry)
    # Peaked (random weights give a median top-1 ~0.6 and a gap ~0.2 std), not one-hot.
    assert 0.8 <= stats["top1"] < 0.995, stats
    assert stats["spread_gap"] > 8, stats
    assert stats["min_gap"] > 4, stats  # a clear winner at EVERY position: rounding can't flip it
    assert stats["designed_rate"] == 1.0, stats  # the circuit decides every token
    assert stats["main_rate"] > 0.4, stats  # mostly through attention (two positions back)
    assert stats["same_rate"] < 0.02, stats  # not the tied model's "predict the input" point
    for run in stats["runs"]:
        assert len(set(run)) >= 15, stats  # greedy text is no constant or short loop


@pytest.mark.parametrize("checkpoint_id", [
    "kipp-synthetic/qwen3-tiny",
    pytest.param("kipp-synthetic/qwen3-tiny-untied", marks=pytest.mark.slow)])  # CI: longest
def test_next_token_distributions_are_peaked_not_degenerate(hf_loaded, checkpoint_id):
    model, _, tokenizer = hf_loaded(checkpoint_id)
    assert_peaked_not_degenerate(model, tokenizer, registry.get(checkpoint_id))


@pytest.mark.slow
def test_the_0_6b_shape_checkpoint(tmp_path):
    pytest.importorskip("transformers")
    entry = registry.get("kipp-synthetic/qwen3-0.6b-shape")
    folder = synthetic.synthesize(entry.id, tmp_path, progress=False)
    assert registry.config_mismatches(entry, read_json(folder / "config.json")) == []
    size = (folder / "model.safetensors").stat().st_size
    assert 2 * entry.parameter_count < size < 2 * entry.parameter_count + 100_000
    import torch
    import transformers

    model = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert_peaked_not_degenerate(model.eval(), tokenizer, entry)


# The attention faults of issue 14, each of which a greedy-token test must be able to see.
ATTENTION_FAULTS = ["attention-output-zeroed", "attention-sees-position-0-only",
                    "rope-query-shifted-by-one", "rope-reversed",
                    "causal-mask-sees-next", "causal-mask-excludes-self", "decode-kv-not-stored",
                    "block-table-off-by-one-at-boundary", "attention-scale-1.1"]


@pytest.fixture(scope="module")
def designed_runs(models):
    from kipp import gates

    model = models("kipp-synthetic/qwen3-tiny")
    prompts = gates.designed_prompts(model.entry)
    rule = synthetic.designed_rule(model.entry)
    return model, prompts, [rule.continuation(p, gates.DESIGNED_STEPS) for p in prompts]


def test_the_reference_follows_the_designed_rule(designed_runs):
    from kipp import gates

    model, _, _ = designed_runs
    result = gates.gate_designed(model)  # the rule's continuation of every designed prompt
    assert result.passed and result.metric == 0.0, result.detail


@pytest.mark.parametrize("name", ATTENTION_FAULTS)
def test_each_attention_fault_changes_greedy_output(designed_runs, monkeypatch, name):
    """Planted in the reference backend, each fault changes the greedy tokens of at least 6
    of the 8 fixed prompts (gates.designed_prompts) within 12 tokens."""
    import faults
    from kipp import gates

    model, prompts, expected = designed_runs
    faults.get(name).plant(monkeypatch)
    got = gates.greedy_tokens(model, prompts, gates.DESIGNED_STEPS, expected)
    changed = [g != e for g, e in zip(got, expected)]
    assert sum(changed) >= 6, (name, changed)
