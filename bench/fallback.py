"""Refuse to record a run whose engine took a slower path than the one requested.

A benchmark that silently measured a fallback is worse than none: the seeds' first Metal campaign
was measured on a build whose matrix kernels had failed to compile while every gate still passed.
So before an arm measures anything, what the engine says it runs (Kipp's `Backend.describe()`,
llama.cpp's model description) is compared with what was asked for, and a mismatch is a
`FallbackError`: the arm is reported as refused, with no numbers.

Kipp backends plug in by name: `KERNEL_PATHS` says which words a backend's describe() must
contain when it runs its fast path. On a machine with no GPU, JAX's only path is its jax.numpy
twins, so they are what is expected there (`expected_path`); on a machine with a GPU the
twins are refused unless the caller names them (`--expect-path jax=twin`). The expectation goes
into the record either way.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Mapping


class FallbackError(RuntimeError):
    """The engine runs a different (slower) path than the one requested."""


# Words describe() must contain for each Kipp backend's requested fast path.
KERNEL_PATHS: Mapping[str, tuple[str, ...]] = {
    "reference": ("numpy",),
    "mlx": ("metal",),
    "jax": ("pallas",),
}

# Words that mark a slower path in any description.
FALLBACK_MARKERS = ("fallback", "fall back", "fell back", "falling back", "interpret",
                    "twin", "emulat", "slow path", "unsupported")

# What a machine without a GPU can run at best, per backend.
NO_GPU_PATHS: Mapping[str, tuple[str, ...]] = {"jax": ("twin",)}


def gpu_present() -> bool:
    """An NVIDIA GPU's device node or driver entry: seen whether or not JAX can use the GPU, so
    a GPU machine whose JAX runs on its CPU still counts as a GPU machine."""
    return (any(Path("/dev").glob("nvidia[0-9]*"))
            or any(Path("/proc/driver/nvidia/gpus").glob("*")))


def expected_path(backend: str, given: tuple[str, ...] | None = None,
                  has_gpu: bool | None = None) -> tuple[str, ...] | None:
    """The words to require of `backend`'s describe(): `given` (from --expect-path) if any;
    else, on a machine without a GPU, what such a machine can run (JAX's twins); else None,
    the fast path of KERNEL_PATHS."""
    if given is not None or backend not in NO_GPU_PATHS:
        return given
    return None if (gpu_present() if has_gpu is None else has_gpu) else NO_GPU_PATHS[backend]


# llama.cpp's model description names the file type of the projections.
LLAMA_CPP_TYPES: Mapping[str, str] = {"bf16": "BF16", "q8_0": "Q8_0", "scale4_gs32": "Q4_0",
                                      "affine4_gs32": "Q4_1"}


def check_kernel_path(backend: str, scheme: str, described: str,
                      expect: tuple[str, ...] | None = None) -> str:
    """Return `described` if it is the path requested for (backend, scheme), else raise.

    `expect` overrides the words required of the description (default KERNEL_PATHS[backend]);
    an explicit expectation also permits the fallback markers it names itself.
    """
    text = described.lower()
    if not text.startswith(backend.lower()):
        raise FallbackError(f"backend {backend!r} was requested but the engine describes "
                            f"itself as {described!r}")
    if scheme.lower() not in text:
        raise FallbackError(f"scheme {scheme!r} was requested but {described!r} does not "
                            f"name it: the weights may have been converted on load")
    required = tuple(w.lower() for w in (expect if expect is not None
                                         else KERNEL_PATHS.get(backend, ())))
    markers = [m for m in FALLBACK_MARKERS if m in text and not any(m in w for w in required)]
    named = shlex.quote(f"{backend}={markers[0]}") if markers else f"{backend}=WORDS"
    hint = f" (to measure the path it runs, add --expect-path {named})"
    if any(w not in text for w in required):
        raise FallbackError(f"{backend} should run the {'/'.join(required)} path but "
                            f"describe() says {described!r}{hint}")
    if markers:
        raise FallbackError(f"{backend} reports a fallback ({markers[0]!r}) in {described!r}"
                            f"{hint}")
    return described


def check_llama_cpp_type(scheme: str, model_description: str) -> str:
    """llama.cpp must run the artifact's own type: 'qwen3 0.6B Q8_0' for q8_0, and so on."""
    want = LLAMA_CPP_TYPES[scheme]
    words = model_description.replace("-", " ").split()
    if want not in words:
        raise FallbackError(f"llama.cpp describes the {scheme} file as {model_description!r}, "
                            f"not {want}: it is not running the artifact's own type")
    return model_description
