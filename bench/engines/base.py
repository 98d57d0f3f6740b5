"""What every engine arm implements, and the spec that tells a worker which arm to be.

An engine runs in its own worker process (bench/worker.py) so its peak RSS is its own and a
crash or a stray thread pool cannot touch the others. It receives token ids, never text, so every
engine evaluates exactly the same prompt, and it picks greedy tokens with a host argmax over the
full logits row, the same step every engine pays.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class ArmSpec:
    """One engine arm: an engine, a backend (Kipp), a weight scheme and where its files are."""

    engine: str  # "kipp", "llama_cpp", "transformers", "mlx_lm", "vllm"
    scheme: str  # Kipp scheme the arm's weights correspond to
    checkpoint: str
    backend: str = ""  # Kipp backend name; empty for peers
    artifact: str = ""  # Kipp GGUF path (kipp, llama_cpp)
    source: str = ""  # Hugging Face folder (transformers, vllm, mlx_lm)
    weights: str = ""  # an engine's own converted weights (mlx_lm quantizations)
    threads: int = 2
    context: int = 2304  # KV capacity the engine allocates: longest prompt + decode + slack
    expect_path: tuple[str, ...] | None = None  # override of the kernel path check (Kipp)
    options: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        engine = f"kipp-{self.backend}" if self.engine == "kipp" else ENGINE_LABELS[self.engine]
        own = self.options.get("own_quant")
        if "weight_memory" in self.options:  # Kipp arms that differ by weight layout
            own = f"{self.options['weight_memory']} weights"
        if "cpu_dot" in self.options:  # or by the stored CPU matmul's dot
            own = ", ".join(filter(None, [own, f"{self.options['cpu_dot']} dot"]))
        return f"{engine}/{self.scheme}" + (f" ({own})" if own else "")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "ArmSpec":
        data = dict(data)
        if data.get("expect_path") is not None:
            data["expect_path"] = tuple(data["expect_path"])
        return cls(**data)


ENGINE_LABELS = {"kipp": "kipp", "llama_cpp": "llama.cpp", "transformers": "transformers",
                 "mlx_lm": "mlx-lm", "vllm": "vllm"}


class Engine(ABC):
    """A loaded model that can prefill and greedily decode token ids."""

    def __init__(self, spec: ArmSpec):
        self.spec = spec

    @abstractmethod
    def load(self) -> dict:
        """Load the weights; return what the record should know (kernel path, versions...).

        Raise bench.fallback.FallbackError if the engine would not run the requested path."""

    @abstractmethod
    def prefill(self, prompt: Sequence[int]) -> float:
        """Seconds to evaluate `prompt` into an empty cache up to its last logits row."""

    @abstractmethod
    def decode(self, prompt: Sequence[int], n: int) -> dict:
        """Prefill `prompt`, then `n` single-token greedy steps.

        Returns prefill_seconds, decode_seconds (the n steps, argmax included), decode_tokens
        (== n) and generated (the greedy ids, first one from the prompt's logits)."""

    def close(self) -> None:
        """Release the model (and any engine processes) before the worker exits."""


def greedy(logits) -> int:
    """The argmax of one logits row (host numpy, the same step for every engine)."""
    return int(np.argmax(np.asarray(logits)))

