"""vLLM's CPU build on the checkpoint's Hugging Face folder (BF16), offline `LLM` API.

vLLM does not expose single steps, so timings come from whole `generate` calls on token-id
prompts with greedy sampling and `ignore_eos`: prefill is a call with max_tokens=1 (the prompt's
forward pass plus one sampled token, which every other arm also pays as its last-logits row);
decode is the difference between a call with max_tokens=n+1 and one with max_tokens=1 on the same
prompt. Prefix caching is off, so no call reuses an earlier one's KV.

It needs, on a 2-core Linux box: VLLM_CPU_OMP_THREADS_BIND=0-1 and VLLM_CPU_NUM_OF_RESERVED_CPU=0
(else it runs the model on one core), a modest VLLM_CPU_KVCACHE_SPACE, and a __main__ guard in
the launching script (its engine process is spawned); bench/worker.py has one, and the
orchestrator sets the variables for this arm's worker (`VLLM_ENV`).
"""

from __future__ import annotations

import time
from typing import Sequence

from bench.engines.base import Engine

VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-{last}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "VLLM_LOGGING_LEVEL": "WARNING"}


def vllm_env(threads: int) -> dict[str, str]:
    return {k: v.format(last=threads - 1) for k, v in VLLM_ENV.items()}


class VllmEngine(Engine):
    def load(self) -> dict:
        import vllm

        spec = self.spec
        self.vllm = vllm
        self.llm = vllm.LLM(model=spec.source, dtype="bfloat16", seed=0,
                            max_model_len=spec.context, max_num_seqs=1,
                            max_num_batched_tokens=max(spec.context, 2048),
                            enable_prefix_caching=False, disable_log_stats=True)
        return {"describe": f"vllm {vllm.__version__} (CPU, bfloat16, prefix caching off)",
                "vllm_version": vllm.__version__, "max_model_len": spec.context}

    def _generate(self, prompt: Sequence[int], max_tokens: int) -> tuple[float, list[int]]:
        from vllm.inputs import TokensPrompt

        params = self.vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                          ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        [output] = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params,
                                     use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, list(output.outputs[0].token_ids)

    def prefill(self, prompt: Sequence[int]) -> float:
        return self._generate(prompt, 1)[0]

    def decode(self, prompt: Sequence[int], n: int) -> dict:
        first, _ = self._generate(prompt, 1)
        whole, generated = self._generate(prompt, n + 1)
        return {"prefill_seconds": first, "decode_seconds": whole - first, "decode_tokens": n,
                "generated": generated, "method": "difference of generate(n+1) and generate(1)"}

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
