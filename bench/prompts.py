"""Token ids every engine evaluates: real text, tokenized once by Kipp, sent as ids.

The text is the repository's tokenizer corpus (tests/data/tokenizer_corpus.jsonl: prose, code,
numbers and eight scripts), repeated as needed. Sending ids rather than text means no engine's
tokenizer can change what is measured.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "tokenizer_corpus.jsonl"


def corpus_text(path: Path = CORPUS) -> str:
    lines = [json.loads(line) for line in path.read_text("utf-8").split("\n") if line.strip()]
    return "\n".join(line for line in lines if isinstance(line, str) and line)


@functools.lru_cache(maxsize=2)
def corpus_tokens(path: Path = CORPUS) -> tuple[int, ...]:
    """The corpus through Kipp's tokenizer (the Qwen3 vocabulary every engine shares)."""
    import tempfile

    from kipp.text.tokenizer import Tokenizer
    from kipp.text.tokenizer_files import tokenizer_config, tokenizer_json_bytes

    with tempfile.TemporaryDirectory() as folder:
        tokenizer_json = Path(folder) / "tokenizer.json"
        config_json = Path(folder) / "tokenizer_config.json"
        tokenizer_json.write_bytes(tokenizer_json_bytes())
        config_json.write_text(json.dumps(tokenizer_config("base")))
        tokenizer = Tokenizer.from_files(tokenizer_json, config_json)
    return tuple(tokenizer.encode(corpus_text(path)))


def prompt(length: int, offset: int = 0) -> list[int]:
    """`length` corpus token ids starting at `offset`, wrapping around the corpus."""
    tokens = corpus_tokens()
    if length < 1:
        raise ValueError(f"prompt length {length} must be positive")
    return [tokens[(offset + i) % len(tokens)] for i in range(length)]
