"""mlx-lm on MLX (the CPU wheel off Apple silicon), on the Hugging Face folder or its own quants.

bf16 arms load the checkpoint's own folder: the same weights as Kipp's bf16 artifact. Quantized
arms load mlx-lm's own conversion (`mlx_lm.convert`, group size 32: 8-bit for q8_0, 4-bit
affine for affine4_gs32); those are the same *kind* of scheme, not the same bytes, and the arm's
name says so. Prefill evaluates the prompt's KV state and then the last token's logits, the way
mlx-lm's own generate loop does; decode is single-token steps with a host argmax.

On Linux the stock MLX wheel runs a slow reference BLAS on one thread (about 2 tok/s decode at
the 0.6B shape), so this arm is optional and sized small.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from bench.engines.base import Engine, greedy


class MlxEngine(Engine):
    def load(self) -> dict:
        import mlx.core as mx
        from mlx_lm import load

        self.mx = mx
        path = self.spec.weights or self.spec.source
        self.model, _ = load(path)
        device = mx.default_device()
        return {"describe": f"mlx-lm (mlx {mx.__version__}, {device}, weights {path})",
                "device": str(device), "weights_path": path}

    def _cache(self):
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def _prompt(self, prompt: Sequence[int], cache):
        mx = self.mx
        if len(prompt) > 1:
            self.model(mx.array([list(prompt[:-1])]), cache=cache)
            mx.eval([c.state for c in cache])
        return self._step(prompt[-1], cache)

    def _step(self, token: int, cache):
        logits = self.model(self.mx.array([[token]]), cache=cache)[0, -1]
        self.mx.eval(logits)
        return np.array(logits.astype(self.mx.float32))

    def prefill(self, prompt: Sequence[int]) -> float:
        cache = self._cache()
        start = time.perf_counter()
        self._prompt(prompt, cache)
        return time.perf_counter() - start

    def decode(self, prompt: Sequence[int], n: int) -> dict:
        cache = self._cache()
        start = time.perf_counter()
        logits = self._prompt(prompt, cache)
        prefill = time.perf_counter() - start
        generated = [greedy(logits)]
        start = time.perf_counter()
        for _ in range(n):
            generated.append(greedy(self._step(generated[-1], cache)))
        decode = time.perf_counter() - start
        return {"prefill_seconds": prefill, "decode_seconds": decode, "decode_tokens": n,
                "generated": generated}
