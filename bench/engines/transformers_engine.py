"""transformers + torch on the CPU, on the checkpoint's own Hugging Face folder (BF16).

The model runs in BF16 (the checkpoint's dtype; the same weights as Kipp's bf16 artifact) with
torch's default attention, `torch.set_num_threads(threads)`, under inference_mode. Prefill asks
for the last position's logits only (`logits_to_keep=1`), as every other engine computes them.
"""

from __future__ import annotations

import time
from typing import Sequence

from bench.engines.base import Engine, greedy


class TransformersEngine(Engine):
    def load(self) -> dict:
        import torch
        import transformers

        torch.set_num_threads(self.spec.threads)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            self.spec.source, dtype=torch.bfloat16)
        self.model.eval()
        capability = torch.backends.cpu.get_cpu_capability()
        attention = getattr(self.model.config, "_attn_implementation", None)
        return {"describe": f"transformers (torch {torch.__version__} CPU {capability}, "
                            f"bfloat16, attention {attention})",
                "threads": torch.get_num_threads(), "cpu_capability": capability,
                "attention": attention}

    def _forward(self, ids: Sequence[int], cache):
        torch = self.torch
        out = self.model(input_ids=torch.tensor([list(ids)], dtype=torch.long),
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float().numpy(), out.past_key_values

    def prefill(self, prompt: Sequence[int]) -> float:
        from transformers import DynamicCache

        with self.torch.inference_mode():
            cache = DynamicCache()
            start = time.perf_counter()
            self._forward(prompt, cache)
            return time.perf_counter() - start

    def decode(self, prompt: Sequence[int], n: int) -> dict:
        from transformers import DynamicCache

        with self.torch.inference_mode():
            start = time.perf_counter()
            logits, cache = self._forward(prompt, DynamicCache())
            prefill = time.perf_counter() - start
            generated = [greedy(logits)]
            start = time.perf_counter()
            for _ in range(n):
                logits, cache = self._forward(generated[-1:], cache)
                generated.append(greedy(logits))
            decode = time.perf_counter() - start
        return {"prefill_seconds": prefill, "decode_seconds": decode, "decode_tokens": n,
                "generated": generated}
