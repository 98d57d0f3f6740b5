"""Kipp: an inference engine for the pinned Qwen3 dense family.

    import kipp
    model = kipp.load("kipp-synthetic/qwen3-tiny")   # kipp.load is kipp.model.load itself
"""

from kipp.errors import ArtifactError, DownloadError, KippError, MissingExtra, RegistryError
from kipp.model import load  # the one load: no wrapper whose signature could drift from it

__version__ = "0.1.0"

__all__ = ["ArtifactError", "DownloadError", "KippError", "MissingExtra", "RegistryError", "load",
           "__version__"]
