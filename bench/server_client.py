"""The server workloads' client: exact-length prompts and one streaming /v1/completions client,
the same for every OpenAI-compatible server (bench/server_bench.py runs the workloads with it).

Prompts are corpus text (bench/prompts.py) cut so that Kipp's tokenizer encodes each one to
exactly the requested number of tokens and decodes it back unchanged; every server gets the same
text (llama-cpp-python's server takes no token-id prompts). Token counts come from each stream's
final usage chunk (`stream_options.include_usage`); a server that sends none (llama-cpp-python)
is counted as max_tokens when its stream ends with finish_reason "length" (exact: it stopped
because it had generated max_tokens), and the source of each count is in the record.
"""

from __future__ import annotations

import functools
import http.client
import json
import math
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from bench.servers import RunningServer
from bench.stats import median

# Tokens that end a generation in llama.cpp's Qwen3 vocabulary (its end-of-generation set) and in
# Kipp's and vLLM's; banned with logit_bias -100 so every stream runs to max_tokens.
END_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
PREFIX_METRIC_WORDS = ("prefix", "cache_hit", "reused")



@functools.lru_cache(maxsize=1)
def _tokenizer():
    """Kipp's tokenizer with the base config (the Qwen3 vocabulary every server shares)."""
    import tempfile

    from kipp.text.tokenizer import Tokenizer
    from kipp.text.tokenizer_files import tokenizer_config, tokenizer_json_bytes

    with tempfile.TemporaryDirectory() as folder:
        tokenizer_json = Path(folder) / "tokenizer.json"
        config_json = Path(folder) / "tokenizer_config.json"
        tokenizer_json.write_bytes(tokenizer_json_bytes())
        config_json.write_text(json.dumps(tokenizer_config("base")))
        return Tokenizer.from_files(tokenizer_json, config_json)


def end_token_ids() -> list[int]:
    tokenizer = _tokenizer()
    ids = [tokenizer.token_to_id(name) for name in END_TOKENS]
    return sorted({i for i in ids if i is not None})


class PromptBook:
    """Corpus prompts of exact token counts, no two sharing their first 16 tokens (so no server
    can reuse one prompt's KV for another), the same text for every server."""

    KEY = 16
    STRIDE = 7919  # a prime: successive prompts start far apart in the corpus

    def __init__(self):
        from bench.prompts import corpus_tokens

        self.corpus = corpus_tokens()
        self.used: set[tuple[int, ...]] = set()
        self.next = 0
        self.cache: dict[tuple, dict] = {}

    def get(self, key: tuple, length: int) -> dict:
        """The prompt named `key` (made on first use): {"text", "tokens", "offset"}."""
        if key not in self.cache:
            self.cache[key] = self._make(length)
        return self.cache[key]

    def _make(self, length: int) -> dict:
        tokenizer = _tokenizer()
        n = len(self.corpus)
        for _ in range(2000):
            offset = self.next % n
            self.next += self.STRIDE
            ids = [self.corpus[(offset + i) % n] for i in range(length)]
            head = tuple(ids[: self.KEY])
            if head in self.used:
                continue
            text = tokenizer.decode(ids)
            if tokenizer.encode(text) != ids:  # cut inside a character or a merge: next one
                continue
            self.used.add(head)
            return {"text": text, "tokens": length, "offset": offset}
        raise RuntimeError(f"no round-trip-stable {length}-token prompt found in the corpus")



class ClientError(RuntimeError):
    """A request was refused or its stream broke."""


def stream_completion(url: str, model: str, prompt: str, max_tokens: int, ban: list[int],
                      timeout: float) -> dict:
    """One streamed /v1/completions request; times are time.perf_counter() values."""
    parts = urlsplit(url)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "seed": 0, "stream": True, "stream_options": {"include_usage": True}}
    if ban:
        body["logit_bias"] = {str(t): -100 for t in ban}
    payload = json.dumps(body).encode()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        sent = time.perf_counter()
        conn.request("POST", "/v1/completions", body=payload,
                     headers={"Content-Type": "application/json",
                              "Accept": "text/event-stream"})
        response = conn.getresponse()
        if response.status != 200:
            raise ClientError(f"HTTP {response.status}: "
                              f"{response.read().decode('utf-8', 'replace')[:500]}")
        got = _read_stream(response)
        ended = time.perf_counter()
    finally:
        conn.close()
    if got["first"] is None:
        raise ClientError("the stream carried no token")
    if not got["done"]:
        raise ClientError("the stream ended without data: [DONE]")
    usage = got["usage"] or {}
    if usage.get("completion_tokens") is not None:
        tokens, source = int(usage["completion_tokens"]), "usage"
    elif got["finish"] == "length":
        tokens, source = max_tokens, "finish_reason=length"
    else:
        tokens, source = got["chunks"], "streamed chunks (approximate)"
    details = usage.get("prompt_tokens_details") or {}
    return {"sent": sent, "first": got["first"], "last": got["last"], "ended": ended,
            "chunks": got["chunks"], "completion_tokens": tokens, "count_source": source,
            "finish_reason": got["finish"], "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens"), "timings": got["timings"],
            "text_chars": got["text_chars"]}


def _read_stream(response) -> dict:
    """The SSE events of one completion stream: first and last token times, chunks, text
    length, the finish reason, and the usage and timings the server sent (None if none)."""
    got = {"first": None, "last": None, "chunks": 0, "text_chars": 0, "finish": None,
           "usage": None, "timings": None, "done": False}
    while line := response.readline():
        line = line.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, ": ping" comments, "event:" lines
        data = line[5:].strip()
        if data == b"[DONE]":
            got["done"] = True
            break
        now = time.perf_counter()
        chunk = json.loads(data)
        if "error" in chunk:
            raise ClientError(f"error in stream: {chunk['error']}")
        choices = chunk.get("choices") or []
        if choices:
            got["chunks"] += 1
            got["first"] = now if got["first"] is None else got["first"]
            got["last"] = now
            for choice in choices:
                got["text_chars"] += len(choice.get("text") or "")
                got["finish"] = choice.get("finish_reason") or got["finish"]
        got["usage"] = chunk.get("usage") or got["usage"]
        got["timings"] = chunk.get("timings") or got["timings"]
    return got


def _positive(seconds: float, what: str) -> float:
    if not seconds > 0 or not math.isfinite(seconds):
        raise ClientError(f"non-positive {what}: {seconds!r} (clock or harness bug)")
    return seconds


def aggregate_round(url: str, model: str, prompts: list[str], max_tokens: int, ban: list[int],
                    timeout: float) -> dict:
    """All prompts at once, one streaming client thread each; the round's numbers."""
    n = len(prompts)
    barrier = threading.Barrier(n + 1)
    got: list[dict | None] = [None] * n
    errors: list[str] = []

    def client(i: int) -> None:
        barrier.wait()
        try:
            got[i] = stream_completion(url, model, prompts[i], max_tokens, ban, timeout)
        except Exception as e:  # recorded, the round fails as a whole
            errors.append(f"client {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join(timeout + 60)
    if errors or any(g is None for g in got):
        raise ClientError("; ".join(errors) or "a client did not finish")
    start = min(g["sent"] for g in got)
    wall = _positive(max(g["ended"] for g in got) - start, "round wall time")
    total = sum(g["completion_tokens"] for g in got)
    per_client = []
    for g in got:
        span = g["last"] - g["first"]
        rate = (g["completion_tokens"] - 1) / span if g["completion_tokens"] > 1 and span > 0 \
            else None
        per_client.append({
            "completion_tokens": g["completion_tokens"], "count_source": g["count_source"],
            "finish_reason": g["finish_reason"], "prompt_tokens": g["prompt_tokens"],
            "cached_tokens": g["cached_tokens"], "chunks": g["chunks"],
            "sent_s": g["sent"] - start, "ttft_s": _positive(g["first"] - g["sent"], "TTFT"),
            "last_token_s": g["last"] - start, "ended_s": g["ended"] - start,
            "decode_tok_s": rate, "server_timings": g["timings"]})
    rates = [c["decode_tok_s"] for c in per_client if c["decode_tok_s"]]
    first_token = min(g["first"] for g in got)
    last_token = max(g["last"] for g in got)
    decode_window = last_token - first_token
    return {"value": total / wall, "wall_s": wall, "completion_tokens": total, "clients": n,
            "max_tokens": max_tokens,
            "decode_window_tok_s": (total - n) / decode_window if decode_window > 0 else None,
            "per_client_decode_tok_s_median": (median(rates) if rates else None),
            "per_client": per_client}


def _prefix_metrics(server: RunningServer) -> dict[str, float]:
    metrics = server.metrics() or {}
    return {k: v for k, v in metrics.items()
            if any(w in k.lower() for w in PREFIX_METRIC_WORDS) and not k.endswith("_created")}


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def ttft_request(server: RunningServer, prompt: str, ban: list[int], timeout: float) -> dict:
    before = _prefix_metrics(server)
    got = stream_completion(server.url, server.model_id, prompt, 1, ban, timeout)
    after = _prefix_metrics(server)
    return {"value": _positive(got["first"] - got["sent"], "TTFT"),
            "ttft_s": got["first"] - got["sent"], "prompt_tokens": got["prompt_tokens"],
            "cached_tokens": got["cached_tokens"], "completion_tokens": got["completion_tokens"],
            "count_source": got["count_source"], "server_timings": got["timings"],
            "prefix_metrics_delta": _delta(before, after)}


def ttft_round(server: RunningServer, long_prompt: str, others: list[str], ban: list[int],
               timeout: float) -> dict:
    """cold, reused at once, and reused after `others`: {phase: run}, plus the others' runs."""
    cold = ttft_request(server, long_prompt, ban, timeout)
    reused = ttft_request(server, long_prompt, ban, timeout)
    between = [ttft_request(server, p, ban, timeout) for p in others]
    interleaved = ttft_request(server, long_prompt, ban, timeout)
    interleaved["between"] = between
    return {"cold": cold, "reused": reused, "interleaved": interleaved}


def tokenization_check(url: str, model: str, book: PromptBook,
                       prompts: tuple[tuple[tuple, int], ...]) -> list[dict]:
    """How the server's /extras/tokenize (llama-cpp-python's) splits each (key, length) prompt of
    `book`, and whether its ids are Kipp's; an error is recorded, not raised."""
    tokenizer, found = _tokenizer(), []
    for key, length in prompts:
        text = book.get(key, length)["text"]
        try:
            ids = _post_json(url + "/extras/tokenize", {"model": model, "input": text})["tokens"]
        except Exception as e:  # recorded; the measurement does not depend on it
            found.append({"prompt": list(key), "error": f"{type(e).__name__}: {e}"})
            continue
        found.append({"prompt": list(key), "kipp_tokens": length, "server_tokens": len(ids),
                      "same_ids": ids == tokenizer.encode(text)})
    return found


def _post_json(url: str, body: dict, timeout: float = 60.0) -> dict:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("POST", parts.path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise ClientError(f"HTTP {response.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()
