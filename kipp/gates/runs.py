"""How the gates drive a model: their prompts, every position's logits, greedy tokens."""

from __future__ import annotations

from typing import Sequence

import numpy as np

DEFAULT_PROMPTS = (
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597, 2584, 4181, 6765, 10946",
    "Qwen3 是一个大型语言模型。它可以回答问题、写代码，还能翻译 🌍 многие языки.",
)


def all_position_logits(model, tokens: Sequence[int]) -> np.ndarray:
    """Logits [len(tokens), vocab] of every position, from one prefill."""
    with model.session(len(tokens)) as session:
        return session.eval(tokens, logits_rows=len(tokens))


def greedy_tokens(model, prompts: Sequence[Sequence[int]], steps: int,
                  expected: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """`steps` greedy tokens after each prompt, the prompts still going in one batched eval per
    step. With `expected` (a continuation per prompt), a prompt stops at its first token off
    its continuation (that token ends its list) and the loop once every prompt has left."""
    sessions = [model.session() for _ in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    try:
        going = list(range(len(prompts)))
        rows = model.eval_batch([(s, list(p), 1) for s, p in zip(sessions, prompts)])
        for step in range(steps):
            for i, r in zip(going, rows):
                out[i].append(int(r[-1].argmax()))
            if expected is not None:
                going = [i for i in going if out[i][-1] == expected[i][step]]
            if not going or step + 1 == steps:
                break
            rows = model.eval_batch([(sessions[i], [out[i][-1]], 1) for i in going])
    finally:
        for s in sessions:
            s.close(publish=False)
    return out
