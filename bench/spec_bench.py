"""Speculative decoding speed-up: greedy decode with and without prompt-lookup speculation.

    .venv/bin/python -m bench.spec_bench --backend jax --checkpoint kipp-synthetic/qwen3-tiny
    .venv/bin/python -m bench.spec_bench --backend jax \\
        --checkpoint kipp-synthetic/qwen3-0.6b-shape --tokens 64 --runs 3

Three texts, each decoded greedily `--tokens` tokens plain and speculatively, interleaved in
one process (round r: copy plain, copy spec, code plain, code spec, random plain, random spec),
after `--warmup` discarded rounds that also compile every JAX round shape. The value is decode
tok/s (tokens picked from decode-eval logits / seconds in decode evals; prefill excluded); the
speed-up is the median over rounds of each round's spec / plain ratio, with its MAD. Every spec
run must emit exactly the plain run's tokens, or the record says so and the command fails.

What the texts are, on a synthetic checkpoint. Its greedy tokens follow a designed rule of the
last three tokens (kipp.synthetic.writer.designed_rule): from three live tokens, greedy text walks a
fixed chain, and the model never copies from its context. A real model's "copy-heavy" text
(editing code, quoting a document, re-stating a list) is text whose continuation already sits
in the context. The synthetic equivalent is a prompt that holds the chain the model is about to
walk:
- copy: 16 random ids, then the chain, 3 random ids, then the
  chain's first three tokens: the continuation is in the prompt word for word.
- code: the continuation in pieces of 2-4 chain tokens, each followed by an edit (a random
  id), the way code repeats identifiers and idioms with changes: drafts are right for a few
  tokens, then wrong.
- random: 64 random ids: the continuation is nowhere in the prompt; drafts come only from
  chance n-gram matches in what was generated.
Acceptance rates and the measured speed-ups therefore say how the engine converts acceptance
into speed on this backend; they say nothing about how often a real model's text repeats.

Target: >= 1.8x on copy-heavy text, never below 0.9x elsewhere. The reference
backend is the oracle, not a fast path (its multi-row logits cost per row); measure JAX.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from bench import provenance, records, stats

TEXTS = ("copy", "code", "random")
TARGETS = {"copy": 1.8, "code": 0.9, "random": 0.9}


def prompts(model, tokens: int, seed: int = 0) -> dict[str, list[int]]:
    """The three texts for a synthetic checkpoint (module docstring)."""
    from kipp.synthetic.writer import designed_rule, live_token_ids

    rng = np.random.default_rng(seed)
    noise = [int(t) for t in rng.integers(0, 151_643, 64)]
    head = [int(t) for t in rng.choice(live_token_ids(model.entry), 3, replace=False)]
    chain = head + designed_rule(model.entry).continuation(head, tokens + 2)
    pieces, i = [], 3
    for piece in range(tokens):
        if i >= len(chain):
            break
        n = 2 + piece % 3  # 2, 3, 4 chain tokens ...
        pieces += chain[i:i + n] + [noise[16 + piece % 48]]  # ... then an edit
        i += n + 1  # the edit replaces one chain token
    return {"copy": noise[:16] + chain + noise[16:19] + chain[:3],
            "code": noise[:16] + pieces + chain[:3],
            "random": noise}


def run_once(model, prompt: list[int], tokens: int, speculative: bool) -> dict:
    generation = model.generate(prompt, tokens, stream=True, temperature=0,
                                speculative=speculative)
    for _ in generation:
        pass
    s = generation.stats
    run = {"tokens": s.decode_tokens, "seconds": s.decode_seconds, "evals": s.decode_evals,
           "tok_s": stats.rate(s.decode_tokens, s.decode_seconds), "ids": s.tokens}
    if s.spec is not None:
        run.update(drafted=s.spec.drafted, accepted=s.spec.accepted)
    return run


def measure(model, texts: dict, tokens: int, warmup: int, runs: int) -> tuple[dict, list]:
    """{(text, mode): [run per round]} over warmup + runs interleaved rounds, and the order."""
    results = {(text, mode): [] for text in texts for mode in ("plain", "spec")}
    order = []
    for r in range(warmup + runs):
        for text, prompt in texts.items():
            for mode in ("plain", "spec"):
                run = run_once(model, prompt, tokens, mode == "spec")
                results[text, mode].append(run)
                order.append(f"{'warmup' if r < warmup else 'run'} {r} {text} {mode}")
                print(f"  round {r} {text:6} {mode:5} {run['tok_s']:8.1f} tok/s "
                      f"({run['evals']} evals)", file=sys.stderr, flush=True)
    return results, order


def arm(backend, text: str, mode: str, runs: list, warmup: int, scheme: str, tokens: int):
    kept = runs[warmup:]
    values = [run["tok_s"] for run in kept]
    strip = lambda run: {k: v for k, v in run.items() if k != "ids"}  # noqa: E731
    return {"arm": f"kipp-{backend.name}/{mode}/{text}", "engine": "kipp", "scheme": scheme,
            "status": "ok", "spec": {"backend": backend.name, "mode": mode, "text": text},
            "info": {"describe": backend.describe()},
            "params": {"max_tokens": tokens, "temperature": 0, "speculative": mode == "spec"},
            "runs": [strip(run) for run in kept], "warmup_runs": [strip(r) for r in runs[:warmup]],
            "values": values, "summary": stats.summarize(values), "peak_rss_bytes": None}


def summarize(results: dict, texts, warmup: int) -> dict:
    """Per text: paired speed-up (median, MAD), acceptance, identical tokens, target met."""
    out = {}
    for text in texts:
        plain, spec = results[text, "plain"], results[text, "spec"]
        ratios = [s["tok_s"] / p["tok_s"] for p, s in zip(plain[warmup:], spec[warmup:])]
        drafted = sum(run["drafted"] for run in spec[warmup:])
        accepted = sum(run["accepted"] for run in spec[warmup:])
        out[text] = {"speedup": stats.summarize(ratios), "ratios": ratios,
                     "acceptance_rate": accepted / drafted if drafted else 0.0,
                     "drafted": drafted, "accepted": accepted,
                     "evals_plain": plain[-1]["evals"], "evals_spec": spec[-1]["evals"],
                     "identical": all(p["ids"] == s["ids"] for p, s in zip(plain, spec)),
                     "target": TARGETS[text],
                     "target_met": stats.median(ratios) >= TARGETS[text]}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="kipp-synthetic/qwen3-tiny")
    parser.add_argument("--backend", default="jax", choices=("jax", "reference"))
    parser.add_argument("--scheme", default="bf16")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per run")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--results", type=Path, default=records.RESULTS)
    args = parser.parse_args(argv)

    import kipp

    model = kipp.load(args.checkpoint, backend=args.backend, scheme=args.scheme,
                      kv_tokens=2048, progress=False)
    texts = prompts(model, args.tokens)
    start = time.perf_counter()
    results, order = measure(model, texts, args.tokens, args.warmup, args.runs)
    summary = summarize(results, texts, args.warmup)
    command = "python -m bench.spec_bench " + " ".join(shlex.quote(a) for a in
                                                      (argv if argv is not None else sys.argv[1:]))
    record = records.new(
        "throughput", command, records.checkpoint_block(args.checkpoint), provenance.collect(),
        workload={"name": "spec", "max_tokens": args.tokens, "batch": 1, "sampling": "greedy",
                  "prompt_tokens": {t: len(p) for t, p in texts.items()},
                  "texts": "see bench/spec_bench.py's docstring"},
        protocol={"warmup": args.warmup, "runs": args.runs, "interleaved": True,
                  "order": order, "seconds": time.perf_counter() - start},
        arms=[arm(model.backend, t, m, results[t, m], args.warmup, args.scheme, args.tokens)
              for t in texts for m in ("plain", "spec")],
        speedups=summary)
    path = records.write(record, args.results)
    for text, s in summary.items():
        print(f"{text:6} speed-up {s['speedup']['median']:.2f}x (MAD {s['speedup']['mad']:.2f}), "
              f"acceptance {s['acceptance_rate']:.0%}, evals {s['evals_spec']} vs "
              f"{s['evals_plain']}, identical {s['identical']}, target >= {s['target']}x: "
              f"{'met' if s['target_met'] else 'NOT met'}")
    print(path)
    return 0 if all(s["identical"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
