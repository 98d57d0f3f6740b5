"""Kipp's tokenizer against its oracles: the `tokenizers` package and transformers.

Every test string must give identical ids, and decoding must give identical text. The corpus
(tests/data/tokenizer_corpus.jsonl, one JSON string per line, so CR, tabs and trailing spaces
survive) covers many scripts, emoji, NFD input, whitespace runs, code, every added token and
near-misses of them, and 10k-character words.
"""

from __future__ import annotations

import copy
import gc
import json
import random
import tracemalloc
import unicodedata
from pathlib import Path

import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kipp.errors import KippError
from kipp.text.tokenizer import StreamingDetokenizer, Tokenizer
from kipp.text.tokenizer_files import tokenizer_config, tokenizer_json_bytes
from kipp.text.vocab import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    TokenizerData,
    TokenizerError,
    load_tokenizer_files,
)

CORPUS = Path(__file__).parent / "data" / "tokenizer_corpus.jsonl"
ADDED_IDS = range(151643, 151669)
HYPOTHESIS = settings(max_examples=300, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture])


def write_tokenizer_dir(folder: Path, config: dict, spec: dict | None = None) -> Path:
    """A Hugging Face tokenizer folder: tokenizer.json + tokenizer_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    if spec is None:
        (folder / "tokenizer.json").write_bytes(tokenizer_json_bytes())
    else:
        (folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def load(folder: Path) -> TokenizerData:
    return load_tokenizer_files(folder / "tokenizer.json", folder / "tokenizer_config.json")


@pytest.fixture(scope="module")
def instruct_dir(tmp_path_factory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("qwen3-tok"), tokenizer_config("instruct"))


@pytest.fixture(scope="module")
def tok(instruct_dir) -> Tokenizer:
    return Tokenizer(load(instruct_dir))


@pytest.fixture(scope="module")
def ref():
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.Tokenizer.from_str(tokenizer_json_bytes().decode("utf-8"))


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    # split("\n"), not splitlines(): the latter would also break at U+2028 and U+0085.
    lines = CORPUS.read_text(encoding="utf-8").split("\n")
    return [json.loads(line) for line in lines if line]


def ref_ids(ref, text: str) -> list[int]:
    return ref.encode(text, add_special_tokens=False).ids


def ref_decode(ref, ids) -> str:
    return ref.decode(list(ids), skip_special_tokens=False)


def nfc_outside_added_tokens(text: str) -> str:
    """What decode(encode(text)) gives: NFC applies to the text between added tokens only."""
    contents = sorted((tokenizer_config("instruct")["added_tokens_decoder"][str(i)]["content"]
                       for i in ADDED_IDS), key=len, reverse=True)
    parts = regex.split("(" + "|".join(map(regex.escape, contents)) + ")", text)
    return "".join(p if i % 2 else unicodedata.normalize("NFC", p) for i, p in enumerate(parts))


def test_corpus_is_broad(corpus):
    text = "".join(corpus)
    for script in ("Han", "Arabic", "Devanagari", "Thai", "Hangul", "Cyrillic", "Greek", "Hebrew"):
        assert regex.search(rf"\p{{{script}}}", text), script
    assert "" in corpus and "\r\n" in text and "\t" in text
    assert any(line.endswith(" ") for line in corpus)
    assert any(len(line) >= 10_000 for line in corpus)
    assert "\u200d" in text and "\U0001F3FD" in text  # ZWJ sequences, skin tones
    assert any(unicodedata.normalize("NFC", s) != s for s in corpus)  # NFD input


def test_corpus_ids_match_tokenizers(tok, ref, corpus):
    mismatched = [line[:60] for line in corpus if tok.encode(line) != ref_ids(ref, line)]
    assert mismatched == []


def test_every_added_token_is_one_id(tok, ref):
    for token_id in ADDED_IDS:
        content = tok.id_to_token(token_id)
        for text in (content, f"a{content}b", f" {content}\n"):
            assert token_id in tok.encode(text)
            assert tok.encode(text) == ref_ids(ref, text)


@pytest.mark.parametrize("text", ["<|im_sta", "<|im_start", "<|im_start|", "<think", "</think >",
                                  "< think>", "<thinking>", "<THINK>", "</tool_call"])
def test_near_special_strings_are_ordinary_text(tok, ref, text):
    ids = tok.encode(text)
    assert ids == ref_ids(ref, text)
    assert not set(ids) & set(ADDED_IDS)


def test_roundtrip_is_nfc_outside_added_tokens(tok, corpus):
    for line in corpus:
        assert tok.decode(tok.encode(line)) == nfc_outside_added_tokens(line), line[:60]
        if "\u0338" not in line:
            assert tok.decode(tok.encode(line)) == unicodedata.normalize("NFC", line)


def test_normalisation_stops_at_added_tokens(tok, ref):
    # NFC of the whole text would fuse ">" + U+0338 into U+226F and break the token apart;
    # upstream normalises only the text between added tokens.
    text = "<think>\u0338x"
    assert tok.encode(text) == ref_ids(ref, text)
    assert tok.encode(text)[0] == 151667


def test_streaming_concatenation_equals_decode(tok, corpus):
    for line in corpus:
        ids = tok.encode(line)
        stream = StreamingDetokenizer(tok)
        pieces = [stream.push(i) for i in ids]
        assert "".join(pieces) + stream.flush() == tok.decode(ids)
        if "\ufffd" not in line:  # a character split across tokens comes out once, whole
            assert not any("\ufffd" in piece for piece in pieces)


def byte_token_ids(tok) -> list[int]:
    from kipp.text.tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return [tok.token_to_id(table[b]) for b in range(256)]


def test_streaming_holds_back_a_split_character(tok):
    byte_ids = byte_token_ids(tok)
    ids = [byte_ids[b] for b in "😀".encode("utf-8")]  # one emoji spelled as four byte tokens
    stream = StreamingDetokenizer(tok)
    outputs = [stream.push(i) for i in ids]
    assert outputs[:-1] == [""] * (len(ids) - 1) and outputs[-1] == "😀"
    assert stream.flush() == ""


def test_invalid_utf8_decodes_like_tokenizers(tok, ref):
    byte_ids = byte_token_ids(tok)
    lone = {b: byte_ids[b] for b in range(256)}
    cases = [
        [lone[0x80]], [lone[0xFF]], [lone[0xE2], lone[0x82]], [lone[0xF0], lone[0x9F], lone[0x98]],
        [lone[0xF0], lone[0x80], lone[0x80]], [lone[0xED], lone[0xA0], lone[0x80]],  # surrogate
        [lone[0xC0], lone[0xAF]], [lone[0xF4], lone[0x90], lone[0x80], lone[0x80]],
        [lone[0xE2], 151645, lone[0x82], lone[0xAC]], [lone[0xC3], 9707, lone[0xA9]],
    ]
    rng = random.Random(7)
    cases += [[rng.choice(byte_ids[0x80:]) for _ in range(rng.randint(1, 12))] for _ in range(300)]
    for ids in cases:
        assert tok.decode(ids) == ref_decode(ref, ids), ids
        stream = StreamingDetokenizer(tok)
        assert "".join(map(stream.push, ids)) + stream.flush() == tok.decode(ids)


def test_padding_ids_decode_to_nothing(tok, ref):
    assert tok.decode([9707, 151700, 151935, 1879]) == ref_decode(ref, [9707, 151700, 1879])
    assert tok.id_to_token(151700) == "[PAD151700]"


@pytest.mark.parametrize("bad", [151936, -1, 10**9, 1.5, "7", None])
def test_ids_outside_the_vocabulary_raise(tok, bad):
    with pytest.raises(TokenizerError, match="token id"):
        tok.decode([9707, bad])
    with pytest.raises(KippError):
        tok.id_to_token(bad)
    with pytest.raises(TokenizerError):
        StreamingDetokenizer(tok).push(bad)


def test_encode_rejects_non_text(tok):
    with pytest.raises(TokenizerError, match="str"):
        tok.encode(b"bytes")


def test_lookups(tok):
    assert tok.vocab_size == 151936
    assert tok.eos_token_id == 151645
    assert tok.token_to_id("<think>") == 151667
    assert tok.token_to_id("Ġthe") == tok.encode(" the")[0]
    assert tok.token_to_id("no such token") is None
    assert tok.id_to_token(151645) == "<|im_end|>"


def test_long_word_bpe_paths_agree(tok):
    # Words longer than the rescan limit use the heap; both must merge in the same order.
    rng = random.Random(3)
    alphabet = "abcdefghij klmnopqrstuvwxyz的一是不了在人有我他这个0123456789éèñ"
    for _ in range(200):
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 60)))
        symbols = [tok._byte_ids[b] for b in word.encode("utf-8")]
        assert tok._bpe_heap(list(symbols)) == tok._bpe_rescan(list(symbols)), word


def toy_spec(rng: random.Random, merges: int) -> dict:
    """tokenizer.json with a random merge table over "abc": pairs repeat, and several merges
    can make the same token, which exercises the heap's stale-entry rule."""
    from kipp.text.tokenizer import bytes_to_unicode

    spec = json.loads(tokenizer_json_bytes())
    tokens = list(bytes_to_unicode().values())
    pool, table = list("abc"), []
    for _ in range(merges):
        left, right = rng.choice(pool), rng.choice(pool)
        table.append([left, right])
        if left + right not in tokens:
            tokens.append(left + right)
            pool.append(left + right)
    spec["model"].update(vocab={t: i for i, t in enumerate(tokens)}, merges=table)
    spec["added_tokens"] = []
    return spec


def test_bpe_merge_order_matches_tokenizers_on_toy_tables(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    rng = random.Random(11)
    for table in range(6):
        spec = toy_spec(rng, merges=rng.choice([10, 40, 120]))
        config = {"eos_token": "<|eos|>", "added_tokens_decoder": {}}
        ours = Tokenizer(load(write_tokenizer_dir(tmp_path / str(table), config, spec)))
        theirs = tokenizers.Tokenizer.from_str(json.dumps(spec))
        for _ in range(300):
            word = "".join(rng.choice("abc") for _ in range(rng.randint(1, 80)))
            assert ours.encode(word) == theirs.encode(word).ids, (table, word)


@given(text=st.text(max_size=200))
@HYPOTHESIS
def test_random_unicode_matches_tokenizers(tok, ref, text):
    assert tok.encode(text) == ref_ids(ref, text)


FRAGMENTS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|im_sta", "<", "|>", "'s",
             "'LL", " ", "  ", "\t", "\n", "\r\n", "\r", "a", "Z", "é", "e\u0301", "\u0338", "1",
             "123", "中文", "😀", "\u200d", "\U0001F3FD", "👍", "ß", "İ", ".", "...", "!", "ـ"]


@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=40))
@HYPOTHESIS
def test_random_fragment_mixes_match_tokenizers(tok, ref, parts):
    text = "".join(parts)
    ids = tok.encode(text)
    assert ids == ref_ids(ref, text)
    assert tok.decode(ids) == ref_decode(ref, ids)


@given(ids=st.lists(st.integers(0, 151668), max_size=30))
@HYPOTHESIS
def test_random_ids_decode_like_tokenizers(tok, ref, ids):
    text = tok.decode(ids)
    assert text == ref_decode(ref, ids)
    stream = StreamingDetokenizer(tok)
    assert "".join(map(stream.push, ids)) + stream.flush() == text


@pytest.mark.slow
def test_unicode_classes_match_oniguruma(tok, ref):
    """Every code point in letter/number/space/other contexts (pins _UNICODE_17_...)."""
    probes = ("a{c}", "1{c}", " {c}", "{c}{c}\n", "'{c}", "{c} x")
    points = [chr(cp) for cp in range(0x110000) if not 0xD800 <= cp < 0xE000]
    for start in range(0, len(points), 4096):
        text = "|".join(p.format(c=c) for c in points[start:start + 4096] for p in probes)
        assert tok.encode(text) == ref_ids(ref, text), hex(ord(points[start]))


def test_transformers_agrees_on_a_subset(tok, instruct_dir, corpus):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(instruct_dir))
    subset = corpus[::4] + [line for line in corpus if "<" in line and len(line) < 1000]
    for line in subset:
        ids = tok.encode(line)
        assert hf.encode(line, add_special_tokens=False) == ids, line[:60]
        assert hf.decode(ids, skip_special_tokens=False) == tok.decode(ids)


def test_load_tokenizer_files_tables(tok):
    data = tok.data
    assert len(data.tokens) == len(data.token_types) == 151936
    assert len(data.merges) == 151387 and data.merges[0] == "Ġ Ġ"
    assert data.token_types[:151643] == (TOKEN_NORMAL,) * 151643
    assert data.tokens[151645] == "<|im_end|>" and data.token_types[151645] == TOKEN_CONTROL
    assert data.token_types[151643] == data.token_types[151644] == TOKEN_CONTROL
    for token_id in (151657, 151658, 151665, 151666, 151667, 151668):  # tool tags, <think>
        assert data.token_types[token_id] == TOKEN_USER_DEFINED
    assert data.tokens[151667] == "<think>"
    assert data.tokens[151669] == "[PAD151669]" and data.tokens[-1] == "[PAD151935]"
    assert set(data.token_types[151669:]) == {TOKEN_UNUSED}
    assert data.eos_token_id == 151645
    assert data.chat_template == tokenizer_config("instruct")["chat_template"]


def test_base_variant_has_endoftext_eos_and_no_template(tmp_path):
    data = load(write_tokenizer_dir(tmp_path, tokenizer_config("base")))
    assert data.eos_token_id == 151643 and data.chat_template is None


def test_string_merges_load_like_list_merges(tmp_path, tok):
    spec = json.loads(tokenizer_json_bytes())
    spec["model"]["merges"] = [" ".join(pair) for pair in spec["model"]["merges"]]
    data = load(write_tokenizer_dir(tmp_path, tokenizer_config("instruct"), spec))
    assert data.merges == tok.data.merges


def test_config_added_tokens_merge_like_transformers(tmp_path):
    config = tokenizer_config("instruct")
    decoder = config["added_tokens_decoder"]
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    decoder["151667"]["special"] = True  # the config's flag wins
    decoder["151669"] = {"content": "<|new|>", "special": False, **flags}
    decoder["151670"] = {"content": "<|new_special|>", "special": True, **flags}
    config["additional_special_tokens"] = [*config["additional_special_tokens"], "<|named|>"]
    folder = write_tokenizer_dir(tmp_path, config)
    data = load(folder)
    expected = {151667: ("<think>", TOKEN_CONTROL), 151669: ("<|new|>", TOKEN_USER_DEFINED),
                151670: ("<|new_special|>", TOKEN_CONTROL), 151671: ("<|named|>", TOKEN_CONTROL),
                151645: ("<|im_end|>", TOKEN_CONTROL), 151672: ("[PAD151672]", TOKEN_UNUSED)}
    for token_id, (token, token_type) in expected.items():
        assert (data.tokens[token_id], data.token_types[token_id]) == (token, token_type)
    assert Tokenizer(data).encode("a<|new|>b<|named|>") == [64, 151669, 65, 151671]

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    for token_id, (token, token_type) in expected.items():
        if token_type != TOKEN_UNUSED:
            assert hf.convert_tokens_to_ids(token) == token_id
            assert hf.added_tokens_decoder[token_id].special == (token_type == TOKEN_CONTROL)


@pytest.mark.parametrize("field, change", [
    ("normalizer", lambda s: s.update(normalizer={"type": "NFKC"})),
    ("pre_tokenizer", lambda s: s["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(
        Regex=r"\s+|\S+")),
    ("model", lambda s: s["model"].update(byte_fallback=True)),
])
def test_other_tokenizer_schemes_are_refused(tmp_path, field, change):
    spec = json.loads(tokenizer_json_bytes())
    change(spec)
    with pytest.raises(TokenizerError, match=field):
        load(write_tokenizer_dir(tmp_path, tokenizer_config("instruct"), spec))


def test_unsupported_added_token_flags_are_refused(tmp_path):
    config = copy.deepcopy(tokenizer_config("instruct"))
    config["added_tokens_decoder"]["151667"]["lstrip"] = True
    with pytest.raises(TokenizerError, match="lstrip"):
        load(write_tokenizer_dir(tmp_path, config))


def test_tokenizer_data_is_validated():
    with pytest.raises(TokenizerError, match="token types"):
        TokenizerData(("a", "b"), (1,), (), 0, None)
    with pytest.raises(TokenizerError, match="eos"):
        TokenizerData(("a",), (1,), (), 5, None)
    with pytest.raises(TokenizerError, match="unknown token types"):
        TokenizerData(("a",), (2,), (), 0, None)


def test_tables_stay_small(instruct_dir):
    """What a loaded model keeps for its tokenizer beyond the vocabulary's strings, at Qwen3's
    vocabulary: the merge ranks, the merged ids as 4-byte integers, every id's bytes in one
    blob; the token -> id map only once token_to_id asks. Measured 16.2 MiB (int objects for
    the merged ids, a bytes object per id and an eager token map took 34)."""
    data = load(instruct_dir)
    gc.collect()
    tracemalloc.start()
    try:
        tok = Tokenizer(data)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert kept < 20 * 2**20, f"{kept / 2**20:.1f} MiB"
    assert tok.token_to_id("Ġworld") == 1879 and tok.decode_bytes([1879, 0]) == b" world!"
