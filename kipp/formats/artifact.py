"""The Kipp artifact: what a checkpoint's GGUF file must hold, and the strict loader.

One table (`expected_metadata`, `expected_tensors`) says what the converter writes and what the
loader demands, so the two cannot drift. The loader maps the file once, matches
(kipp.source.repository, kipp.source.revision) against the registry, requires every field to
equal the entry and binds an explicit `Weights` structure of zero-copy views. Anything else is an
ArtifactError naming the field, before any inference.

Names and keys follow llama.cpp's `qwen3` architecture so other GGUF readers can run the file;
norms are stored as F32 (lossless from BF16) because that is what those readers expect.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from kipp.errors import ArtifactError, FieldMismatch, RegistryError
from kipp.formats import gguf, registry
from kipp.formats.gguf import ValueType
from kipp.formats.quant import (
    GGML_BF16,
    GGML_F32,
    SCHEMES,
    SCHEMES_BY_GGML_TYPE,
    WeightScheme,
    dequantize,
)
from kipp.formats.registry import HEAD_DIM, KV_HEADS, RMS_NORM_EPS, VOCAB_SIZE, Checkpoint
from kipp.text.vocab import TokenizerData

FORMAT_VERSION = 1
ARCHITECTURE = "qwen3"
QUANTIZATION_VERSION = 2  # GGML's block-format revision for Q8_0/Q4_0/Q4_1

# Per-layer tensors: (Weights field, GGUF name suffix, Hugging Face name suffix, kind).
# kind "proj" is quantized by the scheme; "norm" is stored F32.
LAYER_TENSORS = (
    ("attn_norm", "attn_norm", "input_layernorm", "norm"),
    ("q", "attn_q", "self_attn.q_proj", "proj"),
    ("k", "attn_k", "self_attn.k_proj", "proj"),
    ("v", "attn_v", "self_attn.v_proj", "proj"),
    ("q_norm", "attn_q_norm", "self_attn.q_norm", "norm"),
    ("k_norm", "attn_k_norm", "self_attn.k_norm", "norm"),
    ("o", "attn_output", "self_attn.o_proj", "proj"),
    ("ffn_norm", "ffn_norm", "post_attention_layernorm", "norm"),
    ("gate", "ffn_gate", "mlp.gate_proj", "proj"),
    ("up", "ffn_up", "mlp.up_proj", "proj"),
    ("down", "ffn_down", "mlp.down_proj", "proj"),
)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a Kipp artifact holds, with where it comes from in the HF checkpoint."""

    name: str  # GGUF name
    source: str  # Hugging Face safetensors name
    shape: tuple[int, ...]  # numpy order: [out, in] for projections
    ggml_type: int
    kind: str  # "embed", "proj", "norm", "head"


def _layer_shapes(entry: Checkpoint) -> dict[str, tuple[int, ...]]:
    h, a, kv, f = entry.hidden, entry.attention_width, entry.kv_width, entry.intermediate
    return {
        "attn_norm": (h,), "q": (a, h), "k": (kv, h), "v": (kv, h),
        "q_norm": (HEAD_DIM,), "k_norm": (HEAD_DIM,), "o": (h, a), "ffn_norm": (h,),
        "gate": (f, h), "up": (f, h), "down": (h, f),
    }


def expected_tensors(entry: Checkpoint, scheme: WeightScheme) -> list[TensorSpec]:
    """Every tensor of the artifact, in file order."""
    kind_type = {"proj": scheme.ggml_type, "norm": GGML_F32}
    shapes = _layer_shapes(entry)
    specs = [TensorSpec("token_embd.weight", "model.embed_tokens.weight",
                        (VOCAB_SIZE, entry.hidden), GGML_BF16, "embed")]
    for i in range(entry.layers):
        for field, gguf_suffix, hf_suffix, kind in LAYER_TENSORS:
            specs.append(TensorSpec(f"blk.{i}.{gguf_suffix}.weight",
                                    f"model.layers.{i}.{hf_suffix}.weight",
                                    shapes[field], kind_type[kind], kind))
    specs.append(TensorSpec("output_norm.weight", "model.norm.weight", (entry.hidden,),
                            GGML_F32, "norm"))
    if not entry.tied:
        specs.append(TensorSpec("output.weight", "lm_head.weight", (VOCAB_SIZE, entry.hidden),
                                GGML_BF16, "head"))
    return specs


def expected_metadata(entry: Checkpoint, scheme: WeightScheme) -> list[tuple]:
    """(key, value, type) of every model metadata field; the loader requires each to be equal."""
    u32, f32, s = ValueType.UINT32, ValueType.FLOAT32, ValueType.STRING
    a = ARCHITECTURE
    return [
        ("general.architecture", a, s),
        ("general.name", entry.id, s),
        ("general.file_type", scheme.file_type, u32),
        ("general.quantization_version", QUANTIZATION_VERSION, u32),
        ("general.alignment", gguf.DEFAULT_ALIGNMENT, u32),
        (f"{a}.context_length", entry.context_length, u32),
        (f"{a}.embedding_length", entry.hidden, u32),
        (f"{a}.feed_forward_length", entry.intermediate, u32),
        (f"{a}.block_count", entry.layers, u32),
        (f"{a}.attention.head_count", entry.query_heads, u32),
        (f"{a}.attention.head_count_kv", KV_HEADS, u32),
        (f"{a}.attention.key_length", HEAD_DIM, u32),
        (f"{a}.attention.value_length", HEAD_DIM, u32),
        (f"{a}.rope.freq_base", float(np.float32(entry.rope_theta)), f32),
        (f"{a}.attention.layer_norm_rms_epsilon", float(np.float32(RMS_NORM_EPS)), f32),
        ("kipp.format_version", FORMAT_VERSION, u32),
        ("kipp.source.repository", entry.id, s),
        ("kipp.source.revision", entry.revision, s),
        ("kipp.quant.scheme", scheme.name, s),
        ("kipp.variant", entry.variant, s),
        ("tokenizer.ggml.eos_token_id", entry.eos_token_id, u32),
    ]


_TOKENIZER_CONSTANTS = (
    ("tokenizer.ggml.model", "gpt2", ValueType.STRING),
    ("tokenizer.ggml.pre", "qwen2", ValueType.STRING),
    ("tokenizer.ggml.padding_token_id", registry.ENDOFTEXT_ID, ValueType.UINT32),
    ("tokenizer.ggml.bos_token_id", registry.ENDOFTEXT_ID, ValueType.UINT32),
    ("tokenizer.ggml.add_bos_token", False, ValueType.BOOL),
)
_TOKENIZER_ARRAYS = (
    ("tokenizer.ggml.tokens", "tokens", ValueType.STRING),
    ("tokenizer.ggml.token_type", "token_types", ValueType.INT32),
    ("tokenizer.ggml.merges", "merges", ValueType.STRING),
)


def tokenizer_metadata(data) -> list[tuple]:
    """(key, value, type[, element type]) of the tokenizer fields, from a TokenizerData."""
    fields = list(_TOKENIZER_CONSTANTS)
    for key, attribute, element in _TOKENIZER_ARRAYS:
        fields.append((key, list(getattr(data, attribute)), ValueType.ARRAY, element))
    if data.chat_template is not None:
        fields.append(("tokenizer.chat_template", data.chat_template, ValueType.STRING))
    return fields


@dataclass(frozen=True)
class Tensor:
    """A validated tensor: a zero-copy uint8 view into the mapped file plus its format."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    raw: np.ndarray  # uint8, exactly the tensor's bytes

    def bf16(self) -> np.ndarray:
        """The BF16 tensor as an ml_dtypes.bfloat16 array view (no copy)."""
        if self.ggml_type != GGML_BF16:
            raise TypeError(f"{self.name} is GGML type {self.ggml_type}, not BF16")
        return self.raw.view(ml_dtypes.bfloat16).reshape(self.shape)

    def f32(self) -> np.ndarray:
        """The tensor in float32: a view for F32, a conversion for BF16, the dequantizer else."""
        if self.ggml_type == GGML_F32:
            return self.raw.view("<f4").reshape(self.shape)
        if self.ggml_type == GGML_BF16:
            return self.bf16().astype(np.float32)
        return self.dequantize_rows(0, self.shape[0])

    def quantized_rows(self, start: int, stop: int) -> np.ndarray:
        """uint8 [stop - start, row_bytes] view of rows of a 2-D tensor."""
        row_bytes = self.raw.size // self.shape[0]
        return self.raw.reshape(self.shape[0], row_bytes)[start:stop]

    def dequantize_rows(self, start: int, stop: int) -> np.ndarray:
        scheme = SCHEMES_BY_GGML_TYPE[self.ggml_type]
        return dequantize(self.quantized_rows(start, stop), scheme, self.shape[1])



@dataclass(frozen=True)
class LayerWeights:
    attn_norm: Tensor  # [hidden] F32
    q: Tensor  # [query_heads * 128, hidden]
    k: Tensor  # [8 * 128, hidden]
    v: Tensor  # [8 * 128, hidden]
    q_norm: Tensor  # [128] F32
    k_norm: Tensor  # [128] F32
    o: Tensor  # [hidden, query_heads * 128]
    ffn_norm: Tensor  # [hidden] F32
    gate: Tensor  # [intermediate, hidden]
    up: Tensor  # [intermediate, hidden]
    down: Tensor  # [hidden, intermediate]


@dataclass(frozen=True)
class Weights:
    token_embd: Tensor  # [vocab, hidden] BF16
    layers: tuple[LayerWeights, ...]
    output_norm: Tensor  # [hidden] F32
    output: Tensor  # [vocab, hidden] BF16; the embedding itself when tied
    tied: bool


@dataclass
class Artifact:
    """A validated Kipp artifact: its registry entry, scheme, weights and raw GGUF file."""

    path: Path
    entry: Checkpoint
    scheme: WeightScheme
    weights: Weights
    file: gguf.GGUFFile

    def tokenizer_data(self):
        return _tokenizer_data(self.file)

    def release(self, *tensors: Tensor) -> None:
        """Drop these tensors' mapped pages from the process's resident set (best effort).

        A backend that copies weights into its own layout calls this after each copy, so the
        file's pages and the copies are never resident together (peak RSS: the copies, not
        twice the artifact). The pages stay in the OS page cache and the mapping stays valid: a
        later read faults them back in. A no-op where madvise is missing."""
        for t in tensors:
            self.release_view(t.raw)

    def release_view(self, view: np.ndarray) -> None:
        """`release` for part of a tensor: the pages under `view`, a contiguous array viewing
        the mapping (rows a backend has just copied). A no-op for any other array (a copy)."""
        start = view.ctypes.data - self.file.mapping.ctypes.data
        if start < 0 or start >= self.file.mapping.size or not view.flags.c_contiguous:
            return
        self.file.release(start, start + view.nbytes)

    def release_file(self) -> None:
        """`release` for the whole file, for a backend that has copied every tensor."""
        self.file.release()


def open_artifact(path) -> Artifact:
    """Map and validate a Kipp GGUF artifact; raise ArtifactError naming the first problem."""
    file = gguf.read(path)
    entry = _match_registry(file)
    scheme = _scheme(file)
    _check_metadata(file, expected_metadata(entry, scheme))
    _check_tokenizer(file, entry)
    specs = expected_tensors(entry, scheme)
    _check_tensor_set(file, specs)
    tensors = {spec.name: _bind(file, spec) for spec in specs}
    return Artifact(file.path, entry, scheme, _weights(entry, tensors), file)


def with_head_rows(artifact: Artifact, rows: int) -> Artifact:
    """`artifact` with an output head of only the first `rows` vocabulary rows (the embedding
    keeps them all): a backend opened on it gives logits for ids below `rows`. A view of the
    same mapping, nothing copied. For a draft model (kipp.engine.draft): its head over the whole
    vocabulary is most of what a small draft's eval reads."""
    w = artifact.weights
    vocab = w.output.shape[0]
    if not 0 < rows <= vocab:
        raise ArtifactError(f"head rows {rows} is outside 1..{vocab}")
    raw = w.output.quantized_rows(0, rows).reshape(-1)
    head = Tensor(w.output.name, (rows,) + w.output.shape[1:], w.output.ggml_type, raw)
    return dataclasses.replace(artifact, weights=dataclasses.replace(w, output=head, tied=False))


def read_tokenizer_data(path):
    """The tokenizer data of a validated artifact (`Tokenizer(read_tokenizer_data(path))`)."""
    return open_artifact(path).tokenizer_data()


def _require(file: gguf.GGUFFile, key: str, vtype: ValueType,
             element_type: ValueType | None = None):
    value = file.metadata.get(key)
    if value is None:
        raise ArtifactError(file.path, key, "required metadata field is missing")
    if value.type != vtype or value.element_type != element_type:
        found = value.type.name + (f"[{value.element_type.name}]" if value.element_type else "")
        wanted = vtype.name + (f"[{element_type.name}]" if element_type else "")
        raise FieldMismatch(file.path, key, f"type {wanted}", f"type {found}")
    return value.value


def _match_registry(file: gguf.GGUFFile) -> Checkpoint:
    repository = _require(file, "kipp.source.repository", ValueType.STRING)
    revision = _require(file, "kipp.source.revision", ValueType.STRING)
    try:
        entry = registry.get(repository)
    except RegistryError:
        raise ArtifactError(file.path, "kipp.source.repository",
                            f"{repository!r} is not a checkpoint in Kipp's registry") from None
    if entry.revision != revision:
        raise FieldMismatch(file.path, "kipp.source.revision", entry.revision, revision)
    return entry


def _scheme(file: gguf.GGUFFile) -> WeightScheme:
    name = _require(file, "kipp.quant.scheme", ValueType.STRING)
    if name not in SCHEMES:
        raise ArtifactError(file.path, "kipp.quant.scheme",
                            f"unknown scheme {name!r}; Kipp has {', '.join(SCHEMES)}")
    return SCHEMES[name]


def _check_metadata(file: gguf.GGUFFile, fields) -> None:
    for key, expected, vtype in fields:
        found = _require(file, key, vtype)
        if found != expected:
            raise FieldMismatch(file.path, key, expected, found)


def _check_tokenizer(file: gguf.GGUFFile, entry: Checkpoint) -> None:
    _check_metadata(file, _TOKENIZER_CONSTANTS)
    for key, _, element in _TOKENIZER_ARRAYS:
        found = _require(file, key, ValueType.ARRAY, element)
        if key == "tokenizer.ggml.merges":
            if not found:
                raise ArtifactError(file.path, key, "is empty")
        elif len(found) != VOCAB_SIZE:
            raise FieldMismatch(file.path, f"{key} length", VOCAB_SIZE, len(found))
    if entry.has_chat_template:
        _require(file, "tokenizer.chat_template", ValueType.STRING)
    elif "tokenizer.chat_template" in file.metadata:
        raise ArtifactError(file.path, "tokenizer.chat_template",
                            f"{entry.id} is a base checkpoint and has no chat template")


def _check_tensor_set(file: gguf.GGUFFile, specs: list[TensorSpec]) -> None:
    wanted = {spec.name for spec in specs}
    for name in file.tensors:
        if name not in wanted:
            raise ArtifactError(file.path, f"tensor {name}", "is not part of a Kipp artifact")
    for spec in specs:
        if spec.name not in file.tensors:
            raise ArtifactError(file.path, f"tensor {spec.name}", "is missing")


def _bind(file: gguf.GGUFFile, spec: TensorSpec) -> Tensor:
    info = file.tensors[spec.name]
    if info.shape != spec.shape:
        raise FieldMismatch(file.path, f"tensor {spec.name} shape", spec.shape, info.shape)
    if info.ggml_type != spec.ggml_type:
        raise FieldMismatch(file.path, f"tensor {spec.name} type", spec.ggml_type, info.ggml_type)
    return Tensor(spec.name, spec.shape, spec.ggml_type, file.tensor_bytes(spec.name))


def _weights(entry: Checkpoint, tensors: dict[str, Tensor]) -> Weights:
    layers = tuple(
        LayerWeights(**{field: tensors[f"blk.{i}.{suffix}.weight"]
                        for field, suffix, _, _ in LAYER_TENSORS})
        for i in range(entry.layers)
    )
    embed = tensors["token_embd.weight"]
    output = embed if entry.tied else tensors["output.weight"]
    return Weights(embed, layers, tensors["output_norm.weight"], output, entry.tied)


def _tokenizer_data(file: gguf.GGUFFile) -> TokenizerData:
    template = file.metadata.get("tokenizer.chat_template")
    return TokenizerData(
        tokens=file.value("tokenizer.ggml.tokens"),
        token_types=tuple(file.value("tokenizer.ggml.token_type")),
        merges=file.value("tokenizer.ggml.merges"),
        eos_token_id=file.value("tokenizer.ggml.eos_token_id"),
        chat_template=template.value if template else None,
    )
