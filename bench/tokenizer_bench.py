"""Encode speed of Kipp's tokenizer against the `tokenizers` package, both on one thread.

Builds a deterministic mixed-language text (the test corpus plus seeded pseudo-prose in eight
scripts, code and numbers, Zipf-distributed words so the word cache sees realistic misses),
checks both tokenizers give identical ids, and reports MB/s (median, min, max of --runs).
Kipp's word cache is cleared before every run, so its numbers are cold-cache numbers.

    python bench/tokenizer_bench.py [--size-mb 1.5] [--runs 5] [--json OUT]
"""

from __future__ import annotations

import os

# One thread for the Rust side; must be set before `tokenizers` is imported.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import tokenizers  # noqa: E402

from kipp.text.tokenizer import Tokenizer  # noqa: E402
from kipp.text.tokenizer_files import tokenizer_config, tokenizer_json_bytes  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "tokenizer_corpus.jsonl"

# Letters each pseudo-language builds its words from, and how its words are joined.
SCRIPTS = {
    "latin": ("abcdefghijklmnopqrstuvwxyzéèàüöñç", " "),
    "cyrillic": ("абвгдеёжзийклмнопрстуфхцчшщъыьэюя", " "),
    "greek": ("αβγδεζηθικλμνξοπρστυφχψωάέήίόύώ", " "),
    "arabic": ("ابتثجحخدذرزسشصضطظعغفقكلمنهوي", " "),
    "devanagari": ("कखगघचछजझटठडढणतथदधनपफबभमयरलवशषसहािीुूेैोौं", " "),
    "hangul": ("".join(chr(c) for c in range(0xAC00, 0xAC00 + 400)), " "),
    "cjk": ("".join(chr(c) for c in range(0x4E00, 0x4E00 + 2500)), ""),
    "thai": ("กขคงจฉชซญดตถทนบปผพฟมยรลวสหอะาิีึืุูเแโใไ่้", ""),
}
CODE = [
    "def f{n}(x):\n    return x * {n} + len(str(x))\n",
    "for (int i = 0; i < {n}; ++i) {{ total += data[i]; }}\n",
    '{{"id": {n}, "name": "item-{n}", "ok": true, "score": {n}.5}}\n',
    "SELECT * FROM t{n} WHERE id = {n} ORDER BY created_at DESC;\n",
]


def build_text(size_mb: float, seed: int = 0) -> str:
    """A deterministic mixed text of at least size_mb megabytes of UTF-8."""
    rng = random.Random(seed)
    vocab = {name: _pseudo_words(rng, letters, 4000) for name, (letters, _) in SCRIPTS.items()}
    corpus = [json.loads(line) for line in CORPUS.read_text("utf-8").split("\n") if line]
    chunks = [line for line in corpus if len(line) < 2000]
    size = sum(len(c.encode()) for c in chunks)
    while size < size_mb * 1e6:
        chunk = _paragraph(rng, vocab)
        chunks.append(chunk)
        size += len(chunk.encode())
    return "\n".join(chunks)


def _pseudo_words(rng: random.Random, letters: str, count: int) -> list[str]:
    return ["".join(rng.choice(letters) for _ in range(rng.randint(1, 9))) for _ in range(count)]


def _paragraph(rng: random.Random, vocab: dict[str, list[str]]) -> str:
    kind = rng.random()
    if kind < 0.1:
        return rng.choice(CODE).format(n=rng.randint(0, 10**6))
    if kind < 0.15:
        return " ".join(str(rng.randint(0, 10 ** rng.randint(1, 12))) for _ in range(12)) + "\n"
    name = rng.choice(list(SCRIPTS))
    words = vocab[name]
    # Zipf-like: low indices are common, so the cache hit rate resembles real prose.
    picks = [words[min(int(rng.paretovariate(1.0)) - 1, len(words) - 1)] for _ in range(40)]
    sep = SCRIPTS[name][1]
    return sep.join(picks) + rng.choice([". ", "!\n", "?\n\n", ", ", "。", "\n"])


def time_runs(encode, runs: int, before=lambda: None) -> tuple[list[float], list]:
    seconds, result = [], None
    for _ in range(runs):
        before()
        start = time.perf_counter()
        result = encode()
        seconds.append(time.perf_counter() - start)
    return seconds, result


def bench(size_mb: float, runs: int) -> dict:
    text = build_text(size_mb)
    megabytes = len(text.encode("utf-8")) / 1e6
    lines = [line + "\n" for line in text.split("\n")]
    ref = tokenizers.Tokenizer.from_str(tokenizer_json_bytes().decode("utf-8"))
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "tokenizer.json").write_bytes(tokenizer_json_bytes())
        (Path(folder) / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config("instruct")))
        kipp = Tokenizer.from_files(Path(folder) / "tokenizer.json",
                                    Path(folder) / "tokenizer_config.json")
    clear = kipp._cached_piece.cache_clear
    modes = {
        "one string": (lambda: kipp.encode(text), lambda: ref.encode(text).ids),
        "per line": (lambda: [kipp.encode(line) for line in lines],
                     lambda: [ref.encode(line).ids for line in lines]),
    }
    results = {"text_mb": round(megabytes, 3), "runs": runs, "modes": {}}
    for mode, (kipp_encode, ref_encode) in modes.items():
        kipp_s, kipp_ids = time_runs(kipp_encode, runs, before=clear)
        ref_s, ref_ids = time_runs(ref_encode, runs)
        if kipp_ids != ref_ids:
            raise SystemExit(f"{mode}: Kipp's ids differ from the tokenizers package")
        results["modes"][mode] = {
            "kipp_mb_s": _speeds(megabytes, kipp_s),
            "tokenizers_mb_s": _speeds(megabytes, ref_s),
            "ratio": round(statistics.median(kipp_s) / statistics.median(ref_s), 2),
        }
    return results


def _speeds(megabytes: float, seconds: list[float]) -> dict:
    return {"median": round(megabytes / statistics.median(seconds), 3),
            "min": round(megabytes / max(seconds), 3), "max": round(megabytes / min(seconds), 3)}


def print_table(results: dict) -> None:
    print(f"text: {results['text_mb']} MB, {results['runs']} runs each, one thread; "
          "ratio = Kipp time / tokenizers time")
    print(f"{'mode':<11} {'engine':<11} {'median MB/s':>11} {'min':>8} {'max':>8} {'ratio':>6}")
    for mode, row in results["modes"].items():
        for engine, key in (("kipp", "kipp_mb_s"), ("tokenizers", "tokenizers_mb_s")):
            s = row[key]
            ratio = f"{row['ratio']:>6}" if engine == "kipp" else ""
            print(f"{mode:<11} {engine:<11} {s['median']:>11} {s['min']:>8} {s['max']:>8} {ratio}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=1.5, help="text size (at least 1 MB)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    args = parser.parse_args(argv)
    results = bench(max(args.size_mb, 1.0), args.runs)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
