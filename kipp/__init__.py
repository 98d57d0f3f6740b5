"""Kipp: an inference engine for the pinned Qwen3 dense family."""

from kipp.errors import ArtifactError, DownloadError, KippError, RegistryError

__version__ = "0.1.0"

__all__ = ["ArtifactError", "DownloadError", "KippError", "RegistryError", "load", "__version__"]


def load(checkpoint, backend="auto", scheme="bf16", kv_tokens=None, progress=True, **options):
    """Open a registry id or a .gguf artifact on a backend; see kipp.model.load (its other
    keywords: kv_scheme, kv_mib, weight_memory)."""
    from kipp.model import load as _load

    return _load(checkpoint, backend=backend, scheme=scheme, kv_tokens=kv_tokens,
                 progress=progress, **options)
