"""llama.cpp through llama-cpp-python, loading the very same Kipp GGUF file Kipp runs.

That the file loads at all is the interoperability proof; `check_llama_cpp_type` then requires
llama.cpp to report the artifact's own tensor type (BF16, Q8_0, Q4_0 for scale4_gs32, Q4_1 for
affine4_gs32), so it cannot have converted the weights on load. Prefill is one `Llama.eval` of the
prompt after clearing the cache (llama.cpp splits it into n_batch chunks itself); decode is
single-token evals with the same host argmax as every other arm.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from bench.engines.base import Engine, greedy
from bench.fallback import check_llama_cpp_type

N_BATCH = 512  # llama.cpp's default logical and physical batch


class LlamaCppEngine(Engine):
    def load(self) -> dict:
        import llama_cpp

        spec = self.spec
        self.llm = llama_cpp.Llama(
            model_path=spec.artifact, n_ctx=spec.context, n_threads=spec.threads,
            n_threads_batch=spec.threads, n_batch=N_BATCH, n_ubatch=N_BATCH, use_mmap=True,
            logits_all=False, seed=0, verbose=False)
        description = model_description(self.llm)
        check_llama_cpp_type(spec.scheme, description)
        info = llama_cpp.llama_print_system_info()
        return {"describe": f"llama.cpp ({description})",
                "llama_cpp_version": getattr(llama_cpp, "__version__", None),
                "system_info": info.decode() if isinstance(info, bytes) else str(info),
                "n_batch": N_BATCH, "n_ctx": spec.context, "threads": spec.threads}

    def _clear(self) -> None:
        """An empty cache: position 0 next, no KV kept (eval also drops positions past n_tokens)."""
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()

    def _last_logits(self) -> np.ndarray:
        """The last evaluated token's logits, straight from llama.cpp (with logits_all=False the
        wrapper no longer copies them into `Llama.scores`)."""
        return llama_cpp_logits(self.llm)

    def prefill(self, prompt: Sequence[int]) -> float:
        self._clear()
        start = time.perf_counter()
        self.llm.eval(list(prompt))
        return time.perf_counter() - start

    def decode(self, prompt: Sequence[int], n: int) -> dict:
        self._clear()
        start = time.perf_counter()
        self.llm.eval(list(prompt))
        prefill = time.perf_counter() - start
        generated = [greedy(self._last_logits())]
        start = time.perf_counter()
        for _ in range(n):
            self.llm.eval(generated[-1:])
            generated.append(greedy(self._last_logits()))
        decode = time.perf_counter() - start
        return {"prefill_seconds": prefill, "decode_seconds": decode, "decode_tokens": n,
                "generated": generated}

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None and hasattr(llm, "close"):
            llm.close()


def llama_cpp_logits(llm) -> np.ndarray:
    """A copy of the logits of the last token of the last eval, float32 [n_vocab]."""
    import llama_cpp

    pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(pointer, shape=(llm.n_vocab(),)).copy()


def model_description(llm) -> str:
    """llama.cpp's own one-line description of the loaded model, e.g. 'qwen3 0.6B Q8_0'."""
    import ctypes

    import llama_cpp

    buffer = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(llm.model, buffer, ctypes.sizeof(buffer))
    return buffer.value.decode("utf-8", "replace")
