"""Synthetic checkpoints: seeded weights in a real Qwen3 Hugging Face folder.

Kipp is developed where model weights cannot be downloaded, so the registry carries a few
`kipp-synthetic/...` entries that this module writes from their seed: config.json,
generation_config.json, BF16 safetensors (single file or sharded with an index), the upstream
tokenizer files and a README. `transformers` loads the folder as it would a real Qwen3 repo.

Only numpy, ml_dtypes and safetensors are used (no torch). Every tensor is a function of the
seed and of random streams named after tensors ((seed, name) -> stream), so output is
byte-identical for a seed whatever the order or sharding of the writes.

Why not plain random weights. The correctness gates compare argmax between implementations
that differ only by rounding (BF16 K/V, q8_0 weights). With i.i.d. random weights the final
hidden state points nowhere in particular, the ~150k logits are near-i.i.d. Gaussian and the
top two lie ~0.2 logit std apart: rounding flips the argmax at a few % of positions and
greedy runs diverge within a few tokens. Trained models are peaked because the final hidden
state lines up with ONE output row. These weights are built to do that, as a successor table:

- Live tokens (`live_token_ids`): one per MLP unit, the most frequent clean text pieces
  (space-prefixed ASCII words, ASCII punctuation, newline). Their embedding rows (and untied
  lm_head rows) are N(0, embedding^2). Every other row is NONLIVE_SCALE times the row of a
  live token, its cluster's, plus a little noise: as an input it reads as that live token, as
  an output it stays far below the live one. Padding rows are zero.
- Memory: the last layer's MLP is a key -> value memory (`_memory_tensor`). Unit i's gate and
  up rows are live token i's embedding direction (the key), its down column is the output row
  of i's successor pi(i) (the value). The RMS-normalised residual of live token i matches key
  i at ~sqrt(hidden) and every other key at ~N(0, 1); SiLU(gate) * up squares that contrast,
  so the memory writes pi(i)'s output row, MEMORY_GAIN times the input's own row (which a tied
  head would otherwise predict). pi is one random cycle through all live tokens: greedy text
  walks it, so it is varied, never the input token, never a special token (so never an early
  stop) and readable-ish. `memory_prediction` is the designed argmax of every token.
- Every other weight is random: q/k/v/gate/up N(0, init_std^2) and o/down N(0, init_std^2 /
  (2 * layers)), GPT-2's residual scaling, so depth does not change the mix. The embedding is
  sized so that all those random writes add up to RESIDUAL_NOISE of a live row, and q/k
  RMSNorm weights average QK_NORM_GAIN so attention is sharp, as in trained models: each head
  reads a few positions, so the context's share of the residual is about the same at every
  position (with diffuse attention the first positions, averaging few values, got far larger
  writes than later ones and lost their margin). Attention thus moves every logit, so
  attention, RoPE or cache bugs still show far above the gates' NMSE bounds, but it does not
  move the argmax: greedy output depends on the last token only, like a bigram model.
- The final RMSNorm carries the gain that puts the successor's logit at SUCCESSOR_LOGIT over
  the ~0 of the rest of the vocabulary: median top-1 probability ~0.9, peaked, not one-hot.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tqdm.auto import tqdm

from kipp import registry
from kipp.errors import RegistryError
from kipp.registry import ENDOFTEXT_ID, HEAD_DIM, VOCAB_SIZE, Checkpoint
from kipp.tokenizer_files import tokenizer_config, tokenizer_json_bytes

GENERATOR_VERSION = "synthetic-v2"  # bump when output bytes change; revisions name it
# The successor construction (module docstring). Measured on the tiny entries, these give a
# median top-1 probability ~0.9 and a top-1/top-2 gap >= 11 logit stds at every position.
RESIDUAL_NOISE = 0.5  # RMS of all random layers' writes / RMS of a live embedding row
NONLIVE_SCALE = 0.4  # a non-live row is this times its cluster's live row ...
NONLIVE_NOISE = 0.1  # ... plus noise of its own, this times the embedding std
MEMORY_SHARPNESS = 0.5  # memory gate rows are this times the key: SiLU near linear on a match
MEMORY_GAIN = 2.5  # RMS of the memory's write / RMS of a live embedding row: > 1 outvotes the input
SUCCESSOR_LOGIT = 15.0  # the successor's logit; the rest of the vocabulary sits near 0
QK_NORM_GAIN = 2.0  # mean q/k RMSNorm weight: scores ~ N(0, 4^2), sharp attention
ATTENTION_MIX = 0.7  # mean square of a sharp attention average of unit values (calibrated)
NORM_NOISE = 0.1  # RMSNorm weights are 1 + N(0, NORM_NOISE): near 1, yet each one matters
FIRST_PADDING_ID = 151_669  # embedding rows from here on are padding no text maps to
TRANSFORMERS_VERSION = "4.51.0"  # what upstream Qwen3 config files record
# Live-token pieces: a space-prefixed ASCII word, 1-2 ASCII punctuation marks, or a newline.
_CLEAN_PIECE = re.compile(r"Ġ[A-Za-z]+|Ġ?[!-/:-@\[-`{-~]{1,2}|Ċ")
_EMBEDDING = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"
_CHUNK = 1 << 22  # elements drawn at a time, so no tensor is ever held in float32 whole
_PROGRESS_BYTES = 256 << 20  # show a progress bar for checkpoints larger than this


@dataclass(frozen=True)
class InitScales:
    """The scales of one synthetic checkpoint's weights (the module docstring says why)."""

    projection: float  # q/k/v and gate/up of the random layers: the registry's init_std
    residual_projection: float  # o and down of the random layers: init_std / sqrt(2 * layers)
    embedding: float  # std of the live rows of the embedding (and of the untied lm_head)
    memory_down: float  # down column scale that makes the memory write MEMORY_GAIN embeddings
    norm_noise: float  # RMSNorm weights are 1 + N(0, norm_noise)
    final_norm: float  # mean of the final RMSNorm weights: sets the logit scale


@lru_cache(maxsize=None)
def _silu_square_mean(tau: float) -> float:
    """E[silu(g)^2] for g ~ N(0, tau^2), by Gauss-Hermite quadrature."""
    z, w = np.polynomial.hermite_e.hermegauss(64)
    g = tau * z
    return float(np.sum(w * (g / (1 + np.exp(-g))) ** 2) / math.sqrt(2 * math.pi))


def init_scales(entry: Checkpoint) -> InitScales:
    """The init scales of a synthetic entry, derived from its shapes and init_std."""
    d, layers = entry.hidden, entry.layers
    s = entry.synthetic.init_std
    s_out = s / math.sqrt(2 * layers)
    tau = s * math.sqrt(d)  # std of v, gate and up entries: their input is RMS-normalised
    # Mean squares of one random attention and one random MLP write, summed over the layers
    # (the last MLP is the memory), fix the embedding std that makes them RESIDUAL_NOISE of it.
    attention = entry.attention_width * s_out**2 * tau**2 * ATTENTION_MIX
    mlp = entry.intermediate * s_out**2 * tau**2 * _silu_square_mean(tau)
    embedding = math.sqrt(layers * attention + (layers - 1) * mlp) / RESIDUAL_NOISE
    # A live token's residual reaches the memory at cosine 1/sqrt(1 + RESIDUAL_NOISE^2) with
    # its key: that match z drives its unit to silu(a z) z, scaled here to MEMORY_GAIN rows.
    z = math.sqrt(d / (1 + RESIDUAL_NOISE**2))
    a = MEMORY_SHARPNESS * z
    memory_down = MEMORY_GAIN * embedding / (a / (1 + math.exp(-a)) * z)
    # The final hidden state is input + noise + memory; its successor logit is then
    # gain * embedding * MEMORY_GAIN * d / sqrt(1 + RESIDUAL_NOISE^2 + MEMORY_GAIN^2).
    spread = math.sqrt(1 + RESIDUAL_NOISE**2 + MEMORY_GAIN**2)
    final_norm = SUCCESSOR_LOGIT * spread / (d * embedding * MEMORY_GAIN)
    return InitScales(s, s_out, embedding, memory_down, NORM_NOISE, final_norm)


@lru_cache(maxsize=1)
def _clean_piece_ids() -> np.ndarray:
    vocab = json.loads(tokenizer_json_bytes())["model"]["vocab"]
    ids = np.array(sorted(i for piece, i in vocab.items()
                          if i < ENDOFTEXT_ID and _CLEAN_PIECE.fullmatch(piece)))
    ids.flags.writeable = False  # cached and shared
    return ids


def live_token_ids(entry: Checkpoint) -> np.ndarray:
    """The memory's tokens, one per MLP unit: the first `intermediate` clean pieces by id.

    BPE ids follow merge order, so these are the most frequent words and punctuation of
    English and code, and greedy text made of them stays readable.
    """
    clean = _clean_piece_ids()
    if len(clean) < entry.intermediate:
        raise RegistryError(f"{entry.id}: intermediate {entry.intermediate} exceeds the "
                            f"{len(clean)} clean vocabulary pieces a synthetic memory can use")
    return clean[:entry.intermediate]


def successor(entry: Checkpoint) -> np.ndarray:
    """pi, as indices into live_token_ids: one random cycle through every live token.

    One cycle (no fixed points, no short loops) keeps greedy text varied for as long as there
    are live tokens.
    """
    order = _rng(entry.synthetic.seed, "successor").permutation(entry.intermediate)
    pi = np.empty_like(order)
    pi[order] = np.roll(order, -1)
    return pi


def _live_rows(entry: Checkpoint, matrix: str) -> np.ndarray:
    """Float32 rows of the live tokens in token matrix `matrix` (embedding or lm_head)."""
    rng = _rng(entry.synthetic.seed, matrix + "/live")
    rows = rng.standard_normal((entry.intermediate, entry.hidden), dtype=np.float32)
    return rows * np.float32(init_scales(entry).embedding)


def _clusters(entry: Checkpoint, matrix: str) -> np.ndarray:
    """For every row of token matrix `matrix`, the live token (index) whose row it copies."""
    rng = _rng(entry.synthetic.seed, matrix + "/cluster")
    return rng.integers(0, entry.intermediate, VOCAB_SIZE)


def _token_matrix(entry: Checkpoint, name: str) -> np.ndarray:
    """The embedding or lm_head: live rows, scaled copies of them elsewhere, zero padding."""
    std = init_scales(entry).embedding
    live, cluster = _live_rows(entry, name), _clusters(entry, name)
    noise = _rng(entry.synthetic.seed, name)
    out = np.empty((VOCAB_SIZE, entry.hidden), dtype=ml_dtypes.bfloat16)
    step = max(1, _CHUNK // entry.hidden)  # rows per chunk: float32 exists only per chunk
    for start in range(0, VOCAB_SIZE, step):
        rows = noise.standard_normal((min(step, VOCAB_SIZE - start), entry.hidden),
                                     dtype=np.float32)
        rows *= np.float32(NONLIVE_NOISE * std)
        rows += np.float32(NONLIVE_SCALE) * live[cluster[start:start + len(rows)]]
        out[start:start + len(rows)] = rows.astype(ml_dtypes.bfloat16)
    out[live_token_ids(entry)] = live.astype(ml_dtypes.bfloat16)
    # Zero padding rows: their logit is 0, far below the top, so greedy output stays text.
    out[FIRST_PADDING_ID:] = 0
    return out


def memory_prediction(entry: Checkpoint) -> np.ndarray:
    """The token the memory writes after each non-padding token id (the designed argmax).

    A live token is followed by its successor; any other token reads as the live token its
    embedding row copies, so by that one's successor. Attention noise can overrule this only
    rarely (the tests measure how rarely).
    """
    live = live_token_ids(entry)
    unit = _clusters(entry, _EMBEDDING)
    unit[live] = np.arange(len(live))
    return live[successor(entry)[unit[:FIRST_PADDING_ID]]]


def _memory_tensor(entry: Checkpoint, kind: str) -> np.ndarray:
    """The last MLP as a key -> value memory: unit i maps live token i to its successor.

    Gate and up rows are both the unit key, so a unit's activation silu(a z) z grows as z^2
    with the match z = key . input: ~d/(1 + RESIDUAL_NOISE^2) for the key's own token, ~N(0, 1)
    for the others. The down column is the successor's output row (unit RMS) times the scale
    that makes a match write MEMORY_GAIN embedding rows.
    """
    keys = _live_rows(entry, _EMBEDDING)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    if kind == "memory_gate":
        return (MEMORY_SHARPNESS * keys).astype(ml_dtypes.bfloat16)
    if kind == "memory_up":
        return keys.astype(ml_dtypes.bfloat16)
    scales = init_scales(entry)
    values = _live_rows(entry, _EMBEDDING if entry.tied else _LM_HEAD)[successor(entry)]
    values *= np.float32(scales.memory_down / scales.embedding)
    return np.ascontiguousarray(values.T).astype(ml_dtypes.bfloat16)


def synthetic_entry(checkpoint_id: str) -> Checkpoint:
    """The registry entry of a synthetic checkpoint; any other id is a RegistryError."""
    if not checkpoint_id.startswith(registry.SYNTHETIC_PREFIX):
        raise RegistryError(
            f"{checkpoint_id!r} is not a synthetic checkpoint: only ids starting with "
            f"{registry.SYNTHETIC_PREFIX!r} are generated; download hub checkpoints instead"
        )
    entry = registry.get(checkpoint_id)
    expected = f"{GENERATOR_VERSION}-seed-{entry.synthetic.seed}"
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
        memory = n == entry.layers - 1  # the last MLP is the successor memory
        specs += [
            (p + "self_attn.q_proj.weight", (aw, h), "projection"),
            (p + "self_attn.k_proj.weight", (kv, h), "projection"),
            (p + "self_attn.v_proj.weight", (kv, h), "projection"),
            (p + "self_attn.o_proj.weight", (h, aw), "residual_projection"),
            (p + "self_attn.q_norm.weight", (HEAD_DIM,), "qk_norm"),
            (p + "self_attn.k_norm.weight", (HEAD_DIM,), "qk_norm"),
            (p + "mlp.gate_proj.weight", (ff, h), "memory_gate" if memory else "projection"),
            (p + "mlp.up_proj.weight", (ff, h), "memory_up" if memory else "projection"),
            (p + "mlp.down_proj.weight", (h, ff),
             "memory_down" if memory else "residual_projection"),
            (p + "input_layernorm.weight", (h,), "norm"),
            (p + "post_attention_layernorm.weight", (h,), "norm"),
        ]
    specs.append(("model.norm.weight", (h,), "final_norm"))
    if not entry.tied:
        specs.append((_LM_HEAD, (VOCAB_SIZE, h), "lm_head"))
    return specs


def _rng(seed: int, name: str) -> np.random.Generator:
    # A stable digest of the name (Python's hash() is salted per process) joins the seed.
    words = np.frombuffer(hashlib.sha256(name.encode()).digest()[:16], dtype="<u4")
    return np.random.default_rng(np.random.SeedSequence([seed, *words.tolist()]))


def _gaussian(entry: Checkpoint, name: str, shape, mean: float, std: float) -> np.ndarray:
    """N(mean, std^2) in BF16, drawn in float32 chunks from the (seed, name) stream."""
    rng = _rng(entry.synthetic.seed, name)
    out = np.empty(shape, dtype=ml_dtypes.bfloat16)
    flat = out.reshape(-1)
    for start in range(0, flat.size, _CHUNK):
        values = rng.standard_normal(min(_CHUNK, flat.size - start), dtype=np.float32)
        values *= std
        values += mean
        flat[start:start + values.size] = values.astype(ml_dtypes.bfloat16)
    return out


def make_tensor(entry: Checkpoint, name: str, shape, kind: str) -> np.ndarray:
    """One weight in BF16, from the (seed, name) stream and the named streams it reads."""
    scales = init_scales(entry)
    if kind in ("embedding", "lm_head"):
        out = _token_matrix(entry, name)
    elif kind.startswith("memory_"):
        out = _memory_tensor(entry, kind)
    elif kind == "norm":
        out = _gaussian(entry, name, shape, 1.0, scales.norm_noise)
    elif kind == "qk_norm":
        out = _gaussian(entry, name, shape, QK_NORM_GAIN, scales.norm_noise * QK_NORM_GAIN)
    elif kind == "final_norm":
        out = _gaussian(entry, name, shape, scales.final_norm,
                        scales.norm_noise * scales.final_norm)
    else:
        std = {"projection": scales.projection,
               "residual_projection": scales.residual_projection}[kind]
        out = _gaussian(entry, name, shape, 0.0, std)
    assert out.shape == tuple(shape), (name, out.shape, shape)
    return out


def _nbytes(shape) -> int:
    return 2 * math.prod(shape)


def shard_plan(entry: Checkpoint) -> list[tuple[str, list[tuple[str, tuple, str]]]]:
    """(file name, specs) per safetensors file: contiguous groups of about equal bytes."""
    specs = tensor_specs(entry)
    count = entry.synthetic.shards
    if count == 1:
        return [("model.safetensors", specs)]
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
        _write_json(out / "model.safetensors.index.json", weight_index(entry), indent=2,
                    sort_keys=True)


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
    s = init_scales(entry)
    head = "embedding" if entry.tied else "embedding and lm_head"
    return (
        f"# {entry.id}\n\n"
        "**Synthetic weights.** Seeded numbers in the Qwen3 architecture and the Hugging Face "
        "file layout, made by Kipp for tests and benchmarks. Not a trained model: its text is "
        "meaningless, but its next-token distributions are peaked like a trained model's.\n\n"
        f"- generator: `kipp.synthetic` {GENERATOR_VERSION}, seed {entry.synthetic.seed} "
        f"(revision `{entry.revision}`)\n"
        f"- shapes: hidden {entry.hidden}, intermediate {entry.intermediate}, layers "
        f"{entry.layers}, query heads {entry.query_heads}, 8 KV heads, head_dim 128, "
        f"{'tied' if entry.tied else 'untied'} output head\n"
        f"- successor table: {entry.intermediate} live tokens (frequent clean text pieces) have "
        f"{head} rows N(0, {s.embedding:.4g}); other rows are {NONLIVE_SCALE} times a live "
        f"row plus noise; padding rows from {FIRST_PADDING_ID} are zero. The last layer's MLP "
        "maps each live token (its gate/up rows) to a successor's row (its down column), one "
        "random cycle through all live tokens\n"
        f"- random layers: q/k/v/gate/up N(0, {s.projection}), o/down "
        f"N(0, {s.residual_projection:.4g}); RMSNorm weights 1 + N(0, {s.norm_noise}), q/k "
        f"norms {QK_NORM_GAIN} times that, the final one {s.final_norm:.4g} times; BF16\n"
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
        yield "model.safetensors.index.json"
