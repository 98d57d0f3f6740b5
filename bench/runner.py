"""The head-to-head: every arm in its own worker, runs interleaved, one record per workload.

    config = RunConfig(checkpoint="kipp-synthetic/qwen3-0.6b-shape",
                       engines=["kipp", "llama_cpp", "transformers"], ...)
    paths = run(config)

Order of events: plan the arms; mark unavailable the ones whose engine is not importable or whose
weights are missing; start and load every available arm (a load that reports a fallback is
refused); measure the memory bandwidth; for each workload run the interleaved schedule (warm-ups
first, discarded); measure the bandwidth again; close the workers (their peak RSS); write the
records. Nothing is retried and no run is dropped: a failing arm is reported as failed with its
error, and the others carry on.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench import arms as arm_plan
from bench import ceiling, engines, prompts, provenance, records, workloads
from bench.arms import Override, Sizing
from bench.engines.base import ArmSpec
from bench.process import ArmProcess, WorkerError
from bench.stats import summarize

LOAD_TIMEOUT = 900.0


@dataclass
class RunConfig:
    checkpoint: str
    engines: list[str]
    schemes: list[str]
    workloads: list[str]
    backends: list[str] = field(default_factory=lambda: ["reference"])
    sizing: Sizing = field(default_factory=Sizing)
    overrides: list[Override] = field(default_factory=list)
    threads: int = 2
    pythons: dict[str, str] = field(default_factory=dict)  # engine -> interpreter
    expect_paths: dict[str, tuple[str, ...]] = field(default_factory=dict)
    results: Path = records.RESULTS
    logs: Path = Path("/tmp/kipp-bench-logs")
    ceiling: bool = True
    ceiling_size_mb: int = 512
    ceiling_runs: int = 5
    timeout: float = 1800.0  # seconds one measured run may take
    command: str = ""
    weight_memory: list[str] = field(default_factory=list)  # Kipp arms per mode (kipp.memory)
    cpu_dots: list[str] = field(default_factory=list)  # Kipp arms per stored CPU matmul dot


@dataclass
class ArmState:
    spec: ArmSpec
    sizings: dict[str, Sizing]  # per workload name
    python: str
    status: str = "ok"
    reason: str = ""
    info: dict = field(default_factory=dict)
    process: ArmProcess | None = None
    rusage: dict | None = None
    warnings: list[str] = field(default_factory=list)  # fallback lines from the engine's log
    results: dict = field(default_factory=dict)  # workload -> {"warmup": [], "runs": []}
    errors: dict = field(default_factory=dict)  # workload -> (status, error text)


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def context_for(selected: list[workloads.Workload], decode_tokens: int) -> int:
    """KV positions every arm allocates: the longest workload plus slack, whole 32-blocks."""
    longest = max(w.prompt_tokens + (decode_tokens + 1 if w.kind == "decode" else 0)
                  for w in selected)
    return -(-(longest + 32) // 32) * 32


def prepare_states(config: RunConfig, selected) -> list[ArmState]:
    decode_tokens = max([config.sizing.decode_tokens] +
                        [int(o.value) for o in config.overrides if o.key == "decode_tokens"])
    specs = arm_plan.plan(config.checkpoint, config.engines, config.schemes, config.backends,
                          config.threads, context_for(selected, decode_tokens),
                          config.expect_paths, weight_memory=config.weight_memory,
                          cpu_dots=config.cpu_dots)
    states, probed = [], {}
    for spec in specs:
        python = config.pythons.get(spec.engine, sys.executable)
        sizings = {w.name: arm_plan.sizing_for(spec, config.sizing, config.overrides, w.name)
                   for w in selected}
        state = ArmState(spec, sizings, python)
        key = (spec.engine, python)
        if key not in probed:
            probed[key] = engines.availability(spec.engine, python)
        available, why = probed[key]
        missing = [p for p in (spec.artifact, spec.source, spec.weights)
                   if p and Path(p).is_absolute() and not Path(p).exists()]
        if not available:
            state.status, state.reason = "unavailable", why
        elif missing:
            state.status = "unavailable"
            state.reason = f"{missing[0]} is missing: run `python -m bench prepare` first"
        states.append(state)
    return states


def load_arms(states: list[ArmState], logs: Path) -> None:
    for state in states:
        if state.status != "ok":
            log(f"{state.spec.name}: {state.status} ({state.reason})")
            continue
        slug = state.spec.name.replace("/", "_").replace(" ", "_").replace("(", "").replace(")", "")
        state.process = ArmProcess(state.spec, state.python, logs / f"{slug}.log")
        try:
            reply = state.process.request({"op": "load", "spec": state.spec.to_json()},
                                          LOAD_TIMEOUT)
        except WorkerError as e:
            state.status = "refused" if e.refused else "failed"
            state.reason = f"load: {e}"
            state.process.kill()
            state.process = None
            log(f"{state.spec.name}: {state.status}: {state.reason}")
            continue
        state.info = reply["info"]
        log(f"{state.spec.name}: loaded: {state.info.get('describe')}")


def run_workload(workload: workloads.Workload, states: list[ArmState], timeout: float) -> dict:
    """Run one workload's interleaved schedule over the loaded arms; returns params per arm."""
    sizing = {s.spec.name: s.sizings[workload.name] for s in states}
    active = {s.spec.name: s for s in states
              if s.process is not None and workload.name not in sizing[s.spec.name].skip}
    params = {name: (workload.with_params(decode_tokens=sizing[name].decode_tokens)
                     if workload.kind == "decode" else workload) for name in active}
    total = {name: sizing[name].warmup + sizing[name].runs for name in active}
    prompt = prompts.prompt(workload.prompt_tokens)
    order = []
    for state in active.values():
        state.results[workload.name] = {"warmup": [], "runs": []}
    for round_index, name in arm_plan.interleave(list(active), total):
        state = active[name]
        if workload.name in state.errors or state.process is None:
            continue
        warm = round_index < sizing[name].warmup
        request = {"op": "run", "workload": _workload_json(params[name]), "prompt": prompt}
        try:
            result = state.process.request(request, timeout)["result"]
        except WorkerError as e:
            state.errors[workload.name] = ("refused" if e.refused else "failed", str(e))
            log(f"{name} {workload.name}: {state.errors[workload.name][0]}: {e}")
            if state.process.proc.poll() is not None:
                state.process = None  # it died: later workloads record it as failed
            continue
        state.results[workload.name]["warmup" if warm else "runs"].append(result)
        order.append(f"{name}{' (warm-up)' if warm else ''}")
        log(f"{workload.name} round {round_index + 1}/{total[name]} {name}: "
            f"{result['value']:.2f} {workload.unit}{' (warm-up, discarded)' if warm else ''}")
    return {"params": params, "order": order}


def _workload_json(workload: workloads.Workload) -> dict:
    return {"name": workload.name, "kind": workload.kind, "description": workload.description,
            "params": dict(workload.params), "unit": workload.unit,
            "higher_is_better": workload.higher_is_better, "planned": workload.planned}


def close_arms(states: list[ArmState]) -> None:
    for state in states:
        if state.process is None:
            continue
        try:
            state.rusage = state.process.close()
        except WorkerError as e:
            log(f"{state.spec.name}: close failed: {e}")
            state.process.kill()
        state.warnings = fallback_lines(state.process.log)
        state.process = None


FALLBACK_LOG = re.compile(r"fall(s|ing)?[ -]?back|fell back", re.IGNORECASE)


def fallback_lines(path: Path, limit: int = 10) -> list[str]:
    """Lines of an arm's log where its engine says it fell back (a peer's own slower path is
    what its users get on this machine, so it is recorded, not refused)."""
    try:
        text = path.read_text("utf-8", "replace")
    except OSError:
        return []
    found = [" ".join(line.split())[:300] for line in text.splitlines()
             if FALLBACK_LOG.search(line)]
    return list(dict.fromkeys(found))[:limit]


def arm_entry(state: ArmState, workload: workloads.Workload, ran: dict) -> dict:
    spec, sizing = state.spec, state.sizings[workload.name]
    entry = {"arm": spec.name, "engine": spec.engine, "backend": spec.backend,
             "scheme": spec.scheme, "spec": spec.to_json(), "python": state.python,
             "sizing": {"runs": sizing.runs, "warmup": sizing.warmup,
                        "decode_tokens": sizing.decode_tokens, "skip": sorted(sizing.skip)}}
    if state.status != "ok":
        return {**entry, "status": state.status, "reason": state.reason, "info": state.info}
    if workload.name in sizing.skip:
        return {**entry, "status": "skipped", "info": state.info,
                "reason": f"sized out of this run (--set ...skip={workload.name})"}
    if workload.name in state.errors:
        status, reason = state.errors[workload.name]
        return {**entry, "status": status, "reason": reason, "info": state.info}
    got = state.results.get(workload.name)
    if not got or not got["runs"]:
        return {**entry, "status": "failed", "info": state.info,
                "reason": "no measured run: the worker had exited before this workload"}
    values = [r["value"] for r in got["runs"]]
    peak = None
    if state.rusage:
        peak = max(state.rusage["self_peak_rss_bytes"], state.rusage["children_peak_rss_bytes"])
    return {**entry, "status": "ok", "info": state.info, "engine_warnings": state.warnings,
            "params": dict(ran["params"][spec.name].params), "warmup_runs": got["warmup"],
            "runs": got["runs"], "values": values, "summary": summarize(values),
            "peak_rss_bytes": peak, "rusage": state.rusage}


def measure_ceiling(config: RunConfig, label: str) -> dict | None:
    if not config.ceiling:
        return None
    log(f"memory bandwidth ({label})...")
    result = ceiling.measure_bandwidth(config.ceiling_size_mb, config.ceiling_runs,
                                       config.threads)
    log(f"memory bandwidth ({label}): {result['gb_s']:.1f} GB/s ({result['best_kernel']})")
    return result


def ceiling_for(workload: workloads.Workload, bandwidths: list[dict], config: RunConfig):
    """The decode ceiling at the workload's mean context from the higher bandwidth reading."""
    if workload.kind != "decode" or not bandwidths:
        return None
    best = max(bandwidths, key=lambda b: b["gb_s"])
    context = workload.prompt_tokens + workload.params["decode_tokens"] // 2
    block = ceiling.ceiling_block(best, config.checkpoint, config.schemes, context)
    block["readings"] = bandwidths
    return block


def run(config: RunConfig) -> list[Path]:
    selected = [workloads.get(name) for name in config.workloads]
    selected = [w.with_params(decode_tokens=config.sizing.decode_tokens) if w.kind == "decode"
                else w for w in selected]
    states = prepare_states(config, selected)
    written = []
    try:
        load_arms(states, config.logs)
        bandwidths = [b for b in [measure_ceiling(config, "before")] if b]
        ran = {w.name: run_workload(w, states, config.timeout) for w in selected}
        bandwidths += [b for b in [measure_ceiling(config, "after")] if b]
    finally:
        close_arms(states)
    prov = provenance.collect()
    for w in selected:
        record = records.new(
            "throughput", config.command, records.checkpoint_block(config.checkpoint), prov,
            workload=_workload_json(w),
            protocol={"interleave": "round-robin over arms grouped by scheme (A B A B)",
                      "order": ran[w.name]["order"], "threads": config.threads,
                      "timer": "time.perf_counter around the engine calls",
                      "sampling": "greedy, host numpy argmax over the full logits row",
                      "batch": 1, "concurrency": 1, "prompt_source": str(prompts.CORPUS.name),
                      "peak_rss": "the larger of ru_maxrss of the arm's worker and of its "
                                  "children (one process's peak, not a sum: vLLM's model runs "
                                  "in a child), over its whole life: load and every workload"},
            arms=[arm_entry(s, w, ran[w.name]) for s in states],
            ceiling=ceiling_for(w, bandwidths, config))
        written.append(records.write(record, config.results))
        log(f"wrote {written[-1]}")
    return written


def failures(paths: list[Path]) -> list[str]:
    """`arm workload: status: reason` for every arm of any engine that failed (crashed, timed
    out, errored) or was refused (ran another path than asked); unavailable peers are not."""
    import json

    found = []
    for path in paths:
        record = json.loads(Path(path).read_text())
        for arm in record["arms"]:
            if arm["status"] in ("refused", "failed"):
                reason = " ".join(str(arm.get("reason", "")).split())[:200]
                found.append(f"{arm['arm']} {record['workload']['name']}: {arm['status']}: "
                             f"{reason}")
    return found


def exit_status(paths: list[Path]) -> int:
    """0 when every loaded arm measured; 3 when an arm of any engine failed or was refused."""
    return 3 if failures(paths) else 0
