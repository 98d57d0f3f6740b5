"""Gates a backend passes against itself and against the numpy reference.

Cached decode vs recompute and a scrambled block table are bitwise on every backend; batched vs
isolated is bitwise where the backend promises it (the reference), within its bound elsewhere.
An accelerated backend also runs a prefill and decode steps across a block boundary against the
reference on the same artifact (gate_vs_reference, built on gate_backends).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kipp.backend import KV_BLOCK, EvalItem, blocks_needed
from kipp.chooser import open_backend
from kipp.gates.bounds import calibrated_bound
from kipp.gates.compare import GateResult, compare, gate_rows
from kipp.gates.runs import DEFAULT_PROMPTS, all_position_logits


def gate_cached_decode(model, prompt=DEFAULT_PROMPTS[0], steps: int = 12) -> GateResult:
    """Prefill then decode one token at a time vs a full recompute at every position."""
    tokens = model.tokenizer.encode(prompt)
    full = all_position_logits(model, tokens)
    split = max(1, len(tokens) - steps)
    with model.session(len(tokens)) as session:
        rows = [session.eval(tokens[:split])[0]]
        rows += [session.eval([t])[0] for t in tokens[split:]]
    return compare("cached decode vs recompute", np.stack(rows), full[split - 1:],
                   calibrated_bound(model.backend, "cached_decode"),
                   f"{len(tokens) - split} decode positions;")


def gate_scrambled_table(model, prompt=DEFAULT_PROMPTS[2], seed: int = 0) -> GateResult:
    """A scrambled block table must give bitwise the logits of the identity table."""
    tokens = model.tokenizer.encode(prompt * 3)
    blocks = blocks_needed(len(tokens))
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
    return compare("scrambled block table", b, a, 0.0,
                   f"{len(tokens)} tokens over {blocks} blocks;")


def gate_batched(model, prompts=DEFAULT_PROMPTS) -> GateResult:
    """Mixed-length items in one eval vs each alone; bitwise where the backend promises it."""
    token_lists = [model.tokenizer.encode(p) for p in prompts]
    alone = [all_position_logits(model, t)[-2:] for t in token_lists]
    sessions = [model.session(len(t)) for t in token_lists]
    try:
        together = model.eval_batch([(s, t, 2) for s, t in zip(sessions, token_lists)])
    finally:
        for s in sessions:
            s.close(publish=False)
    return compare("batched vs isolated", np.concatenate(together), np.concatenate(alone),
                   calibrated_bound(model.backend, "batched"),
                   f"{len(prompts)} items of {[len(t) for t in token_lists]} tokens;")


def activation_dots(backend) -> str:
    """The dots of Kipp's stored CPU matmul that round `backend`'s projection inputs ("int8",
    "bf16", "int8+bf16"; "f32" where none does): its reference oracle rounds them the same
    way."""
    return getattr(backend, "cpu_dot", "f32")


def gate_vs_reference(model, prompt=DEFAULT_PROMPTS[2], decode_steps: int = 4) -> GateResult:
    """An accelerated backend against the numpy reference on the same artifact: a prefill
    that ends just before a block boundary (every row) and decode steps across it, through a
    scrambled table. The reference rounds the activations where the backend does
    (activation_dots)."""
    tokens = model.tokenizer.encode(prompt * 2)[:KV_BLOCK - 2]
    blocks = blocks_needed(len(tokens) + decode_steps) + 1
    oracle = open_backend("reference", model.artifact, blocks, kv_scheme=model.backend.kv_scheme,
                          activations=activation_dots(model.backend))
    table = model.pool.allocate(blocks)
    try:
        scrambled = tuple(int(b) for b in np.random.default_rng(1).permutation(table))
        return gate_backends(oracle, model.backend, tokens, scrambled, logits_rows=len(tokens),
                             decode_steps=decode_steps, oracle_table=tuple(range(blocks)))
    finally:
        model.pool.release(table)


def gate_backends(oracle, backend, tokens: Sequence[int], table: Sequence[int],
                  logits_rows: int = 1, decode_steps: int = 4, bound: float | None = None,
                  oracle_table: Sequence[int] | None = None) -> GateResult:
    """`backend` against `oracle` (two Backend objects on the same artifact, each with its own
    KV) on one sequence through `table` (the oracle through `oracle_table`, default the same):
    a prefill of `tokens` returning its last `logits_rows` rows, then `decode_steps` decode
    steps fed the oracle's argmax; every step is a gate_rows. The bound defaults to the
    backend's calibrated "reference" bound. The result is the first failing step's, else the
    step with the worst row."""
    limit = calibrated_bound(backend, "reference") if bound is None else bound
    tokens, table = tuple(int(t) for t in tokens), tuple(int(b) for b in table)
    oracle_table = table if oracle_table is None else tuple(int(b) for b in oracle_table)
    rows = min(logits_rows, len(tokens))
    items = (EvalItem(tokens, 0, oracle_table, rows), EvalItem(tokens, 0, table, rows))
    what, results = "prefill", []
    for step in range(decode_steps + 1):
        [want], [got] = oracle.eval([items[0]]), backend.eval([items[1]])
        results.append(gate_rows(f"{backend.name} vs {oracle.name}, {what}", got, want, limit))
        if not results[-1].passed:
            return results[-1]
        position = len(tokens) + step
        token = (int(want[-1].argmax()),)
        items = (EvalItem(token, position, oracle_table), EvalItem(token, position, table))
        what = f"decode position {position}"
    worst = max(results, key=lambda r: r.metric)
    return GateResult(f"vs reference ({len(tokens)}-token prefill, {decode_steps} decode)",
                      True, worst.metric, limit, f"{worst.name}: {worst.detail}",
                      "worst-row NMSE")
