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
from typing import Sequence

from bench.engines.base import Engine, greedy
from bench.fallback import check_kernel_path


class KippEngine(Engine):
    def load(self) -> dict:
        import os

        import kipp
        from kipp.probe import FALLBACK_ENV

        spec = self.spec
        os.environ[FALLBACK_ENV] = "0"  # a kernel that fails its probe fails the arm, loudly
        options = {k: v for k, v in spec.options.items() if k == "weight_memory"}
        self.model = kipp.load(spec.artifact, backend=spec.backend, kv_tokens=spec.context,
                               progress=False, **options)
        described = self.model.backend.describe()
        check_kernel_path(spec.backend, spec.scheme, described, spec.expect_path)
        return {"describe": described, "backend": self.model.backend.name,
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
