"""Engine-level figures this machine can measure: Kipp against itself, every ratio in one run.

    python -m bench engine --checkpoint kipp-synthetic/qwen3-0.6b-shape --backend jax \
        --rounds 3 --warmup 1 [--kipp-source DIR]

One `kipp serve` and one Kipp worker process (bench/worker.py, the harness's raw engine arm) on
the same artifact and backend, both loaded for the whole run. Each round visits, in this order:

    raw       the worker decodes --decode-tokens greedy tokens after a 16-token prompt:
              Session.eval of one token plus a host argmax per step (the backend step rate)
    single    one streaming client, the same prompt length, --decode-tokens + 1 tokens: the
              server's single-stream decode rate, (tokens - 1) / (last - first token), and from
              /metrics the engine's own step time (kipp_engine_step_seconds) and, of it, the
              backend's eval time: the scheduler's time per step is their difference
    c=1, c=N  `bench server`'s aggregate round (bench/server_client.py) with 1 and with
              --clients streams: total completion tokens / wall time
    reuse     a fresh ~2,000-token prompt sent cold (max_tokens 1), then again at once with
              --reuse-tokens + 1 tokens: its time to first token, and the decode step at that
              context from the same stream's later tokens
    profile   in the worker, the same kind of prompt: evaluate it, close the session
              (publishing its blocks), then time adopting the cached prefix, evaluating the
              rest, sampling (the server's greedy request with its logit_bias) and one decode
              step (bench.workloads.measure_reuse_profile)

Three records, values per round, medians and MADs over the measured rounds:

    server_overhead  single / raw (goal >= 0.9), with the scheduler's ms per step
    batch_scaling    aggregate c=N / aggregate c=1 (goal >= 5 at N = 8)
    reuse_ttft       reused TTFT - one decode step at that context, ms (goal <= 50)

`--kipp-source DIR` runs the server and the worker on the Kipp package of another checkout
(e.g. a `git worktree` of an older commit) with this harness: the same measurement of the old
engine, so before and after are the same protocol. Its commit goes into every record and arm.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import provenance, records
from bench.engines.base import ArmSpec
from bench.process import ArmProcess, WorkerError
from bench.server_client import PromptBook, aggregate_round, end_token_ids, stream_completion
from bench.servers import RunningServer, kipp_server, log
from bench.stats import summarize
from bench.tables import engine_setup

GOALS = {"server_overhead": (">=", 0.9), "batch_scaling": (">=", 5.0), "reuse_ttft": ("<=", 50)}
STEP_METRICS = ("kipp_engine_steps_total", "kipp_engine_step_seconds_total",
                "kipp_engine_eval_seconds_total")
COMPILE_METRICS = ("kipp_engine_compiles_total", "kipp_engine_compile_seconds_total")


@dataclass
class EngineBenchConfig:
    checkpoint: str
    scheme: str = "bf16"
    backend: str = "jax"
    rounds: int = 3
    warmup: int = 1
    decode_tokens: int = 32
    prompt_tokens: int = 16
    clients: int = 8
    max_tokens: int = 64  # per client in the aggregate rounds (bench server's default)
    ttft_tokens: int = 2000
    reuse_tokens: int = 8
    threads: int = 2
    expect_path: tuple[str, ...] | None = None
    cpu_dot: str | None = None  # $KIPP_JAX_CPU_DOT for the server and worker (default: as set)
    kipp_source: Path | None = None
    artifact: str | None = None  # default: the registry's artifact for (checkpoint, scheme)
    results: Path = records.RESULTS
    logs: Path = Path("/tmp/kipp-bench-logs")
    request_timeout: float = 1800.0
    command: str = ""

    def __post_init__(self):
        if self.rounds < 1 or self.warmup < 0 or self.clients < 2:
            raise ValueError("rounds >= 1, warmup >= 0 and clients >= 2 are needed")
        if self.decode_tokens < 2 or self.reuse_tokens < 2 or self.max_tokens < 2:
            raise ValueError("decode, reuse and aggregate token counts must be >= 2")

    @property
    def context(self) -> int:
        return -(-(self.ttft_tokens + self.reuse_tokens + 64) // 512) * 512


@dataclass
class Under:
    """The Kipp under test: this checkout's, or another one's (--kipp-source)."""

    source: Path | None
    shim: tempfile.TemporaryDirectory | None = None
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        root = self.source or provenance.REPO
        self.info = {"path": str(root), **provenance.git_state(Path(root))}
        if self.source is not None:  # a folder holding only that checkout's `kipp` package
            self.shim = tempfile.TemporaryDirectory(prefix="kipp-source-")
            (Path(self.shim.name) / "kipp").symlink_to(Path(self.source).resolve() / "kipp")

    @property
    def env(self) -> dict[str, str]:
        """PYTHONPATH putting that `kipp` ahead of this checkout (whose `bench` stays)."""
        if self.shim is None:
            return {}
        return {"PYTHONPATH": f"{self.shim.name}:{provenance.REPO}"}

    @property
    def cwd(self) -> Path:
        """Where the processes start: `python -m` puts it first on sys.path, before
        PYTHONPATH, so it must hold that `kipp` and not this checkout's."""
        return Path(self.shim.name) if self.shim is not None else provenance.REPO

    @property
    def tag(self) -> str:
        commit = (self.info.get("commit") or "unknown")[:10]
        return f"@{commit}{'+dirty' if self.info.get('dirty') else ''}"


def start(config: EngineBenchConfig, under: Under) -> tuple[RunningServer, ArmProcess, dict]:
    """The server and the worker, loaded and path-checked; info for the records."""
    from bench.fallback import check_kernel_path, expected_path
    from kipp.formats import store

    expect = expected_path(config.backend, config.expect_path)
    artifact = config.artifact or str(store.ensure_artifact(config.checkpoint, config.scheme))
    spec = kipp_server(artifact, backend=config.backend, python=_python(), threads=config.threads,
                       scheme=config.scheme, kv_tokens=max(8192, 2 * config.context),
                       max_batch=config.clients, expect_path=expect)
    spec.env.update(under.env)
    spec.env.update(cpu_dot_env(config.cpu_dot))  # the worker's load sets it from its options
    options = {"cpu_dot": config.cpu_dot} if config.cpu_dot else {}
    server = RunningServer(spec, config.logs / "engine-bench-server.log", cwd=under.cwd)
    arm = ArmSpec("kipp", config.scheme, config.checkpoint, backend=config.backend,
                  artifact=artifact, threads=config.threads, context=2 * config.context,
                  expect_path=expect, options=options)
    worker = ArmProcess(arm, _python(), config.logs / "engine-bench-worker.log", env=under.env,
                        cwd=under.cwd)
    try:
        server.wait_ready()
        described = (server.card.get("kipp") or {}).get("backend", "")
        check_kernel_path(config.backend, config.scheme, described, expect)
        loaded = worker.request({"op": "load", "spec": arm.to_json()}, 900.0)["info"]
    except Exception:
        server.stop()
        worker.kill()
        raise
    info = {"server": {"spec": spec.to_json(), "describe": described,
                       "ready_seconds": server.ready_seconds},
            "worker": loaded}
    log(f"engine bench: server and worker ready ({described})")
    return server, worker, info


def cpu_dot_env(value: str | None) -> dict[str, str]:
    """The environment that runs the stored CPU matmul's dot `value` ({} for None: as set);
    a value it does not know raises ValueError naming the variable, before any process."""
    if not value:
        return {}
    from kipp.cuda.cpu.stored_matmul import DOT_ENV, dots

    dots(value)
    return {DOT_ENV: value}


def _python() -> str:
    import sys

    return sys.executable


def _step_counters(server: RunningServer) -> dict[str, float] | None:
    metrics = server.metrics() or {}
    if not all(name in metrics for name in STEP_METRICS):
        return None  # a Kipp without the step counters (older than this workload)
    return {name: metrics[name] for name in STEP_METRICS}


def _compiles(server: RunningServer) -> tuple[float, float] | None:
    metrics = server.metrics() or {}
    if not all(name in metrics for name in COMPILE_METRICS):
        return None  # a Kipp without the compile counters
    return tuple(metrics[name] for name in COMPILE_METRICS)


def compiled_during(server: RunningServer, phase, *args) -> dict:
    """phase(*args), with the step programs the server compiled meanwhile (count, seconds):
    a compile inside a measured phase is engine time a warmed-up run would not pay."""
    before = _compiles(server)
    out = phase(*args)
    after = _compiles(server)
    if before is not None and after is not None:
        out["compiles"] = after[0] - before[0]
        out["compile_s"] = after[1] - before[1]
    return out


def single_stream(server: RunningServer, config: EngineBenchConfig, prompt: str,
                  ban: list[int]) -> dict:
    before = _step_counters(server)
    got = stream_completion(server.url, server.model_id, prompt, config.decode_tokens + 1, ban,
                            config.request_timeout)
    after = _step_counters(server)
    tokens = got["completion_tokens"]
    out = {"tok_s": (tokens - 1) / (got["last"] - got["first"]), "completion_tokens": tokens,
           "ttft_s": got["first"] - got["sent"]}
    if before and after:
        steps, total, evals = (after[k] - before[k] for k in STEP_METRICS)
        out.update(engine_steps=steps, step_ms=1000 * total / steps,
                   eval_ms=1000 * evals / steps, scheduler_ms=1000 * (total - evals) / steps)
    return out


def reuse(server: RunningServer, config: EngineBenchConfig, prompt: str, ban: list[int]) -> dict:
    cold = stream_completion(server.url, server.model_id, prompt, 1, ban, config.request_timeout)
    again = stream_completion(server.url, server.model_id, prompt, config.reuse_tokens + 1, ban,
                              config.request_timeout)
    tokens = again["completion_tokens"]
    step = (again["last"] - again["first"]) / (tokens - 1)
    ttft = again["first"] - again["sent"]
    return {"ttft_s": ttft, "step_s": step, "excess_ms": 1000 * (ttft - step),
            "cold_ttft_s": cold["first"] - cold["sent"], "cached_tokens": again["cached_tokens"],
            "prompt_tokens": again["prompt_tokens"], "completion_tokens": tokens,
            "server_timings": again["timings"], "cold_server_timings": cold["timings"]}


def profile(worker: ArmProcess, config: EngineBenchConfig, prompt: list[int],
            ban: list[int]) -> dict:
    workload = {"name": "reuse_profile", "kind": "reuse_profile",
                "description": "engine bench profile", "unit": "x one decode step",
                "params": {"prompt_tokens": len(prompt), "ban": ban},
                "higher_is_better": False, "planned": True}
    return worker.request({"op": "run", "workload": workload, "prompt": prompt},
                          config.request_timeout)["result"]


def raw_decode(worker: ArmProcess, config: EngineBenchConfig, prompt: list[int]) -> dict:
    workload = {"name": "decode", "kind": "decode", "description": "engine bench raw decode",
                "unit": "tok/s", "params": {"prompt_tokens": len(prompt),
                                            "decode_tokens": config.decode_tokens},
                "higher_is_better": True, "planned": False}
    result = worker.request({"op": "run", "workload": workload, "prompt": prompt},
                            config.request_timeout)["result"]
    return {"tok_s": result["value"], "seconds": result["seconds"], "tokens": result["tokens"]}


def one_round(server, worker, config: EngineBenchConfig, book: PromptBook, ban: list[int],
              r: int) -> dict:
    """Every measurement of round r, in the module docstring's order, with the load average."""
    import os

    short = book.get(("engine-single", r), config.prompt_tokens)
    out = {"round": r, "loadavg_before": list(os.getloadavg())}
    out["raw"] = raw_decode(worker, config, _ids(short))
    out["single"] = compiled_during(server, single_stream, server, config, short["text"], ban)
    for n in (1, config.clients):
        prompts = [book.get(("engine-agg", r, n, i), config.prompt_tokens)["text"]
                   for i in range(n)]
        out[f"c{n}"] = compiled_during(server, _aggregate, server, config, prompts, ban)
    out["reuse"] = compiled_during(server, reuse, server, config,
                                   book.get(("engine-reuse", r), config.ttft_tokens)["text"], ban)
    out["profile"] = profile(worker, config, _ids(book.get(("engine-profile", r),
                                                           config.ttft_tokens)), ban)
    out["loadavg_after"] = list(os.getloadavg())
    return out


def _aggregate(server: RunningServer, config: EngineBenchConfig, prompts: list[str],
               ban: list[int]) -> dict:
    result = aggregate_round(server.url, server.model_id, prompts, config.max_tokens, ban,
                             config.request_timeout)
    return {k: result[k] for k in ("value", "wall_s", "completion_tokens",
                                   "per_client_decode_tok_s_median")}


def _ids(prompt: dict) -> list[int]:
    from bench.server_client import _tokenizer

    return _tokenizer().encode(prompt["text"])


def run(config: EngineBenchConfig) -> list[Path]:
    """Measure; write the three records (bench/README.md renders them)."""
    under = Under(config.kipp_source)
    book, ban = PromptBook(), end_token_ids()
    began = time.perf_counter()
    server, worker, info = start(config, under)
    rounds, failure = [], None
    try:
        for r in range(config.warmup + config.rounds):
            try:
                result = one_round(server, worker, config, book, ban, r)
            except (WorkerError, RuntimeError, OSError) as e:
                failure = f"round {r + 1}: {type(e).__name__}: {e}"
                log(f"engine bench: {failure}")
                break
            result["warmup"] = r < config.warmup
            rounds.append(result)
            log(f"engine bench round {r + 1}: " + summary_of(result)
                + (" (warm-up, discarded)" if result["warmup"] else ""))
    finally:
        info["server"]["peak_rss"] = server.peak_rss()
        server.stop()
        try:
            info["worker"]["rusage"] = worker.close()
        except WorkerError as e:
            info["worker"]["close_error"] = str(e)
    prov = provenance.collect()
    protocol = _protocol(config, time.perf_counter() - began)
    return [records.write(record, config.results)
            for record in build_records(config, under, info, rounds, failure, prov, protocol)]


def summary_of(result: dict) -> str:
    single, raw, reused = result["single"], result["raw"], result["reuse"]
    c1, cn = result["c1"]["value"], [v for k, v in result.items()
                                     if k.startswith("c") and k != "c1"][0]["value"]
    sched = (f", scheduler {single['scheduler_ms']:.1f} ms/step" if "scheduler_ms" in single
             else "")
    compiles = {k: result[k].get("compiles") for k in result
                if isinstance(result[k], dict) and result[k].get("compiles")}
    compiled = f"; compiled during {compiles}" if compiles else ""
    return (f"server/raw {single['tok_s']:.2f}/{raw['tok_s']:.2f} tok/s"
            f" = {single['tok_s'] / raw['tok_s']:.3f}{sched}; aggregate {c1:.2f} -> {cn:.2f} "
            f"tok/s = {cn / c1:.2f}x; reused TTFT {reused['ttft_s'] * 1000:.0f} ms, step "
            f"{reused['step_s'] * 1000:.0f} ms (cached {reused['cached_tokens']}){compiled}")


def _protocol(config: EngineBenchConfig, elapsed: float) -> dict:
    return {"rounds": config.rounds, "warmup_rounds": config.warmup, "elapsed_s": elapsed,
            "threads": config.threads,
            "order": "per round: raw decode (worker), single stream, aggregate c=1, aggregate "
                     f"c={config.clients}, reuse (cold then repeated), profile (worker)",
            "timer": "time.perf_counter in the client and in the worker",
            "statistics": "per-round values; median and raw MAD over the measured rounds"}


WORKLOADS = {
    "server_overhead": ("the server's single-stream decode rate over the raw backend step rate, "
                        "same run (and the scheduler's own ms per step)", "x raw"),
    "batch_scaling": ("aggregate decode of N concurrent streams over one stream, same server, "
                      "same run", "x one client"),
    "reuse_ttft": ("time to first token of a repeated ~2,000-token prompt minus one decode step "
                   "at that context, same request", "ms"),
}


def _values(name: str, result: dict, config: EngineBenchConfig) -> dict:
    """One round's value and the figures it came from, per record."""
    loads = {"loadavg_before": result["loadavg_before"], "loadavg_after": result["loadavg_after"]}
    if name == "server_overhead":
        single, raw = result["single"], result["raw"]
        return {"value": single["tok_s"] / raw["tok_s"], "raw_tok_s": raw["tok_s"],
                "server_tok_s": single["tok_s"], **{k: single.get(k) for k in (
                    "step_ms", "eval_ms", "scheduler_ms", "engine_steps", "compiles",
                    "compile_s")}, **loads}
    if name == "batch_scaling":
        one, many = result["c1"], result[f"c{config.clients}"]
        return {"value": many["value"] / one["value"], "c1_tok_s": one["value"],
                f"c{config.clients}_tok_s": many["value"], "c1": one,
                "value_net_of_compile": _net_of_compile(many) / _net_of_compile(one),
                f"c{config.clients}": many, **{f"{k}_{name}": part.get(k) for name, part in (
                    ("c1", one), (f"c{config.clients}", many)) for k in ("compiles", "compile_s")},
                **loads}
    reused, prof = result["reuse"], result["profile"]
    timings = reused.get("server_timings") or {}
    return {"value": reused["excess_ms"], "ttft_ms": 1000 * reused["ttft_s"],
            "step_ms": 1000 * reused["step_s"], "evaluated_tokens": timings.get("prompt_n"),
            "server_prompt_ms": timings.get("prompt_ms"),
            **{f"profile_{k}_ms": 1000 * prof[f"{k}_seconds"]
               for k in ("adopt", "rest", "sample", "step")},
            **reused, "profile": prof, **loads}


def _net_of_compile(aggregate: dict) -> float:
    """An aggregate round's tok/s with the server's compile seconds taken out of its wall."""
    return aggregate["completion_tokens"] / (aggregate["wall_s"] - aggregate.get("compile_s", 0))


SUMMARIZED = {"server_overhead": ("raw_tok_s", "server_tok_s", "scheduler_ms", "eval_ms"),
              "batch_scaling": ("c1_tok_s", "value_net_of_compile"),
              "reuse_ttft": ("ttft_ms", "step_ms", "evaluated_tokens", "server_prompt_ms",
                             "profile_adopt_ms", "profile_rest_ms", "profile_sample_ms",
                             "profile_step_ms", "cold_ttft_s")}


def _arm(name: str, config: EngineBenchConfig, under: Under, info: dict, rounds: list[dict],
         failure: str | None) -> dict:
    entry = {"arm": f"kipp-{config.backend}/{config.scheme} {under.tag}", "engine": "kipp",
             "backend": config.backend, "scheme": config.scheme, "spec": info["server"]["spec"],
             "sizing": {"runs": config.rounds, "warmup": config.warmup},
             "info": {"kipp_source": under.info, **info}}
    measured = [_values(name, r, config) | {"round": r["round"]} for r in rounds
                if not r["warmup"]]
    if not measured:
        return {**entry, "status": "failed", "reason": failure or "no measured round"}
    values = [m["value"] for m in measured]
    extra = {key: summarize([m[key] for m in measured]) for key in
             SUMMARIZED[name] + ((f"c{config.clients}_tok_s",) if name == "batch_scaling" else ())
             if all(m.get(key) is not None for m in measured)}
    return {**entry, "status": "ok", "params": _params(name, config),
            "warmup_runs": [_values(name, r, config) | {"round": r["round"]} for r in rounds
                            if r["warmup"]],
            "runs": measured, "values": values, "summary": summarize(values),
            "summaries": extra, "failure_after": failure,
            "peak_rss_bytes": (info["server"].get("peak_rss") or {}).get("max_bytes")}


def _params(name: str, config: EngineBenchConfig) -> dict:
    if name == "server_overhead":
        return {"prompt_tokens": config.prompt_tokens, "decode_tokens": config.decode_tokens}
    if name == "batch_scaling":
        return {"prompt_tokens": config.prompt_tokens, "max_tokens": config.max_tokens,
                "clients": config.clients}
    return {"prompt_tokens": config.ttft_tokens, "reuse_tokens": config.reuse_tokens}


def build_records(config: EngineBenchConfig, under: Under, info: dict, rounds: list[dict],
                  failure: str | None, prov: dict, protocol: dict) -> list[dict]:
    checkpoint = records.checkpoint_block(config.checkpoint)
    out = []
    for name, (description, unit) in WORKLOADS.items():
        side, goal = GOALS[name]
        workload = {"name": name, "kind": "engine", "description": description,
                    "params": _params(name, config), "unit": unit,
                    "higher_is_better": side == ">=", "planned": False,
                    "goal": f"{side} {goal}"}
        out.append(records.new("throughput", config.command, checkpoint, prov,
                               workload=workload, protocol=protocol, kipp=under.info,
                               arms=[_arm(name, config, under, info, rounds, failure)]))
    return out


def summary_lines(path: Path) -> list[str]:
    import json

    record = json.loads(Path(path).read_text())
    w = record["workload"]
    lines = [f"{w['name']} (goal {w['goal']}): {path}"]
    for arm in record["arms"]:
        if arm["status"] != "ok":
            lines.append(f"  {arm['arm']}: {arm['status']}: {arm.get('reason')}")
            continue
        s = arm["summary"]
        parts = [f"{k} {v['median']:.4g} ± {v['mad']:.2g}" for k, v in arm["summaries"].items()]
        lines.append(f"  {arm['arm']} ({engine_setup(arm)}): {s['median']:.4g} ± "
                     f"{s['mad']:.2g} {w['unit']} "
                     f"(n={s['n']}); " + ", ".join(parts))
    return lines

