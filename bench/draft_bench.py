"""Speculative decoding with a draft model: speed-up over plain decode at each acceptance dial.

    .venv/bin/python -m bench spec                      # the record run: JAX, the 0.6B shape
    .venv/bin/python -m bench spec --target kipp-synthetic/qwen3-tiny \\
        --agree 95 --tokens 16 --runs 1 --warmup 0      # a smoke run

The target is the 0.6B-shaped synthetic checkpoint; its drafts are the tiny synthetic
checkpoints built to agree with its greedy text at about 95%, 70% and 30%
(kipp-synthetic/qwen3-0.6b-draft-N: its seed's designed rule, a fraction of the live tokens
moved). Prompts are three live tokens, so the target walks its designed chain. Each arm decodes
`--tokens` tokens per stream, greedy and at temperature 0.7, 1 stream and 8, plain and with the
draft, interleaved per round after `--warmup` rounds; a run that compiled a step shape it had
not met (the target's or the draft's) is run again, so no compile is inside a measurement.
The value is decode tok/s (generated tokens over the wall time from the last prompt's logits to
the end). Each arm's spec runs sit between two plain runs, and a round's speed-up is spec over
the geometric mean of the two: a shared host's load drifts over a round's runs, and one plain
run before them all measured a drafting arm against an earlier minute. The speed-up is the
median over rounds. Greedy spec runs must emit exactly the plain runs' tokens, or the command
fails. `--draft-vocab full 32768` measures each
draft twice in the same rounds: its head over the whole vocabulary, and over the first 32,768
ids (load's draft_vocab); the record keeps the share of this repository's docs' and code's
tokens below each cut, what a real pair's drafts could still propose.

Beside the measurement, `predict` gives the speed-up for Qwen3-0.6B drafting for 8B and 32B
(BF16, batch 1) on an H200 and on an M-series Mac. A round of draft length k costs k draft decode
steps and one target verify of k + 1 rows, and yields E(k) = (1 - a^(k+1)) / (1 - a) tokens at
acceptance a; the speed-up is E(k) x (target step) / (round), k the best of the gate's sizes.
- H200: every step time is the compile report's roofline (bench/kernels.py, the newest
  kernels-h200 record in bench/results): the projections and head at M = 1 (decode) or M = 8
  (a verify of up to 8 rows, so k <= 7), plus decode attention over 2,048 positions, per layer.
  Like the report's own predictions these leave out XLA's ops between the kernels.
- M-series: no compile report exists for Metal, so a step is the weights' bytes over the
  bandwidth (an M4 Max's 546 GB/s), or a verify's FLOPs at the BF16 peak when that is longer.
- A draft vocabulary N (`--draft-vocab N`) gets rows of its own: the draft step shrinks with the
  head rows it no longer reads (both models step at their weights' bytes), and the acceptance
  is a x c, c the measured share of text tokens below N (`draft_vocab_coverage`): a token past
  the cut is never drafted, and the rest as often as with the whole head.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from bench import provenance, records, stats

TARGET = "kipp-synthetic/qwen3-0.6b-shape"
AGREE = (95, 70, 30)
MAC = ("M4 Max (546 GB/s)", 546e9, 34e12)  # bandwidth and BF16 peak (vendor figures)
RETRIES = 4  # runs of one arm and round while each compiles a step shape it had not met
GOALS = {"speedup_at_70_single": 1.8, "floor": 0.95}
FULL = "full"  # a draft's head over the whole vocabulary


def _draft_vocab(text: str):
    return FULL if text == FULL else int(text)


def prompts(model, streams: int, seed: int) -> list[list[int]]:
    from kipp.synthetic.writer import live_token_ids

    rng = np.random.default_rng(seed)
    live = live_token_ids(model.entry)
    return [[int(t) for t in rng.choice(live, 3, replace=False)] for _ in range(streams)]


def decode(model, prompts_, tokens: int, temperature: float, spec, seed: int) -> dict:
    """One batch of streams to the end: decode tok/s, tokens, acceptance."""
    from kipp.engine.scheduler import Done, Request, Scheduler
    from kipp.text.sampling import SamplingParams

    compiled = _compiled(model, spec)
    scheduler = Scheduler(model, max_batch=max(8, len(prompts_)), speculative=spec or False)
    # A seeded request on a batch-variant backend runs alone (kipp.engine.choices), so sampled
    # streams of a batch go unseeded: they share the rounds, as a server's requests do.
    alone = seed if len(prompts_) == 1 else None
    tickets = [scheduler.submit(Request(tuple(p), tokens, sampling=SamplingParams(
        temperature=temperature, seed=alone))) for p in prompts_]
    while any(r.prompt_done_at is None for r in scheduler._running) or scheduler._fifo:
        scheduler.step()
    start = time.perf_counter()
    scheduler.run_until_idle()
    seconds = time.perf_counter() - start
    ids, drafted, accepted, verifies, plains = [], 0, 0, 0, 0
    for ticket in tickets:
        events = list(ticket)
        ids.append([t for e in events if hasattr(e, "tokens") for t in e.tokens])
        done = events[-1]
        if isinstance(done, Done) and done.spec is not None:
            drafted += done.spec.drafted
            accepted += done.spec.accepted
            verifies += done.spec.verify_evals
            plains += done.spec.plain_evals
    generated = sum(len(i) for i in ids) - len(ids)  # the first token came with the prompt
    return {"tok_s": stats.rate(generated, seconds), "seconds": seconds, "ids": ids,
            "drafted": drafted, "accepted": accepted, "verify_evals": verifies,
            "plain_evals": plains,
            "compiled": _compiled(model, spec) - compiled}


def _compiled(model, spec) -> int:
    """Step shapes compiled so far by the target and the draft (0 on an uncompiled backend)."""
    models = [model] + ([spec.draft_model] if spec and getattr(spec, "draft_model", None)
                        else [])
    return sum(len(getattr(m.backend, "buckets", ())) for m in models)


def gate_costs(target, drafts: dict) -> dict:
    """Each draft's gate costs, measured once (kipp.engine.draft), so every round's gates
    price alike and the record says what they were."""
    from kipp.engine.draft import draft_cost, verify_costs

    row_costs = verify_costs(target)
    return {key: {"draft_cost": draft_cost(target, draft), "row_costs": row_costs}
            for key, draft in drafts.items()}


def vocab_coverage(model, vocabs) -> dict:
    """The share of the tokens of this repository's docs and Python below each draft vocabulary
    (English prose and code): a target token past a draft's cut head is never drafted, so
    this bounds what the cut costs a real pair's acceptance."""
    root = Path(__file__).resolve().parent.parent
    files = sorted(root.glob("docs/*.md")) + sorted(root.glob("kipp/**/*.py"))
    ids = np.array([t for f in files for t in model.tokenizer.encode(f.read_text())])
    return {"files": "docs/*.md, kipp/**/*.py", "tokens": int(ids.size),
            **{str(v): round(float(np.mean(ids < v)), 4) for v in vocabs if v != FULL}}


def measure(target, drafts: dict, costs: dict, args) -> dict:
    """Per round, dial, temperature and stream count: plain, each draft vocabulary's spec run,
    plain again; results[(agree, vocab, temperature, streams)] lists (kept, run), vocab
    None the plain runs (two a round)."""
    from kipp.engine.draft import spec_config

    results = {}
    for r in range(args.warmup + args.runs):
        for agree in args.agree:
            specs = {vocab: spec_config(draft, target, **costs[agree, vocab])
                     for (a, vocab), draft in drafts.items() if a == agree}
            for temperature in (0.0, 0.7):
                for streams in args.streams:
                    ps = prompts(target, streams, seed=r)
                    for vocab, spec in [(None, None), *specs.items(), (None, None)]:
                        for _ in range(RETRIES):  # a run that compiled a new shape is redone
                            run = decode(target, ps, args.tokens, temperature, spec,
                                         seed=100 * r)
                            if not run["compiled"]:
                                break
                        key = (agree, vocab, temperature, streams)
                        results.setdefault(key, []).append((r >= args.warmup, run))
                        mode = "plain" if spec is None else f"spec {vocab}"
                        print(f"  round {r} agree {agree} T={temperature} x{streams} {mode:10} "
                              f"{run['tok_s']:8.1f} tok/s", file=sys.stderr, flush=True)
    return results


def summarize(results: dict) -> list[dict]:
    rows = []
    for (agree, vocab, temperature, streams), runs in results.items():
        if vocab is None:
            continue
        plain = [run for kept, run in results[agree, None, temperature, streams] if kept]
        spec = [run for kept, run in runs if kept]
        # each round's spec run against the geometric mean of the plain runs around it
        around = [(b["tok_s"] * a["tok_s"]) ** 0.5 for b, a in zip(plain[::2], plain[1::2])]
        ratios = [s["tok_s"] / p for p, s in zip(around, spec)]
        drafted = sum(s["drafted"] for s in spec)
        rows.append({"agree": agree, "draft_vocab": vocab, "temperature": temperature,
                     "streams": streams,
                     "speedup": stats.summarize(ratios), "ratios": ratios,
                     "plain_tok_s": stats.median([p["tok_s"] for p in plain]),
                     "spec_tok_s": stats.median([s["tok_s"] for s in spec]),
                     "acceptance_rate": sum(s["accepted"] for s in spec) / drafted
                     if drafted else 0.0,
                     # how often the gate drafted: a choice's verifying and plain steps
                     "verify_evals": sum(s["verify_evals"] for s in spec),
                     "plain_evals": sum(s["plain_evals"] for s in spec),
                     "identical": temperature > 0 or all(p["ids"] == s["ids"]
                                                         for p, s in zip(plain[::2], spec))})
    return rows


def _gain(a: float, k: int, step: float, verify: float, draft_step: float) -> float:
    return (1 - a ** (k + 1)) / (1 - a) * step / (verify + k * draft_step)


def _h200_steps(entries) -> dict | None:
    """{checkpoint id: (decode step s, verify step s)} from the newest compile report."""
    from bench import kernels

    found = sorted(records.RESULTS.glob("*-kernels-h200.json"))
    if not found:
        return None
    rows = json.loads(found[-1].read_text())["kernels"]
    out = {}
    for entry in entries:
        decode = kernels._step_seconds(rows, entry, "bf16", 1, "decode_attention", "S=1 ")
        verify = kernels._step_seconds(rows, entry, "bf16", 8, "decode_attention", "S=1 ")
        if decode is None or verify is None:
            return None
        out[entry.id] = (decode, verify)
    out["report"] = found[-1].name
    return out


def predict(acceptances=(0.95, 0.7, 0.3), draft="Qwen/Qwen3-0.6B",
            targets=("Qwen/Qwen3-8B", "Qwen/Qwen3-32B"), coverage=None) -> list[dict]:
    """The batch-1 BF16 speed-up per machine, target, acceptance and draft vocabulary (module
    docstring): the whole head, then each cut in `coverage` ({N: share of text tokens below N},
    draft_vocab_coverage's)."""
    from kipp.engine.draft import MODEL_GATE
    from kipp.formats import registry

    sizes = MODEL_GATE["sizes"]
    entry = registry.get(draft)
    whole = 2 * entry.parameter_count  # BF16 bytes a draft step reads, its head included
    vocabs = [(FULL, 1.0, 1.0)] + [  # (vocabulary, coverage, draft step's share of whole)
        (int(n), c, 1 - 2 * (registry.VOCAB_SIZE - int(n)) * entry.hidden / whole)
        for n, c in (coverage or {}).items()]
    out = []
    h200 = _h200_steps([registry.get(c) for c in (draft, *targets)])
    name, bandwidth, flops = MAC
    for target in targets:
        t = 2 * registry.get(target).parameter_count
        mac_step = t / bandwidth
        machines = [(name, "bandwidth", sizes, mac_step,
                     lambda k: max(mac_step, t * (k + 1) / flops), whole / bandwidth)]
        if h200 is not None:  # a verify of up to 8 rows, timed at M = 8
            step, verify = h200[target]
            machines.insert(0, ("H200 SXM", h200["report"], [k for k in sizes if k + 1 <= 8],
                                step, lambda k, v=verify: v, h200[draft][0]))
        for vocab, covered, share in vocabs:
            for a in acceptances:
                for machine, model, ks, step, verify, draft_step in machines:
                    out.append({"machine": machine, "model": model, "target": target,
                                "draft": draft, "draft_vocab": vocab, "acceptance": a,
                                "draft_acceptance": a * covered,
                                **_best(a * covered, ks, step, verify, draft_step * share)})
    return out


def _best(a: float, sizes, step: float, verify, draft_step: float) -> dict:
    """The gate's best draft length at acceptance `a` and its speed-up (never below plain)."""
    k = max(sizes, key=lambda k: _gain(a, k, step, verify(k), draft_step))
    return {"k": k, "step_ms": step * 1e3, "verify_ms": verify(k) * 1e3,
            "draft_step_ms": draft_step * 1e3,
            "speedup": max(1.0, _gain(a, k, step, verify(k), draft_step))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--agree", type=int, nargs="+", default=list(AGREE), choices=AGREE)
    parser.add_argument("--backend", default="jax", choices=("jax", "reference"))
    parser.add_argument("--draft-vocab", type=_draft_vocab, nargs="+", default=[FULL],
                        help="each draft's head: 'full' or the first N ids (load's "
                             "draft_vocab), an arm each")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--results", type=Path, default=records.RESULTS)
    args = parser.parse_args(argv)

    import kipp

    def load(checkpoint, **options):
        return kipp.load(checkpoint, backend=args.backend, kv_tokens=4096, progress=False,
                         **options)

    target = load(args.target)
    # a draft's head cut as load(..., draft_vocab=N) cuts it, without a second target
    drafts = {(a, v): load(f"kipp-synthetic/qwen3-0.6b-draft-{a}",
                           _head_rows=None if v == FULL else v)
              for a in args.agree for v in args.draft_vocab}
    start = time.perf_counter()
    costs = gate_costs(target, drafts)
    results = measure(target, drafts, costs, args)
    rows = summarize(results)
    coverage = vocab_coverage(target, args.draft_vocab)
    predicted = predict(coverage={str(v): coverage[str(v)] for v in args.draft_vocab
                                  if v != FULL})
    command = "python -m bench spec " + " ".join(shlex.quote(a) for a in
                                                 (argv if argv is not None else sys.argv[1:]))
    record = records.new(
        "throughput", command, records.checkpoint_block(args.target), provenance.collect(),
        workload={"name": "spec-draft", "max_tokens": args.tokens, "streams": args.streams,
                  "drafts": {a: f"kipp-synthetic/qwen3-0.6b-draft-{a}" for a in args.agree},
                  "draft_vocab": args.draft_vocab,
                  "draft_vocab_coverage": coverage,
                  "texts": "see bench/draft_bench.py's docstring",
                  "gate_costs": {f"{a}/{v}": c for (a, v), c in costs.items()}},
        protocol={"warmup": args.warmup, "runs": args.runs, "interleaved": True,
                  "seconds": time.perf_counter() - start},
        arms=[], speedups=rows, predicted=predicted, goals=GOALS)
    path = records.write(record, args.results)
    for row in rows:
        s = row["speedup"]
        print(f"agree {row['agree']:2d}% vocab {row['draft_vocab']} "
              f"T={row['temperature']} x{row['streams']}: speed-up "
              f"{s['median']:.2f}x (MAD {s['mad']:.2f}), acceptance {row['acceptance_rate']:.0%}"
              f", identical {row['identical']}")
    for p in predicted:
        print(f"predicted {p['machine']:18s} {p['draft']} (vocab {p['draft_vocab']}) -> "
              f"{p['target']}: acceptance {p['acceptance']:.0%}, k={p['k']}: "
              f"{p['speedup']:.2f}x")
    print(path)
    return 0 if all(row["identical"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
