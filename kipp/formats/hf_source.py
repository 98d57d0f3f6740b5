"""The tensors of a Hugging Face checkpoint folder, read through safetensors' memory maps."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 for safetensors' numpy reader)
import numpy as np
from safetensors import safe_open

from kipp.errors import ConvertError

INDEX_FILE = "model.safetensors.index.json"  # a sharded folder: tensor name -> shard file
SINGLE_WEIGHTS_FILE = "model.safetensors"


class HfSource:
    """A checkpoint folder's tensors, in one file or in shards that INDEX_FILE maps them to;
    every file stays open (mapped, nothing read) until the `with` block ends.

        with HfSource(folder) as source:
            rows = source.rows("model.embed_tokens.weight", 0, 8)  # BF16 [8, hidden]
    """

    def __init__(self, folder):
        self.folder = Path(folder)
        self._stack = contextlib.ExitStack()
        self._handles = {}
        try:
            for file in self._files():
                self._open(file)
        except BaseException:
            self._stack.close()
            raise

    def _files(self) -> list[str]:
        index = self.folder / INDEX_FILE
        if index.is_file():
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if (self.folder / SINGLE_WEIGHTS_FILE).is_file():
            return [SINGLE_WEIGHTS_FILE]
        raise ConvertError(f"{self.folder}: no {SINGLE_WEIGHTS_FILE} or {INDEX_FILE}")

    def _open(self, file: str) -> None:
        path = self.folder / file
        if not path.is_file():
            raise ConvertError(f"{self.folder}: weights file {file} is missing")
        handle = self._stack.enter_context(safe_open(str(path), framework="np"))
        for name in handle.keys():
            if name in self._handles:
                raise ConvertError(f"{self.folder}: tensor {name} appears in two files")
            self._handles[name] = handle

    def __enter__(self) -> HfSource:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        """Every tensor name the folder holds."""
        return list(self._handles)

    def __contains__(self, name: str) -> bool:
        return name in self._handles

    def _handle(self, name: str):
        if name not in self._handles:
            raise ConvertError(f"{self.folder}: tensor {name} is missing")
        return self._handles[name]

    def _slice(self, name: str):
        return self._handle(name).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it ("BF16", "F32", ...)."""
        return self._slice(name).get_dtype()

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of tensor `name`, as stored (BF16 stays ml_dtypes.bfloat16)."""
        return self._slice(name)[start:stop]

    def tensor(self, name: str) -> np.ndarray:
        """The whole tensor `name`, as stored."""
        return self._handle(name).get_tensor(name)
