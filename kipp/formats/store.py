"""Where Kipp keeps what it makes: synthetic sources and converted artifacts.

`ensure_artifact(id, scheme)` is what `kipp.load` and `kipp prepare` call: it returns the path of
the checkpoint's artifact for that scheme, generating (synthetic) or downloading (hub, pinned
revision) the source and converting it first when missing. Artifacts are keyed by revision, so a
registry change never serves a stale file. The root is $KIPP_HOME, else ~/.cache/kipp.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kipp.formats import registry


def home() -> Path:
    return Path(os.environ.get("KIPP_HOME") or Path.home() / ".cache" / "kipp")


def _slug(checkpoint_id: str) -> str:
    return checkpoint_id.replace("/", "--")


def artifact_path(checkpoint_id: str, scheme: str) -> Path:
    entry = registry.get(checkpoint_id)
    return home() / "artifacts" / _slug(entry.id) / entry.revision / f"{scheme}.gguf"


def source_folder(checkpoint_id: str, progress: bool = True) -> Path:
    """The checkpoint's Hugging Face folder: generated once for synthetic ids, else downloaded."""
    entry = registry.get(checkpoint_id)
    if not entry.is_synthetic:
        from kipp.formats.download import download

        return download(entry.id)
    folder = home() / "sources" / _slug(entry.id) / entry.revision
    if not (folder / "config.json").is_file():
        from kipp.synthetic.writer import synthesize

        if progress:
            print(f"kipp: generating synthetic checkpoint {entry.id} in {folder}",
                  file=sys.stderr)
        synthesize(entry.id, folder)
    return folder


def ensure_artifact(checkpoint_id: str, scheme: str = "bf16", progress: bool = True) -> Path:
    """Path of the checkpoint's artifact for `scheme`, converting it first if needed."""
    path = artifact_path(checkpoint_id, scheme)
    if not path.is_file():
        from kipp.formats.convert import convert

        source = source_folder(checkpoint_id, progress)
        if progress:
            print(f"kipp: converting {checkpoint_id} to {scheme} at {path}", file=sys.stderr)
        convert(checkpoint_id, source, scheme, path, progress=progress)
    return path
