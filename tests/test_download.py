"""kipp.formats.download through huggingface_hub's real cache code path, offline.

Each test lays a synthetic checkpoint into a Hugging Face cache layout in tmp_path exactly as
huggingface_hub writes it (blobs named by etag, snapshot links, refs) and runs with offline mode
on, so no test can reach the network.
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from kipp.errors import DownloadError, RegistryError
from kipp.formats import download as dl
from kipp.formats import registry
from kipp.synthetic import writer as synthetic

TINY = "kipp-synthetic/qwen3-tiny"
UNTIED = "kipp-synthetic/qwen3-tiny-untied"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    import huggingface_hub.constants

    # huggingface_hub reads HF_HUB_OFFLINE once at import: patch its constant as well.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")


def is_lfs(path: Path) -> bool:
    return path.suffix == ".safetensors" or path.stat().st_size > 10 << 20


def etag(data: bytes, lfs: bool) -> str:
    """The hub's etag: sha256 for an LFS file, the git blob sha1 for a regular one."""
    if lfs:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def commit_for(revision: str) -> str:
    return revision if len(revision) == 40 else hashlib.sha1(revision.encode()).hexdigest()


def lay_into_cache(src: Path, cache: Path, repo: str, revision: str, *, listing=False,
                   copy=()) -> Path:
    """Put the files of `src` into an HF cache as snapshot `revision` of `repo`.

    `listing` also writes the tree listing huggingface_hub caches per commit; names in `copy`
    become plain copies instead of links into blobs/ (as without symlink support).
    """
    storage = cache / ("models--" + repo.replace("/", "--"))
    commit = commit_for(revision)
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir(exist_ok=True)
    files = {}
    for path in sorted(src.iterdir()):
        data, lfs = path.read_bytes(), is_lfs(path)
        blob = storage / "blobs" / etag(data, lfs)
        if not blob.exists():
            os.link(path, blob)  # cheap; a test that corrupts a blob replaces it instead
        if path.name in copy:
            shutil.copyfile(blob, snapshot / path.name)
        else:
            (snapshot / path.name).symlink_to(Path("../../blobs") / blob.name)
        files[path.name] = {"size": len(data), "blob_id": etag(data, False)}
        if lfs:
            files[path.name].update(lfs_sha256=etag(data, True), lfs_size=len(data))
    if revision != commit:
        (storage / "refs").mkdir()
        (storage / "refs" / revision).write_text(commit)  # no newline: the hub reads it raw
    if listing:
        (storage / "trees").mkdir()
        (storage / "trees" / f"{commit}.json").write_text(
            json.dumps({"format_version": 1, "files": files}))
    return snapshot


def edited_copy(src: Path, dest: Path, name: str, edit) -> Path:
    """A copy of folder `src` whose JSON file `name` went through `edit(dict)`."""
    shutil.copytree(src, dest)
    obj = json.loads((dest / name).read_text())
    edit(obj)
    (dest / name).write_text(json.dumps(obj, indent=2))
    return dest


def one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


def test_a_cached_synthetic_snapshot_is_found_and_verified(tiny_dir, tmp_path):
    entry = registry.get(TINY)
    snapshot = lay_into_cache(tiny_dir, tmp_path, TINY, entry.revision)
    assert dl.download(TINY, cache_dir=tmp_path) == snapshot
    assert dl.download(TINY, revision=entry.revision, cache_dir=tmp_path) == snapshot
    assert dl.cached_snapshot(TINY, cache_dir=tmp_path) == snapshot


def test_a_hub_checkpoint_at_its_pinned_commit_is_served_from_the_cache(tiny_dir, tmp_path):
    # Tiny weights under a hub id: download checks checksums, config and layout, not shapes.
    entry = registry.get("Qwen/Qwen3-0.6B")
    src = edited_copy(tiny_dir, tmp_path / "src", "config.json",
                      lambda c: c.update(synthetic.config_json(entry)))
    snapshot = lay_into_cache(src, tmp_path / "cache", entry.id, entry.revision, listing=True)
    assert snapshot.name == entry.revision
    assert dl.download(entry.id, cache_dir=tmp_path / "cache") == snapshot


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_corrupted_blob_is_refused_naming_the_file(tiny_dir, tmp_path, name):
    snapshot = lay_into_cache(tiny_dir, tmp_path, TINY, registry.get(TINY).revision)
    blob = (snapshot / name).resolve()
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1
    blob.unlink()  # a hard link to the session's synthetic folder: never write through it
    blob.write_bytes(bytes(data))
    with pytest.raises(DownloadError) as error:
        dl.download(TINY, cache_dir=tmp_path)
    algorithm = "sha256" if name.endswith(".safetensors") else "git-sha1"
    assert f"{name} does not match its recorded {algorithm}" in one_line(error)


def test_a_copied_file_verifies_against_the_cached_tree_listing(tiny_dir, tmp_path):
    entry = registry.get(TINY)
    lay_into_cache(tiny_dir, tmp_path, TINY, entry.revision, listing=True,
                   copy={"model.safetensors", "config.json"})
    assert dl.download(TINY, cache_dir=tmp_path).is_dir()


def test_a_file_without_any_recorded_checksum_is_refused(tiny_dir, tmp_path):
    lay_into_cache(tiny_dir, tmp_path, TINY, registry.get(TINY).revision,
                   copy={"model.safetensors"})
    with pytest.raises(DownloadError) as error:
        dl.download(TINY, cache_dir=tmp_path)
    assert "no recorded checksum for model.safetensors" in one_line(error)


def test_a_config_field_that_differs_is_refused_naming_it(tiny_dir, tmp_path):
    src = edited_copy(tiny_dir, tmp_path / "src", "config.json",
                      lambda c: c.update(hidden_size=512))
    lay_into_cache(src, tmp_path / "cache", TINY, registry.get(TINY).revision)
    with pytest.raises(DownloadError) as error:
        dl.download(TINY, cache_dir=tmp_path / "cache")
    assert "hidden_size expected 256, found 512" in one_line(error)
    assert "unconfirmed" not in str(error.value)


def test_a_difference_in_an_unconfirmed_field_asks_for_a_registry_review(tiny_dir, tmp_path):
    entry = registry.get("Qwen/Qwen3-8B")  # tied is unconfirmed there
    assert "tied" in entry.unconfirmed
    src = edited_copy(tiny_dir, tmp_path / "src", "config.json",
                      lambda c: c.update(synthetic.config_json(entry), tie_word_embeddings=True))
    lay_into_cache(src, tmp_path / "cache", entry.id, entry.revision)
    with pytest.raises(DownloadError) as error:
        dl.download(entry.id, cache_dir=tmp_path / "cache")
    text = one_line(error)
    assert "tie_word_embeddings expected False, found True" in text
    assert "registry itself may be wrong" in text


def test_an_empty_cache_offline_says_how_to_get_the_checkpoint(tmp_path):
    with pytest.raises(DownloadError) as error:
        dl.download("Qwen/Qwen3-0.6B", cache_dir=tmp_path)
    text = one_line(error)
    assert "c1899de289a04d12100db370d81485cdf75e47ca is not in the Hugging Face cache" in text
    assert "HF_HUB_OFFLINE=1" in text
    assert "run `kipp download Qwen/Qwen3-0.6B` on a machine with network access" in text
    assert dl.cached_snapshot("Qwen/Qwen3-0.6B", cache_dir=tmp_path) is None


def test_offline_set_after_import_is_honoured(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(DownloadError, match="HF_HUB_OFFLINE=1"):  # and no ~25 s of retries
        dl.download("Qwen/Qwen3-0.6B", cache_dir=tmp_path)


def test_a_synthetic_checkpoint_missing_from_the_cache_points_to_synthesize(tmp_path):
    with pytest.raises(DownloadError) as error:
        dl.download(TINY, cache_dir=tmp_path)
    assert f"generated with `kipp synthesize {TINY} --out DIR`" in one_line(error)


def test_an_unpinned_revision_is_refused(tmp_path):
    with pytest.raises(DownloadError) as error:
        dl.download("Qwen/Qwen3-0.6B", revision="main", cache_dir=tmp_path)
    assert "Kipp runs only pinned revisions" in one_line(error)


def test_an_unknown_checkpoint_is_refused(tmp_path):
    with pytest.raises(RegistryError, match="not in Kipp's checkpoint registry"):
        dl.download("Qwen/Qwen3-0.6B-FP8", cache_dir=tmp_path)


def test_a_sharded_snapshot_missing_a_shard_is_refused(synthetic_dir, tmp_path):
    snapshot = lay_into_cache(synthetic_dir(UNTIED), tmp_path, UNTIED,
                              registry.get(UNTIED).revision)
    assert dl.download(UNTIED, cache_dir=tmp_path) == snapshot
    (snapshot / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(DownloadError) as error:
        dl.download(UNTIED, cache_dir=tmp_path)
    assert "lacks model-00002-of-00002.safetensors" in one_line(error)


def test_a_shard_whose_blob_is_gone_is_refused(synthetic_dir, tmp_path):
    snapshot = lay_into_cache(synthetic_dir(UNTIED), tmp_path, UNTIED,
                              registry.get(UNTIED).revision)
    (snapshot / "model-00001-of-00002.safetensors").resolve().unlink()  # a dangling link
    with pytest.raises(DownloadError, match="lacks model-00001-of-00002.safetensors"):
        dl.download(UNTIED, cache_dir=tmp_path)


def test_an_incomplete_snapshot_by_the_tree_listing_is_refused(synthetic_dir, tmp_path):
    snapshot = lay_into_cache(synthetic_dir(UNTIED), tmp_path, UNTIED,
                              registry.get(UNTIED).revision, listing=True)
    (snapshot / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(DownloadError) as error:  # huggingface_hub itself notices here
        dl.download(UNTIED, cache_dir=tmp_path)
    assert "is incomplete" in one_line(error)


def test_an_incomplete_hub_snapshot_offline_says_how_to_complete_it(tiny_dir, tmp_path):
    entry = registry.get("Qwen/Qwen3-0.6B")
    src = edited_copy(tiny_dir, tmp_path / "src", "config.json",
                      lambda c: c.update(synthetic.config_json(entry)))
    snapshot = lay_into_cache(src, tmp_path / "cache", entry.id, entry.revision, listing=True)
    (snapshot / "vocab.json").unlink()  # not needed by Kipp, but the listing promises it
    with pytest.raises(DownloadError) as error:
        dl.download(entry.id, cache_dir=tmp_path / "cache")
    text = one_line(error)
    assert f"the cached snapshot of pinned revision {entry.revision}" in text
    assert "is incomplete and offline mode is on" in text


def test_an_index_promising_a_tensor_its_shard_lacks_is_refused(synthetic_dir, tmp_path):
    def move_lm_head(index):
        index["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors"

    src = edited_copy(synthetic_dir(UNTIED), tmp_path / "src",
                      "model.safetensors.index.json", move_lm_head)
    lay_into_cache(src, tmp_path / "cache", UNTIED, registry.get(UNTIED).revision)
    with pytest.raises(DownloadError) as error:
        dl.download(UNTIED, cache_dir=tmp_path / "cache")
    assert "model-00001-of-00002.safetensors that it does not hold" in one_line(error)
