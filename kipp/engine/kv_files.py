"""The KV disk tier's files: published full blocks kept on disk, named by content, verified
on read, written behind the step, size-bounded.

    tier = DiskTier(folder, namespace(...), block_bytes, limit_bytes)
    tier.submit(keys, fetch)            # the writer thread writes them (temp name, rename)
    payloads = tier.read_run(tokens, start, stop)   # verified payloads, in order

A block file is named by the pool's chained block hash (kipp.engine.blocks.block_hash) inside a
namespace folder; the namespace digests everything that makes the bytes differ: the artifact's
checksum, the KV scheme and the backend's numerics (Backend.kv_identity). A file holds a header
(magic, namespace, digest, the block's 32 token ids, payload length), the backend's payload and
an XXH3-64 of all of it; a file failing any check is deleted, counted and recomputed, never used.
A finished sequence's partial last block (the pool's tail) is kept too, one file per parent
(`tail-<key>.kvb`, the latest replacing the last).

Writes run on one background thread behind a bounded queue (64 jobs, 1 GiB of payloads beyond
the first job; a full queue drops the job and counts it): temp name, then rename, so a killed
process leaves no half file under a real name; two processes writing the same block write the
same bytes (content addressing), the rename of the second just replaces the first. The folder
is size-bounded: the least recently used files (by mtime, refreshed on every hit) go first.
Any OSError (full disk, read-only folder) is counted and the tier keeps serving from what it
has: the server never fails for its disk.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import enum
import functools
import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import xxhash

from kipp.backend import KV_BLOCK
from kipp.engine.blocks import block_hash
from kipp.errors import KippError

log = logging.getLogger("kipp.kv_disk")  # one logger for the tier

MAGIC = b"KIPPKV2\0"  # 2: the checksum is XXH3-64 (CRC-32 ran at a tenth of the speed)
SUFFIX = ".kvb"
TAIL = "tail-"  # a partial last block's file: tail-<key of its parent>.kvb
NO_TOKEN = 0xFFFFFFFF  # pads a tail's token slots
LABEL = "label.txt"  # in each namespace folder: the artifact, KV scheme and backend
_HEADER = struct.Struct(f"<8s16s16s{KV_BLOCK}IQ")
_SUM = struct.Struct("<Q")
QUEUE_JOBS = 64  # publications waiting for the writer; more are dropped (counted)
QUEUE_BYTES = 1 << 30  # payload bytes they may hold (device memory, on a GPU) beyond the first
DEFAULT_SHARE = 0.25  # of the free disk, when --kv-disk-mib is not given
DEFAULT_CAP = 32 << 30


class TierError(KippError, ValueError):
    """A disk-tier setting that cannot work (names the flag)."""


class Bad(enum.Enum):
    """Why a block file was refused."""

    SHORT = "truncated"
    MAGIC = "not a Kipp KV block"
    NAMESPACE = "another artifact, KV scheme or backend's block"
    KEY = "another block's content"
    CHECKSUM = "checksum mismatch"


@dataclass(frozen=True)
class _Job:
    keys: tuple[tuple[bytes, tuple[int, ...]], ...]  # (digest, tokens) per block
    fetch: Callable[[], list[bytes]]  # the payloads, read off the backend in the writer


def namespace(*parts: str) -> bytes:
    """The 16-byte digest of what makes KV bytes differ (artifact, KV scheme, numerics)."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part.encode() + b"\0")
    return h.digest()


def artifact_checksum(path: Path, memo: Path | None = None) -> str:
    """blake2b of the artifact file's bytes (what identifies the weights), memoized in `memo`
    (a JSON file in the tier's folder) by path, size and mtime: hashed once per file."""
    st = os.stat(path)
    key = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}"
    known = {}
    if memo is not None:
        try:
            known = json.loads(memo.read_text())
        except (OSError, ValueError):
            known = {}
        if isinstance(known, dict) and isinstance(known.get(key), str):
            return known[key]
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    if memo is not None:
        try:
            known = dict(known) if isinstance(known, dict) else {}
            known[key] = h.hexdigest()
            tmp = memo.with_name(f".tmp-{os.getpid()}-memo")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, memo)
        except OSError as e:  # a read-only folder: the checksum is computed again next time
            log.debug("artifact checksum memo not written: %s", e)
    return h.hexdigest()


READERS = 4  # block files read and checked at once on a restore
READ_AHEAD = 16  # blocks read before their import is started


@functools.cache
def _readers() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(READERS, thread_name_prefix="kipp-kv-read")


ALIGN = 64  # a payload at this alignment reaches a CPU backend without a copy (JAX aliases it)


def _aligned_rows(n: int, size: int, offset: int) -> np.ndarray:
    """n rows of `size` bytes, each row's byte `offset` at an ALIGN boundary."""
    stride = -(-size // ALIGN) * ALIGN
    raw = np.empty(n * stride + ALIGN, np.uint8)
    skip = -(raw.ctypes.data + offset) % ALIGN
    return raw[skip:skip + n * stride].reshape(n, stride)[:, :size]


def tail_key(parent: bytes | None) -> bytes:
    """The name of the tail after `parent` (None: a tail holding position 0)."""
    return hashlib.blake2b(b"tail" + (parent or b""), digest_size=16).digest()


def default_limit(folder: Path) -> int:
    """A quarter of the free disk under `folder`, at most 32 GiB."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return int(min(shutil.disk_usage(probe).free * DEFAULT_SHARE, DEFAULT_CAP))


class DiskTier:
    """Block files of one namespace in `folder` (others' namespaces share the size bound)."""

    def __init__(self, folder: Path, space: bytes, block_bytes: int, limit_bytes: int,
                 label: str = ""):
        if limit_bytes < 0:
            raise TierError(f"--kv-disk-mib must be >= 0, got {limit_bytes / 2**20:g}")
        self.root = Path(folder)
        self.space = space
        self.dir = self.root / space.hex()
        self.block_bytes = block_bytes
        self.file_bytes = _HEADER.size + block_bytes + _SUM.size
        self.limit = limit_bytes
        self.counters = dict(hits=0, misses=0, bytes_read=0, bytes_written=0, writes=0,
                             evictions=0, bad_blocks=0, dropped=0, write_errors=0)
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._sizes: dict[Path, int] = {}  # every block file under root, oldest first
        self._queue: queue.Queue[_Job | None] = queue.Queue(QUEUE_JOBS)
        self._tmp = 0
        self._queued = 0  # payload bytes of the queued jobs
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if label and not (self.dir / LABEL).exists():  # what `kipp cache ls` names it by
                (self.dir / LABEL).write_text(label + "\n")
        except OSError as e:
            self._error(f"cannot write in {self.dir}: {e.strerror}")
        self._scan()
        self._thread = threading.Thread(target=self._writer, name="kipp-kv-disk", daemon=True)
        self._thread.start()
        atexit.register(self.flush, 10.0)  # a short-lived process still leaves its blocks

    def path(self, digest: bytes) -> Path:
        return self.dir / (digest.hex() + SUFFIX)

    def tail_path(self, parent: bytes | None) -> Path:
        return self.dir / (TAIL + tail_key(parent).hex() + SUFFIX)

    def has(self, digest: bytes) -> bool:
        with self._lock:
            return self.path(digest) in self._sizes

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    @property
    def files(self) -> int:
        with self._lock:
            return len(self._sizes)

    def stats(self) -> dict:
        return dict(self.counters, files=self.files, used_bytes=self.used_bytes,
                    limit_bytes=self.limit, queued=self._queue.qsize())

    # -- reading (the engine thread, before prefill) --------------------------------------------

    def read_run(self, tokens: Sequence[int], start: int, stop: int) -> list[memoryview]:
        """Payloads of blocks start..stop-1 of `tokens` found on disk, in order, up to the first
        missing or bad one. Files are read into one buffer (no allocation per file) and checked
        READERS at a time (file reads and XXH3 release the GIL), in order; those past the first
        failure are not counted."""
        digest, keys = None, []
        for i in range(stop):
            chunk = tuple(tokens[i * KV_BLOCK:(i + 1) * KV_BLOCK])
            digest = block_hash(digest, chunk)
            if i >= start:
                keys.append((digest, chunk))
        rows = _aligned_rows(len(keys), self.file_bytes, _HEADER.size)
        out = []
        for at in range(0, len(keys), READERS):
            batch = list(zip(keys[at:at + READERS], rows[at:at + READERS]))
            loaded = list(_readers().map(lambda job: self._load(*job[0], into=job[1]), batch))
            for ((digest, chunk), _), found in zip(batch, loaded):
                payload = self._settle(self.path(digest), found)
                if payload is None:
                    return out
                out.append(payload)
        return out

    def tail_tokens(self, parent: bytes | None) -> tuple[int, ...] | None:
        """The tokens named in the header of `parent`'s tail file (unverified), or None."""
        try:
            with open(self.tail_path(parent), "rb") as f:
                head = f.read(_HEADER.size)
        except OSError:
            return None
        if len(head) != _HEADER.size:
            return None
        return tuple(t for t in _HEADER.unpack(head)[3:3 + KV_BLOCK] if t != NO_TOKEN)

    def read_tail(self, parent: bytes | None) -> tuple[bytes, tuple[int, ...]] | None:
        """(payload, tokens) of the partial block last published after `parent`, or None."""
        found = self.read(tail_key(parent), None, self.tail_path(parent))
        return found

    def read(self, digest: bytes, chunk: tuple[int, ...] | None,
             path: Path | None = None):
        """A verified block's payload (a tail's: (payload, tokens), `chunk` None), or None."""
        path = self.path(digest) if path is None else path
        return self._settle(path, self._load(digest, chunk, path))

    def _load(self, digest: bytes, chunk, path: Path | None = None,
              into: np.ndarray | None = None):
        """(data, why it is bad or None, chunk) of a block file, read into `into` (a fresh
        buffer when None); None when it is missing."""
        path = self.path(digest) if path is None else path
        data = np.empty(self.file_bytes, np.uint8) if into is None else into
        try:
            with open(path, "rb", buffering=0) as f:
                if os.fstat(f.fileno()).st_size != self.file_bytes:
                    return memoryview(b""), Bad.SHORT, chunk
                n = f.readinto(data)
        except OSError:
            return None
        view = memoryview(data)
        if n != self.file_bytes:
            return view, Bad.SHORT, chunk
        return view, self._check(view, digest, chunk), chunk

    def _settle(self, path: Path, found):
        """Count a loaded file, drop a bad one; its payload (a tail's with its tokens)."""
        if found is None:
            self.counters["misses"] += 1
            return None
        data, bad, chunk = found
        if bad is not None:
            log.warning("KV block file %s dropped: %s", path.name, bad.value)
            self.counters["bad_blocks"] += 1
            self._remove(path)
            return None
        self.counters["hits"] += 1
        self.counters["bytes_read"] += len(data)
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        with self._lock:
            self._sizes.pop(path, None)
            self._sizes[path] = len(data)
        payload = memoryview(data)[_HEADER.size:_HEADER.size + self.block_bytes]
        if chunk is None:
            tokens = _HEADER.unpack_from(data)[3:3 + KV_BLOCK]
            return payload, tuple(t for t in tokens if t != NO_TOKEN)
        return payload

    def _check(self, data: memoryview, digest: bytes,
               chunk: tuple[int, ...] | None) -> Bad | None:
        if len(data) != self.file_bytes:
            return Bad.SHORT
        magic, space, key, *rest = _HEADER.unpack_from(data)
        if magic != MAGIC:
            return Bad.MAGIC
        if space != self.space:
            return Bad.NAMESPACE
        if chunk is None:  # a tail: 1..31 tokens, then padding
            n = KV_BLOCK - rest[:KV_BLOCK].count(NO_TOKEN)
            chunk = tuple(rest[:n]) + (NO_TOKEN,) * (KV_BLOCK - n) if 0 < n < KV_BLOCK else ()
        if key != digest or tuple(rest[:KV_BLOCK]) != chunk or rest[KV_BLOCK] != self.block_bytes:
            return Bad.KEY
        (total,) = _SUM.unpack_from(data, len(data) - _SUM.size)
        if xxhash.xxh3_64_intdigest(data[:-_SUM.size]) != total:
            return Bad.CHECKSUM
        return None

    # -- writing (the writer thread) ------------------------------------------------------------

    def admits(self, blocks: int) -> bool:
        """Whether a job of `blocks` would be queued; if not, it is counted as dropped."""
        with self._lock:
            fits = self._queued == 0 or self._queued + blocks * self.block_bytes <= QUEUE_BYTES
        if not fits or self._queue.full():
            self.counters["dropped"] += blocks
            return False
        return True

    def submit(self, keys: Sequence[tuple[bytes, tuple[int, ...]]],
               fetch: Callable[[], list[bytes]]) -> bool:
        """Queue blocks to write; False (counted in `dropped`) when the queue is full."""
        size = len(keys) * self.block_bytes
        try:
            self._queue.put_nowait(_Job(tuple(keys), fetch))
        except queue.Full:
            self.counters["dropped"] += len(keys)
            return False
        with self._lock:
            self._queued += size
        return True

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued write is done (tests, cache-prompt, exit)."""
        done = threading.Event()
        try:
            self._queue.put((done.set, None), timeout=timeout)  # a marker job
        except queue.Full:
            return
        done.wait(timeout)

    def _writer(self) -> None:
        while True:
            job = self._queue.get()
            if isinstance(job, tuple):
                job[0]()
                continue
            try:
                payloads = job.fetch()
            except Exception as e:  # the backend could not hand the bytes over: drop the job
                log.warning("KV blocks not written: %s", e)
                self.counters["write_errors"] += len(job.keys)
                payloads = []
            with self._lock:
                self._queued -= len(job.keys) * self.block_bytes
            for (digest, chunk), payload in zip(job.keys, payloads):
                if len(chunk) < KV_BLOCK:  # a tail: its digest is its parent's
                    self._write(tail_key(digest or None), chunk, payload,
                                self.tail_path(digest or None))
                else:
                    self._write(digest, chunk, payload)
            self._evict()

    def _write(self, digest: bytes, chunk: tuple[int, ...], payload: bytes,
               path: Path | None = None) -> None:
        tail = path is not None  # a tail replaces the last one of its parent
        path = self.path(digest) if path is None else path
        if len(payload) != self.block_bytes or (path.exists() and not tail):
            return  # another process (or an earlier job) wrote it: content-addressed
        if tail:
            chunk = tuple(chunk) + (NO_TOKEN,) * (KV_BLOCK - len(chunk))
        body = _HEADER.pack(MAGIC, self.space, digest, *chunk, len(payload)) + payload
        data = body + _SUM.pack(xxhash.xxh3_64_intdigest(body))
        self._tmp += 1
        tmp = self.dir / f".tmp-{os.getpid()}-{self._tmp}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            self._error(f"cannot write {path.name}: {e.strerror}")
            self.counters["write_errors"] += 1
            self._remove(tmp, evicted=False)
            return
        self.counters["writes"] += 1
        self.counters["bytes_written"] += len(data)
        with self._lock:
            self._sizes[path] = len(data)

    def _evict(self) -> None:
        while True:
            with self._lock:
                if sum(self._sizes.values()) <= self.limit or not self._sizes:
                    return
                path = next(iter(self._sizes))
            self._remove(path)
            self.counters["evictions"] += 1

    def _remove(self, path: Path, evicted: bool = True) -> None:
        with self._lock:
            self._sizes.pop(path, None)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            self._error(f"cannot remove {path.name}: {e.strerror}")

    def _scan(self) -> None:
        """Index every block file under root, oldest first; sweep this process's stale temps
        (a killed process leaves only .tmp-* names, never a half file under a block name)."""
        found = []
        try:
            for sub in self.root.iterdir():
                if not sub.is_dir():
                    continue
                for entry in os.scandir(sub):
                    if entry.name.endswith(SUFFIX):
                        st = entry.stat()
                        found.append((st.st_mtime_ns, Path(entry.path), st.st_size))
                    elif entry.name.startswith(".tmp-") and _stale(entry.name):
                        self._remove(Path(entry.path), evicted=False)
        except OSError as e:
            self._error(f"cannot list {self.root}: {e.strerror}")
        for _, path, size in sorted(found):
            self._sizes[path] = size

    def _error(self, message: str) -> None:
        if message != self.last_error:
            log.warning("KV disk tier: %s", message)
        self.last_error = message


def _stale(name: str) -> bool:
    """A temp file whose writing process is gone (killed mid-write)."""
    try:
        pid = int(name.split("-")[1])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    """{namespace label: (block files, bytes)} of a tier folder (`kipp cache ls`)."""
    out: dict[str, tuple[int, int]] = {}
    if not Path(folder).is_dir():
        return out
    for sub in sorted(Path(folder).iterdir()):
        if not sub.is_dir():
            continue
        sizes = [e.stat().st_size for e in os.scandir(sub) if e.name.endswith(SUFFIX)]
        try:
            label = (sub / LABEL).read_text().strip()
        except OSError:
            label = sub.name
        out[label or sub.name] = (len(sizes), sum(sizes))
    return out


def clear(folder: Path) -> tuple[int, int]:
    """Remove every block file (and temp file) of a tier folder; (files, bytes) removed."""
    files = size = 0
    if not Path(folder).is_dir():
        return 0, 0
    for sub in Path(folder).iterdir():
        if not sub.is_dir():
            continue
        for entry in os.scandir(sub):
            if entry.name.endswith(SUFFIX) or entry.name.startswith(".tmp-"):
                try:
                    n = entry.stat().st_size
                    os.unlink(entry.path)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    raise TierError(f"cannot clear {folder}: {e}") from None
                files, size = files + entry.name.endswith(SUFFIX), size + n
    return files, size
