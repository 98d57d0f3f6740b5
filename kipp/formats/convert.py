"""Convert a BF16 Hugging Face checkpoint folder into one Kipp GGUF artifact.

Tensors are read through safetensors' memory-mapped slices a block of rows at a time and streamed
into the file, so the converter never holds more than one chunk of the model in memory. Only the
seven per-layer projections are quantized; embedding and lm_head stay BF16 and norms become F32
(both exact). The file appears under its final name only once complete.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm.auto import tqdm  # a widget in Jupyter, a text bar on stderr elsewhere

from kipp.errors import ConvertError, QuantError
from kipp.formats import gguf, registry
from kipp.formats.artifact import (
    TensorSpec,
    expected_metadata,
    expected_tensors,
    tokenizer_metadata,
)
from kipp.formats.hf_source import HfSource
from kipp.formats.quant import WeightScheme, quantize
from kipp.formats.quant import scheme as get_scheme

_CHUNK_BYTES = 64 << 20  # float32 bytes of source rows converted at once


def convert(checkpoint_id: str, source, scheme_name: str, out, progress: bool = True,
            merge_lora=None) -> Path:
    """Write the `scheme_name` artifact of `checkpoint_id` from the HF folder `source` to `out`.
    `merge_lora`: a LoRA adapter folder (kipp.lora.adapter) trained on the checkpoint, merged
    into the projections (W + s B A in float32, rounded to BF16 as the source is, then the
    scheme's encoding) and recorded in the metadata (kipp.lora.*)."""
    entry = registry.get(checkpoint_id)
    scheme = get_scheme(scheme_name)
    source, out = Path(source), Path(out)
    adapter = None
    if merge_lora is not None:
        from kipp.lora.adapter import load_adapter

        adapter = load_adapter(merge_lora, entry)  # refused before anything is written
    _check_config(entry, source)
    specs = expected_tensors(entry, scheme)
    writer = gguf.Writer(out)
    for field in expected_metadata(entry, scheme) + tokenizer_metadata(_tokenizer(entry, source)):
        writer.add(*field)
    for field in _lora_metadata(adapter):
        writer.add(*field)
    for spec in specs:
        writer.add_tensor(spec.name, spec.shape, spec.ggml_type)
    with contextlib.ExitStack() as stack:
        src = stack.enter_context(HfSource(source))
        _check_tensor_set(entry, src, specs)
        total = sum(info.nbytes for info in writer.tensors)
        bar = stack.enter_context(tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                                       desc=f"{entry.id} {scheme.name}"))
        with writer:
            for spec in specs:
                for chunk in _converted_chunks(src, spec, scheme, adapter):
                    writer.write_data(spec.name, chunk)
                    bar.update(chunk.nbytes)
    return out


def _check_config(entry: registry.Checkpoint, source: Path) -> None:
    config_path = source / "config.json"
    if not config_path.is_file():
        raise ConvertError(f"{source}: config.json is missing; is this a Hugging Face folder?")
    mismatches = registry.config_mismatches(entry, json.loads(config_path.read_text()))
    if mismatches:
        detail = "; ".join(f"{k}: expected {e!r}, found {f!r}" for k, e, f in mismatches)
        raise ConvertError(f"{source}/config.json does not match registry entry {entry.id}: "
                           f"{detail}")


def _tokenizer(entry: registry.Checkpoint, source: Path):
    from kipp.text.tokenizer import load_tokenizer_files

    paths = [source / "tokenizer.json", source / "tokenizer_config.json"]
    for path in paths:
        if not path.is_file():
            raise ConvertError(f"{source}: {path.name} is missing")
    data = load_tokenizer_files(*paths)
    if data.eos_token_id != entry.eos_token_id:
        raise ConvertError(f"{source}/tokenizer_config.json: eos token {data.eos_token_id} is not "
                           f"{entry.eos_token_id}, the {entry.variant} eos of {entry.id}")
    if (data.chat_template is not None) != entry.has_chat_template:
        state = "has" if data.chat_template is not None else "lacks"
        raise ConvertError(f"{source}/tokenizer_config.json {state} a chat template, but "
                           f"{entry.id} is a {entry.variant} checkpoint")
    return data


def _check_tensor_set(entry: registry.Checkpoint, src: HfSource, specs: list[TensorSpec]) -> None:
    for spec in specs:
        shape, dtype = src.shape(spec.source), src.dtype(spec.source)
        if shape != spec.shape or dtype != "BF16":
            raise ConvertError(f"{src.folder}: tensor {spec.source} is {dtype}{list(shape)}, "
                               f"expected BF16{list(spec.shape)}")
    expected = {spec.source for spec in specs}
    for name in src.names():
        if name in expected:
            continue
        if name == "lm_head.weight" and entry.tied:
            _check_tied_head(src)
            continue
        raise ConvertError(f"{src.folder}: unexpected tensor {name} for {entry.id}")


def _check_tied_head(src: HfSource) -> None:
    """Some tied checkpoints also store lm_head.weight; accept it only as the embedding's copy."""
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    rows, width = src.shape(embed)
    step = max(1, _CHUNK_BYTES // 4 // width)
    for start in range(0, rows, step):
        a, b = src.rows(embed, start, start + step), src.rows(head, start, start + step)
        if a.shape != b.shape or a.view(np.uint16).tobytes() != b.view(np.uint16).tobytes():
            raise ConvertError(f"{src.folder}: the checkpoint is tied but lm_head.weight differs "
                               f"from model.embed_tokens.weight")


def _lora_metadata(adapter) -> list[tuple]:
    """What a merged artifact records of its adapter (nothing without one)."""
    if adapter is None:
        return []
    s, f32, u32 = gguf.ValueType.STRING, gguf.ValueType.FLOAT32, gguf.ValueType.UINT32
    return [("kipp.lora.merged", adapter.name, s), ("kipp.lora.format", adapter.format, s),
            ("kipp.lora.digest", adapter.digest.hex(), s), ("kipp.lora.rank", adapter.rank, u32),
            ("kipp.lora.scale", float(np.float32(adapter.scale)), f32),
            ("kipp.lora.targets", ",".join(adapter.targets), s)]


_LAYER_PROJECTION = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)_proj\.weight")


def _merged(chunk: np.ndarray, name: str, start: int, adapter) -> np.ndarray:
    """BF16 source rows [start, start + n) of projection `name` with s B A added."""
    m = _LAYER_PROJECTION.fullmatch(name)
    pair = adapter.weights.get((int(m[1]), m[2])) if m else None
    if pair is None:
        return chunk
    a, b = pair
    delta = np.float32(adapter.scale) * (b[start:start + chunk.shape[0]] @ a)  # [n, in]
    return (chunk.astype(np.float32) + delta).astype(ml_dtypes.bfloat16)


def _converted_chunks(src: HfSource, spec: TensorSpec, scheme: WeightScheme, adapter=None):
    """Yield the artifact bytes of `spec`, a block of rows at a time."""
    rows = spec.shape[0]
    row_floats = int(np.prod(spec.shape[1:], dtype=np.int64)) or 1
    step = max(1, _CHUNK_BYTES // 4 // row_floats)
    for start in range(0, rows, step):
        chunk = src.rows(spec.source, start, min(rows, start + step))
        if chunk.dtype != ml_dtypes.bfloat16:
            raise ConvertError(f"{src.folder}: tensor {spec.source} is {chunk.dtype}, not BF16")
        if spec.kind == "norm":
            yield chunk.astype(np.float32)
        elif spec.kind == "proj":
            if adapter is not None:
                chunk = _merged(chunk, spec.source, start, adapter)
            try:
                yield quantize(chunk, scheme)
            except QuantError as e:
                raise ConvertError(f"{src.folder}: tensor {spec.source} rows from {start}: {e}")
        else:
            yield chunk.view(np.uint8)
