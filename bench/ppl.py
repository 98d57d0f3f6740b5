"""Quality: perplexity of each weight scheme against BF16, from multi-row logits.

Each window of the corpus is evaluated once per scheme with `Session.eval(window,
logits_rows=len(window))`, so every position's next-token distribution comes out of one call.
Per scheme: mean negative log-likelihood (nats/token) and perplexity over the corpus; and against
the BF16 logits of the same positions: mean KL(BF16 || scheme), top-1 agreement and logit NMSE.

On synthetic (random) weights perplexity is not a language score: the model knows no language.
Only the change between schemes on the same weights means something, and KL to BF16 and top-1
agreement say it more directly than the perplexity ratio does.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

REFERENCE_SCHEME = "bf16"


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def window_logits(model, window: Sequence[int]) -> np.ndarray:
    """Logits [len(window), vocab] of every position of `window`, from an empty session."""
    session = model.session(len(window))
    try:
        return session.eval(list(window), logits_rows=len(window))
    finally:
        session.close(publish=False)


class Tally:
    """Running sums for one scheme."""

    def __init__(self):
        self.nll = 0.0
        self.count = 0
        self.kl = 0.0
        self.agree = 0
        self.err = 0.0
        self.ref = 0.0

    def add(self, logp: np.ndarray, targets: np.ndarray, logits, ref_logp=None, ref_logits=None):
        self.nll -= float(logp[np.arange(len(targets)), targets].sum())
        self.count += len(targets)
        if ref_logp is not None:
            self.kl += float((np.exp(ref_logp) * (ref_logp - logp)).sum())
            self.agree += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
            diff = np.asarray(logits, np.float64) - ref_logits
            self.err += float((diff ** 2).sum())
            self.ref += float((np.asarray(ref_logits, np.float64) ** 2).sum())

    def summary(self, reference: "Tally | None") -> dict:
        nll = self.nll / self.count
        out = {"tokens": self.count, "nll_mean": nll, "ppl": math.exp(min(nll, 700.0))}
        if reference is not None and reference is not self:
            ref_nll = reference.nll / reference.count
            out.update(nll_change=nll - ref_nll, ppl_ratio=math.exp(min(nll - ref_nll, 700.0)),
                       kl_mean=self.kl / self.count, top1_agreement=self.agree / self.count,
                       logits_nmse=self.err / self.ref if self.ref else None)
        return out


def evaluate(models: dict, tokens: Sequence[int], window: int) -> dict:
    """Per-scheme quality over non-overlapping windows of `tokens`; BF16 must be among `models`."""
    if REFERENCE_SCHEME not in models:
        raise ValueError("perplexity against BF16 needs the bf16 model")
    if window < 2:
        raise ValueError(f"window {window} must be at least 2 tokens")
    order = [REFERENCE_SCHEME] + [s for s in models if s != REFERENCE_SCHEME]
    tallies = {s: Tally() for s in order}
    windows = 0
    for start in range(0, len(tokens) - 1, window):
        chunk = list(tokens[start:start + window])
        if len(chunk) < 2:
            break
        targets = np.asarray(chunk[1:])
        ref_logp = ref_logits = None
        for scheme in order:
            logits = window_logits(models[scheme], chunk)[:-1]
            logp = log_softmax(logits)
            if scheme == REFERENCE_SCHEME:
                tallies[scheme].add(logp, targets, logits)
                ref_logp, ref_logits = logp, np.asarray(logits, np.float64)
            else:
                tallies[scheme].add(logp, targets, logits, ref_logp, ref_logits)
        windows += 1
    reference = tallies[REFERENCE_SCHEME]
    return {"windows": windows, "schemes": {s: t.summary(reference) for s, t in tallies.items()}}


def load_models(checkpoint: str, schemes: Sequence[str], backend: str, kv_tokens: int,
                expect_path=None) -> tuple[dict, dict]:
    """({scheme: Model}, {scheme: describe()}) from the prepared artifacts, fallback-checked."""
    import kipp
    from bench.fallback import check_kernel_path, expected_path
    from kipp.formats import store

    expect_path = expected_path(backend, expect_path)
    models, described = {}, {}
    for scheme in schemes:
        path = store.artifact_path(checkpoint, scheme)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: run `python -m bench prepare` first")
        model = kipp.load(path, backend=backend, kv_tokens=kv_tokens, progress=False)
        described[scheme] = check_kernel_path(backend, scheme, model.backend.describe(),
                                              expect_path)
        models[scheme] = model
    return models, described
