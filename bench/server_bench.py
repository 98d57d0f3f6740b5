"""The server workloads against any OpenAI-compatible server, the same client and requests for each.

    python -m bench server --model kipp-synthetic/qwen3-0.6b-shape --scheme bf16 \
        --servers kipp,llama_cpp,vllm --clients 1,2,4,8 --rounds 3

Servers (launchers in bench/servers.py): kipp (`kipp serve`, --backend jax by default), llama_cpp
(llama-cpp-python's `llama_cpp.server`, same GGUF), llama_cpp_cache (the same with its RAM prompt
cache on), vllm (vLLM's CPU OpenAI server on the HF folder). Two workloads, one record each:

    server_aggregate  N concurrent greedy streaming clients (--clients), end-of-generation tokens
                      banned so each runs to --max-tokens: total completion tokens / round wall
                      time (first request sent to last stream closed); per client, decode rate
                      (tokens - 1) / (last - first token time) and TTFT.
    ttft_prefix       TTFT of a --ttft-tokens prompt: cold, reused at once, and reused after
                      --others other prompts (max_tokens 1; a fresh prompt every round).

Servers take turns each round (`--mode interleaved`; `sequential` runs one at a time, for machines
without memory for all); warm-up rounds are kept apart. The client: bench/server_client.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import provenance, records
from bench.fallback import expected_path
from bench.server_client import (
    END_TOKENS,
    PromptBook,
    aggregate_round,
    end_token_ids,
    tokenization_check,
    ttft_round,
)
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
from bench.stats import summarize

PHASES = ("cold", "reused", "interleaved")


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
                                     expect_path=expected_path(
                                         config.kipp_backend,
                                         config.expect_paths.get(config.kipp_backend))))
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
            state.reason = str(e)
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
    """llama-cpp-python's stream reports no prompt token counts: record how it splits two of
    the run's prompts, and whether its ids are Kipp's."""
    if state.server is None or state.spec.engine != "llama_cpp":
        return
    prompts = ((("agg", 0, config.clients[0], 0), config.prompt_tokens),
               (("ttft", 0), config.ttft_tokens))
    found = tokenization_check(state.server.url, state.server.model_id, book, prompts)
    state.info["tokenization_check"] = found
    log(f"{state.spec.name}: tokenization check {found}")


def _rotate(items: list, by: int) -> list:
    if not items:
        return items
    by %= len(items)
    return items[by:] + items[:by]


def run(config: ServerBenchConfig) -> list[Path]:
    """Measure every server; write the server_aggregate and ttft_prefix records."""
    states = [ServerState(spec) for spec in build_specs(config)]
    book, ban = PromptBook(), end_token_ids()
    began = time.perf_counter()
    try:
        visit = _interleaved if config.mode == "interleaved" else _sequential
        order = visit(states, config, book, ban)
    finally:
        for state in states:
            stop(state)
    written = _write_records(states, config, _protocol(config, order,
                                                       time.perf_counter() - began, ban))
    for path in written:
        log(f"wrote {path}")
    return written


def _interleaved(states: list[ServerState], config: ServerBenchConfig, book: PromptBook,
                 ban) -> list[str]:
    """Every server started; each round visits them all, the order rotating by one each round.
    Returns the order."""
    order = []
    for state in states:
        start(state, config)
        check_tokenization(state, book, config)
    for r in range(config.warmup + config.rounds):
        _round(_rotate([s for s in states if s.status == "ok"], r), r, config, book, ban, order)
    return order


def _sequential(states: list[ServerState], config: ServerBenchConfig, book: PromptBook,
                ban) -> list[str]:
    """One server at a time: started, all its rounds, stopped. Returns the order."""
    order = []
    for state in states:
        start(state, config)
        check_tokenization(state, book, config)
        try:
            for r in range(config.warmup + config.rounds):
                _round([state], r, config, book, ban, order)
        finally:
            stop(state)
    return order


def _round(visit: list[ServerState], r: int, config: ServerBenchConfig, book: PromptBook, ban,
           order: list[str]) -> None:
    """Round r: for each client count every server in `visit` runs its aggregate round, then
    every one runs its TTFT sequence; each turn is appended to `order`."""
    for clients in config.clients:
        for state in visit:
            run_aggregate(state, config, book, ban, r, clients)
            order.append(f"r{r + 1} {state.spec.name} c={clients}")
    for state in visit:
        run_ttft(state, config, book, ban, r)
        order.append(f"r{r + 1} {state.spec.name} ttft")


def _write_records(states: list[ServerState], config: ServerBenchConfig,
                   protocol: dict) -> list[Path]:
    prov = provenance.collect()
    checkpoint = records.checkpoint_block(config.checkpoint)
    servers_block = [{"spec": s.spec.to_json(), "status": s.status, "reason": s.reason,
                      **s.info} for s in states]

    def write(workload: dict, arms: list[dict]) -> Path:
        record = records.new("throughput", config.command, checkpoint, prov,
                             workload={**workload, "planned": False}, protocol=protocol,
                             servers=servers_block, arms=arms)
        return records.write(record, config.results)

    aggregate = write(
        {"name": "server_aggregate", "kind": "server",
         "description": "aggregate decode tok/s of N concurrent streaming clients (total "
                        "completion tokens / round wall time)",
         "params": {"prompt_tokens": config.prompt_tokens, "max_tokens": config.max_tokens,
                    "clients": list(config.clients)},
         "unit": "tok/s", "higher_is_better": True},
        [_aggregate_arm(s, c, config) for s in states for c in config.clients])
    ttft = write(
        {"name": "ttft_prefix", "kind": "ttft",
         "description": "time to first token of a repeated prompt: cold, reused at once, "
                        "reused after other prompts",
         "params": {"prompt_tokens": config.ttft_tokens,
                    "other_prompt_tokens": config.other_tokens,
                    "others_between": config.others, "max_tokens": 1},
         "unit": "s", "higher_is_better": False},
        [_ttft_arm(s, p, config) for s in states for p in PHASES])
    return [aggregate, ttft]


def _protocol(config: ServerBenchConfig, order: list[str], elapsed: float, ban) -> dict:
    return {"mode": config.mode,
            "interleave": ("all servers loaded together; per round, each client count visits "
                           "every server in turn, then every server runs its TTFT sequence; "
                           "the server order rotates by one each round"
                           if config.mode == "interleaved" else
                           "one server at a time, all its rounds, then it is stopped"),
            "rounds": config.rounds, "warmup_rounds": config.warmup, "order": order,
            "threads": config.threads, "elapsed_s": elapsed,
            "client": "bench/server_client.py: http.client, one thread per streaming client, "
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
