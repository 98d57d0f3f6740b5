"""The Qwen3 tokenizer files Kipp ships as package data (see data/qwen3-tokenizer/PROVENANCE.md).

Every Qwen3 dense checkpoint shares one vocabulary, merge list and special-token set; only the
tokenizer_config.json differs between variants (instruct: eos <|im_end|> and the chat template;
base: eos <|endoftext|> and no template). Synthetic checkpoints and tests take their files from
here, so a fresh clone needs nothing outside the package.
"""

from __future__ import annotations

import copy
import gzip
import json
from functools import lru_cache
from importlib import resources

_PACKAGE = "kipp"
_FOLDER = "data/qwen3-tokenizer"


def _read(name: str) -> bytes:
    return resources.files(_PACKAGE).joinpath(f"{_FOLDER}/{name}").read_bytes()


@lru_cache(maxsize=1)
def tokenizer_json_bytes() -> bytes:
    """The upstream tokenizer.json, byte for byte (stored gzip-compressed)."""
    return gzip.decompress(_read("tokenizer.json.gz"))


@lru_cache(maxsize=1)
def _instruct_config() -> dict:
    return json.loads(_read("tokenizer_config.json"))


def tokenizer_config(variant: str) -> dict:
    """tokenizer_config.json for a variant: the upstream instruct file, its base form, or its
    thinking form (Qwen3-4B-Thinking-2507's chat template, which opens the think block)."""
    config = copy.deepcopy(_instruct_config())
    if variant == "base":
        config["eos_token"] = "<|endoftext|>"
        config.pop("chat_template", None)
    elif variant == "thinking":
        config["chat_template"] = thinking_2507_template()
    elif variant != "instruct":
        raise ValueError(f"unknown variant {variant!r}")
    return config


@lru_cache(maxsize=1)
def thinking_2507_template() -> str:
    """The Qwen3-4B-Thinking-2507 template text Kipp carries (data/chat-templates)."""
    from importlib import resources

    path = resources.files("kipp").joinpath("data/chat-templates/qwen3-thinking-2507.jinja")
    return path.read_text(encoding="utf-8")
