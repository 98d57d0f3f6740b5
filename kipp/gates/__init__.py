"""Correctness gates: a backend's logits against independent oracles, before any speed claim.

Each gate returns a GateResult (a measured error, the bound it is held to, pass or fail);
`kipp gates` prints them as a table and the tests assert them. `run_gates(model, source)` is
the whole set for one artifact on one backend:

- kipp.gates.source: the artifact holds exactly the source checkpoint's weights, and the
  backend matches `transformers` (float32) on them at every position of DEFAULT_PROMPTS;
- kipp.gates.consistency: vs the numpy reference (accelerated backends), cached decode vs
  recompute, a scrambled block table, batched vs isolated;
- kipp.gates.greedy: greedy tokens follow a synthetic checkpoint's designed rule, and the
  quality report of a quantized artifact against its BF16 source.

Bounds are calibrated per backend (kipp.gates.bounds); an argmax difference passes only as a
numerical near-tie (kipp.gates.compare.argmax_check), and is reported.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from kipp.gates.bounds import BOUNDS, GATES, bound_key, calibrated_bound
from kipp.gates.compare import GateResult, argmax_check, compare, gate_rows, nmse
from kipp.gates.consistency import (
    activation_dots,
    gate_backends,
    gate_batched,
    gate_cached_decode,
    gate_scrambled_table,
    gate_vs_reference,
)
from kipp.gates.greedy import (
    DESIGNED_STEPS,
    QUALITY_STEPS,
    designed_prompts,
    gate_designed,
    quality_report,
)
from kipp.gates.runs import DEFAULT_PROMPTS, all_position_logits, greedy_tokens
from kipp.gates.source import (
    gate_source,
    gate_transformers,
    transformers_logits,
    transformers_model,
)

__all__ = [
    "BOUNDS", "DEFAULT_PROMPTS", "DESIGNED_STEPS", "GATES", "QUALITY_STEPS", "GateResult",
    "activation_dots", "all_position_logits", "argmax_check", "bound_key", "calibrated_bound",
    "compare", "designed_prompts", "format_table", "gate_backends", "gate_batched",
    "gate_cached_decode", "gate_designed", "gate_rows", "gate_scrambled_table", "gate_source",
    "gate_transformers", "gate_vs_reference", "greedy_tokens", "nmse", "quality_report",
    "run_gates", "transformers_logits", "transformers_model",
]


def run_gates(model, source_dir, bf16_model=None) -> list[GateResult]:
    """Every gate for `model` (an artifact on a backend) against the HF folder `source_dir`;
    `bf16_model` (the BF16 artifact of the same source) adds the quality report."""
    hf = gate_transformers(model, source_dir)
    if model.backend.kv_scheme != "bf16":  # transformers keeps float32 K/V: nothing to hold
        hf = dataclasses.replace(
            hf, passed=True, bound=float("nan"), gating=False,
            detail=f"{model.backend.kv_scheme} KV, transformers float32 K/V: a report; the "
                   f"backend vs reference gate holds it; {hf.detail}")
    results = [gate_source(model.artifact, source_dir), hf]
    if model.entry.is_synthetic:
        results.append(gate_designed(model))
    if model.backend.name != "reference":
        results.append(gate_vs_reference(model))
    results += [gate_cached_decode(model), gate_scrambled_table(model), gate_batched(model)]
    if bf16_model is not None:
        results.append(quality_report(model, bf16_model))
    return results


def format_table(results: Sequence[GateResult]) -> str:
    """The results as a table: gate, verdict, measured error, bound, what was measured, detail."""
    lines = [f"{'gate':44} {'result':6} {'measured':>10} {'bound':>8}  {'measure':26} detail"]
    for r in results:
        limit = "report" if not r.gating else f"{r.bound:8.1e}"
        lines.append(f"{r.name:44} {r.verdict:6} {r.metric:10.3e} {limit:>8}  {r.measure:26} "
                     f"{r.detail}")
    return "\n".join(lines)
