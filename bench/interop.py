"""Interop proof: llama.cpp runs Kipp's own GGUF files and agrees with Kipp's reference.

For each scheme, the very file Kipp loads is opened with llama-cpp-python. If llama.cpp rejects
it, its exact error is the result. Otherwise both engines evaluate the same prompts (corpus token
ids) and the last-position logits are compared: argmax agreement and NMSE against Kipp's
reference. llama.cpp quantizes activations to 8 bits inside its quantized dot products, so its
4-bit and 8-bit logits differ from Kipp's (which dequantizes weights and accumulates in FP32) by
more than its BF16 logits do; the numbers say by how much.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Sequence

import numpy as np

from bench import prompts


@contextlib.contextmanager
def captured_stderr():
    """Capture what C code writes to file descriptor 2 (llama.cpp's loader messages)."""
    saved = os.dup(2)
    box = {"text": ""}
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield box
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            box["text"] = sink.read().decode("utf-8", "replace")


def compare(checkpoint: str, schemes: Sequence[str], n_prompts: int = 4, length: int = 32,
            threads: int = 2) -> dict:
    """{scheme: result} for every scheme; results say loaded or not, and agreement."""
    import kipp
    from kipp.formats import store
    from kipp.gates import nmse

    prompt_list = [prompts.prompt(length, offset=i * 997) for i in range(n_prompts)]
    out = {}
    for scheme in schemes:
        path = store.artifact_path(checkpoint, scheme)
        if not path.is_file():
            out[scheme] = {"loaded": False, "error": f"{path} is missing (bench prepare)"}
            continue
        model = kipp.load(path, backend="reference", kv_tokens=length + 32, progress=False)
        ours = [_kipp_logits(model, p) for p in prompt_list]
        out[scheme] = _llama_side(str(path), scheme, prompt_list, ours, threads, nmse)
    return out


def _kipp_logits(model, tokens: list[int]) -> np.ndarray:
    session = model.session(len(tokens))
    try:
        return session.eval(tokens)[0]
    finally:
        session.close(publish=False)


def _llama_side(path: str, scheme: str, prompt_list, ours, threads: int, nmse) -> dict:
    try:
        import llama_cpp
    except ImportError as e:
        return {"loaded": False, "error": f"llama_cpp is not importable: {e}"}
    with captured_stderr() as log:  # llama.cpp's loader talks on fd 2; keep it for errors
        try:
            llm = llama_cpp.Llama(model_path=path, n_ctx=64 + max(len(p) for p in prompt_list),
                                  n_threads=threads, n_threads_batch=threads, logits_all=False,
                                  verbose=True)
        except Exception as e:  # llama.cpp's rejection: keep its own words
            llm, error = None, f"{type(e).__name__}: {e}"
        if llm is not None:
            result = _agreement(llm, prompt_list, ours, nmse)
            llm.close()
    if llm is None:
        lines = [line for line in log["text"].splitlines()
                 if "error" in line.lower() or "fail" in line.lower()]
        return {"loaded": False, "error": error, "llama_cpp_log": lines[-20:]}
    return result


def _agreement(llm, prompt_list, ours, nmse) -> dict:
    from bench.engines.llama_cpp_engine import llama_cpp_logits, model_description

    agree, errors = 0, []
    for tokens, mine in zip(prompt_list, ours):
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval(tokens)
        theirs = llama_cpp_logits(llm)
        agree += int(np.argmax(theirs) == np.argmax(mine))
        errors.append(nmse(theirs, mine))
    return {"loaded": True, "llama_cpp_type": model_description(llm),
            "prompts": len(prompt_list), "prompt_tokens": len(prompt_list[0]),
            "argmax_agree": agree, "nmse": errors, "max_nmse": max(errors)}
