"""Kipp's GGUF subset: a strict reader and a streaming writer for GGUF version 3.

Written from the published format: a little-endian header (magic, version, tensor count,
metadata count), typed metadata key/values, a tensor directory (name, dims innermost-first,
GGML type, offset into the data section), then the aligned data section. The reader checks every
length, type and offset against the file before anything trusts it, so a damaged file surfaces as
an ArtifactError naming what is wrong, never as an IndexError or a garbage tensor.

This module knows the container only; what a Kipp artifact must contain is `kipp.formats.artifact`.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, BinaryIO, Iterable

import numpy as np

from kipp.errors import ArtifactError, QuantError
from kipp.formats.quant import ggml_type_bytes
from kipp.formats.string_table import StringTable, bad_utf8

MAGIC = b"GGUF"
VERSION = 3
DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4
_MAX_STRING = 1 << 26  # a single metadata string (the chat template is ~10 KB)
_MAX_ARRAY = 1 << 24  # elements in one metadata array (the vocabulary is 151,936)
_MAX_COUNT = 1 << 20  # tensors or metadata keys


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR_FORMATS = {
    ValueType.UINT8: "<B", ValueType.INT8: "<b", ValueType.UINT16: "<H", ValueType.INT16: "<h",
    ValueType.UINT32: "<I", ValueType.INT32: "<i", ValueType.FLOAT32: "<f", ValueType.BOOL: "<?",
    ValueType.UINT64: "<Q", ValueType.INT64: "<q", ValueType.FLOAT64: "<d",
}
_ARRAY_DTYPES = {
    ValueType.UINT8: "<u1", ValueType.INT8: "<i1", ValueType.UINT16: "<u2", ValueType.INT16: "<i2",
    ValueType.UINT32: "<u4", ValueType.INT32: "<i4", ValueType.FLOAT32: "<f4",
    ValueType.UINT64: "<u8", ValueType.INT64: "<i8", ValueType.FLOAT64: "<f8",
}


@dataclass(frozen=True)
class Value:
    """A metadata value with its GGUF type (element type too, for arrays)."""

    value: Any
    type: ValueType
    element_type: ValueType | None = None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor directory entry. `shape` is numpy order (outermost first): dims reversed."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # relative to the start of the data section
    nbytes: int


@dataclass
class GGUFFile:
    """A parsed, bounds-checked GGUF file over one read-only memory map."""

    path: Path
    version: int
    alignment: int
    metadata: dict[str, Value]
    tensors: dict[str, TensorInfo]
    data_offset: int
    mapping: np.memmap  # the whole file, uint8

    def value(self, key: str) -> Any:
        return self.metadata[key].value

    def tensor_bytes(self, name: str) -> np.ndarray:
        """Zero-copy uint8 view of a tensor's data."""
        info = self.tensors[name]
        start = self.data_offset + info.offset
        return self.mapping[start:start + info.nbytes]

    def release(self, start: int = 0, stop: int | None = None) -> None:
        """Drop the mapped pages over bytes start..stop (the whole file by default) from the
        process's resident set (best effort). The pages stay in the OS page cache and the
        mapping stays valid: a later read faults them back in. The first page may be shared
        with bytes before `start`: dropping it is harmless, a read-only mapping reads it back
        unchanged. A no-op where madvise is missing."""
        mapping = getattr(self.mapping, "_mmap", None)
        if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        first = max(start, 0) // mmap.PAGESIZE * mmap.PAGESIZE  # madvise takes whole pages
        stop = len(mapping) if stop is None else min(len(mapping), stop)
        if stop > first:
            mapping.madvise(mmap.MADV_DONTNEED, first, stop - first)


class _Cursor:
    """Reads little-endian fields from a buffer, turning every overrun into an ArtifactError."""

    def __init__(self, path: Path, buffer: memoryview):
        self.path = path
        self.buffer = buffer
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buffer):
            raise ArtifactError(self.path, what,
                                f"file is truncated: needs bytes {self.pos}..{end}, "
                                f"file has {len(self.buffer)}")
        chunk = self.buffer[self.pos:end]
        self.pos = end
        return chunk

    def scalar(self, vtype: ValueType, what: str):
        fmt = _SCALAR_FORMATS[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(ValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(ValueType.UINT64, what)

    def string(self, what: str) -> str:
        length = self.u64(what)
        if length > _MAX_STRING:
            raise ArtifactError(self.path, what, f"string length {length} is implausible")
        raw = self.take(length, what)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ArtifactError(self.path, what,
                                f"string is not valid UTF-8 ({e.reason})") from None


def _value_type(cur: _Cursor, raw: int, what: str) -> ValueType:
    try:
        return ValueType(raw)
    except ValueError:
        raise ArtifactError(cur.path, what, f"unknown metadata value type {raw}") from None


def _read_value(cur: _Cursor, vtype: ValueType, key: str) -> Value:
    if vtype == ValueType.STRING:
        return Value(cur.string(key), vtype)
    if vtype != ValueType.ARRAY:
        return Value(cur.scalar(vtype, key), vtype)
    element_type = _value_type(cur, cur.u32(key), key)
    count = cur.u64(key)
    if count > _MAX_ARRAY:
        raise ArtifactError(cur.path, key, f"array length {count} is implausible")
    if element_type == ValueType.ARRAY:
        raise ArtifactError(cur.path, key, "nested arrays are outside Kipp's GGUF subset")
    if element_type == ValueType.STRING:
        items = _string_array(cur, count, key)
    elif element_type == ValueType.BOOL:
        items = tuple(bool(b) for b in bytes(cur.take(count, key)))
    else:  # a tuple, which a reader that wants one (the token types) takes without a copy
        dtype = np.dtype(_ARRAY_DTYPES[element_type])
        items = tuple(np.frombuffer(cur.take(count * dtype.itemsize, key), dtype=dtype).tolist())
    return Value(items, vtype, element_type)


def _string_array(cur: _Cursor, count: int, key: str) -> StringTable:
    """`count` length-prefixed strings, kept as one blob (StringTable); the vocabulary makes
    this the loader's hot loop, so the loop only walks the lengths and numpy cuts them out."""
    buffer, first, pos, size = cur.buffer, cur.pos, cur.pos, len(cur.buffer)
    length_at = struct.Struct("<Q").unpack_from
    stops = []  # where each string ends in the buffer
    try:
        for _ in range(count):
            (length,) = length_at(buffer, pos)
            pos += 8 + length
            if pos > size:
                break
            stops.append(pos)
    except struct.error:
        pass
    if len(stops) != count:
        raise ArtifactError(cur.path, f"{key}[{len(stops)}]",
                            f"file is truncated inside a {count}-string array")
    stops = np.asarray(stops, np.int64) - first
    keep = np.ones(pos - first, bool)
    prefixes = np.concatenate(([0], stops[:-1])) if count else stops
    keep[(prefixes[:, None] + np.arange(8)).reshape(-1)] = False
    blob = np.frombuffer(buffer[first:pos], np.uint8)[keep].tobytes()
    ends = stops - 8 * np.arange(1, count + 1)
    bad = bad_utf8(blob, ends)
    if bad is not None:
        raise ArtifactError(cur.path, f"{key}[{bad[0]}]",
                            f"string is not valid UTF-8 ({bad[1]})")
    cur.pos = pos
    return StringTable(blob, ends)


def _read_tensor_info(cur: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    what = f"tensor directory entry {index}"
    name = cur.string(what)
    what = f"tensor {name}"
    n_dims = cur.u32(what)
    if not 1 <= n_dims <= _MAX_DIMS:
        raise ArtifactError(cur.path, what, f"has {n_dims} dimensions, expected 1..{_MAX_DIMS}")
    dims = [cur.u64(what) for _ in range(n_dims)]
    if any(d == 0 or d > 1 << 40 for d in dims):
        raise ArtifactError(cur.path, what, f"has implausible dimensions {dims}")
    ggml_type = cur.u32(what)
    offset = cur.u64(what)
    return name, tuple(reversed(dims)), ggml_type, offset


def read(path) -> GGUFFile:
    """Map `path` read-only and parse it; every structural problem is an ArtifactError."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ArtifactError(path, "file", f"cannot be opened ({e.strerror})") from None
    if size < 24:
        raise ArtifactError(path, "header", f"file is truncated: {size} bytes")
    mapping = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(path, memoryview(mapping))
    magic = bytes(cur.take(4, "magic"))
    if magic != MAGIC:
        raise ArtifactError(path, "magic", f"expected {MAGIC!r}, found {magic!r}: not a GGUF file")
    version = cur.u32("version")
    if version != VERSION:
        raise ArtifactError(path, "version", f"GGUF version {version} is unsupported (Kipp "
                                             f"reads version {VERSION})")
    tensor_count = cur.u64("tensor count")
    kv_count = cur.u64("metadata count")
    for what, count in (("tensor count", tensor_count), ("metadata count", kv_count)):
        if count > _MAX_COUNT:
            raise ArtifactError(path, what, f"{count} is implausible")
    metadata = _read_metadata(cur, kv_count)
    alignment = _alignment(path, metadata)
    entries = [_read_tensor_info(cur, i) for i in range(tensor_count)]
    data_offset = _align(cur.pos, alignment)
    tensors = _tensor_directory(path, entries, alignment, size - data_offset)
    file = GGUFFile(path, version, alignment, metadata, tensors, data_offset, mapping)
    file.release(0, data_offset)  # the header lives on as parsed objects (5.7 MiB for Qwen3's)
    return file


def _read_metadata(cur: _Cursor, count: int) -> dict[str, Value]:
    metadata: dict[str, Value] = {}
    for i in range(count):
        key = cur.string(f"metadata key {i}")
        if key in metadata:
            raise ArtifactError(cur.path, key, "metadata key appears twice")
        vtype = _value_type(cur, cur.u32(key), key)
        metadata[key] = _read_value(cur, vtype, key)
    return metadata


def _alignment(path: Path, metadata: dict[str, Value]) -> int:
    entry = metadata.get("general.alignment")
    if entry is None:
        return DEFAULT_ALIGNMENT
    if entry.type != ValueType.UINT32 or entry.value == 0 or entry.value & (entry.value - 1):
        raise ArtifactError(path, "general.alignment",
                            f"must be a power-of-two uint32, found {entry.value!r}")
    return entry.value


def _tensor_directory(path, entries, alignment, data_size) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for name, shape, ggml_type, offset in entries:
        what = f"tensor {name}"
        if name in tensors:
            raise ArtifactError(path, what, "appears twice in the tensor directory")
        try:
            nbytes = tensor_nbytes(ggml_type, shape)
        except QuantError as e:
            raise ArtifactError(path, what, str(e)) from None
        if offset % alignment:
            raise ArtifactError(path, what, f"offset {offset} is not aligned to {alignment}")
        if offset + nbytes > data_size:
            raise ArtifactError(path, what, f"data {offset}..{offset + nbytes} runs past the end "
                                            f"of the data section ({data_size} bytes)")
        tensors[name] = TensorInfo(name, shape, ggml_type, offset, nbytes)
    _check_no_overlap(path, tensors.values())
    return tensors


def _check_no_overlap(path, infos: Iterable[TensorInfo]) -> None:
    previous = None
    for info in sorted(infos, key=lambda t: t.offset):
        if previous and info.offset < previous.offset + previous.nbytes:
            raise ArtifactError(path, f"tensor {info.name}",
                                f"data overlaps tensor {previous.name}")
        previous = info


def tensor_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor: rows of its innermost dimension, each a whole number of blocks."""
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    return rows * ggml_type_bytes(ggml_type, shape[-1])


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class Writer:
    """Streams a GGUF file: declare metadata and tensors, then write each tensor's bytes in order.

        w = Writer(path)
        w.add("general.architecture", "qwen3", ValueType.STRING)
        w.add_tensor("token_embd.weight", (vocab, hidden), ggml_type)
        with w:                       # writes the header, then expects data in declared order
            w.write_data("token_embd.weight", chunk)   # any number of chunks per tensor
    The file is written to a temporary name and renamed into place only when complete.
    """

    def __init__(self, path, alignment: int = DEFAULT_ALIGNMENT):
        self.path = Path(path)
        self.alignment = alignment
        self.metadata: list[tuple[str, Value]] = []
        self.tensors: list[TensorInfo] = []
        self._file: BinaryIO | None = None
        self._written: dict[str, int] = {}
        self._complete = False
        self._temp = self.path.with_name(self.path.name + ".partial")

    def add(self, key: str, value: Any, vtype: ValueType,
            element_type: ValueType | None = None) -> None:
        if vtype == ValueType.ARRAY and element_type is None:
            raise ValueError(f"{key}: arrays need an element type")
        self.metadata.append((key, Value(value, vtype, element_type)))

    def add_tensor(self, name: str, shape: tuple[int, ...], ggml_type: int) -> None:
        offset = 0
        if self.tensors:
            last = self.tensors[-1]
            offset = _align(last.offset + last.nbytes, self.alignment)
        nbytes = tensor_nbytes(ggml_type, shape)
        self.tensors.append(TensorInfo(name, tuple(shape), ggml_type, offset, nbytes))

    def __enter__(self) -> "Writer":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self._temp, "wb")
        header = self._header()
        self._file.write(header)
        self._file.write(b"\0" * (_align(len(header), self.alignment) - len(header)))
        self._data_start = self._file.tell()
        return self

    def write_data(self, name: str, data) -> None:
        """Append bytes of tensor `name`; tensors must be written in declared order."""
        index = len(self._written) - (1 if name in self._written else 0)
        info = self.tensors[index] if index < len(self.tensors) else None
        if info is None or info.name != name:
            raise ValueError(f"tensor {name} written out of declared order")
        if name not in self._written:
            self._pad_to(self._data_start + info.offset)
            self._written[name] = 0
        raw = memoryview(np.ascontiguousarray(data)).cast("B")
        self._written[name] += len(raw)
        if self._written[name] > info.nbytes:
            raise ValueError(f"tensor {name}: {self._written[name]} bytes written, "
                             f"declared {info.nbytes}")
        self._file.write(raw)

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._check_complete()
        finally:
            self._file.close()
            if exc_type is None and self._complete:
                os.replace(self._temp, self.path)
            else:
                self._temp.unlink(missing_ok=True)

    def _check_complete(self) -> None:
        self._complete = False
        for info in self.tensors:
            if self._written.get(info.name) != info.nbytes:
                raise ValueError(f"tensor {info.name}: {self._written.get(info.name, 0)} bytes "
                                 f"written, declared {info.nbytes}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._complete = True

    def _pad_to(self, position: int) -> None:
        gap = position - self._file.tell()
        if gap < 0:
            raise ValueError("tensor data overran its declared size")
        self._file.write(b"\0" * gap)

    def _header(self) -> bytes:
        out = bytearray(MAGIC)
        out += struct.pack("<IQQ", VERSION, len(self.tensors), len(self.metadata))
        for key, value in self.metadata:
            out += _pack_string(key) + struct.pack("<I", value.type) + _pack_value(value)
        for info in self.tensors:
            dims = tuple(reversed(info.shape))
            out += _pack_string(info.name) + struct.pack("<I", len(dims))
            out += struct.pack(f"<{len(dims)}Q", *dims)
            out += struct.pack("<IQ", info.ggml_type, info.offset)
        return bytes(out)


def _pack_string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _pack_value(value: Value) -> bytes:
    if value.type == ValueType.STRING:
        return _pack_string(value.value)
    if value.type != ValueType.ARRAY:
        return struct.pack(_SCALAR_FORMATS[value.type], value.value)
    items = value.value
    head = struct.pack("<IQ", value.element_type, len(items))
    if value.element_type == ValueType.STRING:
        return head + b"".join(_pack_string(s) for s in items)
    if value.element_type == ValueType.BOOL:
        return head + bytes(bool(b) for b in items)
    return head + np.asarray(items, dtype=_ARRAY_DTYPES[value.element_type]).tobytes()
