"""Registry cross-checks: family invariants, derived facts, lookups."""

import pytest

from kipp.errors import RegistryError
from kipp.formats import registry


def test_family_invariants_hold_for_every_entry():
    assert len(registry.REGISTRY) >= 13
    for entry in registry.REGISTRY.values():
        config = entry.hf_config()
        assert config["vocab_size"] == 151_936
        assert config["head_dim"] == 128
        assert config["num_key_value_heads"] == 8
        assert config["rms_norm_eps"] == 1e-6
        assert config["hidden_act"] == "silu"
        assert config["attention_bias"] is False
        assert config["torch_dtype"] == "bfloat16"
        assert entry.query_heads % 8 == 0
        assert entry.hidden % 32 == 0 and entry.intermediate % 32 == 0
        assert entry.attention_width == entry.query_heads * 128


@pytest.mark.parametrize("checkpoint_id,expected", [
    ("Qwen/Qwen3-4B", 147_456),
    ("Qwen/Qwen3-8B", 147_456),
    ("Qwen/Qwen3-0.6B", 114_688),
    ("Qwen/Qwen3-1.7B-Base", 114_688),
    ("Qwen/Qwen3-32B", 262_144),
])
def test_kv_bytes_per_token(checkpoint_id, expected):
    entry = registry.get(checkpoint_id)
    assert entry.kv_bytes_per_token == expected == entry.layers * 4096


def test_attention_width_differs_from_hidden_where_it_should():
    assert registry.get("Qwen/Qwen3-0.6B").attention_width == 2048
    assert registry.get("Qwen/Qwen3-0.6B").hidden == 1024
    assert registry.get("Qwen/Qwen3-32B").attention_width == 8192
    # REGISTRY-FACTS names 0.6B and 32B; 32 heads x 128 = 4096 at hidden 2560 makes 4B a third.
    assert registry.get("Qwen/Qwen3-4B").attention_width == 4096
    for same in ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-8B", "Qwen/Qwen3-14B"):
        assert registry.get(same).attention_width == registry.get(same).hidden


def test_pinned_revisions_and_variants():
    for entry in registry.REGISTRY.values():
        if entry.is_synthetic:
            continue
        assert len(entry.revision) == 40
        assert entry.variant == ("base" if entry.id.endswith("-Base") else
                                 "thinking" if "Thinking" in entry.id else "instruct")
    assert "Qwen/Qwen3-32B-Base" not in registry.REGISTRY
    assert registry.get("Qwen/Qwen3-0.6B").revision == "c1899de289a04d12100db370d81485cdf75e47ca"


def test_stop_tokens_by_variant():
    assert registry.get("Qwen/Qwen3-4B").stop_token_ids == (151645, 151643)
    assert registry.get("Qwen/Qwen3-4B").eos_token_id == 151645
    assert registry.get("Qwen/Qwen3-4B-Base").stop_token_ids == (151643,)
    assert not registry.get("Qwen/Qwen3-4B-Base").has_chat_template


def test_synthetic_entries_cover_what_tests_need():
    tiny = registry.get("kipp-synthetic/qwen3-tiny")
    assert (tiny.layers, tiny.hidden, tiny.tied, tiny.variant) == (2, 256, True, "instruct")
    untied = registry.get("kipp-synthetic/qwen3-tiny-untied")
    assert not untied.tied and untied.attention_width != untied.hidden
    assert untied.synthetic.shards > 1
    shape = registry.get("kipp-synthetic/qwen3-0.6b-shape")
    real = registry.get("Qwen/Qwen3-0.6B")
    for field in ("hidden", "intermediate", "layers", "query_heads", "tied", "context_length"):
        assert getattr(shape, field) == getattr(real, field)
    assert registry.get("kipp-synthetic/qwen3-tiny-base").variant == "base"


def test_unknown_checkpoint_is_a_clear_rejection():
    with pytest.raises(RegistryError, match="not in Kipp's checkpoint registry"):
        registry.get("Qwen/Qwen3-30B-A3B")
    with pytest.raises(RegistryError, match="pinned to revision"):
        registry.find("Qwen/Qwen3-0.6B", "main")


def test_bad_entries_are_refused_at_construction():
    with pytest.raises(RegistryError, match="not a multiple of 8 KV heads"):
        registry.Checkpoint("Qwen/X", "0" * 40, "base", 1024, 3072, 28, 12, 4096, 1e6, True)
    with pytest.raises(RegistryError, match="not a 40-hex commit"):
        registry.Checkpoint("Qwen/X", "main", "base", 1024, 3072, 28, 16, 4096, 1e6, True)
    with pytest.raises(RegistryError, match="not a multiple of 32"):
        registry.Checkpoint("Qwen/X", "0" * 40, "base", 1000, 3072, 28, 16, 4096, 1e6, True)


def test_config_mismatches_name_each_field():
    entry = registry.get("Qwen/Qwen3-0.6B")
    config = entry.hf_config()
    assert registry.config_mismatches(entry, config) == []
    config = dict(config, hidden_size=2048, tie_word_embeddings=False)
    config["dtype"] = config.pop("torch_dtype")
    assert registry.config_mismatches(entry, config) == [
        ("hidden_size", 1024, 2048), ("tie_word_embeddings", True, False)]
    assert ("rope_theta", 1e6, "<missing>") in registry.config_mismatches(
        entry, {k: v for k, v in entry.hf_config().items() if k != "rope_theta"})
