"""The engines a benchmark can run, by name, and which weight schemes each one has.

Heavy imports (torch, llama_cpp, vllm, mlx) happen only inside a worker process that loads that
engine, so the orchestrator and the tests never need them.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from dataclasses import dataclass

from bench.engines.base import ENGINE_LABELS, ArmSpec, Engine


@dataclass(frozen=True)
class EngineInfo:
    name: str
    module: str  # bench.engines submodule with the Engine class
    cls: str
    imports: tuple[str, ...]  # modules the engine needs in its worker's interpreter
    weights: str  # "artifact" (Kipp GGUF) or "source" (HF folder)
    schemes: tuple[str, ...]  # schemes it runs on identical weights
    own_quant: tuple[str, ...] = ()  # schemes it runs on its own conversion (not identical)
    optional: bool = False  # off unless asked for: too slow or too heavy for a default run


ALL_SCHEMES = ("bf16", "q8_0", "scale4_gs32", "affine4_gs32")

ENGINES = {
    e.name: e
    for e in (
        EngineInfo("kipp", "kipp_engine", "KippEngine", ("kipp",), "artifact", ALL_SCHEMES),
        EngineInfo("llama_cpp", "llama_cpp_engine", "LlamaCppEngine", ("llama_cpp",),
                   "artifact", ALL_SCHEMES),
        EngineInfo("transformers", "transformers_engine", "TransformersEngine",
                   ("torch", "transformers"), "source", ("bf16",)),
        EngineInfo("vllm", "vllm_engine", "VllmEngine", ("vllm",), "source", ("bf16",),
                   optional=True),
        EngineInfo("mlx_lm", "mlx_engine", "MlxEngine", ("mlx.core", "mlx_lm"), "source",
                   ("bf16",), own_quant=("q8_0", "affine4_gs32"), optional=True),
    )
}


def get(name: str) -> EngineInfo:
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}") from None


def engine_class(name: str) -> type[Engine]:
    info = get(name)
    module = importlib.import_module(f"bench.engines.{info.module}")
    return getattr(module, info.cls)


_PROBE = """
import importlib.util, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = importlib.util.find_spec(name) is not None
    except Exception as e:  # a parent package that fails to import
        found[name] = False
print(json.dumps(found))
"""


def probe_imports(python: str, modules) -> dict[str, bool]:
    """Which of `modules` the interpreter `python` can find (without importing them)."""
    try:
        done = subprocess.run([python, "-c", _PROBE, *modules], capture_output=True, text=True,
                              timeout=120)
        return json.loads(done.stdout)
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return {m: False for m in modules}


def availability(name: str, python: str = sys.executable) -> tuple[bool, str]:
    """(available, reason) of an engine in the interpreter that would run its worker."""
    info = get(name)
    found = probe_imports(python, info.imports)
    missing = [m for m in info.imports if not found.get(m)]
    if missing:
        return False, f"{', '.join(missing)} not importable by {python}"
    return True, "importable"


__all__ = ["ENGINES", "ENGINE_LABELS", "ALL_SCHEMES", "ArmSpec", "Engine", "EngineInfo",
           "availability", "engine_class", "get", "probe_imports"]
