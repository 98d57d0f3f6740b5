"""Synthetic checkpoints: seeded weights in a real Qwen3 Hugging Face folder.

The registry's `kipp-synthetic/...` entries let Kipp be built and tested without downloading
weights. This module writes them from their seed: config.json, generation_config.json, BF16
safetensors (single file or sharded with an index), the upstream tokenizer files and a README;
`transformers` loads the folder as it would a real Qwen3 repo. Only numpy, ml_dtypes and
safetensors are used. Every tensor is a function of the seed and of random streams named after
tensors, so output is byte-identical for a seed whatever the order or sharding of the writes.

Why not plain random weights: their top two logits lie ~0.2 std apart, so rounding flips the
argmax, and greedy-token checks mean something only if a bug in attention, RoPE or the KV cache
changes the tokens. The weights implement a circuit instead (kipp.synthetic.rule says what it
computes, kipp.synthetic.circuit how), with the winner's logit well clear of the rest;
`designed_rule(entry)` gives the designed greedy tokens.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from kipp.errors import RegistryError
from kipp.formats import registry
from kipp.formats.hf_source import INDEX_FILE, SINGLE_WEIGHTS_FILE
from kipp.formats.registry import HEAD_DIM, VOCAB_SIZE, Checkpoint
from kipp.synthetic import circuit, rule
from kipp.synthetic.circuit import FIRST_PADDING_ID  # noqa: F401  (tests read it here)
from kipp.synthetic.rule import live_token_ids, successor  # noqa: F401  (callers import them here)
from kipp.text.tokenizer_files import tokenizer_config, tokenizer_json_bytes

GENERATOR_VERSION = "synthetic-v6"  # bump when output bytes change; revisions name it
TRANSFORMERS_VERSION = "4.51.0"  # what upstream Qwen3 config files record
_EMBEDDING = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"
_CHUNK = 1 << 22  # elements drawn at a time, so no tensor is ever held in float32 whole
_PROGRESS_BYTES = 256 << 20  # show a progress bar for checkpoints larger than this


def designed_rule(entry: Checkpoint) -> rule.Rule:
    """The designed greedy rule of a synthetic entry: `.next(tokens)`, `.continuation(tokens,
    n)`, `.main_fires(tokens)` (see kipp.synthetic.rule)."""
    return rule.rule(entry)


def _token_matrix(entry: Checkpoint, name: str) -> np.ndarray:
    """The embedding or lm_head in BF16, built a chunk of rows at a time."""
    out = np.empty((VOCAB_SIZE, entry.hidden), dtype=ml_dtypes.bfloat16)
    step = max(1, _CHUNK // entry.hidden)  # rows per chunk: float32 exists only per chunk
    for start in range(0, VOCAB_SIZE, step):
        stop = min(VOCAB_SIZE, start + step)
        out[start:stop] = circuit.token_rows(entry, name, start, stop).astype(ml_dtypes.bfloat16)
    return out


def synthetic_entry(checkpoint_id: str) -> Checkpoint:
    """The registry entry of a synthetic checkpoint; any other id is a RegistryError."""
    if not checkpoint_id.startswith(registry.SYNTHETIC_PREFIX):
        raise RegistryError(
            f"{checkpoint_id!r} is not a synthetic checkpoint: only ids starting with "
            f"{registry.SYNTHETIC_PREFIX!r} are generated; download hub checkpoints instead"
        )
    entry = registry.get(checkpoint_id)
    expected = f"{GENERATOR_VERSION}-seed-{entry.synthetic.seed}"
    if entry.synthetic.disagree:  # a draft: its agreement dial is part of what made the bytes
        expected += f"-agree-{round(100 * (1 - entry.synthetic.disagree))}"
    if entry.revision != expected:
        # The revision names what produced the bytes; a mismatch means stale registry data.
        raise RegistryError(
            f"{checkpoint_id}: revision {entry.revision!r} does not name this generator "
            f"and seed ({expected!r})"
        )
    return entry


def config_json(entry: Checkpoint) -> dict:
    """config.json as upstream Qwen3 repos write it: the registry fields plus the rest."""
    config = entry.hf_config()
    config.update(
        bos_token_id=registry.ENDOFTEXT_ID,
        attention_dropout=0.0,
        initializer_range=0.02,  # upstream's value; transformers uses it only for absent weights
        max_window_layers=entry.layers,
        rope_scaling=None,
        sliding_window=None,
        use_cache=True,
        use_sliding_window=False,
        transformers_version=TRANSFORMERS_VERSION,
    )
    if float(config["rope_theta"]).is_integer():
        config["rope_theta"] = int(config["rope_theta"])  # upstream writes 1000000, not 1e6
    return config


def generation_config_json(entry: Checkpoint) -> dict:
    """generation_config.json as upstream: sampling defaults for chat, plain stop for base."""
    if entry.variant == "base":
        config = {"bos_token_id": registry.ENDOFTEXT_ID, "do_sample": False,
                  "eos_token_id": registry.ENDOFTEXT_ID, "max_new_tokens": 2048}
    else:
        config = {"bos_token_id": registry.ENDOFTEXT_ID, "do_sample": True,
                  "eos_token_id": list(entry.stop_token_ids),
                  "pad_token_id": registry.ENDOFTEXT_ID,
                  "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    config["transformers_version"] = TRANSFORMERS_VERSION
    return config


def tensor_specs(entry: Checkpoint) -> list[tuple[str, tuple[int, ...], str]]:
    """(Hugging Face name, shape, kind) of every weight, in state-dict order."""
    h, aw, kv, ff = entry.hidden, entry.attention_width, entry.kv_width, entry.intermediate
    specs = [(_EMBEDDING, (VOCAB_SIZE, h), "embedding")]
    for n in range(entry.layers):
        p = f"model.layers.{n}."
        specs += [
            (p + "self_attn.q_proj.weight", (aw, h), "q"),
            (p + "self_attn.k_proj.weight", (kv, h), "k"),
            (p + "self_attn.v_proj.weight", (kv, h), "v"),
            (p + "self_attn.o_proj.weight", (h, aw), "o"),
            (p + "self_attn.q_norm.weight", (HEAD_DIM,), "qk_norm"),
            (p + "self_attn.k_norm.weight", (HEAD_DIM,), "qk_norm"),
            (p + "mlp.gate_proj.weight", (ff, h), "gate"),
            (p + "mlp.up_proj.weight", (ff, h), "up"),
            (p + "mlp.down_proj.weight", (h, ff), "down"),
            (p + "input_layernorm.weight", (h,), "norm"),
            (p + "post_attention_layernorm.weight", (h,), "norm"),
        ]
    specs.append(("model.norm.weight", (h,), "final_norm"))
    if not entry.tied:
        specs.append((_LM_HEAD, (VOCAB_SIZE, h), "lm_head"))
    return specs


def make_tensor(entry: Checkpoint, name: str, shape, kind: str) -> np.ndarray:
    """One weight in BF16, from the (seed, name) stream and the named streams it reads."""
    if kind in ("embedding", "lm_head"):
        out = _token_matrix(entry, name)
    elif kind in ("norm", "qk_norm", "final_norm"):
        out = circuit.norm_weights(entry, name, kind)
    elif kind in ("q", "k", "v", "o"):
        out = circuit.attention_tensor(entry, name, tuple(shape), kind)
    elif kind in ("gate", "up", "down"):
        out = circuit.mlp_tensor(entry, name, tuple(shape), kind)
    else:
        raise ValueError(f"unknown tensor kind {kind!r}")
    out = out.astype(ml_dtypes.bfloat16)
    assert out.shape == tuple(shape), (name, out.shape, shape)
    return out


def _nbytes(shape) -> int:
    return 2 * math.prod(shape)


def shard_plan(entry: Checkpoint) -> list[tuple[str, list[tuple[str, tuple, str]]]]:
    """(file name, specs) per safetensors file: contiguous groups of about equal bytes."""
    specs = tensor_specs(entry)
    count = entry.synthetic.shards
    if count == 1:
        return [(SINGLE_WEIGHTS_FILE, specs)]
    total = sum(_nbytes(shape) for _, shape, _ in specs)
    groups: list[list] = [[] for _ in range(count)]
    done = 0
    for spec in specs:
        # Start the next shard once this one holds its share (never leave a later one empty).
        k = min(count - 1, done * count // total)
        groups[k].append(spec)
        done += _nbytes(spec[1])
    if any(not g for g in groups):
        raise RegistryError(f"{entry.id}: {count} shards is more than its tensors can fill")
    return [(f"model-{k + 1:05d}-of-{count:05d}.safetensors", g) for k, g in enumerate(groups)]


def weight_index(entry: Checkpoint) -> dict:
    """model.safetensors.index.json for a sharded layout, as transformers writes it."""
    plan = shard_plan(entry)
    total = sum(_nbytes(shape) for _, specs in plan for _, shape, _ in specs)
    weight_map = {name: file for file, specs in plan for name, _, _ in specs}
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def _write_json(path: Path, obj: dict, end: str = "\n", **dump_args) -> None:
    path.write_text(json.dumps(obj, **dump_args) + end, encoding="utf-8")


def _write_weights(entry: Checkpoint, out: Path, progress: bool | None) -> None:
    plan = shard_plan(entry)
    total = sum(_nbytes(shape) for _, specs in plan for _, shape, _ in specs)
    show = total > _PROGRESS_BYTES if progress is None else progress
    with tqdm(total=total, unit="B", unit_scale=True, disable=not show,
              desc=f"synthesizing {entry.id}") as bar:
        for file, specs in plan:
            tensors = {}  # one file's BF16 tensors; float32 exists only per chunk
            for name, shape, kind in specs:
                tensors[name] = make_tensor(entry, name, shape, kind)
                bar.update(_nbytes(shape))
            save_file(tensors, out / file, metadata={"format": "pt"})  # as torch-saved files
            # safetensors creates files 0600; give them the mode config.json (written first) got.
            shutil.copymode(out / "config.json", out / file)
            del tensors
    if len(plan) > 1:
        _write_json(out / INDEX_FILE, weight_index(entry), indent=2, sort_keys=True)


def _vocab_and_merges(tokenizer_json: bytes) -> tuple[str, str]:
    """vocab.json and merges.txt text, as Qwen2Tokenizer's slow files carry them."""
    model = json.loads(tokenizer_json)["model"]
    vocab = json.dumps(model["vocab"], ensure_ascii=False, separators=(",", ":"))
    # tokenizers >= 0.20 stores merges as pairs; older files as "a b" strings.
    lines = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return vocab, "#version: 0.2\n" + "\n".join(lines) + "\n"


def _write_tokenizer(entry: Checkpoint, out: Path) -> None:
    raw = tokenizer_json_bytes()
    (out / "tokenizer.json").write_bytes(raw)
    # indent=2 and no trailing newline reproduces the upstream file byte for byte.
    _write_json(out / "tokenizer_config.json", tokenizer_config(entry.variant), end="",
                indent=2, ensure_ascii=False)
    vocab, merges = _vocab_and_merges(raw)
    (out / "vocab.json").write_text(vocab, encoding="utf-8")
    (out / "merges.txt").write_text(merges, encoding="utf-8")


def readme(entry: Checkpoint) -> str:
    """A short model card saying the weights are synthetic and how they were made."""
    s = circuit.scales(entry)
    return (
        f"# {entry.id}\n\n"
        "**Synthetic weights.** Seeded numbers in the Qwen3 architecture and the Hugging Face "
        "file layout, made by Kipp for tests and benchmarks. Not a trained model: its text is "
        "meaningless, but its next-token distributions are peaked like a trained model's, and "
        "its greedy output depends on the context through attention.\n\n"
        f"- generator: `kipp.synthetic.writer` {GENERATOR_VERSION}, seed {entry.synthetic.seed} "
        f"(revision `{entry.revision}`)\n"
        f"- shapes: hidden {entry.hidden}, intermediate {entry.intermediate}, layers "
        f"{entry.layers}, query heads {entry.query_heads}, 8 KV heads, head_dim 128, "
        f"{'tied' if entry.tied else 'untied'} output head\n"
        f"- designed greedy rule: {rule.N_LIVE} live tokens (frequent words and "
        "punctuation) in one successor cycle; the next token is the successor of the token "
        "two positions back when that one is live and differs from the previous one, else "
        "the successor of the current token (or its cluster's pick). The first layer's "
        "positional heads and MLP measure the attention softmax's temperature, the last "
        "layer's head and MLP fetch two positions back and decide (kipp/synthetic/circuit.py)\n"
        f"- random heads and units: q/k/v/gate/up N(0, {s.projection}), o N(0, "
        f"{s.attention_write:.4g}) and down N(0, {s.mlp_write:.4g}) into dimensions no "
        "designed logit reads; RMSNorm "
        f"weights 1 + N(0, {circuit.NORM_NOISE}) on token dimensions; BF16\n"
        f"- regenerate: `kipp synthesize {entry.id} --out DIR`\n\n"
        "The tokenizer files are the upstream Qwen3 tokenizer (Apache-2.0, Qwen team).\n"
    )


def _check_out_dir(out_dir) -> Path:
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        # A stale shard or index from another layout would be picked up by loaders.
        raise FileExistsError(f"{out} is not an empty folder; synthesize into a new or empty one")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def synthesize(checkpoint_id: str, out_dir, *, progress: bool | None = None) -> Path:
    """Write the Hugging Face folder of synthetic checkpoint `checkpoint_id` as `out_dir`.

    `out_dir` must be empty or absent. The same registry entry always gives byte-identical
    files. The folder appears complete or not at all (written beside it, then renamed), so a
    folder holding config.json is a finished one. `progress` shows a tqdm bar (default: only
    for checkpoints over 256 MB).

    >>> folder = synthesize("kipp-synthetic/qwen3-tiny", "/tmp/qwen3-tiny")  # doctest: +SKIP
    """
    entry = synthetic_entry(checkpoint_id)
    out = _check_out_dir(out_dir)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        _write_folder(entry, partial, progress)
        os.replace(partial, out)  # replaces an empty folder atomically on POSIX
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _write_folder(entry: Checkpoint, out: Path, progress: bool | None) -> None:
    _write_json(out / "config.json", config_json(entry), indent=2, sort_keys=True)
    _write_json(out / "generation_config.json", generation_config_json(entry), indent=2,
                sort_keys=True)
    _write_tokenizer(entry, out)
    (out / "README.md").write_text(readme(entry), encoding="utf-8")
    _write_weights(entry, out, progress)


def layout_files(checkpoint_id: str) -> Iterator[str]:
    """Every file name `synthesize` writes for `checkpoint_id`."""
    entry = synthetic_entry(checkpoint_id)
    yield from ("config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "vocab.json", "merges.txt", "README.md")
    plan = shard_plan(entry)
    yield from (file for file, _ in plan)
    if len(plan) > 1:
        yield INDEX_FILE
