"""The workload registry: what a benchmark measures, by name.

Each workload fixes its shape (prompt length, generated tokens, clients) and how one measured run
turns an engine into a number. Runnable workloads today:

    decode        single-stream greedy decode of 128 tokens after a 16-token prompt (tok/s of
                  the decode steps only; the prompt's prefill is timed and reported apart)
    prefill512    prefill of a 512-token prompt into an empty cache (tok/s to the last logits)
    prefill2048   the same at 2,048 tokens

Registered here for their names and shapes, but measured against each engine's own HTTP
server by `python -m bench server` (bench/server_bench.py), not by `run`'s in-process arms:

    server_aggregate   aggregate decode tok/s with 1/2/4/8 concurrent clients against each
                       engine's own HTTP server (Kipp's, llama.cpp's, vLLM's)
    ttft_prefix        time to first token of a 2,000-token prompt sent twice (prefix reuse)

and one that `python -m bench engine` (bench/engine_bench.py) runs in a Kipp worker:

    reuse_profile      a repeated prompt's adopt / evaluate-the-rest / sample / decode-step times
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from bench.stats import rate


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "decode", "prefill", "server", "ttft"
    description: str
    params: Mapping[str, int] = field(default_factory=dict)
    unit: str = "tok/s"
    higher_is_better: bool = True
    planned: bool = False  # not runnable by `bench run` (the server workloads: `bench server`)

    def with_params(self, **overrides) -> "Workload":
        """A copy with some parameters changed (unknown names are an error)."""
        unknown = set(overrides) - set(self.params)
        if unknown:
            raise ValueError(f"workload {self.name} has no parameter(s) {sorted(unknown)}; "
                             f"it has {sorted(self.params)}")
        return replace(self, params={**self.params, **overrides})

    @property
    def prompt_tokens(self) -> int:
        return int(self.params.get("prompt_tokens", 0))


GENERATED_KEPT = 32  # greedy ids kept per decode run, to compare continuations across engines


def measure_decode(engine, prompt: list[int], params: Mapping[str, int]) -> dict:
    """Greedy decode of params["decode_tokens"] tokens after `prompt`; the value is decode tok/s."""
    n = int(params["decode_tokens"])
    timing = engine.decode(prompt, n)
    return {"value": rate(timing["decode_tokens"], timing["decode_seconds"]),
            "seconds": timing["decode_seconds"], "tokens": timing["decode_tokens"],
            "generated": [int(t) for t in timing.get("generated", [])[:GENERATED_KEPT]],
            "prefill_seconds": timing.get("prefill_seconds"),
            "prefill_tok_s": (rate(len(prompt), timing["prefill_seconds"])
                              if timing.get("prefill_seconds") else None)}


def measure_prefill(engine, prompt: list[int], params: Mapping[str, int]) -> dict:
    """Prefill of `prompt` into an empty cache; the value is prompt tok/s."""
    seconds = engine.prefill(prompt)
    return {"value": rate(len(prompt), seconds), "seconds": seconds, "tokens": len(prompt)}


def measure_reuse_profile(engine, prompt: list[int], params: Mapping[str, int]) -> dict:
    """Kipp only: a repeated prompt's adopt / evaluate-the-rest / sample / decode-step times
    (KippEngine.reuse_profile); the value is the rest's evaluation over one decode step."""
    ban = [int(t) for t in params.get("ban", ())]
    timing = engine.reuse_profile(prompt, ban)
    return {"value": timing["rest_seconds"] / timing["step_seconds"], **timing}


MEASURE: Mapping[str, Callable] = {"decode": measure_decode, "prefill": measure_prefill,
                                   "reuse_profile": measure_reuse_profile}

WORKLOADS: Mapping[str, Workload] = {
    w.name: w
    for w in (
        Workload("decode", "decode", "greedy single-stream decode after a short prompt",
                 {"prompt_tokens": 16, "decode_tokens": 128}),
        Workload("prefill512", "prefill", "prefill of a 512-token prompt", {"prompt_tokens": 512}),
        Workload("prefill2048", "prefill", "prefill of a 2,048-token prompt",
                 {"prompt_tokens": 2048}),
        Workload("server_aggregate", "server",
                 "aggregate decode tok/s with 1/2/4/8 concurrent clients on each engine's server",
                 {"prompt_tokens": 16, "decode_tokens": 128, "clients": 8}, planned=True),
        Workload("ttft_prefix", "ttft", "time to first token of a repeated 2,000-token prompt",
                 {"prompt_tokens": 2000, "repeats": 2}, unit="s", higher_is_better=False,
                 planned=True),
        Workload("reuse_profile", "reuse_profile",
                 "a repeated prompt's adopt, evaluate-the-rest, sample and decode-step times "
                 "(Kipp only, run by `python -m bench engine`)",
                 {"prompt_tokens": 2000}, unit="x one decode step", higher_is_better=False,
                 planned=True),
    )
}


def get(name: str) -> Workload:
    try:
        workload = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None
    if workload.planned:
        raise ValueError(f"workload {name!r} ({workload.description}) is measured by "
                         f"`python -m bench server`, not `run`")
    return workload


def measure(workload: Workload, engine, prompt: list[int]) -> dict:
    """One measured (or warm-up) run of `workload` on a loaded engine."""
    if len(prompt) != workload.prompt_tokens:
        raise ValueError(f"{workload.name}: prompt has {len(prompt)} tokens, "
                         f"workload wants {workload.prompt_tokens}")
    return MEASURE[workload.kind](engine, prompt, workload.params)
