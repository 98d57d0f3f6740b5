"""Kipp's native Qwen3 tokenizer: the byte-level BPE of Qwen2Tokenizer, nothing generic.

encode: split out added tokens (leftmost, longest first) -> NFC on each remaining segment ->
the Qwen2 regex split -> UTF-8 bytes -> BPE by merge rank -> ids.
decode: ids -> bytes (tokens map back through the GPT-2 byte table) -> UTF-8, errors="replace".

The oracle is the `tokenizers` package on the same tokenizer.json: tests/test_tokenizer.py
requires identical ids and identical decoded text.

Usage:
    tok = Tokenizer.from_files("tokenizer.json", "tokenizer_config.json")
    ids = tok.encode("<|im_start|>user\\nHi<|im_end|>")
    text = tok.decode(ids)
"""

from __future__ import annotations

import codecs
import heapq
import unicodedata
from array import array
from functools import cached_property, lru_cache
from itertools import accumulate, chain
from typing import Iterable

import regex

from kipp.display import html_view, text_view
from kipp.text.vocab import (
    ADDED_TYPES,
    QWEN2_SPLIT_PATTERN,
    TOKEN_NORMAL,
    TOKEN_UNUSED,
    TokenizerData,
    TokenizerError,
    load_tokenizer_files,
)

# Letters and numbers new in Unicode 17. The `regex` package knows them; the Oniguruma inside
# `tokenizers` (Unicode 16) does not, so there they are neither \p{L} nor \p{N}. Found by
# comparing both engines on every code point; test_unicode_classes_match_oniguruma re-checks.
_UNICODE_17_LETTERS_AND_NUMBERS = (
    (0x558, 0x558), (0x58B, 0x58C), (0x88F, 0x88F), (0xC5C, 0xC5C), (0xCDC, 0xCDC),
    (0x208F, 0x208F), (0x209D, 0x209F), (0xA7CE, 0xA7CF), (0xA7D2, 0xA7D2), (0xA7D4, 0xA7D4),
    (0xA7DD, 0xA7DD), (0xA7E2, 0xA7E2), (0xA7F1, 0xA7F1), (0xAB6C, 0xAB6D), (0x107BB, 0x107BF),
    (0x10940, 0x10959), (0x10EC5, 0x10EC7), (0x10ED9, 0x10EEE), (0x11B0A, 0x11B0A),
    (0x11DB0, 0x11DDB), (0x11DE0, 0x11DE9), (0x11DF1, 0x11DF1), (0x1246F, 0x1246F),
    (0x12475, 0x1247F), (0x12550, 0x12686), (0x16EA0, 0x16EB8), (0x16EBB, 0x16ED3),
    (0x16FF2, 0x16FF6), (0x187F8, 0x187FF), (0x18CD6, 0x18CDA), (0x18D09, 0x18D20),
    (0x18D80, 0x18DF2), (0x18E00, 0x19191), (0x191A0, 0x191D2), (0x1B123, 0x1B128),
    (0x1B168, 0x1B168), (0x1D6A6, 0x1D6A6), (0x1DF1F, 0x1DF24), (0x1DF2B, 0x1DF81),
    (0x1DF90, 0x1DF96), (0x1DFCD, 0x1DFFF), (0x1E6C0, 0x1E6DE), (0x1E6E0, 0x1E6E2),
    (0x1E6E4, 0x1E6E5), (0x1E6E7, 0x1E6ED), (0x1E6F0, 0x1E6F4), (0x1E6FE, 0x1E6FF),
    (0x2B73A, 0x2B73F), (0x2B81E, 0x2B81E), (0x2CEA2, 0x2CEAD), (0x323B0, 0x33479),
    (0x3D000, 0x3FC3F),
)

_PIECE_CACHE_SIZE = 1 << 16  # distinct pre-tokens remembered (LRU)
_CACHED_PIECE_MAX = 256  # longer pre-tokens are not cached, so the cache stays small
_SHORT_WORD = 32  # byte symbols up to which the list-rescan BPE beats the heap (tokenizer_bench)
_PAIR_KEY = 1 << 18  # pair (a, b) -> a * _PAIR_KEY + b; every id is below 2**18


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character table that byte-level BPE tokens are spelled in.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, 0x7F-0xA0,
    0xAD) take the characters from U+0100 on, in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


class Tokenizer:
    """The Qwen3 tokenizer. Build it with from_files, or from a TokenizerData (an artifact's:
    `Tokenizer(open_artifact(path).tokenizer_data())`; the tokenizer knows no file format)."""

    def __init__(self, data: TokenizerData):
        self.data = data
        bpe_ids = {t: i for i, (t, ty) in enumerate(zip(data.tokens, data.token_types))
                   if ty == TOKEN_NORMAL}
        self._byte_ids = _byte_ids(bpe_ids)
        self._ranks, self._merged, injective = _merge_tables(data.merges, bpe_ids)
        # The rescan BPE equals the tokenizers heap only when no two merges make one token.
        self._short_word = _SHORT_WORD if injective else 0
        self._added_ids = {t: i for i, (t, ty) in enumerate(zip(data.tokens, data.token_types))
                           if ty in ADDED_TYPES}
        self._added_split = _added_token_pattern(self._added_ids)
        self._split = regex.compile(QWEN2_SPLIT_PATTERN)
        self._split_pinned = regex.compile(_pinned_split_pattern(), regex.V1)
        self._unicode_17 = regex.compile(_unicode_17_class())
        self._bytes, self._bytes_at = _bytes_table(data.tokens, data.token_types)
        self._cached_piece = lru_cache(maxsize=_PIECE_CACHE_SIZE)(self._checked_piece)

    @classmethod
    def from_files(cls, tokenizer_json_path, tokenizer_config_json_path) -> "Tokenizer":
        """Load from a Hugging Face tokenizer.json + tokenizer_config.json pair."""
        return cls(load_tokenizer_files(tokenizer_json_path, tokenizer_config_json_path))

    def _display_rows(self) -> list[tuple[str, str]]:
        types = self.data.token_types
        bpe = sum(1 for t in types if t == TOKEN_NORMAL)
        added = sum(1 for t in types if t in ADDED_TYPES)
        template = "yes" if self.data.chat_template else "none (a base checkpoint)"
        return [("vocabulary", f"{self.vocab_size:,} ids: {bpe:,} BPE tokens, {added} added, "
                               f"{self.vocab_size - bpe - added} padding"),
                ("end of text", f"{self.id_to_token(self.eos_token_id)} ({self.eos_token_id})"),
                ("chat template", template)]

    def __repr__(self) -> str:
        return text_view("kipp.Tokenizer (Qwen3 byte-level BPE)", self._display_rows())

    def _repr_html_(self) -> str:
        return html_view("kipp.Tokenizer (Qwen3 byte-level BPE)", self._display_rows())

    @property
    def vocab_size(self) -> int:
        """Embedding rows (151936 for Qwen3), padding rows included."""
        return len(self.data.tokens)

    @property
    def eos_token_id(self) -> int:
        return self.data.eos_token_id

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (byte-level spelling for BPE tokens), or None."""
        return self._token_ids.get(token)

    @cached_property
    def _token_ids(self) -> dict[str, int]:
        # built at the first lookup: generation never needs it (~8 MiB at Qwen3's vocabulary)
        return {token: i for i, token in enumerate(self.data.tokens)}

    def id_to_token(self, token_id: int) -> str:
        """The token string of an id (padding rows give "[PAD<id>]")."""
        self._check_ids([token_id])
        return self.data.tokens[token_id]

    def encode(self, text: str) -> list[int]:
        """Token ids for text. Added tokens written in the text become their ids."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, not {type(text).__name__}")
        if not self._added_ids:
            return self._encode_ordinary(text)
        ids: list[int] = []
        # split() with a capturing group alternates: text, added token, text, ...
        for i, part in enumerate(self._added_split.split(text)):
            if i % 2:
                ids.append(self._added_ids[part])
            elif part:
                ids.extend(self._encode_ordinary(part))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text for ids; invalid UTF-8 becomes U+FFFD as in bytes.decode(errors="replace")."""
        return self.decode_bytes(ids).decode("utf-8", "replace")

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The raw bytes the ids stand for (padding ids stand for nothing)."""
        ids = list(ids)
        self._check_ids(ids)
        blob, at = self._bytes, self._bytes_at
        return b"".join([blob[at[i]:at[i + 1]] for i in ids])

    def _check_ids(self, ids: list) -> None:
        n = len(self._bytes_at) - 1
        try:
            if not ids or (0 <= min(ids) and max(ids) < n and all(map(_is_index, ids))):
                return
            bad = next(i for i in ids if not (_is_index(i) and 0 <= i < n))
        except TypeError:
            bad = next(i for i in ids if not _is_index(i))
        raise TokenizerError(f"token id {bad!r} is not an integer in 0..{n - 1}")

    def _encode_ordinary(self, text: str) -> list[int]:
        """Ids for text that holds no added token: NFC, regex split, BPE per piece."""
        text = unicodedata.normalize("NFC", text)
        try:
            return self._encode_pieces(self._split.findall(text))
        except _NeedsPinnedSplit:
            pieces = self._split_pinned.findall(text)
            return [i for piece in pieces for i in self._encode_piece(piece)]

    def _encode_pieces(self, pieces: list[str]) -> list[int]:
        if not pieces:
            return []
        if max(map(len, pieces)) <= _CACHED_PIECE_MAX:
            return list(chain.from_iterable(map(self._cached_piece, pieces)))
        ids: list[int] = []
        for piece in pieces:
            long = len(piece) > _CACHED_PIECE_MAX
            ids.extend(self._checked_piece(piece) if long else self._cached_piece(piece))
        return ids

    def _checked_piece(self, piece: str) -> tuple[int, ...]:
        """BPE of a piece from the fast split, unless the piece shows that split was wrong.

        The fast split treats Unicode 17 letters and numbers as \\p{L}/\\p{N}; `tokenizers`
        does not. Checking each new piece (not the whole text) keeps that check off the hot path:
        a piece holding such a character is never cached, so it always reaches this check.
        """
        if self._unicode_17.search(piece):
            raise _NeedsPinnedSplit
        return self._encode_piece(piece)

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        symbols = list(map(self._byte_ids.__getitem__, piece.encode("utf-8")))
        if len(symbols) <= self._short_word:
            return tuple(self._bpe_rescan(symbols))
        return tuple(self._bpe_heap(symbols))

    def _bpe_rescan(self, symbols: list[int]) -> list[int]:
        """BPE for short words: apply the lowest-rank pair (leftmost on ties) until none is left.

        Keeps one rank per adjacent pair, so each merge costs two dict lookups plus min/index
        over a short list (both in C).
        """
        get, merged, none = self._ranks.get, self._merged, len(self._merged)
        ranks = [get(a * _PAIR_KEY + b, none) for a, b in zip(symbols, symbols[1:])]
        while ranks:
            best = min(ranks)
            if best == none:
                break
            i = ranks.index(best)
            new = symbols[i] = merged[best]
            del symbols[i + 1], ranks[i]
            if i > 0:
                ranks[i - 1] = get(symbols[i - 1] * _PAIR_KEY + new, none)
            if i < len(ranks):
                ranks[i] = get(new * _PAIR_KEY + symbols[i + 1], none)
        return symbols

    def _bpe_heap(self, symbols: list[int]) -> list[int]:
        """BPE for long words in O(n log n): a heap of (rank, position) over a linked list.

        Same order as the `tokenizers` crate: lowest rank first, then leftmost; a popped entry
        is stale unless the pair now at its position still merges into the same token. Heap
        entries are rank << 32 | position, single ints being cheaper to compare than tuples.
        """
        get, merged, push, pop = self._ranks.get, self._merged, heapq.heappush, heapq.heappop
        n = len(symbols)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))
        heap = [r << 32 | i for i in range(n - 1)
                if (r := get(symbols[i] * _PAIR_KEY + symbols[i + 1])) is not None]
        heapq.heapify(heap)
        while heap:
            entry = pop(heap)
            rank, i = entry >> 32, entry & 0xFFFFFFFF
            j = nxt[i]
            if symbols[i] < 0 or j < 0:
                continue
            current = get(symbols[i] * _PAIR_KEY + symbols[j])
            if current != rank and (current is None or merged[current] != merged[rank]):
                continue
            new = symbols[i] = merged[rank]
            symbols[j] = -1  # removed
            k = nxt[i] = nxt[j]
            if k >= 0:
                prev[k] = i
                if (r := get(new * _PAIR_KEY + symbols[k])) is not None:
                    push(heap, r << 32 | i)
            p = prev[i]
            if p >= 0 and (r := get(symbols[p] * _PAIR_KEY + new)) is not None:
                push(heap, r << 32 | p)
        return [s for s in symbols if s >= 0]


class _NeedsPinnedSplit(Exception):
    """The text holds a Unicode 17 letter or number: split it again with the pinned pattern."""


def _is_index(value) -> bool:
    return hasattr(value, "__index__") and not isinstance(value, bool)


def _byte_ids(bpe_ids: dict[str, int]) -> list[int]:
    try:
        return [bpe_ids[_BYTE_TO_CHAR[b]] for b in range(256)]
    except KeyError as missing:
        raise TokenizerError(f"the vocabulary lacks the byte token {missing}") from None


def _merge_tables(merges: tuple[str, ...], bpe_ids: dict[str, int]):
    """(pair key -> rank, rank -> merged id, whether every merge makes a different token)."""
    pairs = [merge.partition(" ") for merge in merges]
    try:
        lefts = [bpe_ids[left] for left, _, _ in pairs]
        rights = [bpe_ids[right] for _, _, right in pairs]
        merged = [bpe_ids[left + right] for left, _, right in pairs]
    except KeyError as missing:
        raise TokenizerError(f"a merge names {missing}, which is not in the vocabulary") from None
    # A repeated pair keeps its last rank, as in the tokenizers crate's merge map.
    ranks = {a * _PAIR_KEY + b: rank for rank, (a, b) in enumerate(zip(lefts, rights))}
    injective = len(set(merged)) == len(merged) == len(ranks)
    return ranks, array("i", merged), injective  # 4 bytes a merged id, not an int object


def _added_token_pattern(added_ids: dict[str, int]) -> "regex.Pattern":
    # Longest first: the alternation then picks the longest token at the leftmost position.
    contents = sorted(added_ids, key=len, reverse=True)
    return regex.compile("(" + "|".join(regex.escape(c) for c in contents) + ")")


def _unicode_17_class() -> str:
    return "[" + "".join(f"\\U{a:08X}-\\U{b:08X}" for a, b in
                         _UNICODE_17_LETTERS_AND_NUMBERS) + "]"


def _pinned_split_pattern() -> str:
    """QWEN2_SPLIT_PATTERN with \\p{L} and \\p{N} narrowed to Oniguruma's Unicode 16 sets."""
    excluded = _unicode_17_class()
    # (?-f): V1 would otherwise switch on full case folding for the (?i:'s|...) branch.
    pattern = QWEN2_SPLIT_PATTERN.replace(r"\p{L}", rf"[\p{{L}}--{excluded}]")
    return "(?-f)" + pattern.replace(r"\p{N}", rf"[\p{{N}}--{excluded}]")


# Byte-level character -> the Latin-1 character of its byte; every other Latin-1 character
# -> U+FFFF, so that a token holding one fails the Latin-1 encode in _token_bytes.
_UNSPELL = {c: 0xFFFF for c in range(256)} | {ord(c): b for c, b in _CHAR_TO_BYTE.items()}


def _bytes_table(tokens: tuple[str, ...], token_types: tuple[int, ...]) -> tuple[bytes, array]:
    """Every id's bytes (_token_bytes) in one blob: id i's are blob[at[i]:at[i + 1]]. A list
    of bytes objects would take ~7 MiB at Qwen3's vocabulary, the blob and offsets ~2."""
    pieces = [_token_bytes(t, ty) for t, ty in zip(tokens, token_types)]
    return b"".join(pieces), array("I", accumulate(map(len, pieces), initial=0))


def _token_bytes(token: str, token_type: int) -> bytes:
    """The bytes an id decodes to, as the `tokenizers` ByteLevel decoder produces them.

    A token spelled wholly in byte-level characters maps back byte by byte; any other token
    (an added token such as "日本") contributes its UTF-8. Padding rows contribute nothing.
    """
    if token_type == TOKEN_UNUSED:
        return b""
    try:
        return token.translate(_UNSPELL).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


class StreamingDetokenizer:
    """Turns ids into text one id at a time, holding back an unfinished UTF-8 character.

    Usage:
        stream = StreamingDetokenizer(tokenizer)
        for token_id in generated:
            print(stream.push(token_id), end="")
        print(stream.flush())

    The concatenation of every push() and the final flush() equals tokenizer.decode(all ids).
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Feed one id; return the text it completes (possibly "")."""
        return self._decoder.decode(self._tokenizer.decode_bytes([token_id]))

    def flush(self) -> str:
        """End of stream: an unfinished character becomes U+FFFD, as decode() would make it."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text
