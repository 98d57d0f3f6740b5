"""The vocabulary Kipp's tokenizer runs on (TokenizerData: tokens, their GGUF types, merges, end
of text, chat template) and its reader for a Hugging Face tokenizer.json + tokenizer_config.json
pair, which refuses any pipeline but Qwen2's byte-level BPE. Artifacts store the same fields.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kipp.errors import KippError
from kipp.formats.registry import VOCAB_SIZE
from kipp.formats.string_table import StringTable

# GGUF / llama.cpp token types.
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3  # added token with special=True (<|im_end|>)
TOKEN_USER_DEFINED = 4  # added token with special=False (<think>, <tool_call>)
TOKEN_UNUSED = 5  # padding row no text maps to
ADDED_TYPES = (TOKEN_CONTROL, TOKEN_USER_DEFINED)

# The pre-tokenizer of every Qwen2/Qwen3 tokenizer.json, verbatim.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenizerError(KippError):
    """Bad tokenizer files, an unsupported tokenizer scheme, or an id outside the vocabulary."""


@dataclass(frozen=True)
class TokenizerData:
    """Everything Kipp's tokenizer needs; the GGUF converter stores exactly these fields.

    tokens[i] is id i's token: byte-level spelling for BPE entries, literal content for added
    tokens, f"[PAD{i}]" for padding rows. token_types uses the GGUF codes (TOKEN_*).
    merges are "left right" strings in rank order. Both string lists are kept as StringTables
    (any sequence of str given is converted): a tuple of them would hold about 22 MiB.
    """

    tokens: Sequence[str]
    token_types: tuple[int, ...]
    merges: Sequence[str]
    eos_token_id: int
    chat_template: str | None

    def __post_init__(self):
        object.__setattr__(self, "tokens", StringTable.of(self.tokens))
        object.__setattr__(self, "merges", StringTable.of(self.merges))
        if len(self.tokens) != len(self.token_types):
            raise TokenizerError(
                f"{len(self.tokens)} tokens but {len(self.token_types)} token types")
        if not 0 <= self.eos_token_id < len(self.tokens):
            raise TokenizerError(f"eos_token_id {self.eos_token_id} is outside the vocabulary")
        unknown = set(self.token_types) - {TOKEN_NORMAL, *ADDED_TYPES, TOKEN_UNUSED}
        if unknown:
            raise TokenizerError(f"unknown token types {sorted(unknown)}")


def load_tokenizer_files(tokenizer_json_path, tokenizer_config_json_path) -> TokenizerData:
    """Read a Hugging Face tokenizer.json + tokenizer_config.json pair into TokenizerData.

    tokenizer_config.json's added_tokens_decoder is merged over tokenizer.json's added_tokens
    the way transformers does it: a known content keeps its id and takes the config's `special`
    flag; a new content is added at the next free id. The vocabulary is padded to VOCAB_SIZE.
    """
    spec = json.loads(Path(tokenizer_json_path).read_text(encoding="utf-8"))
    config = json.loads(Path(tokenizer_config_json_path).read_text(encoding="utf-8"))
    _check_scheme(spec)
    vocab: dict[str, int] = spec["model"]["vocab"]
    added = _merge_added_tokens(vocab, spec.get("added_tokens", []), config)
    tokens, types = _token_table(vocab, added)
    template = config.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise TokenizerError("chat_template must be a string (named templates are not supported)")
    return TokenizerData(
        tokens=tokens,
        token_types=types,
        merges=tuple(_merge_string(m) for m in spec["model"]["merges"]),
        eos_token_id=_eos_id(config, tokens),
        chat_template=template,
    )


def _check_scheme(spec: dict) -> None:
    """Refuse a tokenizer.json whose pipeline is not the Qwen2 byte-level BPE Kipp implements."""
    split = {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT_PATTERN},
             "behavior": "Isolated", "invert": False}
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    model = spec.get("model") or {}
    checks = {
        "normalizer": spec.get("normalizer") == {"type": "NFC"},
        "pre_tokenizer": len(steps) == 2 and steps[0] == split
        and _has(steps[1], type="ByteLevel", add_prefix_space=False, use_regex=False),
        "decoder": _has(spec.get("decoder") or {}, type="ByteLevel"),
        "model": _has(model, type="BPE", dropout=None, byte_fallback=False)
        and not model.get("continuing_subword_prefix")
        and not model.get("end_of_word_suffix")
        and not model.get("ignore_merges"),
    }
    for field, ok in checks.items():
        if not ok:
            raise TokenizerError(f"tokenizer.json {field} is not the Qwen2 byte-level BPE scheme")


def _has(obj: dict, **expected) -> bool:
    return all(obj.get(key) == value for key, value in expected.items())


def _merge_added_tokens(vocab: dict, json_added: list, config: dict) -> dict[int, tuple[str, bool]]:
    """id -> (content, special): tokenizer.json's added tokens with the config's merged over.

    As transformers does: a config entry that differs from the known token replaces its flags
    (special if either the entry or the config's special-token names say so) and keeps its id;
    an unknown content, or a special-token name nobody defined, takes the next free id.
    """
    added = {entry["id"]: _added_entry(entry) for entry in json_added}
    ids = {content: i for i, (content, _) in added.items()}
    named = _config_special_names(config)

    def put(content: str, special: bool) -> None:
        token_id = ids.get(content, vocab.get(content))
        if token_id is None:
            token_id = max([len(vocab) - 1, *added]) + 1
        added[token_id] = (content, special)
        ids[content] = token_id

    decoder = config.get("added_tokens_decoder", {})
    for content, special in (_added_entry(decoder[key]) for key in sorted(decoder, key=int)):
        if added.get(ids.get(content)) != (content, special):
            put(content, special or content in named)
    for name in named:
        if name not in ids:
            put(name, True)
    return added


def _added_entry(entry: dict) -> tuple[str, bool]:
    for flag in ("lstrip", "rstrip", "single_word", "normalized"):
        if entry.get(flag, False):
            raise TokenizerError(f"added token {entry.get('content')!r}: {flag}=true is not "
                                 "supported by Kipp's tokenizer")
    return entry["content"], bool(entry.get("special", False))


def _config_special_names(config: dict) -> list[str]:
    keys = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
            "mask_token")
    names = [config.get(key) for key in keys] + list(config.get("additional_special_tokens") or [])
    return list(dict.fromkeys(_token_content(n) for n in names if n is not None))


def _token_content(value) -> str:
    """A tokenizer_config token field: a string, or a serialized AddedToken dict."""
    return value["content"] if isinstance(value, dict) else value


def _token_table(vocab: dict, added: dict) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(tokens, token_types) over all VOCAB_SIZE ids, unused ids as padding."""
    if max([*vocab.values(), *added]) >= VOCAB_SIZE:
        raise TokenizerError(f"the tokenizer has ids beyond the {VOCAB_SIZE} embedding rows")
    tokens = [f"[PAD{i}]" for i in range(VOCAB_SIZE)]
    types = [TOKEN_UNUSED] * VOCAB_SIZE
    for token, i in vocab.items():
        tokens[i], types[i] = token, TOKEN_NORMAL
    for i, (content, special) in added.items():
        tokens[i] = content
        types[i] = TOKEN_CONTROL if special else TOKEN_USER_DEFINED
    return tuple(tokens), tuple(types)


def _merge_string(merge) -> str:
    """A tokenizer.json merge, either ["a", "b"] (newer files) or "a b" (older ones)."""
    if isinstance(merge, str):
        return merge
    left, right = merge
    return f"{left} {right}"


def _eos_id(config: dict, tokens: tuple[str, ...]) -> int:
    eos = config.get("eos_token")
    if eos is None:
        raise TokenizerError("tokenizer_config.json has no eos_token")
    content = _token_content(eos)
    try:
        return tokens.index(content)
    except ValueError:
        raise TokenizerError(f"eos_token {content!r} is not in the vocabulary") from None
