"""kipp.synthetic: deterministic synthetic checkpoints in the real Qwen3 Hugging Face layout."""

import json
import os
import subprocess
import sys

import ml_dtypes  # noqa: F401  (registers numpy's 'bfloat16' name for safe_open)
import numpy as np
import pytest
from safetensors import safe_open

from kipp import registry, synthetic
from kipp.errors import RegistryError
from kipp.tokenizer_files import tokenizer_json_bytes

TINY_IDS = ["kipp-synthetic/qwen3-tiny", "kipp-synthetic/qwen3-tiny-base",
            "kipp-synthetic/qwen3-tiny-untied"]
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
    # Drawn alone, a random projection and a memory tensor (which reads the embedding's
    # streams) equal the file's copies; another seed gives other bytes.
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
    packaged = synthetic.__file__.replace("synthetic.py", "data/qwen3-tokenizer/"
                                          "tokenizer_config.json")
    assert (folder / "tokenizer_config.json").read_bytes() == open(packaged, "rb").read()
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


def test_weight_statistics_follow_the_init_scales(tiny_dir):
    entry = registry.get("kipp-synthetic/qwen3-tiny")
    scales = synthetic.init_scales(entry)
    tensors, _ = weights(tiny_dir)
    f32 = {name: t.astype(np.float32) for name, t in tensors.items()}
    assert f32["model.layers.0.mlp.up_proj.weight"].std() == pytest.approx(scales.projection,
                                                                           rel=0.02)
    assert f32["model.layers.1.self_attn.o_proj.weight"].std() == pytest.approx(
        scales.residual_projection, rel=0.02)
    assert scales.residual_projection == pytest.approx(scales.projection / 2)  # 1/sqrt(2*2)
    embed = f32["model.embed_tokens.weight"]
    assert not embed[synthetic.FIRST_PADDING_ID:].any()  # padding rows never win an argmax
    live = synthetic.live_token_ids(entry)
    assert embed[live].std() == pytest.approx(scales.embedding, rel=0.02)
    others = np.ones(synthetic.FIRST_PADDING_ID, bool)
    others[live] = False
    expected = scales.embedding * np.hypot(synthetic.NONLIVE_SCALE, synthetic.NONLIVE_NOISE)
    assert embed[:synthetic.FIRST_PADDING_ID][others].std() == pytest.approx(expected, rel=0.02)
    q_norm = f32["model.layers.0.self_attn.q_norm.weight"]
    gain = synthetic.QK_NORM_GAIN
    assert abs(q_norm.mean() - gain) < 0.05 * gain and 0.05 < q_norm.std() / gain < 0.2
    norm = f32["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean() - 1) < 0.05 and 0.05 < norm.std() < 0.2  # near 1, not all 1
    assert f32["model.norm.weight"].mean() == pytest.approx(scales.final_norm, rel=0.05)


def test_live_tokens_are_clean_text_in_one_successor_cycle():
    entry = registry.get("kipp-synthetic/qwen3-tiny")
    live = synthetic.live_token_ids(entry)
    assert len(live) == len(set(live.tolist())) == entry.intermediate
    vocab = {i: piece for piece, i in json.loads(tokenizer_json_bytes())["model"]["vocab"].items()}
    pieces = [vocab[i] for i in live.tolist()]
    assert all(synthetic._CLEAN_PIECE.fullmatch(p) for p in pieces)
    assert {"Ġthe", "Ġand", "Ċ", "."} <= set(pieces)  # the most common text pieces
    assert live.max() < registry.ENDOFTEXT_ID  # never a special token, so never an early stop
    pi = synthetic.successor(entry)
    seen, i = [], 0
    for _ in range(len(pi)):
        seen.append(i)
        i = pi[i]
    assert i == 0 and sorted(seen) == list(range(len(pi)))  # one cycle through all of them
    prediction = synthetic.memory_prediction(entry)
    assert np.array_equal(prediction[live], live[pi])
    assert set(prediction.tolist()) == set(live.tolist())


@pytest.mark.parametrize("checkpoint_id", ["kipp-synthetic/qwen3-tiny",
                                           "kipp-synthetic/qwen3-tiny-untied"])
def test_the_last_mlp_is_the_successor_memory(synthetic_dir, checkpoint_id):
    entry = registry.get(checkpoint_id)
    tensors, _ = weights(synthetic_dir(checkpoint_id))
    f32 = {name: t.astype(np.float32) for name, t in tensors.items()}
    mlp = f"model.layers.{entry.layers - 1}.mlp."
    live = synthetic.live_token_ids(entry)
    keys = f32["model.embed_tokens.weight"][live]
    out = f32["model.embed_tokens.weight" if entry.tied else "lm_head.weight"][live]

    def cosines(a, b):
        return np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)

    assert cosines(f32[mlp + "gate_proj.weight"], keys).min() > 0.99
    assert cosines(f32[mlp + "up_proj.weight"], keys).min() > 0.99
    values = out[synthetic.successor(entry)]
    assert cosines(f32[mlp + "down_proj.weight"].T, values).min() > 0.99


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
    code = ("import sys; from kipp.synthetic import synthesize; "
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
    """Next-token statistics over PROMPTS, and 20-token greedy runs from each prompt."""
    import torch

    top1, gaps, same, designed, positions, runs = [], [], 0, 0, 0, []
    prediction = torch.as_tensor(synthetic.memory_prediction(entry))
    with torch.no_grad():
        for text in PROMPTS:
            ids = tokenizer(text, return_tensors="pt").input_ids
            logits = model(ids).logits[0]  # (T, vocab)
            best = torch.topk(logits, 2, dim=-1)
            top1 += torch.softmax(logits, -1).max(-1).values.tolist()
            # The top-1/top-2 gap in units of the logits' spread over the vocabulary.
            gaps += ((best.values[:, 0] - best.values[:, 1]) / logits.std(-1)).tolist()
            same += int((best.indices[:, 0] == ids[0]).sum())
            designed += int((best.indices[:, 0] == prediction[ids[0]]).sum())
            positions += ids.shape[1]
            greedy = model.generate(ids, max_new_tokens=20, do_sample=False,
                                    attention_mask=torch.ones_like(ids))[0, ids.shape[1]:]
            runs.append(greedy.tolist())
    return {"top1": float(np.median(top1)), "gap": float(np.median(gaps)),
            "min_gap": float(np.min(gaps)), "same_rate": same / positions,
            "designed_rate": designed / positions, "runs": runs}


def assert_peaked_not_degenerate(model, tokenizer, entry):
    stats = peakedness(model, tokenizer, entry)
    # Peaked (random weights give a median top-1 ~0.6 and a gap ~0.2 std), not one-hot.
    assert 0.8 <= stats["top1"] < 0.99, stats
    assert stats["gap"] > 8, stats
    assert stats["min_gap"] > 4, stats  # a clear winner at EVERY position: rounding can't flip it
    assert stats["designed_rate"] >= 0.98, stats  # the successor table, attention rarely overrules
    assert stats["same_rate"] < 0.02, stats  # not the tied model's "predict the input" point
    for run in stats["runs"]:
        assert len(set(run)) >= 15, stats  # greedy text is no constant or short loop


@pytest.mark.parametrize("checkpoint_id", ["kipp-synthetic/qwen3-tiny",
                                           "kipp-synthetic/qwen3-tiny-untied"])
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
