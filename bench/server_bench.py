"""The server workloads: one client script, the same requests, against any OpenAI-compatible server.

    python -m bench server --model kipp-synthetic/qwen3-0.6b-shape --scheme bf16 \
        --servers kipp,llama_cpp,vllm --clients 1,2,4,8 --rounds 3 --expect-path jax=twin

Servers (`--servers`, launchers in bench/servers.py): kipp (`kipp serve`, --backend jax by
default), llama_cpp (llama-cpp-python's `llama_cpp.server`, same GGUF), llama_cpp_cache (the same
with its RAM prompt cache on), vllm (vLLM's CPU OpenAI server on the HF folder).

Two workloads, one record each (type "throughput", the harness's schema), every server measured in
the same run with the same client code:

    server_aggregate  N concurrent streaming clients (N in --clients), each with its own prompt
                      (--prompt-tokens) and max_tokens (--max-tokens), greedy (temperature 0,
                      seed 0), the end-of-generation tokens banned through logit_bias so every
                      stream runs to max_tokens. Value: total completion tokens / wall time of the
                      round (first request sent to last stream closed). Also per client:
                      decode rate (tokens - 1) / (last-token time - first-token time) and TTFT.
    ttft_prefix       time to first token of a ~2,000-token prompt (--ttft-tokens): cold (first
                      time it is sent), reused (sent again at once), and interleaved (sent a
                      third time after --others other ~500-token prompts). max_tokens 1. Each
                      round uses a prompt no earlier request shares a prefix with.

Protocol. All servers are started together and visited in turn (`--mode interleaved`, the
default): in every round, for each client count every server runs its aggregate round, then
every server runs its TTFT sequence; the server order rotates by one each round. Rounds before
--warmup are discarded (kept as `warmup_runs`: JAX compiles its step shapes then). Medians and
MADs are over the measured rounds. `--mode sequential` instead runs one server at a time (all its
rounds, then stop it), for machines without memory for all three at once.

Prompts are corpus text (bench/prompts.py) cut so that Kipp's tokenizer encodes each one to
exactly the requested number of tokens and decodes it back unchanged; every server gets the same
text (llama-cpp-python's server takes no token-id prompts) and every record keeps the prompt
token counts each server reported. Token counts come from each stream's final usage chunk
(`stream_options.include_usage`); a server that sends none (llama-cpp-python) is counted as
max_tokens when its stream ends with finish_reason "length" (exact: it stopped because it had
generated max_tokens), and the source of each count is in the record.
"""

from __future__ import annotations

import functools
import http.client
import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from bench import provenance, records
from bench.servers import (
    SERVERS,
    RunningServer,
    ServerError,
    ServerSpec,
    importable,
    interpreter_versions,
    kipp_server,
    llama_cpp_server,
    log,
    vllm_server,
)
from bench.stats import median, summarize

# Tokens that end a generation in llama.cpp's Qwen3 vocabulary (its end-of-generation set) and in
# Kipp's and vLLM's; banned with logit_bias -100 so every stream runs to max_tokens.
END_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
PHASES = ("cold", "reused", "interleaved")
PREFIX_METRIC_WORDS = ("prefix", "cache_hit", "reused")


@dataclass
class ServerBenchConfig:
    checkpoint: str
    scheme: str = "bf16"
    servers: list[str] = field(default_factory=lambda: list(SERVERS))
    clients: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    rounds: int = 3
    warmup: int = 1
    max_tokens: int = 64
    prompt_tokens: int = 16
    ttft_tokens: int = 2000
    other_tokens: int = 500
    others: int = 3
    kipp_backend: str = "jax"
    expect_paths: dict[str, tuple[str, ...]] = field(default_factory=dict)
    pythons: dict[str, str] = field(default_factory=dict)
    artifact: str | None = None  # default: the registry's artifact for (checkpoint, scheme)
    source: str | None = None  # default: the checkpoint's HF folder (vLLM)
    threads: int = 2
    kv_tokens: int | None = None  # Kipp's pool; default fits the workloads
    max_batch: int = 8
    mode: str = "interleaved"
    results: Path = records.RESULTS
    logs: Path = Path("/tmp/kipp-bench-logs")
    ready_timeout: float = 900.0
    request_timeout: float = 1800.0
    command: str = ""

    def __post_init__(self):
        unknown = [s for s in self.servers if s not in SERVERS]
        if unknown:
            raise ValueError(f"unknown server(s) {unknown}; known: {', '.join(SERVERS)}")
        if self.rounds < 1 or self.warmup < 0:
            raise ValueError("rounds must be >= 1 and warmup >= 0")
        if not self.clients or min(self.clients) < 1:
            raise ValueError("clients must be positive counts")
        if self.max_tokens < 2:
            raise ValueError("max_tokens must be at least 2 (a decode rate needs two tokens)")
        if self.mode not in ("interleaved", "sequential"):
            raise ValueError(f"mode {self.mode!r}: interleaved or sequential")

    @property
    def context(self) -> int:
        """Positions the longest request needs, plus slack, in whole 512s."""
        longest = max(self.ttft_tokens + 1, self.other_tokens + 1,
                      self.prompt_tokens + self.max_tokens)
        return -(-(longest + 64) // 512) * 512


# -- prompts ------------------------------------------------------------------------------------


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


# -- the client ---------------------------------------------------------------------------------


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
        first = last = None
        chunks, text, finish, usage, timings, done = 0, [], None, None, None, False
        while True:
            line = response.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, ": ping" comments, "event:" lines
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if "error" in chunk:
                raise ClientError(f"error in stream: {chunk['error']}")
            choices = chunk.get("choices") or []
            if choices:
                chunks += 1
                first = now if first is None else first
                last = now
                for choice in choices:
                    text.append(choice.get("text") or "")
                    finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("timings"):
                timings = chunk["timings"]
        ended = time.perf_counter()
    finally:
        conn.close()
    if first is None:
        raise ClientError("the stream carried no token")
    if not done:
        raise ClientError("the stream ended without data: [DONE]")
    if usage and usage.get("completion_tokens") is not None:
        tokens, source = int(usage["completion_tokens"]), "usage"
    elif finish == "length":
        tokens, source = max_tokens, "finish_reason=length"
    else:
        tokens, source = chunks, "streamed chunks (approximate)"
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"sent": sent, "first": first, "last": last, "ended": ended, "chunks": chunks,
            "completion_tokens": tokens, "count_source": source, "finish_reason": finish,
            "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens"), "timings": timings,
            "text_chars": sum(len(t) for t in text)}


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


# -- the run ------------------------------------------------------------------------------------


@dataclass
class ServerState:
    spec: ServerSpec
    status: str = "ok"
    reason: str = ""
    server: RunningServer | None = None
    info: dict = field(default_factory=dict)
    agg: dict = field(default_factory=dict)  # clients -> {"warmup": [], "runs": []}
    ttft: dict = field(default_factory=lambda: {p: {"warmup": [], "runs": []} for p in PHASES})
    errors: dict = field(default_factory=dict)  # "aggregate c=N" / "ttft" -> message
    busy_cpu: float = 0.0  # CPU seconds used during its own turns
    order_seen: list = field(default_factory=list)


def default_python(engine: str) -> str:
    import sys

    venv = {"kipp": ".venv", "llama_cpp": ".venv-bench", "llama_cpp_cache": ".venv-bench",
            "vllm": ".venv-vllm"}[engine]
    path = provenance.REPO / venv / "bin" / "python"
    return str(path) if path.exists() else sys.executable


def build_specs(config: ServerBenchConfig) -> list[ServerSpec]:
    from kipp.formats import store

    artifact = config.artifact
    if artifact is None and ({"kipp", "llama_cpp", "llama_cpp_cache"} & set(config.servers)):
        artifact = str(store.ensure_artifact(config.checkpoint, config.scheme))
    specs = []
    for name in config.servers:
        python = (config.pythons.get(name) or
                  (config.pythons.get("llama_cpp") if name == "llama_cpp_cache" else None) or
                  default_python(name))
        if name == "kipp":
            kv = config.kv_tokens or max(8192, config.context * 2)
            specs.append(kipp_server(artifact, backend=config.kipp_backend, python=python,
                                     threads=config.threads, scheme=config.scheme,
                                     kv_tokens=kv, max_batch=config.max_batch,
                                     expect_path=config.expect_paths.get(config.kipp_backend)))
        elif name in ("llama_cpp", "llama_cpp_cache"):
            specs.append(llama_cpp_server(artifact, python=python, threads=config.threads,
                                          scheme=config.scheme, n_ctx=config.context,
                                          cache=name == "llama_cpp_cache"))
        else:
            source = config.source or str(store.source_folder(config.checkpoint))
            specs.append(vllm_server(source, python=python, threads=config.threads,
                                     max_model_len=config.context,
                                     max_num_seqs=config.max_batch))
    return specs


def start(state: ServerState, config: ServerBenchConfig) -> None:
    """Launch the server, wait for it, check its path (Kipp), read its versions."""
    spec = state.spec
    ok, why = importable(spec.python, spec.module)
    if not ok:
        state.status, state.reason = "unavailable", why
        log(f"{spec.name}: unavailable: {why}")
        return
    state.info["versions"] = interpreter_versions(spec.python)
    log(f"{spec.name}: starting: {' '.join(spec.command)}")
    slug = spec.name.replace("/", "_")
    state.server = RunningServer(spec, config.logs / f"server-{slug}.log")
    try:
        state.server.wait_ready(config.ready_timeout)
    except ServerError as e:
        state.status, state.reason = "failed", f"start: {e}"
        log(f"{spec.name}: failed to start: {e}")
        stop(state)
        return
    server = state.server
    state.info.update({"model_id": server.model_id, "model_card": server.card,
                       "health_status": server.health, "ready_seconds": server.ready_seconds,
                       "url": server.url, "log": str(server.log)})
    if spec.engine == "kipp":
        from bench.fallback import FallbackError, check_kernel_path

        described = (server.card.get("kipp") or {}).get("backend", "")
        state.info["describe"] = described
        try:
            check_kernel_path(spec.options["backend"], spec.scheme, described, spec.expect_path)
        except FallbackError as e:
            state.status = "refused"
            state.reason = (f"{e} (accept the named path with --expect-path "
                            f"{spec.options['backend']}=WORDS)")
            log(f"{spec.name}: refused: {state.reason}")
            stop(state)
            return
    state.info["idle_cpu_start"] = server.cpu_seconds()
    log(f"{spec.name}: ready in {server.ready_seconds:.1f} s as {server.model_id!r}"
        f"{' (' + state.info['describe'] + ')' if state.info.get('describe') else ''}")


def stop(state: ServerState) -> None:
    server = state.server
    if server is None:
        return
    try:
        rss = server.peak_rss()
        cpu = server.cpu_seconds()
        state.info["peak_rss"] = rss
        if cpu is not None and state.info.get("idle_cpu_start") is not None:
            state.info["cpu_seconds_total_after_ready"] = cpu - state.info["idle_cpu_start"]
            state.info["cpu_seconds_outside_own_turns"] = (
                cpu - state.info["idle_cpu_start"] - state.busy_cpu)
    finally:
        state.info["exit_code"] = server.stop()
        from bench.runner import fallback_lines

        state.info["log_warnings"] = fallback_lines(server.log)
        state.info["log_tail"] = server.log_tail(1500)
        state.server = None


def _turn(state: ServerState, what: str, fn):
    """Run one measured piece on a server, charging its CPU time to the server's own turns."""
    server = state.server
    before = server.cpu_seconds() or 0.0
    try:
        return fn(server)
    finally:
        after = server.cpu_seconds()
        if after is not None:
            state.busy_cpu += after - before
        state.order_seen.append(what)


def run_aggregate(state: ServerState, config: ServerBenchConfig, book: PromptBook, ban,
                  round_index: int, clients: int) -> None:
    key = f"aggregate c={clients}"
    if state.server is None or key in state.errors:
        return
    prompts = [book.get(("agg", round_index, clients, i), config.prompt_tokens)["text"]
               for i in range(clients)]
    warm = round_index < config.warmup
    try:
        result = _turn(state, key, lambda s: aggregate_round(
            s.url, s.model_id, prompts, config.max_tokens, ban, config.request_timeout))
    except Exception as e:
        _failed(state, key, e)
        return
    bucket = state.agg.setdefault(clients, {"warmup": [], "runs": []})
    bucket["warmup" if warm else "runs"].append({"round": round_index, **result})
    log(f"round {round_index + 1} {state.spec.name} c={clients}: {result['value']:.2f} tok/s "
        f"aggregate ({result['completion_tokens']} tokens in {result['wall_s']:.1f} s)"
        f"{' (warm-up, discarded)' if warm else ''}")


def run_ttft(state: ServerState, config: ServerBenchConfig, book: PromptBook, ban,
             round_index: int) -> None:
    if state.server is None or "ttft" in state.errors:
        return
    long_prompt = book.get(("ttft", round_index), config.ttft_tokens)["text"]
    others = [book.get(("other", round_index, k), config.other_tokens)["text"]
              for k in range(config.others)]
    warm = round_index < config.warmup
    try:
        result = _turn(state, "ttft", lambda s: ttft_round(s, long_prompt, others, ban,
                                                           config.request_timeout))
    except Exception as e:
        _failed(state, "ttft", e)
        return
    for phase in PHASES:
        state.ttft[phase]["warmup" if warm else "runs"].append(
            {"round": round_index, **result[phase]})
    log(f"round {round_index + 1} {state.spec.name} TTFT: "
        + ", ".join(f"{p} {result[p]['ttft_s']:.3f} s (cached {result[p]['cached_tokens']})"
                    for p in PHASES) + (" (warm-up, discarded)" if warm else ""))


def _failed(state: ServerState, key: str, error: Exception) -> None:
    message = f"{type(error).__name__}: {error}"
    if state.server is not None and state.server.proc.poll() is not None:
        message += f"\nserver exited ({state.server.proc.returncode}); log tail:\n" \
                   f"{state.server.log_tail()}"
        stop(state)
    state.errors[key] = message
    log(f"{state.spec.name} {key}: failed: {message}")


def check_tokenization(state: ServerState, book: PromptBook, config: ServerBenchConfig) -> None:
    """llama-cpp-python's stream reports no prompt token counts: ask its /extras/tokenize how it
    splits two of the run's prompts and record whether its ids are Kipp's."""
    if state.server is None or state.spec.engine != "llama_cpp":
        return
    tokenizer, found = _tokenizer(), []
    for key, length in ((("agg", 0, config.clients[0], 0), config.prompt_tokens),
                        (("ttft", 0), config.ttft_tokens)):
        text = book.get(key, length)["text"]
        try:
            ids = _post_json(state.server.url + "/extras/tokenize",
                             {"model": state.server.model_id, "input": text})["tokens"]
        except Exception as e:  # recorded; the measurement does not depend on it
            found.append({"prompt": list(key), "error": f"{type(e).__name__}: {e}"})
            continue
        found.append({"prompt": list(key), "kipp_tokens": length, "server_tokens": len(ids),
                      "same_ids": ids == tokenizer.encode(text)})
    state.info["tokenization_check"] = found
    log(f"{state.spec.name}: tokenization check {found}")


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


def _rotate(items: list, by: int) -> list:
    if not items:
        return items
    by %= len(items)
    return items[by:] + items[:by]


def run(config: ServerBenchConfig) -> list[Path]:
    """Measure every server; write the server_aggregate and ttft_prefix records."""
    states = [ServerState(spec) for spec in build_specs(config)]
    book, ban = PromptBook(), end_token_ids()
    total_rounds = config.warmup + config.rounds
    order: list[str] = []
    began = time.perf_counter()
    try:
        if config.mode == "interleaved":
            for state in states:
                start(state, config)
                check_tokenization(state, book, config)
            for r in range(total_rounds):
                visit = _rotate([s for s in states if s.status == "ok"], r)
                for clients in config.clients:
                    for state in visit:
                        run_aggregate(state, config, book, ban, r, clients)
                        order.append(f"r{r + 1} {state.spec.name} c={clients}")
                for state in visit:
                    run_ttft(state, config, book, ban, r)
                    order.append(f"r{r + 1} {state.spec.name} ttft")
        else:
            for state in states:
                start(state, config)
                check_tokenization(state, book, config)
                try:
                    for r in range(total_rounds):
                        for clients in config.clients:
                            run_aggregate(state, config, book, ban, r, clients)
                            order.append(f"r{r + 1} {state.spec.name} c={clients}")
                        run_ttft(state, config, book, ban, r)
                        order.append(f"r{r + 1} {state.spec.name} ttft")
                finally:
                    stop(state)
    finally:
        for state in states:
            stop(state)
    elapsed = time.perf_counter() - began
    prov = provenance.collect()
    checkpoint = records.checkpoint_block(config.checkpoint)
    protocol = _protocol(config, order, elapsed, ban)
    servers_block = [{"spec": s.spec.to_json(), "status": s.status, "reason": s.reason,
                      **s.info} for s in states]
    written = []
    agg_record = records.new(
        "throughput", config.command, checkpoint, prov,
        workload={"name": "server_aggregate", "kind": "server",
                  "description": "aggregate decode tok/s of N concurrent streaming clients "
                                 "(total completion tokens / round wall time)",
                  "params": {"prompt_tokens": config.prompt_tokens,
                             "max_tokens": config.max_tokens, "clients": list(config.clients)},
                  "unit": "tok/s", "higher_is_better": True, "planned": False},
        protocol=protocol, servers=servers_block,
        arms=[_aggregate_arm(s, c, config) for s in states for c in config.clients])
    written.append(records.write(agg_record, config.results))
    ttft_record = records.new(
        "throughput", config.command, checkpoint, prov,
        workload={"name": "ttft_prefix", "kind": "ttft",
                  "description": "time to first token of a repeated prompt: cold, reused at "
                                 "once, reused after other prompts",
                  "params": {"prompt_tokens": config.ttft_tokens,
                             "other_prompt_tokens": config.other_tokens,
                             "others_between": config.others, "max_tokens": 1},
                  "unit": "s", "higher_is_better": False, "planned": False},
        protocol=protocol, servers=servers_block,
        arms=[_ttft_arm(s, p, config) for s in states for p in PHASES])
    written.append(records.write(ttft_record, config.results))
    for path in written:
        log(f"wrote {path}")
    return written


def _protocol(config: ServerBenchConfig, order: list[str], elapsed: float, ban) -> dict:
    return {"mode": config.mode,
            "interleave": ("all servers loaded together; per round, each client count visits "
                           "every server in turn, then every server runs its TTFT sequence; "
                           "the server order rotates by one each round"
                           if config.mode == "interleaved" else
                           "one server at a time, all its rounds, then it is stopped"),
            "rounds": config.rounds, "warmup_rounds": config.warmup, "order": order,
            "threads": config.threads, "elapsed_s": elapsed,
            "client": "bench/server_bench.py: http.client, one thread per streaming client, "
                      "all released by a barrier; SSE parsed line by line",
            "timer": "time.perf_counter in the client process",
            "request": {"endpoint": "/v1/completions", "temperature": 0.0, "seed": 0,
                        "stream": True, "stream_options": {"include_usage": True},
                        "logit_bias": {str(t): -100 for t in ban}},
            "banned_end_tokens": dict(zip(END_TOKENS, end_token_ids())),
            "aggregate": "total completion tokens / (last stream closed - first request sent)",
            "per_client_decode": "(completion tokens - 1) / (last token chunk - first token "
                                 "chunk), per client",
            "ttft": "request sent to first chunk carrying a choice (max_tokens 1)",
            "prompts": "corpus text, Kipp-tokenizer-exact lengths, no two prompts sharing "
                       "their first 16 tokens; the same text for every server",
            "statistics": "median and raw MAD over the measured rounds (warm-up discarded)"}


def _base_arm(state: ServerState, label: str, config: ServerBenchConfig) -> dict:
    spec = state.spec
    return {"arm": f"{spec.name} {label}", "engine": spec.engine,
            "backend": spec.options.get("backend"), "scheme": spec.scheme,
            "spec": spec.to_json(), "python": spec.python,
            "sizing": {"runs": config.rounds, "warmup": config.warmup}}


def _peak(state: ServerState) -> int | None:
    return (state.info.get("peak_rss") or {}).get("max_bytes")


def _not_ok(entry: dict, state: ServerState, error_key: str) -> dict | None:
    if state.status != "ok":
        return {**entry, "status": state.status, "reason": state.reason, "info": state.info}
    if error_key in state.errors:
        return {**entry, "status": "failed", "reason": state.errors[error_key],
                "info": state.info}
    return None


def _aggregate_arm(state: ServerState, clients: int, config: ServerBenchConfig) -> dict:
    entry = _base_arm(state, f"c={clients}", config)
    bad = _not_ok(entry, state, f"aggregate c={clients}")
    if bad:
        return bad
    got = state.agg.get(clients) or {"warmup": [], "runs": []}
    if not got["runs"]:
        return {**entry, "status": "failed", "info": state.info,
                "reason": "no measured round (the server had stopped)"}
    values = [r["value"] for r in got["runs"]]
    rates = [c["decode_tok_s"] for r in got["runs"] for c in r["per_client"]
             if c["decode_tok_s"]]
    ttfts = [c["ttft_s"] for r in got["runs"] for c in r["per_client"]]
    return {**entry, "status": "ok", "info": state.info,
            "engine_warnings": state.info.get("log_warnings", []),
            "params": {"clients": clients, "max_tokens": config.max_tokens,
                       "prompt_tokens": config.prompt_tokens},
            "warmup_runs": got["warmup"], "runs": got["runs"], "values": values,
            "summary": summarize(values),
            "per_client_decode_tok_s": summarize(rates) if rates else None,
            "per_client_ttft_s": summarize(ttfts),
            "peak_rss_bytes": _peak(state)}


def _ttft_arm(state: ServerState, phase: str, config: ServerBenchConfig) -> dict:
    entry = _base_arm(state, phase, config)
    bad = _not_ok(entry, state, "ttft")
    if bad:
        return bad
    got = state.ttft[phase]
    if not got["runs"]:
        return {**entry, "status": "failed", "info": state.info,
                "reason": "no measured round (the server had stopped)"}
    values = [r["value"] for r in got["runs"]]
    return {**entry, "status": "ok", "info": state.info,
            "engine_warnings": state.info.get("log_warnings", []),
            "params": {"phase": phase, "prompt_tokens": config.ttft_tokens,
                       "other_prompt_tokens": config.other_tokens,
                       "others_between": config.others if phase == "interleaved" else 0},
            "warmup_runs": got["warmup"], "runs": got["runs"], "values": values,
            "summary": summarize(values), "peak_rss_bytes": _peak(state)}


# -- terminal summary ---------------------------------------------------------------------------


def summary_lines(path: Path) -> list[str]:
    """A plain-text table of one server record."""
    record = json.loads(Path(path).read_text())
    unit = record["workload"]["unit"]
    lines = [f"{record['workload']['name']}: {path}"]
    for arm in record["arms"]:
        if arm["status"] != "ok":
            reason = " ".join(str(arm.get("reason", "")).split())[:160]
            lines.append(f"  {arm['arm']:<28} {arm['status']}: {reason}")
            continue
        s = arm["summary"]
        extra = ""
        if arm.get("per_client_decode_tok_s"):
            extra = f"  per-client decode {arm['per_client_decode_tok_s']['median']:.2f} tok/s"
        if "phase" in arm.get("params", {}):
            cached = [r.get("cached_tokens") for r in arm["runs"]]
            extra = f"  cached tokens {cached}"
        lines.append(f"  {arm['arm']:<28} {s['median']:.4g} ± {s['mad']:.2g} {unit} "
                     f"(n={s['n']}){extra}")
    return lines


def exit_status(paths: list[Path]) -> int:
    """0 when every arm measured; 3 when an arm of any engine was refused or failed (a crashed
    server included), or Kipp's own server was unavailable."""
    for path in paths:
        for arm in json.loads(Path(path).read_text())["arms"]:
            if arm["status"] in ("refused", "failed") or (
                    arm["engine"] == "kipp" and arm["status"] == "unavailable"):
                return 3
    return 0
