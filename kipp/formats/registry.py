"""The checkpoint registry: every Qwen3 dense checkpoint Kipp runs, pinned to one revision.

A checkpoint outside this table is a rejection, never an extension point. Each entry fixes the
dims the artifact loader requires and the fields the downloader compares with the pinned
config.json. Family invariants (vocab, head_dim, KV heads, eps, activation, no bias, BF16) are
module constants shared by every entry and checked when this module is imported.

Synthetic entries (`kipp-synthetic/...`) are checkpoints Kipp generates itself from a seed
(`kipp.synthetic.writer`), with the real Qwen3 architecture and file layout, because model
weights cannot be downloaded everywhere Kipp is developed and tested.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Mapping

from kipp.errors import RegistryError

VOCAB_SIZE = 151_936  # embedding rows; ids >= 151_669 are padding rows no text maps to
HEAD_DIM = 128
KV_HEADS = 8
RMS_NORM_EPS = 1e-6
HIDDEN_ACT = "silu"
QUANT_BLOCK = 32  # weights per quantization block; every family dimension is a multiple

ENDOFTEXT_ID = 151_643  # <|endoftext|>
IM_START_ID = 151_644  # <|im_start|>
IM_END_ID = 151_645  # <|im_end|>

Variant = Literal["base", "instruct", "thinking"]
SYNTHETIC_PREFIX = "kipp-synthetic/"
_HUB_REVISION = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class Synthetic:
    """How `kipp.synthetic.writer` generates a synthetic checkpoint's weights."""

    seed: int
    init_std: float  # std of random q/k/v/gate/up weights; o/down: init_std / sqrt(2 * layers)
    shards: int = 1  # >1 writes model-0000N-of-0000M.safetensors plus an index, like big repos
    # A draft for its seed's checkpoint: this fraction of the live tokens get another designed
    # successor, so its greedy text agrees with that checkpoint's at about 1 - disagree
    disagree: float = 0.0


@dataclass(frozen=True)
class Checkpoint:
    """One pinned checkpoint. Fields are what config.json and the GGUF artifact must match."""

    id: str  # Hugging Face repository, e.g. "Qwen/Qwen3-0.6B"
    revision: str  # immutable commit on the hub (40 hex); synthetic: generator version + seed
    variant: Variant
    hidden: int
    intermediate: int
    layers: int
    query_heads: int
    context_length: int
    rope_theta: float
    tied: bool  # lm_head is the transposed token embedding
    unconfirmed: tuple[str, ...] = ()  # fields seen in one public source only
    synthetic: Synthetic | None = field(default=None, compare=False)

    def __post_init__(self):
        problems = _entry_problems(self)
        if problems:
            raise RegistryError(f"registry entry {self.id}: " + "; ".join(problems))

    @property
    def attention_width(self) -> int:
        """query_heads * head_dim: NOT the hidden width at 0.6B, 4B and 32B."""
        return self.query_heads * HEAD_DIM

    @property
    def kv_width(self) -> int:
        return KV_HEADS * HEAD_DIM

    @property
    def kv_bytes_per_token(self) -> int:
        """BF16 K and V for every layer: layers * 2 * 8 * 128 * 2 bytes."""
        return self.layers * 2 * KV_HEADS * HEAD_DIM * 2

    @property
    def eos_token_id(self) -> int:
        return ENDOFTEXT_ID if self.variant == "base" else IM_END_ID

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Instruct checkpoints stop on <|im_end|> and also on <|endoftext|>."""
        return (ENDOFTEXT_ID,) if self.variant == "base" else (IM_END_ID, ENDOFTEXT_ID)

    @property
    def has_chat_template(self) -> bool:
        return self.variant != "base"

    @property
    def is_synthetic(self) -> bool:
        return self.synthetic is not None

    @property
    def parameter_count(self) -> int:
        per_layer = (
            self.hidden * (self.attention_width + 2 * self.kv_width)  # q, k, v
            + self.attention_width * self.hidden  # o
            + 3 * self.hidden * self.intermediate  # gate, up, down
            + 2 * self.hidden + 2 * HEAD_DIM  # attn/ffn norms, q/k norms
        )
        head = 0 if self.tied else VOCAB_SIZE * self.hidden
        return VOCAB_SIZE * self.hidden + self.layers * per_layer + self.hidden + head

    def hf_config(self) -> dict:
        """The config.json fields that identify this checkpoint (Hugging Face key names)."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.query_heads,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "max_position_embeddings": self.context_length,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": RMS_NORM_EPS,
            "hidden_act": HIDDEN_ACT,
            "attention_bias": False,
            "tie_word_embeddings": self.tied,
            "torch_dtype": "bfloat16",
            "eos_token_id": self.eos_token_id,
        }


def _entry_problems(c: Checkpoint) -> list[str]:
    problems = []
    if c.variant not in ("base", "instruct", "thinking"):
        problems.append(f"variant {c.variant!r} is not base, instruct or thinking")
    if c.id.startswith(SYNTHETIC_PREFIX) != (c.synthetic is not None):
        problems.append("synthetic ids start with 'kipp-synthetic/' and carry generator settings")
    if c.synthetic is None and not _HUB_REVISION.fullmatch(c.revision):
        problems.append(f"revision {c.revision!r} is not a 40-hex commit")
    for name in ("hidden", "intermediate", "layers", "query_heads", "context_length"):
        if getattr(c, name) <= 0:
            problems.append(f"{name} must be positive")
    for name, width in (("hidden", c.hidden), ("intermediate", c.intermediate)):
        if width % QUANT_BLOCK:
            problems.append(f"{name} {width} is not a multiple of {QUANT_BLOCK}")
    if c.query_heads % KV_HEADS:
        problems.append(f"query_heads {c.query_heads} is not a multiple of {KV_HEADS} KV heads")
    if c.rope_theta <= 0:
        problems.append("rope_theta must be positive")
    unknown = set(c.unconfirmed) - set(Checkpoint.__dataclass_fields__)
    if unknown:
        problems.append(f"unconfirmed names unknown fields {sorted(unknown)}")
    return problems


def _hub(repo, revision, variant, hidden, intermediate, layers, heads, context, theta, tied,
         unconfirmed=()):
    return Checkpoint(repo, revision, variant, hidden, intermediate, layers, heads, context,
                      theta, tied, tuple(unconfirmed))


# Values from public copies of each repository's config.json at the pinned revision
# (shared REGISTRY-FACTS). `unconfirmed` lists cells seen in one source only: `kipp download`
# compares every field with the downloaded config.json and refuses on any difference.
_ENTRIES = [
    _hub("Qwen/Qwen3-0.6B", "c1899de289a04d12100db370d81485cdf75e47ca",
         "instruct", 1024, 3072, 28, 16, 40960, 1e6, True),
    _hub("Qwen/Qwen3-0.6B-Base", "da87bfb608c14b7cf20ba1ce41287e8de496c0cd",
         "base", 1024, 3072, 28, 16, 32768, 1e6, True, ["tied"]),
    _hub("Qwen/Qwen3-1.7B", "70d244cc86ccca08cf5af4e1e306ecf908b1ad5e",
         "instruct", 2048, 6144, 28, 16, 40960, 1e6, True, ["tied"]),
    _hub("Qwen/Qwen3-1.7B-Base", "ea980cb0a6c2ae4b936e82123acc929f1cec04c1",
         "base", 2048, 6144, 28, 16, 32768, 1e6, True, ["tied"]),
    _hub("Qwen/Qwen3-4B", "1cfa9a7208912126459214e8b04321603b3df60c",
         "instruct", 2560, 9728, 36, 32, 40960, 1e6, True),
    _hub("Qwen/Qwen3-4B-Base", "906bfd4b4dc7f14ee4320094d8b41684abff8539",
         "base", 2560, 9728, 36, 32, 32768, 1e6, True, ["context_length", "tied"]),
    _hub("Qwen/Qwen3-4B-Instruct-2507", "cdbee75f17c01a7cc42f958dc650907174af0554",
         "instruct", 2560, 9728, 36, 32, 262144, 5e6, True),
    _hub("Qwen/Qwen3-4B-Thinking-2507", "768f209d9ea81521153ed38c47d515654e938aea",
         "thinking", 2560, 9728, 36, 32, 262144, 5e6, True,
         ["revision", "context_length", "rope_theta", "tied"]),
    _hub("Qwen/Qwen3-8B", "b968826d9c46dd6066d109eabc6255188de91218",
         "instruct", 4096, 12288, 36, 32, 40960, 1e6, False, ["tied"]),
    _hub("Qwen/Qwen3-8B-Base", "49e3418fbbbca6ecbdf9608b4d22e5a407081db4",
         "base", 4096, 12288, 36, 32, 32768, 1e6, False, ["context_length", "tied"]),
    _hub("Qwen/Qwen3-14B", "40c069824f4251a91eefaf281ebe4c544efd3e18",
         "instruct", 5120, 17408, 40, 40, 40960, 1e6, False, ["tied"]),
    _hub("Qwen/Qwen3-14B-Base", "0b0bd3732e2c374d483664439ea334928b65f304",
         "base", 5120, 17408, 40, 40, 32768, 1e6, False, ["context_length", "tied"]),
    _hub("Qwen/Qwen3-32B", "9216db5781bf21249d130ec9da846c4624c16137",
         "instruct", 5120, 25600, 64, 64, 40960, 1e6, False, ["tied"]),
    # Synthetic checkpoints: seeded random weights, real architecture and file layout.
    # The instruct family's 40,960-token context: an agent's system prompt and tools fit.
    Checkpoint("kipp-synthetic/qwen3-tiny", "synthetic-v6-seed-1", "instruct",
               256, 768, 2, 16, 40960, 1e6, True, synthetic=Synthetic(seed=1, init_std=0.08)),
    Checkpoint("kipp-synthetic/qwen3-tiny-base", "synthetic-v6-seed-2", "base",
               256, 768, 2, 16, 4096, 1e6, True, synthetic=Synthetic(seed=2, init_std=0.08)),
    # Untied lm_head, 5 query heads per KV head (as at 14B), a sharded safetensors layout.
    Checkpoint("kipp-synthetic/qwen3-tiny-untied", "synthetic-v6-seed-3", "instruct",
               256, 768, 2, 40, 4096, 1e6, False,
               synthetic=Synthetic(seed=3, init_std=0.08, shards=2)),
    # The thinking variant: Qwen3-4B-Thinking-2507's template opens the think block in the
    # prompt, so the reasoning split and budget run on real replies.
    Checkpoint("kipp-synthetic/qwen3-tiny-thinking", "synthetic-v6-seed-5", "thinking",
               256, 768, 2, 16, 40960, 1e6, True, synthetic=Synthetic(seed=5, init_std=0.08)),
    # The exact Qwen3-0.6B shapes, for benchmarks.
    Checkpoint("kipp-synthetic/qwen3-0.6b-shape", "synthetic-v6-seed-4", "instruct",
               1024, 3072, 28, 16, 40960, 1e6, True, synthetic=Synthetic(seed=4, init_std=0.04)),
    # Tiny drafts for the 0.6B shape (its seed, its designed rule but for a fraction of the
    # live tokens), agreeing at about 95%, 70% and 30%: speculation's acceptance as a dial.
    *(Checkpoint(f"kipp-synthetic/qwen3-0.6b-draft-{agree}", f"synthetic-v6-seed-4-agree-{agree}",
                 "instruct", 256, 768, 2, 16, 40960, 1e6, True,
                 synthetic=Synthetic(seed=4, init_std=0.08, disagree=(100 - agree) / 100))
      for agree in (95, 70, 30)),
]

REGISTRY: Mapping[str, Checkpoint] = MappingProxyType({c.id: c for c in _ENTRIES})
if len(REGISTRY) != len(_ENTRIES):
    raise RegistryError("registry has duplicate checkpoint ids")

DEFAULT_CHECKPOINT = "kipp-synthetic/qwen3-tiny"


def get(checkpoint_id: str) -> Checkpoint:
    """The registry entry for `checkpoint_id`, or a RegistryError listing what exists."""
    try:
        return REGISTRY[checkpoint_id]
    except KeyError:
        raise RegistryError(
            f"{checkpoint_id!r} is not in Kipp's checkpoint registry; supported: "
            + ", ".join(REGISTRY)
        ) from None


def find(repository: str, revision: str) -> Checkpoint:
    """The entry pinned to exactly (repository, revision); anything else is rejected."""
    entry = get(repository)
    if entry.revision != revision:
        raise RegistryError(
            f"{repository} is pinned to revision {entry.revision}, not {revision!r}"
        )
    return entry


def config_mismatches(entry: Checkpoint, config: Mapping) -> list[tuple[str, object, object]]:
    """(field, expected, found) for every identifying config.json field that differs.

    Newer transformers write `dtype` where older ones wrote `torch_dtype`; either is accepted.
    """
    config = dict(config)
    if "torch_dtype" not in config and "dtype" in config:
        config["torch_dtype"] = config["dtype"]
    mismatches = []
    for key, expected in entry.hf_config().items():
        found = config.get(key, "<missing>")
        if isinstance(expected, float) and isinstance(found, (int, float)):
            same = float(found) == expected
        else:
            same = found == expected
        if not same:
            mismatches.append((key, expected, found))
    return mismatches
