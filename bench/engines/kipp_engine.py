"""Kipp itself, on any backend by name ("reference" today; "mlx" and "jax" plug in later).

The arm loads the artifact through `kipp.load` with kernel fallback off (KIPP_KERNEL_FALLBACK=0:
a kernel that fails its probe fails the arm) and the arm's `weight_memory` if it has one,
checks that `Backend.describe()` names the requested backend, scheme and fast path
(bench.fallback), and drives sessions directly: prefill is
one `Session.eval` of the prompt, decode is single-token evals with a host argmax. Sessions close
without publishing their blocks, so no run can adopt a previous run's prefix.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from bench.engines.base import Engine, greedy
from bench.fallback import check_kernel_path


class KippEngine(Engine):
    def load(self) -> dict:
        import os

        import kipp
        from kipp.cuda.cpu.stored_matmul import DOT_ENV
        from kipp.probe import FALLBACK_ENV

        spec = self.spec
        options = {k: v for k, v in spec.options.items() if k == "weight_memory"}
        # a kernel that fails its probe (at load) fails the arm, loudly; the arm's dot is read
        # at load. Both switches are restored after it, so an in-process caller (the tests)
        # keeps its own settings
        switches = {FALLBACK_ENV: "0"}
        if "cpu_dot" in spec.options:
            switches[DOT_ENV] = spec.options["cpu_dot"]
        previous = {name: os.environ.get(name) for name in switches}
        os.environ.update(switches)
        try:
            self.model = kipp.load(spec.artifact, backend=spec.backend, kv_tokens=spec.context,
                                   progress=False, **options)
        finally:
            for name, value in previous.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value
        described = self.model.backend.describe()
        check_kernel_path(spec.backend, spec.scheme, described, spec.expect_path)
        return {"describe": described, "backend": self.model.backend.name,
                "kipp_path": str(Path(kipp.__file__).parent),
                "artifact_scheme": self.model.artifact.scheme.name,
                "checkpoint": self.model.entry.id, "revision": self.model.entry.revision}

    def recheck(self) -> None:
        """After a run: a backend that fell back mid-run must not have its numbers recorded."""
        check_kernel_path(self.spec.backend, self.spec.scheme, self.model.backend.describe(),
                          self.spec.expect_path)

    def prefill(self, prompt: Sequence[int]) -> float:
        session = self.model.session(len(prompt))
        try:
            start = time.perf_counter()
            session.eval(prompt)
            return time.perf_counter() - start
        finally:
            session.close(publish=False)

    def decode(self, prompt: Sequence[int], n: int) -> dict:
        session = self.model.session(len(prompt) + n)
        try:
            start = time.perf_counter()
            logits = session.eval(prompt)[0]
            prefill = time.perf_counter() - start
            generated = [greedy(logits)]
            start = time.perf_counter()
            for _ in range(n):
                logits = session.eval(generated[-1:])[0]
                generated.append(greedy(logits))
            decode = time.perf_counter() - start
        finally:
            session.close(publish=False)
        return {"prefill_seconds": prefill, "decode_seconds": decode, "decode_tokens": n,
                "generated": generated}

    def reuse_profile(self, prompt: Sequence[int], ban: Sequence[int]) -> dict:
        """Where a repeated prompt's time goes, step by step (bench/engine_bench.py): evaluate
        `prompt` in one session and close it publishing its blocks (what a finished request
        does), then time, for the same prompt again: adopting the cached prefix, evaluating
        the rest, sampling (greedy, `ban` biased away, as the server's requests are), and one
        decode step at that context."""
        from kipp.text.sampling import Sampler, SamplingParams

        model = self.model
        with model.session(len(prompt) + 2) as first:
            start = time.perf_counter()
            first.eval(prompt)
            cold = time.perf_counter() - start
        session = model.session(len(prompt) + 2)
        try:
            start = time.perf_counter()
            adopted = session.match_prefix(prompt)
            adopt = time.perf_counter() - start
            logits = session.eval(prompt[adopted:])[0]
            rest = time.perf_counter() - start - adopt
            sampler = Sampler(SamplingParams(temperature=0.0,
                                             logit_bias={int(t): -100 for t in ban}))
            start = time.perf_counter()
            token = sampler.sample(logits, session.tokens)
            sample = time.perf_counter() - start
            start = time.perf_counter()
            session.eval([token])
            step = time.perf_counter() - start
        finally:
            session.close(publish=False)
        return {"cold_seconds": cold, "adopted_tokens": adopted,
                "evaluated_tokens": len(prompt) - adopted, "adopt_seconds": adopt,
                "rest_seconds": rest, "sample_seconds": sample, "step_seconds": step}
