"""Per-token overhead of constrained decoding: the scheduler's decode steps with and without a
JSON Schema grammar, single stream and 8 streams.

    .venv/bin/python -m bench.grammar_bench --checkpoint kipp-synthetic/qwen3-0.6b-shape \\
        --backend jax --tokens 48 --warmup 1 --runs 3

Each arm submits `streams` requests (n=1, temperature 0.7, its own seed) of a short prompt to a
Scheduler and steps it until all are done, timing every step in which all streams decode (the
prefill steps are excluded). Arms, interleaved in every round:
- plain: no grammar;
- json-sync: the JSON Schema below, every mask computed when the sampler asks for it;
- json-ahead: the same, the step's next masks computed in one task on the grammar worker
  thread while the backend evaluates (Scheduler(masks_ahead=True)).
The scheduler's default is json-ahead where the backend evaluates off the host CPU and json-sync
on a CPU backend (kipp.text.grammar.masks_ahead); the goal applies to the default. The value is
seconds per decode step (all streams advance one token); the overhead is the median over rounds
of each round's arm / plain ratio of the median step, with its MAD. Goal: <= 1.05.

On a loaded machine two step times differ by more than the grammar costs, so each constrained
step's grammar work on the engine thread is also accounted directly: the time spent waiting for
or computing masks, consuming tokens and checking completion (timed around those calls), plus
the sampler's extra cost of applying a mask (timed apart, below) per stream. `accounted` is
that time over the plain arm's median step.

The schema forces a long answer (an array of at least 200 objects, each an integer id, a short
string and an enum), so no constrained stream ends before `--tokens`; every constrained output
so far is checked against the grammar (llguidance consumed it without error). A record also
carries the cost of the pieces, timed apart on the same process: computing one mask, and one
sample with and without the mask applied.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from bench import provenance, records, stats

SCHEMA = {
    "type": "object", "required": ["rows"], "additionalProperties": False,
    "properties": {"rows": {"type": "array", "minItems": 200, "items": {
        "type": "object", "required": ["id", "name", "kind"], "additionalProperties": False,
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                       "name": {"type": "string", "maxLength": 8},
                       "kind": {"enum": ["alpha", "beta", "gamma"]}}}}}}
ARMS = ("plain", "json-sync", "json-ahead")
GOAL = 1.05


def run_arm(model, prompt: list[int], streams: int, tokens: int, arm: str, seed: int) -> dict:
    """One arm: `streams` requests through a Scheduler; the decode steps' durations."""
    from kipp.engine.scheduler import Request, Scheduler, collect
    from kipp.text import grammar
    from kipp.text.sampling import SamplingParams

    constraint = None if arm == "plain" else grammar.json_schema_grammar(SCHEMA)
    scheduler = Scheduler(model, max_batch=max(8, streams), masks_ahead=arm == "json-ahead")
    tickets = [scheduler.submit(Request(prompt, tokens, grammar=constraint, sampling=SamplingParams(
        temperature=0.7, seed=seed + i))) for i in range(streams)]
    originals = {name: getattr(grammar.Matcher, name) for name in _TIMED}
    spent = [0.0]
    for name, method in originals.items():
        setattr(grammar.Matcher, name, _timed(method, spent))
    scheduler_prefetch = sys.modules["kipp.engine.scheduler"].prefetch
    sys.modules["kipp.engine.scheduler"].prefetch = _timed(scheduler_prefetch, spent)
    steps, grammar_s = [], []
    try:
        while True:
            decoding = all(not c.in_prompt for r in scheduler._running for c in r.choices) \
                and len(scheduler._running) == streams
            spent[0] = 0.0
            start = time.perf_counter()
            if not scheduler.step():
                break
            if decoding:
                steps.append(time.perf_counter() - start)
                grammar_s.append(spent[0])
    finally:
        for name, method in originals.items():
            setattr(grammar.Matcher, name, method)
        sys.modules["kipp.engine.scheduler"].prefetch = scheduler_prefetch
    outputs = [collect(t) for t in tickets]
    generated = [len(out[0][0]) for out in outputs]
    if constraint is not None:
        _check_grammar(model, constraint, [out[0][0] for out in outputs])
    return {"steps": len(steps), "step_s": stats.median(steps), "mean_step_s": float(
        np.mean(steps)), "grammar_s": stats.median(grammar_s), "generated": generated,
        "reasons": [out[2][0] for out in outputs]}


_TIMED = ("allowed", "consume", "valid_prefix")


def _timed(function, spent: list):
    def wrapper(*args):
        start = time.perf_counter()
        try:
            return function(*args)
        finally:
            spent[0] += time.perf_counter() - start
    return wrapper


def _check_grammar(model, constraint, outputs: list[list[int]]) -> None:
    from kipp.text import grammar

    tokenizer = grammar.grammar_tokenizer(model.tokenizer, model.entry.stop_token_ids)
    for tokens in outputs:
        matcher = grammar.Matcher(tokenizer, constraint)
        for token in tokens:
            matcher.consume(token)  # raises on a token the grammar bars


def pieces(model, prompt: list[int], repeats: int = 200) -> dict:
    """Median microseconds of one mask computation and of one sample with/without a mask."""
    from kipp.text import grammar
    from kipp.text.sampling import Sampler, SamplingParams

    with model.session(64) as session:
        logits = session.eval(prompt)[0]  # real logits (float32 [vocab])
    matcher = grammar.Matcher(grammar.grammar_tokenizer(model.tokenizer,
                                                        model.entry.stop_token_ids),
                              grammar.json_schema_grammar(SCHEMA))
    sampler = Sampler(SamplingParams(temperature=0.7, seed=0))
    mask_us, plain_us, masked_us = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        allowed = matcher.allowed()
        mask_us.append(1e6 * (time.perf_counter() - start))
        start = time.perf_counter()
        sampler.sample(logits, prompt)
        plain_us.append(1e6 * (time.perf_counter() - start))
        start = time.perf_counter()
        token = sampler.sample(logits, prompt, allowed)
        masked_us.append(1e6 * (time.perf_counter() - start))
        matcher.consume(token)
    return {"mask_us": stats.summarize(mask_us), "sample_us": stats.summarize(plain_us),
            "masked_sample_us": stats.summarize(masked_us), "repeats": repeats}


def measure(model, prompt, streams_list, tokens, warmup, runs) -> tuple[dict, list]:
    results = {(s, arm): [] for s in streams_list for arm in ARMS}
    order = []
    for r in range(warmup + runs):
        for streams in streams_list:
            for arm in ARMS:
                run = run_arm(model, prompt, streams, tokens, arm, seed=100 * r)
                results[streams, arm].append(run)
                order.append(f"{'warmup' if r < warmup else 'run'} {r} x{streams} {arm}")
                print(f"  round {r} x{streams} {arm:9} {1000 * run['step_s']:8.1f} ms/step "
                      f"({run['steps']} steps)", file=sys.stderr, flush=True)
    return results, order


def summarize(results: dict, streams_list, warmup: int, parts: dict,
              masks_ahead: bool) -> dict:
    out = {}
    mask_apply_s = 1e-6 * (parts["masked_sample_us"]["median"] - parts["sample_us"]["median"])
    for streams in streams_list:
        plain = [run["step_s"] for run in results[streams, "plain"][warmup:]]
        row = {"plain_step_ms": stats.summarize([1000 * v for v in plain])}
        for arm in ARMS[1:]:
            runs = results[streams, arm][warmup:]
            mine = [run["step_s"] for run in runs]
            ratios = [m / p for m, p in zip(mine, plain)]
            accounted = [1 + (run["grammar_s"] + streams * mask_apply_s) / p
                         for run, p in zip(runs, plain)]
            row[arm] = {"step_ms": stats.summarize([1000 * v for v in mine]),
                        "ratio": stats.summarize(ratios), "ratios": ratios,
                        "grammar_ms_per_step": stats.summarize(
                            [1000 * run["grammar_s"] for run in runs]),
                        "accounted": stats.summarize(accounted)}
        row["default"] = "json-ahead" if masks_ahead else "json-sync"
        row["goal"] = GOAL
        row["goal_met"] = row[row["default"]]["ratio"]["median"] <= GOAL
        out[f"x{streams}"] = row
    return out


def arm_record(backend, streams, arm, runs, warmup, scheme, tokens) -> dict:
    kept = runs[warmup:]
    return {"arm": f"kipp-{backend.name}/{arm}/x{streams}", "engine": "kipp", "scheme": scheme,
            "status": "ok", "spec": {"backend": backend.name, "arm": arm, "streams": streams},
            "info": {"describe": backend.describe()},
            "params": {"max_tokens": tokens, "temperature": 0.7, "grammar": arm != "plain"},
            "runs": kept, "warmup_runs": runs[:warmup],
            "values": [run["step_s"] for run in kept],
            "summary": stats.summarize([run["step_s"] for run in kept]), "peak_rss_bytes": None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="kipp-synthetic/qwen3-tiny")
    parser.add_argument("--backend", default="jax", choices=("jax", "reference", "mlx"))
    parser.add_argument("--scheme", default="bf16")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per stream per run")
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--results", type=Path, default=records.RESULTS)
    args = parser.parse_args(argv)

    import kipp

    streams_list = [int(s) for s in args.streams.split(",")]
    model = kipp.load(args.checkpoint, backend=args.backend, scheme=args.scheme,
                      kv_tokens=max(2048, 8 * (args.tokens + 64)), progress=False)
    prompt = model.tokenizer.encode("Write the table as JSON rows:")
    load_before = os.getloadavg()
    start = time.perf_counter()
    results, order = measure(model, prompt, streams_list, args.tokens, args.warmup, args.runs)
    parts = pieces(model, prompt)
    from kipp.text.grammar import masks_ahead

    summary = summarize(results, streams_list, args.warmup, parts, masks_ahead(model.backend))
    command = "python -m bench.grammar_bench " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    record = records.new(
        "throughput", command, records.checkpoint_block(args.checkpoint), provenance.collect(),
        workload={"name": "grammar", "max_tokens": args.tokens, "streams": streams_list,
                  "sampling": "temperature 0.7, seeded", "prompt_tokens": len(prompt),
                  "schema": SCHEMA},
        protocol={"warmup": args.warmup, "runs": args.runs, "interleaved": True,
                  "order": order, "seconds": time.perf_counter() - start,
                  "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        arms=[arm_record(model.backend, s, a, results[s, a], args.warmup, args.scheme,
                         args.tokens) for s in streams_list for a in ARMS],
        overhead=summary, pieces=parts)
    path = records.write(record, args.results)
    for key, row in summary.items():
        arms = "; ".join(
            f"{arm} {row[arm]['ratio']['median']:.3f}x (MAD {row[arm]['ratio']['mad']:.3f}, "
            f"accounted {row[arm]['accounted']['median']:.4f}x)" for arm in ARMS[1:])
        print(f"{key}: plain {row['plain_step_ms']['median']:.1f} ms/step; {arms}; default "
              f"{row['default']}: goal <= {GOAL} {'met' if row['goal_met'] else 'NOT met'}")
    print(f"mask {parts['mask_us']['median']:.0f} us, sample {parts['sample_us']['median']:.0f}"
          f" us, masked sample {parts['masked_sample_us']['median']:.0f} us")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
