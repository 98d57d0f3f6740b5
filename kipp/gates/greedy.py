"""Gates on greedy tokens: a synthetic checkpoint's designed rule, and the quality report.

The designed rule (kipp.synthetic.rule) is exact on every backend and scheme, and attention,
RoPE, mask, KV cache and block-table bugs change it; the quality report compares a quantized
artifact with its BF16 source on the same backend (a report, never a failure).
"""

from __future__ import annotations

import numpy as np

from kipp.formats.registry import ENDOFTEXT_ID
from kipp.gates.compare import GateResult, kl_divergence, nmse
from kipp.gates.runs import DEFAULT_PROMPTS, all_position_logits, greedy_tokens
from kipp.synthetic.rule import live_token_ids
from kipp.synthetic.rule import rule as designed_rule

DESIGNED_STEPS = 12  # greedy tokens the designed-rule gate follows per prompt
QUALITY_STEPS = 32  # greedy tokens compared in the quality report


def designed_prompts(entry) -> list[list[int]]:
    """Eight fixed prompts for a synthetic checkpoint: noise, then three distinct live tokens
    (so the designed rule fetches two positions back at once), 22 to 29 tokens long so that
    decoding crosses the block boundary at 32 within DESIGNED_STEPS tokens."""
    rng = np.random.default_rng(14)
    live = live_token_ids(entry)
    prompts = []
    for n in range(22, 30):
        tail = rng.choice(live, 3, replace=False)
        prompts.append([int(t) for t in rng.integers(0, ENDOFTEXT_ID, n - 3)]
                       + [int(t) for t in tail])
    return prompts


def gate_designed(model, steps: int = DESIGNED_STEPS) -> GateResult:
    """A synthetic checkpoint's greedy tokens against its designed rule (kipp.synthetic.rule):
    exact on every backend and scheme, and changed by attention, RoPE, mask, KV and
    block-table bugs that logits bounds might let through."""
    prompts = designed_prompts(model.entry)
    rule = designed_rule(model.entry)
    expected = [rule.continuation(p, steps) for p in prompts]
    got = greedy_tokens(model, prompts, steps, expected)
    left = [g != e for g, e in zip(got, expected)]
    return GateResult("greedy = designed rule", not any(left), float(sum(left)), 0.0,
                      f"{len(prompts) - sum(left)}/{len(prompts)} prompts follow it for "
                      f"{steps} tokens", "prompts off the design")


def quality_report(model, bf16_model, steps: int = QUALITY_STEPS) -> GateResult:
    """A quantized artifact vs its BF16 source: NMSE, KL, top-1 and greedy agreement (a
    report: quantization changes the model, so there is nothing exact to hold it to)."""
    scheme = model.artifact.scheme.name
    prompt = model.tokenizer.encode(DEFAULT_PROMPTS[1])
    got, want = all_position_logits(model, prompt), all_position_logits(bf16_model, prompt)
    error = nmse(got, want)
    top1 = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    kl = float(np.mean(kl_divergence(want, got)))
    [a], [b] = greedy_tokens(model, [prompt], steps), greedy_tokens(bf16_model, [prompt], steps)
    agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    detail = (f"KL {kl:.2e} nats; top-1 agreement {top1:.3f}; greedy {steps}: "
              f"{'identical' if agree == len(a) else f'first {agree} tokens identical'}")
    return GateResult(f"quality: {scheme} vs bf16", True, error, float("nan"), detail,
                      gating=False)
