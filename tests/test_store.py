"""kipp.load / kipp prepare by registry id: the artifact is made once and reused."""

import pytest

import kipp
from kipp.cli import main as cli_main
from kipp.errors import DownloadError
from kipp.formats import store

TINY = "kipp-synthetic/qwen3-tiny"


def test_load_by_id_makes_the_artifact_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KIPP_HOME", str(tmp_path))
    model = kipp.load(TINY, backend="reference", kv_tokens=256)
    path = store.artifact_path(TINY, "bf16")
    assert path.is_file() and model.artifact.path == path
    printed = capsys.readouterr()
    assert "converting" in printed.err and printed.out == ""  # status never on stdout
    stamp = path.stat().st_mtime_ns
    assert cli_main(["prepare", TINY, "--quiet"]) == 0
    assert "valid Kipp artifact" in capsys.readouterr().out
    assert path.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert model.generate("Hi", max_tokens=3, temperature=0)


def test_hub_checkpoint_offline_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("KIPP_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf"))
    with pytest.raises(DownloadError, match="kipp download"):
        kipp.load("Qwen/Qwen3-0.6B", progress=False)
