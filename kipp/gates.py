"""Correctness gates: a backend's logits against independent oracles, before any speed claim.

Each gate returns a GateResult; `kipp gates` prints them as a table and the tests assert them.
Bounds are DESIGN.md's: reference vs transformers NMSE <= 5e-5 with identical argmax; cached
decode vs full recompute NMSE <= 1e-6; scrambled block table and batched eval bitwise on the
reference backend; q8_0 artifacts greedy-identical to BF16, 4-bit NMSE <= 3e-2. Argmax gates
accept a differing position only as a numerical tie (see argmax_check), and say how many.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kipp.backend import EvalItem
from kipp.registry import KV_BLOCK

TRANSFORMERS_NMSE = 5e-5
BACKEND_NMSE = 1e-4  # a backend (JAX, MLX) vs the reference backend on the same artifact
CACHED_DECODE_NMSE = 1e-6
QUANT_NMSE = {"bf16": 0.0, "q8_0": 2e-3, "affine4_gs32": 3e-2, "scale4_gs32": 3e-2}

DEFAULT_PROMPTS = (
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597, 2584, 4181, 6765, 10946",
    "Qwen3 是一个大型语言模型。它可以回答问题、写代码，还能翻译 🌍 многие языки.",
)


@dataclass(frozen=True)
class GateResult:
    name: str
    passed: bool
    metric: float  # the measured value (NMSE, or mismatch count for exact gates)
    bound: float
    detail: str = ""


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    """sum((a - b)^2) / sum(b^2), in float64; b is the oracle."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sum((a - b) ** 2) / np.sum(b ** 2))


def argmax_check(got: np.ndarray, want: np.ndarray) -> tuple[int, int]:
    """(positions whose argmax differs, how many of those are numerical ties).

    A differing position is a tie when the oracle's logit of our pick is within twice the row's
    largest error elsewhere (every logit but the two in question) of the oracle's maximum: noise
    of the size seen across the row could swap them. Synthetic random weights produce such
    near-ties now and then (their top two logits can be arbitrarily close). An error that lands
    on the two logits alone, larger than anywhere else in the row, is a real disagreement. (The
    row's largest error including the two would excuse every swap: a swap needs the two errors
    to differ by more than the gap.)
    """
    got, want = np.atleast_2d(got), np.atleast_2d(want)
    ours, theirs = got.argmax(-1), want.argmax(-1)
    differ = np.flatnonzero(ours != theirs)
    ties = 0
    for i in differ:
        error = np.abs(got[i].astype(np.float64) - want[i])
        error[[ours[i], theirs[i]]] = 0.0
        ties += bool(want[i, theirs[i]] - want[i, ours[i]] <= 2 * float(error.max()))
    return len(differ), ties


def _compare(name, got, want, bound, detail="") -> GateResult:
    error = nmse(got, want)
    differ, ties = argmax_check(got, want)
    passed = differ == ties and error <= bound
    positions = np.atleast_2d(want).shape[0]
    note = f"{detail} argmax identical at {positions - differ}/{positions}"
    if differ:
        note += f" ({ties} of {differ} others are near-ties within the measured error)"
    return GateResult(name, passed, error, bound, note.strip())


def all_position_logits(model, tokens: Sequence[int]) -> np.ndarray:
    """Logits [len(tokens), vocab] of every position, from one prefill."""
    with model.session(len(tokens)) as session:
        return session.eval(tokens, logits_rows=len(tokens))


def transformers_logits(source_dir, token_lists: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """The `transformers` Qwen3 model (float32) on the same weights: the independent oracle."""
    import torch
    import transformers

    hf = transformers.Qwen3ForCausalLM.from_pretrained(source_dir, dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        return [hf(torch.tensor([list(t)])).logits[0].numpy() for t in token_lists]


def gate_transformers(model, source_dir, prompts=DEFAULT_PROMPTS) -> GateResult:
    token_lists = [model.tokenizer.encode(p) for p in prompts]
    want = transformers_logits(source_dir, token_lists)
    got = [all_position_logits(model, t) for t in token_lists]
    result = _compare("vs transformers (every position)", np.concatenate(got),
                      np.concatenate(want), TRANSFORMERS_NMSE, f"{len(prompts)} prompts;")
    worst = max(nmse(g, w) for g, w in zip(got, want))
    return GateResult(result.name, result.passed and worst <= TRANSFORMERS_NMSE, worst,
                      TRANSFORMERS_NMSE, result.detail)


def gate_cached_decode(model, prompt=DEFAULT_PROMPTS[0], steps: int = 12) -> GateResult:
    """Prefill then decode one token at a time vs a full recompute at every position."""
    tokens = model.tokenizer.encode(prompt)
    full = all_position_logits(model, tokens)
    split = max(1, len(tokens) - steps)
    with model.session(len(tokens)) as session:
        rows = [session.eval(tokens[:split])[0]]
        rows += [session.eval([t])[0] for t in tokens[split:]]
    return _compare("cached decode vs recompute", np.stack(rows), full[split - 1:], CACHED_DECODE_NMSE,
                    f"{len(tokens) - split} decode positions")


def gate_scrambled_table(model, prompt=DEFAULT_PROMPTS[2], seed: int = 0) -> GateResult:
    """A scrambled block table must give bitwise the logits of the identity table."""
    tokens = model.tokenizer.encode(prompt * 3)
    blocks = -(-len(tokens) // KV_BLOCK)
    pool = model.pool
    table = pool.allocate(blocks)
    try:
        identity = sorted(table)
        scrambled = list(np.random.default_rng(seed).permutation(table))
        rows = min(len(tokens), 4)
        [a] = model.backend.eval([EvalItem(tokens, 0, identity, rows)])
        [b] = model.backend.eval([EvalItem(tokens, 0, scrambled, rows)])
    finally:
        pool.release(table)
    mismatches = int(np.sum(a.view(np.uint32) != b.view(np.uint32)))
    return GateResult("scrambled block table", mismatches == 0, mismatches, 0,
                      f"{len(tokens)} tokens over {blocks} blocks")


def gate_batched(model, prompts=DEFAULT_PROMPTS, tolerance: float = 0.0) -> GateResult:
    """Mixed-length items in one eval vs each alone; bitwise when tolerance is 0."""
    token_lists = [model.tokenizer.encode(p) for p in prompts]
    alone = [all_position_logits(model, t)[-2:] for t in token_lists]
    sessions = [model.session(len(t)) for t in token_lists]
    try:
        together = model.eval_batch([(s, t, 2) for s, t in zip(sessions, token_lists)])
    finally:
        for s in sessions:
            s.close(publish=False)
    if tolerance == 0.0:
        mismatches = sum(int(np.sum(a.view(np.uint32) != b.view(np.uint32)))
                         for a, b in zip(together, alone))
        return GateResult("batched vs isolated", mismatches == 0, mismatches, 0,
                          f"{len(prompts)} items of {[len(t) for t in token_lists]} tokens")
    worst = max(nmse(a, b) for a, b in zip(together, alone))
    return GateResult("batched vs isolated", worst <= tolerance, worst, tolerance)


def gate_quantized(model, bf16_model, steps: int = 32) -> GateResult:
    """A quantized artifact vs its BF16 reference: greedy continuation and full-logit NMSE."""
    scheme = model.artifact.scheme.name
    bound = QUANT_NMSE[scheme]
    prompt = model.tokenizer.encode(DEFAULT_PROMPTS[1])
    got, want = all_position_logits(model, prompt), all_position_logits(bf16_model, prompt)
    error = nmse(got, want)
    argmax_agree = float(np.mean(got.argmax(-1) == want.argmax(-1)))  # reported, not gated
    a = model.generate(prompt, steps, stream=True, temperature=0)
    b = bf16_model.generate(prompt, steps, stream=True, temperature=0)
    list(a), list(b)
    same = a.stats.tokens == b.stats.tokens
    agree = next((i for i, (x, y) in enumerate(zip(a.stats.tokens, b.stats.tokens)) if x != y),
                 min(len(a.stats.tokens), len(b.stats.tokens)))
    detail = (f"argmax agreement {argmax_agree:.3f}; greedy {steps}: "
              f"{'identical' if same else f'first {agree} tokens identical'}")
    passed = error <= bound and (same if scheme == "q8_0" else True)
    return GateResult(f"{scheme} vs bf16", passed, error, bound, detail)


def gate_rows(name: str, got: Sequence[np.ndarray], want: Sequence[np.ndarray],
              bound: float = BACKEND_NMSE) -> GateResult:
    """Row by row (each row a position's logits): NMSE within `bound` and an identical argmax
    (up to near-ties, see argmax_check). The result holds the worst row's NMSE and names it
    and the first failing rows."""
    worst, where, failures = -1.0, "", []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        error = nmse(g, w)
        differ, ties = argmax_check(g, w)
        if error > worst:
            worst, where = error, f"row {i}"
        if error > bound or differ != ties:
            failures.append(f"row {i}: NMSE {error:.2e}"
                            + ("" if differ == ties else ", argmax differs beyond a near-tie"))
    detail = f"worst at {where} of {len(want)}"
    if failures:
        detail = f"{'; '.join(failures[:3])} ({len(failures)} rows fail); {detail}"
    return GateResult(name, not failures, worst, bound, detail)


def gate_backends(oracle, backend, tokens: Sequence[int], table: Sequence[int],
                  logits_rows: int = 1, decode_steps: int = 4,
                  bound: float = BACKEND_NMSE) -> GateResult:
    """`backend` against `oracle` (two Backend objects on the same artifact, each with its own
    KV) on one sequence through `table`: a prefill of `tokens` returning its last `logits_rows`
    rows, then `decode_steps` decode steps fed the oracle's argmax; every step is a gate_rows.
    The result is the first failing step's, else the step with the worst row."""
    tokens, table = tuple(int(t) for t in tokens), tuple(int(b) for b in table)
    item, what = EvalItem(tokens, 0, table, min(logits_rows, len(tokens))), "prefill"
    results = []
    for step in range(decode_steps + 1):
        [want], [got] = oracle.eval([item]), backend.eval([item])
        results.append(gate_rows(f"{backend.name} vs {oracle.name}, {what}", got, want, bound))
        if not results[-1].passed:
            return results[-1]
        position = len(tokens) + step
        item = EvalItem((int(want[-1].argmax()),), position, table)
        what = f"decode position {position}"
    return max(results, key=lambda r: r.metric)


def format_table(results: Sequence[GateResult]) -> str:
    lines = [f"{'gate':36} {'result':6} {'measured':>11} {'bound':>9}  detail"]
    for r in results:
        lines.append(f"{r.name:36} {'PASS' if r.passed else 'FAIL':6} {r.metric:11.3e} "
                     f"{r.bound:9.1e}  {r.detail}")
    return "\n".join(lines)
