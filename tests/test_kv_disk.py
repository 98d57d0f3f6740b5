"""The KV disk tier (kipp.engine.kv_disk): a prefix survives a restart, and every damaged,
foreign or unwritable block file leaves the model serving the uncached run's exact output.

"A restart" is a second Model loaded on the same folder: its pool and slab start empty, so the
disk is all the two share. The oracle is a model without a tier computing the same KV the same
way (`uncached`); on the reference that is bitwise the plain one-call run too.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kipp.backend import KV_BLOCK
from kipp.engine import kv_files

TINY = "kipp-synthetic/qwen3-tiny"
PROMPT = [int(t) for t in np.random.default_rng(29).integers(1, 5000, 4 * KV_BLOCK + 9)]
FULL = len(PROMPT) // KV_BLOCK  # 4 full blocks, then 9 tokens in a partial block
TAIL = len(PROMPT) - 1 - FULL * KV_BLOCK  # of those, a tail on disk gives all but the last
RESTORED = FULL * KV_BLOCK + TAIL
FILES = FULL + 1  # a saved run's block files: the full blocks and its tail


_TOKENIZERS: dict = {}
_UNCACHED: dict = {}


def model(path, folder=None, backend="reference", mib=None, kv_scheme="bf16"):
    """A fresh Model (pool and slab empty: "a restarted process") on `folder`'s tier; the
    tokenizer, slow to build and immutable, is shared between them."""
    from kipp.chooser import open_backend
    from kipp.formats.artifact import open_artifact
    from kipp.model import Model
    from kipp.text.tokenizer import Tokenizer

    artifact = open_artifact(path)
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = Tokenizer(artifact.tokenizer_data())
    options = {} if kv_scheme == "bf16" else {"kv_scheme": kv_scheme}
    m = Model(artifact, open_backend(backend, artifact, 1024 // KV_BLOCK, **options),
              _TOKENIZERS[path])
    if folder is not None:
        m.attach_kv_disk(folder, mib)
    return m


def run(m, restored: int | None = None):
    """(logits of the prompt's last token, of one more token) and the tokens restored."""
    with m.session() as s:
        n = s.match_prefix(PROMPT)
        if restored is not None:
            assert n == restored
        first = s.eval(PROMPT[n:])
        second = s.eval([int(np.argmax(first[-1]))])
    m.pool.check()
    return first, second, n


def uncached(path, split: int, backend="reference"):
    """The oracle (memoized): no tier; the whole prompt evaluated, as the saving process did
    (on JAX a round's shape can change the bits of its KV), cut back to `split` and the rest
    evaluated again, as the restoring process does."""
    key = (str(path), split, backend)
    if key not in _UNCACHED:
        m = model(path, backend=backend)
        with m.session() as s:
            if split:  # the KV of PROMPT[:split] as the saving process computed it
                s.eval(PROMPT)
                s.truncate(split)
            first = s.eval(PROMPT[split:])
            second = s.eval([int(np.argmax(first[-1]))])
        _UNCACHED[key] = first, second
    return _UNCACHED[key]


def saved(path, folder, backend="reference", **kw):
    """A first process: runs the prompt, its blocks are written; returns its block files."""
    m = model(path, folder, backend, **kw)
    run(m)
    m.kv_disk.tier.flush()
    assert m.kv_disk.stats()["writes"] == FILES
    return sorted(m.kv_disk.tier.dir.glob("*" + kv_files.SUFFIX), key=os.path.getmtime)


def block_file(tier_dir: Path, index: int) -> Path:
    """The file of PROMPT's block `index` (named by the chained hash)."""
    from kipp.engine.blocks import block_hash

    digest = None
    for i in range(index + 1):
        digest = block_hash(digest, PROMPT[i * KV_BLOCK:(i + 1) * KV_BLOCK])
    return tier_dir / (digest.hex() + kv_files.SUFFIX)


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def tiny(artifacts):
    return artifacts(TINY)


@pytest.mark.slow  # CI's longest default checks
def test_restart_restores_the_prefix_bitwise(tiny, tmp_path):
    saved(tiny, tmp_path)
    m = model(tiny, tmp_path)
    first, second, n = run(m, restored=RESTORED)
    assert same((first, second), uncached(tiny, n))
    assert same((first, second), uncached(tiny, 0))  # the reference: any split, same bits
    stats = m.kv_disk.stats()
    assert stats["hits"] == FILES and stats["bad_blocks"] == 0
    assert stats["restored_tokens"] == RESTORED
    assert stats["bytes_read"] == FILES * m.kv_disk.tier.file_bytes
    # restored blocks are published in the pool: the next request adopts them from RAM
    before = stats["hits"]
    run(m, restored=RESTORED)
    assert m.kv_disk.stats()["hits"] == before


@pytest.mark.parametrize("ahead", [1, pytest.param(3, marks=pytest.mark.slow)])  # CI: longest
def test_a_restore_in_several_runs_is_bitwise_and_a_failed_import_leaves_the_pool(
        tiny, tmp_path, monkeypatch, ahead):
    """The restore reads the next run of blocks while the backend imports this one: with runs
    of 1 and 3 blocks the restored prefix is still bitwise, and an import failing on the second
    run frees every block it took (the pool's refcounts check) with no read left running."""
    from kipp.engine import kv_disk

    monkeypatch.setattr(kv_disk, "READ_AHEAD", ahead)
    saved(tiny, tmp_path)
    m = model(tiny, tmp_path)
    real, calls = m.backend.write_blocks, []

    def failing_second(blocks, payloads):
        calls.append(len(blocks))
        if len(calls) == 2:
            raise OSError("planted import failure")
        return real(blocks, payloads)

    tier, reads = m.kv_disk.tier, []
    real_read = tier.read_run

    def slow_read(*args):
        reads.append("started")
        time.sleep(0.1)
        out = real_read(*args)
        reads.append("done")
        return out

    m.backend.write_blocks, tier.read_run = failing_second, slow_read
    free = m.pool.num_available
    with pytest.raises(OSError, match="planted"), m.session() as s:
        s.match_prefix(PROMPT)
    at_raise = list(reads)
    time.sleep(0.3)  # a read left behind would start or finish in this time
    assert reads == at_raise and reads.count("started") == reads.count("done") >= 2, reads
    del tier.read_run
    m.pool.check()
    assert m.pool.num_available == free and m.pool.stats()["published"] == 0
    del m.backend.write_blocks
    first, second, n = run(m, restored=RESTORED)
    assert same((first, second), uncached(tiny, n))
    assert calls[0] == ahead


def test_generate_counts_restored_tokens_as_cached(tiny, tmp_path):
    saved(tiny, tmp_path)
    m = model(tiny, tmp_path)
    gen = m.generate(PROMPT, max_tokens=6, temperature=0, stream=True)
    text = "".join(gen)
    assert gen.stats.reused_tokens == RESTORED
    assert text == model(tiny).generate(PROMPT, max_tokens=6, temperature=0)  # uncached
    assert m.engine.stats()["disk"]["restored_tokens"] == RESTORED


def test_cache_prompt_warms_a_later_process(tiny, tmp_path):
    m = model(tiny, tmp_path)
    assert m.cache_prompt(PROMPT) == len(PROMPT)
    assert m.kv_disk.stats()["writes"] == FILES
    first, second, n = run(model(tiny, tmp_path), restored=RESTORED)
    assert same((first, second), uncached(tiny, n))


def mutate_truncate(path: Path, other: Path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def mutate_flip(path: Path, other: Path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit of the payload
    path.write_bytes(bytes(data))


def mutate_foreign(path: Path, other: Path):
    path.write_bytes(other.read_bytes())  # the same block (same name) of another namespace


@pytest.mark.parametrize("mutate", [  # the flip in CI's longest default checks
    mutate_truncate, pytest.param(mutate_flip, marks=pytest.mark.slow), mutate_foreign],
    ids=["truncated", "flipped-byte", "foreign"])
@pytest.mark.parametrize("foreign", [dict(kv_scheme="q8_0"), dict(scheme="q8_0")],
                         ids=["kv-scheme", "artifact"])
def test_a_bad_block_file_is_dropped_and_recomputed(tiny, artifacts, tmp_path, mutate,
                                                     foreign):
    if mutate is not mutate_foreign and foreign.get("scheme"):
        pytest.skip("one run of the truncation and the flip is enough")
    files = saved(tiny, tmp_path)
    other_path = artifacts(TINY, foreign["scheme"]) if "scheme" in foreign else tiny
    other_dir = tmp_path / "other"
    other = model(other_path, other_dir, kv_scheme=foreign.get("kv_scheme", "bf16"))
    run(other)
    other.kv_disk.tier.flush()
    assert other.kv_disk.tier.dir.name != files[0].parent.name  # another namespace
    bad = block_file(files[0].parent, 2)
    mutate(bad, block_file(other.kv_disk.tier.dir, 2))
    m = model(tiny, tmp_path)
    first, second, n = run(m, restored=2 * KV_BLOCK)  # blocks 0 and 1, then recompute
    assert same((first, second), uncached(tiny, n))
    stats = m.kv_disk.stats()
    assert stats["bad_blocks"] == 1 and stats["hits"] == 2
    m.kv_disk.tier.flush()  # the recomputed block is written again, whole
    assert bad.exists() and len(bad.read_bytes()) == m.kv_disk.tier.file_bytes
    assert run(model(tiny, tmp_path), restored=RESTORED)[2] == RESTORED


class _Refusing:
    """`open` for kv_files that writes half a temp file, then fails as the disk would."""

    def __init__(self, code: int):
        self.code, self.refused = code, 0

    def __call__(self, path, mode="r", *args, **kwargs):
        if "w" not in mode:
            return open(path, mode, *args, **kwargs)
        self.refused += 1
        if self.code != errno.ENOSPC:
            raise OSError(self.code, os.strerror(self.code), str(path))
        real = open(path, mode, *args, **kwargs)
        code = self.code

        class Half:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                real.close()

            def write(self, data):
                real.write(data[:len(data) // 2])
                raise OSError(code, os.strerror(code), str(path))

        return Half()


@pytest.mark.parametrize("code", [errno.ENOSPC, pytest.param(errno.EROFS, marks=pytest.mark.slow)],
                         ids=["full-disk", "read-only"])  # read-only: CI's longest default checks
def test_an_unwritable_disk_is_counted_and_serving_goes_on(tiny, tmp_path, monkeypatch, code):
    files = saved(tiny, tmp_path)  # a tier with the first blocks, then the disk refuses
    keep = [block_file(files[0].parent, i) for i in range(3)]
    for f in set(files) - set(keep):
        f.unlink()
    files = keep
    refusing = _Refusing(code)
    monkeypatch.setattr(kv_files, "open", refusing, raising=False)
    m = model(tiny, tmp_path)
    first, second, n = run(m, restored=3 * KV_BLOCK)  # what is there still restores
    m.kv_disk.tier.flush()
    assert same((first, second), uncached(tiny, n))
    stats = m.kv_disk.stats()
    assert refusing.refused and stats["write_errors"] == FILES - 3 and stats["writes"] == 0
    assert m.kv_disk.tier.last_error and os.strerror(code) in m.kv_disk.tier.last_error
    assert not list(m.kv_disk.tier.dir.glob(".tmp-*"))  # no half file left behind
    assert sorted(m.kv_disk.tier.dir.glob("*" + kv_files.SUFFIX)) == sorted(files)
    text = m.generate(PROMPT, max_tokens=4, temperature=0)
    assert text == model(tiny).generate(PROMPT, max_tokens=4, temperature=0)


KILLED_WRITER = """
import os, sys, time
from kipp.engine import kv_files
from kipp.model import load
real, seen = open, []
def stalling(path, mode="r", *a, **k):
    f = real(path, mode, *a, **k)
    if "w" in mode:
        seen.append(path)
        if len(seen) == 3:  # the third block: half written, then killed
            class Half:
                def __enter__(s): return s
                def __exit__(s, *e): pass
                def write(s, data):
                    f.write(data[:len(data) // 2]); f.flush()
                    real(sys.argv[3], "w").close()
                    time.sleep(600)
            return Half()
    return f
kv_files.open = stalling
m = load(sys.argv[1], backend="reference", kv_tokens=1024, progress=False,
         kv_cache_dir=sys.argv[2])
with m.session() as s:
    s.eval([int(t) for t in sys.argv[4].split(",")])
time.sleep(600)
"""


def test_a_process_killed_mid_write_leaves_no_half_block(tiny, tmp_path):
    ready = tmp_path / "ready"
    folder = tmp_path / "kv"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tiny), str(folder),
                             str(ready), ",".join(map(str, PROMPT))], env=os.environ.copy())
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "writer never stalled"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    [space] = [d for d in folder.iterdir() if d.is_dir()]
    assert len(list(space.glob(".tmp-*"))) == 1  # the half-written block, under a temp name
    assert len(list(space.glob("*" + kv_files.SUFFIX))) == 2
    m = model(tiny, folder)
    assert not list(space.glob(".tmp-*"))  # swept: its process is gone
    first, second, n = run(m, restored=2 * KV_BLOCK)
    assert same((first, second), uncached(tiny, n))
    assert m.kv_disk.stats()["bad_blocks"] == 0


@pytest.mark.slow  # one of the default suite's longest (CI's longest-checks step)
def test_the_size_bound_evicts_least_recently_used(tiny, tmp_path):
    m = model(tiny, tmp_path)
    limit = 3 * m.kv_disk.tier.file_bytes
    m = model(tiny, tmp_path, mib=limit / 2**20)
    run(m)
    m.kv_disk.tier.flush()
    stats = m.kv_disk.stats()
    assert stats["files"] == 3 and stats["evictions"] == FILES - 3
    assert stats["used_bytes"] <= limit
    # the oldest (the prefix's first blocks) went: a restart finds no prefix, and recomputes
    assert not block_file(m.kv_disk.tier.dir, 0).exists()
    assert block_file(m.kv_disk.tier.dir, FULL - 1).exists()
    first, second, n = run(model(tiny, tmp_path, mib=limit / 2**20), restored=0)
    assert same((first, second), uncached(tiny, 0))


def test_two_processes_share_a_folder(tiny, tmp_path):
    a, b = model(tiny, tmp_path), model(tiny, tmp_path)
    run(a)
    run(b)  # both publish the same blocks: the same bytes under the same names
    a.kv_disk.tier.flush()
    b.kv_disk.tier.flush()
    files = list(a.kv_disk.tier.dir.glob("*" + kv_files.SUFFIX))
    assert len(files) == FILES
    first, second, n = run(model(tiny, tmp_path), restored=RESTORED)
    assert same((first, second), uncached(tiny, n))


def test_a_full_queue_drops_and_counts(tmp_path):
    tier = kv_files.DiskTier(tmp_path, kv_files.namespace("x"), 8, 1 << 20)
    release = threading.Event()
    key = [(bytes(16), tuple(range(KV_BLOCK)))]

    def slow():
        release.wait(30)
        return [b"12345678"]

    accepted = [tier.submit(key, slow) for _ in range(kv_files.QUEUE_JOBS + 3)]
    release.set()
    tier.flush()
    assert accepted.count(False) >= 2 and tier.counters["dropped"] == accepted.count(False)
    assert tier.counters["writes"] == 1  # the one block, written once


def test_cache_ls_and_clear(tiny, tmp_path, capsys):
    from kipp.cli import main

    saved(tiny, tmp_path)
    assert main(["cache", "ls", "--kv-cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{FILES:>8,} blocks" in out and "qwen3-tiny bf16" in out and "reference" in out
    assert main(["cache", "clear", "--kv-cache-dir", str(tmp_path)]) == 0
    assert f"removed {FILES} KV block files" in capsys.readouterr().out
    assert not list(tmp_path.glob("*/*" + kv_files.SUFFIX))


def test_cache_prompt_command(tiny, tmp_path, capsys):
    from kipp.cli import main

    text = tmp_path / "system.txt"
    text.write_text("You are a careful assistant. " * 30)
    folder = tmp_path / "kv"
    args = ["cache-prompt", str(tiny), "--backend", "reference", "--file", str(text),
            "--kv-cache-dir", str(folder)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "cached" in out and str(folder) in out
    assert kv_files.listing(folder)
    assert main(args) == 0
    assert "(0 blocks written)" in capsys.readouterr().out  # already there
    assert main(["cache-prompt", str(tiny), "--backend", "reference", "--file",
                 str(tmp_path / "missing.txt"), "--kv-cache-dir", str(folder)]) == 1
    assert "--file" in capsys.readouterr().err


def test_bad_settings_are_refused(tiny, tmp_path):
    from kipp.errors import KippError

    (tmp_path / "file").write_text("x")
    with pytest.raises(KippError, match="kv_cache_dir .* is a file"):
        model(tiny, tmp_path / "file")
    with pytest.raises(KippError, match="kv_disk_mib must be"):
        model(tiny, tmp_path, mib=-1)


@pytest.mark.parametrize("backend", ["jax", "mlx"])
def test_a_compiled_backend_restores_bitwise(artifacts, tmp_path, backend):
    pytest.importorskip(backend)
    tiny = artifacts(TINY)
    saved(tiny, tmp_path, backend=backend)
    m = model(tiny, tmp_path, backend=backend)
    first, second, n = run(m, restored=RESTORED)
    assert same((first, second), uncached(tiny, n, backend=backend))
    with m.session() as s:  # the restored KV is bitwise the saved bytes
        s.match_prefix(PROMPT)
        payloads = m.backend.read_blocks(s.block_table[:FULL])()
    for i, payload in enumerate(payloads):
        data = block_file(m.kv_disk.tier.dir, i).read_bytes()
        assert payload == data[kv_files._HEADER.size:kv_files._HEADER.size + len(payload)]
    # the reference's blocks live in another namespace: never read by this backend
    assert model(tiny, tmp_path).kv_disk.tier.dir != m.kv_disk.tier.dir


def test_metrics_and_doctor_show_the_tier(tiny, tmp_path):
    pytest.importorskip("prometheus_client")
    from kipp.doctor import _kv_disk_line, kv_disk_info
    from kipp.http.metrics import _disk_metrics

    saved(tiny, tmp_path)
    m = model(tiny, tmp_path)
    run(m)
    families = {f.name: f.samples[0].value for f in _disk_metrics(m.engine.stats()["disk"])}
    assert families["kipp_kv_disk_hits"] == FILES
    assert families["kipp_kv_disk_restored_tokens"] == RESTORED
    assert families["kipp_kv_disk_bytes"] == FILES * m.kv_disk.tier.file_bytes
    assert list(_disk_metrics(None)) == []
    info = kv_disk_info(True, tmp_path)
    assert info["files"] == FILES and info["writable"] and len(info["namespaces"]) == 1
    assert f"{FILES} blocks" in _kv_disk_line(info)
    assert "KV disk" in repr(m) and f"{FILES} blocks" in repr(m)


@pytest.mark.slow  # CI's longest-checks step; a later process's warmed prefix stays
def test_a_restarted_server_restores_the_prefix(tiny, tmp_path):
    """`kipp serve` stopped and started again on the same --kv-cache-dir: the repeated prompt's
    usage counts every restored token as cached, /metrics counts the disk hits, and the greedy
    text is the first server's."""
    pytest.importorskip("flask")
    from live_server import LiveServer

    body = {"model": TINY, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    flags = ("--kv-cache-dir", str(tmp_path), "--kv-disk-mib", "64")
    first = LiveServer(tiny, *flags)
    try:
        status, text, _ = first.post("/v1/completions", body)
        assert status == 200, text
        cold = json.loads(text)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        first.stop()  # SIGTERM: the queued block writes are flushed at exit
    assert len(list(Path(tmp_path).glob("*/*.kvb"))) == FILES
    second = LiveServer(tiny, *flags)
    try:
        status, text, _ = second.post("/v1/completions", body)
        assert status == 200, text
        warm = json.loads(text)
        hits = second.metrics()["kipp_kv_disk_hits_total"]
    finally:
        second.stop()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == RESTORED
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert hits == FILES
