"""Fetch a registry checkpoint at its pinned revision through the Hugging Face cache; verify it.

`download` asks `huggingface_hub.snapshot_download` for exactly the files Kipp uses, at the
registry's pinned revision only, then refuses the snapshot unless

  (a) every file's content matches the checksum the hub recorded for it: the name of the cache
      blob it links to (an LFS file's etag is its sha256; a git file's is its git blob sha1) and,
      where huggingface_hub cached the repository's tree listing, that listing's sha256/blob id;
  (b) config.json agrees with the registry entry field by field;
  (c) every weights file the layout promises (single file, or each shard of the index) is there
      and holds the tensors the index maps to it.

Synthetic checkpoints are never fetched from the network (no hub has them); they are found in
the cache if someone laid them there, else the error says how to generate them.
Every failure is a `DownloadError` whose message is one line saying what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from huggingface_hub import constants, errors, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
from huggingface_hub.utils import filter_repo_objects
from huggingface_hub.utils import tqdm as hf_tqdm  # honours HF_HUB_DISABLE_PROGRESS_BARS

from kipp.errors import DownloadError
from kipp.formats import registry
from kipp.formats.hf_source import INDEX_FILE, SINGLE_WEIGHTS_FILE
from kipp.formats.registry import Checkpoint

ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "LICENSE", "README.md",
]
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")

# config.json key -> the registry field it checks (for the "unconfirmed" hint).
_REGISTRY_FIELD = {
    "hidden_size": "hidden", "intermediate_size": "intermediate",
    "num_hidden_layers": "layers", "num_attention_heads": "query_heads",
    "max_position_embeddings": "context_length", "rope_theta": "rope_theta",
    "tie_word_embeddings": "tied", "eos_token_id": "variant",
}
_SHA256 = re.compile(r"[0-9a-f]{64}")
_GIT_SHA1 = re.compile(r"[0-9a-f]{40}")
_HASH_CHUNK = 16 << 20
_PROGRESS_BYTES = 256 << 20


def download(checkpoint_id: str, *, revision: str | None = None, cache_dir=None) -> Path:
    """The verified local snapshot folder of `checkpoint_id` at its pinned revision.

    Downloads what is missing into the Hugging Face cache (`cache_dir`, default HF_HUB_CACHE)
    with huggingface_hub's progress bars. `revision`, if given, must be the pinned one: Kipp
    runs only pinned revisions. Raises RegistryError for an unknown id, DownloadError otherwise.
    """
    entry = registry.get(checkpoint_id)
    if revision is not None and revision != entry.revision:
        raise DownloadError(
            f"{entry.id} is pinned to revision {entry.revision}; Kipp runs only pinned "
            f"revisions, so {revision!r} is refused (omit the revision to use the pinned one)"
        )
    folder = _fetch(entry, cache_dir)
    verify_snapshot(entry.id, folder)
    return folder


def cached_snapshot(checkpoint_id: str, cache_dir=None) -> Path | None:
    """The pinned snapshot folder if it is in the HF cache, else None; never uses the network.

    The folder is not verified here: `download` verifies it, `verify_snapshot` can again.
    """
    entry = registry.get(checkpoint_id)
    try:
        return _snapshot(entry, cache_dir, local_only=True)
    except LocalEntryNotFoundError:  # also an incomplete snapshot
        return None


def _snapshot(entry: Checkpoint, cache_dir, local_only: bool) -> Path:
    """huggingface_hub's snapshot folder of the pinned revision, Kipp's files only."""
    return Path(snapshot_download(repo_id=entry.id, revision=entry.revision,
                                  allow_patterns=ALLOW_PATTERNS, cache_dir=cache_dir,
                                  local_files_only=local_only))


def verify_snapshot(checkpoint_id: str, folder) -> None:
    """Refuse (DownloadError) a snapshot folder that fails checks (a), (b) or (c) above."""
    entry = registry.get(checkpoint_id)
    folder = Path(folder)
    files = _snapshot_files(folder)
    _check_files_present(entry, folder, files)
    _check_checksums(entry, folder, files)
    _check_config(entry, folder)
    _check_index_matches_shards(entry, folder, files)


def _offline() -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE once, at import; honour a later change too.
    late = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    return constants.HF_HUB_OFFLINE or late


def _cache_root(cache_dir) -> Path:
    return Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser()


def _fetch(entry: Checkpoint, cache_dir) -> Path:
    cached = cached_snapshot(entry.id, cache_dir)
    if cached is not None and not _missing_files(entry, cached, _snapshot_files(cached)):
        # A pinned commit never changes, so a snapshot with every needed file is final. This
        # also spares a network that is down huggingface_hub's ~25 s of retries.
        return cached
    local_only = entry.is_synthetic or _offline()  # no hub has synthetic checkpoints
    try:
        return _snapshot(entry, cache_dir, local_only)
    except LocalEntryNotFoundError as error:  # before OSError: it is a FileNotFoundError
        raise DownloadError(_not_cached_message(entry, cache_dir, error)) from None
    except HfHubHTTPError as error:  # repository/revision not found, gated, hub down
        raise DownloadError(
            f"{entry.id}@{entry.revision}: the Hugging Face hub refused the download "
            f"({type(error).__name__}: {_first_line(error)}); check the network, token and "
            "access, then run `kipp download` again"
        ) from None
    except OSError as error:
        raise DownloadError(
            f"{entry.id}@{entry.revision}: could not write to the Hugging Face cache at "
            f"{_cache_root(cache_dir)} ({_first_line(error)})"
        ) from None


def _not_cached_message(entry: Checkpoint, cache_dir, error: Exception) -> str:
    cache = _cache_root(cache_dir)
    if isinstance(error, getattr(errors, "IncompleteSnapshotError", ())):
        state = f"the cached snapshot of pinned revision {entry.revision} in {cache} is incomplete"
    else:
        state = f"pinned revision {entry.revision} is not in the Hugging Face cache ({cache})"
    if entry.is_synthetic:
        return (f"{entry.id} is a synthetic checkpoint and {state}: synthetic checkpoints are "
                f"generated with `kipp synthesize {entry.id} --out DIR`, not downloaded")
    if _offline() or isinstance(error.__cause__, errors.OfflineModeIsEnabled):
        reason = "offline mode is on (HF_HUB_OFFLINE=1)"
    else:
        reason = "the hub cannot be reached"
    folder = "models--" + entry.id.replace("/", "--")
    return (f"{entry.id}: {state} and {reason}: run `kipp download {entry.id}` on a "
            f"machine with network access and copy its {folder} cache folder into {cache}")


def _again(entry: Checkpoint) -> str:
    """What fixes a broken snapshot: fetch it again, or regenerate a synthetic one."""
    if entry.is_synthetic:
        return f"regenerate it with `kipp synthesize {entry.id} --out DIR`"
    return f"run `kipp download {entry.id}` again"


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _snapshot_files(folder: Path) -> list[str]:
    """Relative paths of the snapshot's files that Kipp fetched (ALLOW_PATTERNS)."""
    if not folder.is_dir():
        raise DownloadError(f"{folder} is not a snapshot folder")
    found = [p.relative_to(folder).as_posix() for p in folder.rglob("*")
             if p.is_file() or p.is_symlink()]
    return sorted(filter_repo_objects(found, allow_patterns=ALLOW_PATTERNS))


def _missing_files(entry: Checkpoint, folder: Path, files: list[str]) -> list[str]:
    """Needed files the snapshot lacks: tokenizer and config, and every promised weights file."""
    missing = [name for name in REQUIRED_FILES if name not in files]
    if INDEX_FILE in files:
        shards = sorted(set(_read_json(entry, folder, INDEX_FILE).get("weight_map", {}).values()))
        missing += [shard for shard in shards if shard not in files] or (
            [] if shards else [f"the shards ({INDEX_FILE} maps no tensors)"])
    elif SINGLE_WEIGHTS_FILE not in files:
        missing.append(f"{SINGLE_WEIGHTS_FILE} (or {INDEX_FILE} with its shards)")
    # A dangling link (its blob deleted) is as missing as an absent file.
    return missing + [name for name in files if not (folder / name).exists()]


def _check_files_present(entry: Checkpoint, folder: Path, files: list[str]) -> None:
    missing = _missing_files(entry, folder, files)
    if missing:
        raise DownloadError(f"{entry.id}@{entry.revision}: the snapshot at {folder} lacks "
                            f"{', '.join(missing)}: {_again(entry)}")


def _check_checksums(entry: Checkpoint, folder: Path, files: list[str]) -> None:
    listing = _tree_listing(folder)
    records = {name: _recorded_digests(folder, name, listing) for name in files}
    unrecorded = [name for name, rec in records.items() if not rec]
    if unrecorded:
        # Without a record a corrupt or substituted file would pass silently, so refuse.
        raise DownloadError(
            f"{entry.id}: no recorded checksum for {', '.join(unrecorded)} in {folder} (not "
            "links into the cache's blobs/, no cached tree listing); Kipp verifies only Hugging "
            f"Face cache snapshots: {_again(entry)}"
        )
    total = sum((folder / name).stat().st_size for name in files)
    with _progress(total, f"verifying {entry.id}") as bar:
        for name in files:
            found = _digests(folder / name, {algo for algo, _, _ in records[name]}, bar)
            for algo, expected, source in records[name]:
                if found[algo] != expected:
                    raise DownloadError(
                        f"{entry.id}@{entry.revision}: {name} does not match its recorded "
                        f"{algo} ({source}): expected {expected}, found {found[algo]}; the "
                        f"cached copy is corrupt: delete {folder.parent.parent} and "
                        f"{_again(entry)}"
                    )


def _tree_listing(folder: Path) -> dict:
    """The repository tree listing huggingface_hub >= 1.x caches per commit, or {}."""
    path = folder.parent.parent / "trees" / f"{folder.name}.json"
    try:
        listing = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(listing, dict) or listing.get("format_version") != 1:
        return {}  # a format this code does not know: the blob names still verify
    return listing.get("files", {})


def _recorded_digests(folder: Path, name: str, listing: dict) -> list[tuple[str, str, str]]:
    """(algorithm, hex digest, where it was recorded) for one snapshot file."""
    records = []
    etag = _blob_name(folder, name)
    if etag and _SHA256.fullmatch(etag):
        records.append(("sha256", etag, "cache blob name"))
    elif etag and _GIT_SHA1.fullmatch(etag):
        records.append(("git-sha1", etag, "cache blob name"))
    info = listing.get(name)
    if isinstance(info, dict) and info.get("lfs_sha256"):
        records.append(("sha256", info["lfs_sha256"], "cached tree listing"))
    elif isinstance(info, dict) and info.get("blob_id"):
        records.append(("git-sha1", info["blob_id"], "cached tree listing"))
    return records


def _blob_name(folder: Path, name: str) -> str | None:
    """The etag a snapshot link points at (snapshots/<commit>/<name> -> blobs/<etag>)."""
    path = folder / name
    if not path.is_symlink():
        return None  # a copied file (no symlink support, local_dir): no blob name to check
    # One level only: the blob may itself link into huggingface_hub's shared xet store.
    target = os.path.normpath(os.path.join(path.parent, os.readlink(path)))
    blobs = os.path.normpath(folder.parent.parent / "blobs")
    return os.path.basename(target) if os.path.dirname(target) == blobs else None


def _digests(path: Path, algorithms: set[str], bar) -> dict[str, str]:
    """Hex digests of a file's content: sha256 and/or git's blob sha1 (of "blob <size>\\0...")."""
    hashes = {}
    if "sha256" in algorithms:
        hashes["sha256"] = hashlib.sha256()
    if "git-sha1" in algorithms:
        hashes["git-sha1"] = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            for h in hashes.values():
                h.update(chunk)
            bar.update(len(chunk))
    return {algo: h.hexdigest() for algo, h in hashes.items()}


def _progress(total: int, desc: str):
    return hf_tqdm(total=total, unit="B", unit_scale=True, desc=desc,
                disable=total < _PROGRESS_BYTES)


def _read_json(entry: Checkpoint, folder: Path, name: str) -> dict:
    try:
        return json.loads((folder / name).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DownloadError(f"{entry.id}: {name} in {folder} is unreadable "
                            f"({_first_line(error)}): {_again(entry)}") from None


def _check_config(entry: Checkpoint, folder: Path) -> None:
    mismatches = registry.config_mismatches(entry, _read_json(entry, folder, "config.json"))
    if not mismatches:
        return
    parts = []
    for key, expected, found in mismatches:
        part = f"{key} expected {expected!r}, found {found!r}"
        field = _REGISTRY_FIELD.get(key)
        if field in entry.unconfirmed:
            part += (f" (registry field '{field}' is unconfirmed: the registry itself may be "
                     "wrong and needs a review)")
        parts.append(part)
    raise DownloadError(f"{entry.id}@{entry.revision}: config.json differs from Kipp's "
                        f"registry, refusing it: {'; '.join(parts)}")


def _check_index_matches_shards(entry: Checkpoint, folder: Path, files: list[str]) -> None:
    if INDEX_FILE not in files:
        return
    weight_map = _read_json(entry, folder, INDEX_FILE)["weight_map"]
    by_shard: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        by_shard.setdefault(shard, set()).add(tensor)
    for shard, tensors in sorted(by_shard.items()):
        absent = sorted(tensors - _tensor_names(folder / shard))
        if absent:
            raise DownloadError(
                f"{entry.id}@{entry.revision}: {INDEX_FILE} maps tensors to {shard} that it "
                f"does not hold ({absent[0]}, {len(absent)} in all); the snapshot is "
                f"inconsistent: {_again(entry)}"
            )


def _tensor_names(path: Path) -> set[str]:
    """Tensor names in a safetensors header (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return {name for name in header if name != "__metadata__"}
