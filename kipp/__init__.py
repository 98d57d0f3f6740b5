"""Kipp: an inference engine for the pinned Qwen3 dense family."""

from kipp.errors import ArtifactError, DownloadError, KippError, RegistryError

__version__ = "0.1.0"

__all__ = ["ArtifactError", "DownloadError", "KippError", "RegistryError", "__version__"]
