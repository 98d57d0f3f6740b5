"""Refuse to record a run whose engine took a slower path than the one requested.

A benchmark that silently measured a fallback is worse than none: the seeds' first Metal campaign
was measured on a build whose matrix kernels had failed to compile while every gate still passed.
So before an arm measures anything, what the engine says it runs (Kipp's `Backend.describe()`,
llama.cpp's model description) is compared with what was asked for, and a mismatch is a
`FallbackError`: the arm is reported as refused, with no numbers.

Kipp backends plug in by name: `KERNEL_PATHS` says which words a backend's describe() must
contain when it runs its fast path. A backend whose fast path is not available on a machine
(JAX without a GPU runs its plain jax.numpy twins) is refused unless the caller names the slower
path explicitly (`--expect-path jax=twin`), which then goes into the record.
"""

from __future__ import annotations

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
    missing = [w for w in required if w not in text]
    if missing:
        raise FallbackError(f"{backend} should run the {'/'.join(required)} path but "
                            f"describe() says {described!r}")
    markers = [m for m in FALLBACK_MARKERS if m in text and not any(m in w for w in required)]
    if markers:
        raise FallbackError(f"{backend} reports a fallback ({markers[0]!r}) in {described!r}")
    return described


def check_llama_cpp_type(scheme: str, model_description: str) -> str:
    """llama.cpp must run the artifact's own type: 'qwen3 0.6B Q8_0' for q8_0, and so on."""
    want = LLAMA_CPP_TYPES[scheme]
    words = model_description.replace("-", " ").split()
    if want not in words:
        raise FallbackError(f"llama.cpp describes the {scheme} file as {model_description!r}, "
                            f"not {want}: it is not running the artifact's own type")
    return model_description
