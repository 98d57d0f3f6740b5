"""The converter and the strict loader: interop with the `gguf` package, round trips, rejections."""

import json
import shutil
import struct

import gguf as gguf_pkg
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from kipp.cli import main as cli_main
from kipp.errors import ArtifactError, ConvertError, FieldMismatch, KippError
from kipp.formats import gguf, registry
from kipp.formats.artifact import expected_tensors, open_artifact
from kipp.formats.convert import convert
from kipp.formats.hf_source import INDEX_FILE, SINGLE_WEIGHTS_FILE, HfSource
from kipp.formats.quant import GGML_BF16, GGML_F32, SCHEMES, dequantize, quantize

TINY = "kipp-synthetic/qwen3-tiny"
UNTIED = "kipp-synthetic/qwen3-tiny-untied"


def _source_tensors(folder):
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="np") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


ALL_CASES = [(TINY, s) for s in SCHEMES] + [(UNTIED, "bf16"), (UNTIED, "scale4_gs32")]
# The gguf package parses the 300k-string vocabulary slowly (~13 s a file): one file per GGML
# tensor type and layout is enough to show interoperability, and the default suite reads one
# (the others are slow: CI's "artifacts, interpret mode" step).
INTEROP_CASES = [(TINY, "bf16")] + [pytest.param(*case, marks=pytest.mark.slow) for case in
                                    ((TINY, "q8_0"), (TINY, "affine4_gs32"),
                                     (UNTIED, "scale4_gs32"))]


@pytest.mark.parametrize("checkpoint_id,scheme", INTEROP_CASES)
def test_gguf_package_reads_kipp_files(artifacts, checkpoint_id, scheme):
    path = artifacts(checkpoint_id, scheme)
    entry = registry.get(checkpoint_id)
    reader = gguf_pkg.GGUFReader(path)
    seen = {t.name: t for t in reader.tensors}
    specs = expected_tensors(entry, SCHEMES[scheme])
    assert list(seen) == [spec.name for spec in specs]
    for spec in specs:
        tensor = seen[spec.name]
        assert tuple(int(d) for d in reversed(tensor.shape)) == spec.shape, spec.name
        assert int(tensor.tensor_type) == spec.ggml_type, spec.name
    field = reader.fields["qwen3.block_count"]
    assert int(field.parts[field.data[0]][0]) == entry.layers
    assert str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8") == "qwen3"


@pytest.mark.parametrize("checkpoint_id,scheme", ALL_CASES)
def test_round_trip_equals_source(artifacts, synthetic_dir, checkpoint_id, scheme):
    artifact = open_artifact(artifacts(checkpoint_id, scheme))
    source = _source_tensors(synthetic_dir(checkpoint_id))
    for spec in expected_tensors(artifact.entry, artifact.scheme):
        original = source[spec.source]
        loaded = artifact.file.tensor_bytes(spec.name)
        if spec.ggml_type == GGML_BF16:
            assert loaded.tobytes() == original.tobytes(), spec.name
        elif spec.ggml_type == GGML_F32:
            assert np.array_equal(loaded.view("<f4").reshape(spec.shape),
                                  original.astype(np.float32)), spec.name
        else:
            cols = spec.shape[1]
            expected = dequantize(quantize(original, artifact.scheme), artifact.scheme, cols)
            rows = loaded.reshape(spec.shape[0], -1)
            assert np.array_equal(dequantize(rows, artifact.scheme, cols), expected), spec.name


def test_weights_structure_binds_every_field(artifacts):
    tied = open_artifact(artifacts(TINY, "q8_0"))
    w = tied.weights
    assert len(w.layers) == tied.entry.layers
    assert w.tied and w.output is w.token_embd
    layer = w.layers[1]
    assert layer.q.shape == (tied.entry.attention_width, tied.entry.hidden)
    assert layer.o.shape == (tied.entry.hidden, tied.entry.attention_width)
    assert layer.q.ggml_type == SCHEMES["q8_0"].ggml_type
    assert layer.q_norm.f32().shape == (registry.HEAD_DIM,)
    assert w.token_embd.bf16().dtype == ml_dtypes.bfloat16
    # Zero-copy: the embedding view shares memory with the file mapping.
    assert np.shares_memory(w.token_embd.bf16(), tied.file.mapping)

    untied = open_artifact(artifacts(UNTIED, "bf16"))
    assert not untied.weights.tied
    assert untied.weights.output.name == "output.weight"
    assert untied.entry.attention_width != untied.entry.hidden


def test_tokenizer_data_survives_the_artifact(artifacts, synthetic_dir):
    from kipp.text.tokenizer import load_tokenizer_files

    folder = synthetic_dir(TINY)
    from_files = load_tokenizer_files(folder / "tokenizer.json", folder / "tokenizer_config.json")
    artifact = open_artifact(artifacts(TINY, "bf16"))
    from_gguf = artifact.tokenizer_data()
    assert from_gguf == from_files
    # the artifact's metadata and the tokenizer's data share their arrays, not copies of them
    assert from_gguf.tokens is artifact.file.value("tokenizer.ggml.tokens")
    assert from_gguf.merges is artifact.file.value("tokenizer.ggml.merges")
    assert from_gguf.token_types is artifact.file.value("tokenizer.ggml.token_type")


def test_tokenizer_from_gguf_encodes_like_from_files(artifacts, synthetic_dir):
    from kipp.formats.artifact import read_tokenizer_data
    from kipp.text.tokenizer import Tokenizer

    folder = synthetic_dir(TINY)
    a = Tokenizer.from_files(folder / "tokenizer.json", folder / "tokenizer_config.json")
    b = Tokenizer(read_tokenizer_data(artifacts(TINY, "q8_0")))
    text = "<|im_start|>user\nHéllo, 世界! <think>x</think> 12345<|im_end|>\n"
    assert a.encode(text) == b.encode(text)
    assert b.decode(b.encode(text)) == text


# ---- rejections ------------------------------------------------------------------------------


def _rewrite(src, dst, metadata=None, tensors=None):
    """Copy a GGUF file through Kipp's writer, letting a test edit metadata and tensors.

    metadata(list of [key, value, type, element_type]) and tensors(list of [name, shape, type,
    bytes]) edit the lists in place.
    """
    f = gguf.read(src)
    md = [[k, v.value, v.type, v.element_type] for k, v in f.metadata.items()]
    ts = [[t.name, t.shape, t.ggml_type, f.tensor_bytes(t.name)] for t in f.tensors.values()]
    if metadata:
        metadata(md)
    if tensors:
        tensors(ts)
    writer = gguf.Writer(dst)
    for key, value, vtype, element in md:
        writer.add(key, value, vtype, element)
    for name, shape, ggml_type, _ in ts:
        writer.add_tensor(name, shape, ggml_type)
    with writer:
        for name, _, _, data in ts:
            writer.write_data(name, data)
    return dst


def _set(key, value):
    def edit(md):
        for item in md:
            if item[0] == key:
                item[1] = value
    return edit


@pytest.fixture()
def tiny_bf16(artifacts):
    return artifacts(TINY, "bf16")


def _expect(path, field, exc=ArtifactError):
    with pytest.raises(exc) as info:
        open_artifact(path)
    assert info.value.field == field, str(info.value)
    return info.value


def test_rejects_bad_magic(tiny_bf16, tmp_path):
    bad = tmp_path / "bad.gguf"
    data = bytearray(tiny_bf16.read_bytes()[:4096])
    data[:4] = b"GGML"
    bad.write_bytes(bytes(data))
    assert "not a GGUF file" in str(_expect(bad, "magic"))


def test_rejects_unsupported_version(tiny_bf16, tmp_path):
    bad = tmp_path / "v2.gguf"
    data = bytearray(tiny_bf16.read_bytes()[:4096])
    struct.pack_into("<I", data, 4, 2)
    bad.write_bytes(bytes(data))
    assert "version 2" in str(_expect(bad, "version"))


@pytest.mark.parametrize("keep", [10, 4096, "header", "data"])
def test_rejects_truncated_file(tiny_bf16, tmp_path, keep):
    raw = tiny_bf16.read_bytes()
    data_offset = gguf.read(tiny_bf16).data_offset
    cut = {"header": data_offset - 100, "data": len(raw) - 1}.get(keep, keep)
    bad = tmp_path / "short.gguf"
    bad.write_bytes(raw[:cut])
    with pytest.raises(ArtifactError, match="truncated|runs past the end"):
        open_artifact(bad)


@pytest.mark.parametrize("part, name, field", [
    ("tensors", "blk.1.ffn_up.weight", "tensor blk.1.ffn_up.weight"),
    ("metadata", "qwen3.attention.head_count", "qwen3.attention.head_count"),
])
def test_rejects_missing_tensor_or_metadata(tiny_bf16, tmp_path, part, name, field):
    def drop(entries):
        entries[:] = [e for e in entries if e[0] != name]
    bad = _rewrite(tiny_bf16, tmp_path / "missing.gguf", **{part: drop})
    assert "missing" in str(_expect(bad, field))


def test_rejects_extra_tensor(tiny_bf16, tmp_path):
    def add(ts):
        ts.append(["blk.0.attn_q.bias", (256,), GGML_F32, np.zeros(256, np.float32)])
    bad = _rewrite(tiny_bf16, tmp_path / "extra.gguf", tensors=add)
    _expect(bad, "tensor blk.0.attn_q.bias")


def test_rejects_wrong_shape(tiny_bf16, tmp_path):
    def reshape(ts):
        for t in ts:
            if t[0] == "blk.0.attn_q_norm.weight":
                t[1], t[3] = (64,), t[3][:256]
    bad = _rewrite(tiny_bf16, tmp_path / "shape.gguf", tensors=reshape)
    err = _expect(bad, "tensor blk.0.attn_q_norm.weight shape", FieldMismatch)
    assert (err.expected, err.found) == ((128,), (64,))


def test_rejects_wrong_dtype(tiny_bf16, tmp_path):
    def to_bf16(ts):
        for t in ts:
            if t[0] == "output_norm.weight":
                t[2] = GGML_BF16
                t[3] = t[3].view("<f4").astype(ml_dtypes.bfloat16).view(np.uint8)
    bad = _rewrite(tiny_bf16, tmp_path / "dtype.gguf", tensors=to_bf16)
    err = _expect(bad, "tensor output_norm.weight type", FieldMismatch)
    assert (err.expected, err.found) == (GGML_F32, GGML_BF16)


def _offset_field(path, name):
    """Byte position of `name`'s offset field in the tensor directory."""
    raw = path.read_bytes()
    info = gguf.read(path).tensors[name]
    at = raw.index(struct.pack("<Q", len(name)) + name.encode())
    return at + 8 + len(name) + 4 + 8 * len(info.shape) + 4, info


@pytest.mark.parametrize("name, offset, message", [
    ("output_norm.weight", lambda offset: offset + 4, "not aligned"),
    ("blk.0.attn_q.weight", lambda offset: 1 << 40, "past the end"),
], ids=["misaligned", "past-end"])
def test_rejects_bad_offset(tiny_bf16, tmp_path, name, offset, message):
    bad = tmp_path / "offset.gguf"
    shutil.copy(tiny_bf16, bad)
    pos, info = _offset_field(bad, name)
    with open(bad, "r+b") as f:
        f.seek(pos)
        f.write(struct.pack("<Q", offset(info.offset)))
    assert message in str(_expect(bad, f"tensor {name}"))


@pytest.mark.parametrize("key,value", [
    ("qwen3.block_count", 3),
    ("qwen3.embedding_length", 512),
    ("qwen3.rope.freq_base", 10000.0),
    ("qwen3.context_length", 8192),
    ("kipp.variant", "base"),
    ("tokenizer.ggml.eos_token_id", 151643),
    ("general.architecture", "llama"),
])
def test_rejects_metadata_differing_from_registry(tiny_bf16, tmp_path, key, value):
    bad = _rewrite(tiny_bf16, tmp_path / "field.gguf", metadata=_set(key, value))
    err = _expect(bad, key, FieldMismatch)
    assert err.found == value


def test_rejects_unknown_repository(tiny_bf16, tmp_path):
    bad = _rewrite(tiny_bf16, tmp_path / "repo.gguf",
                   metadata=_set("kipp.source.repository", "Qwen/Qwen3-1B"))
    assert "not a checkpoint in Kipp's registry" in str(_expect(bad, "kipp.source.repository"))


def test_rejects_unknown_revision(tiny_bf16, tmp_path):
    bad = _rewrite(tiny_bf16, tmp_path / "rev.gguf",
                   metadata=_set("kipp.source.revision", "synthetic-v0"))
    err = _expect(bad, "kipp.source.revision", FieldMismatch)
    assert err.expected == registry.get(TINY).revision


def test_rejects_unknown_scheme(tiny_bf16, tmp_path):
    bad = _rewrite(tiny_bf16, tmp_path / "scheme.gguf", metadata=_set("kipp.quant.scheme", "q2_k"))
    assert "unknown scheme" in str(_expect(bad, "kipp.quant.scheme"))


def test_rejects_wrong_metadata_type(tiny_bf16, tmp_path):
    def retype(md):
        for m in md:
            if m[0] == "qwen3.block_count":
                m[2] = gguf.ValueType.UINT64
    bad = _rewrite(tiny_bf16, tmp_path / "type.gguf", metadata=retype)
    _expect(bad, "qwen3.block_count", FieldMismatch)


def test_rejects_short_vocabulary(tiny_bf16, tmp_path):
    def shorten(md):
        for m in md:
            if m[0] in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
                m[1] = m[1][:1000]
    bad = _rewrite(tiny_bf16, tmp_path / "vocab.gguf", metadata=shorten)
    _expect(bad, "tokenizer.ggml.tokens length", FieldMismatch)


@pytest.mark.slow  # CI's "artifacts, interpret mode" step; the named header faults above stay
def test_fuzzed_headers_only_raise_kipp_errors(tiny_bf16, tmp_path):
    """Random byte flips over the header and directory: a Kipp exception or a valid artifact."""
    target = tmp_path / "fuzz.gguf"
    shutil.copy(tiny_bf16, target)
    header_end = gguf.read(tiny_bf16).data_offset
    rng = np.random.default_rng(1234)
    # The tokenizer arrays dominate the header; bias flips to the structural parts around them.
    raw = target.read_bytes()
    directory = raw.index(b"token_embd.weight") - 8
    regions = [(0, 4096), (directory, header_end), (0, header_end)]
    outcomes = {"rejected": 0, "accepted": 0}
    with open(target, "r+b") as f:
        for trial in range(90):
            lo, hi = regions[trial % len(regions)]
            positions = rng.integers(lo, hi, size=rng.integers(1, 4))
            originals = []
            for pos in positions:
                f.seek(pos)
                originals.append((pos, f.read(1)))
                f.seek(pos)
                f.write(bytes([rng.integers(0, 256)]))
            f.flush()
            try:
                open_artifact(target)
                outcomes["accepted"] += 1
            except KippError:
                outcomes["rejected"] += 1
            for pos, byte in reversed(originals):
                f.seek(pos)
                f.write(byte)
            f.flush()
    assert outcomes["rejected"] > 20, outcomes


# ---- converter -------------------------------------------------------------------------------


def test_converter_refuses_config_mismatch(synthetic_dir, tmp_path):
    source = tmp_path / "src"
    shutil.copytree(synthetic_dir(TINY), source)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError, match="num_hidden_layers: expected 2, found 3"):
        convert(TINY, source, "bf16", tmp_path / "out.gguf", progress=False)
    assert not (tmp_path / "out.gguf").exists()


def test_converter_refuses_missing_shard(synthetic_dir, tmp_path):
    source = tmp_path / "src"
    shutil.copytree(synthetic_dir(UNTIED), source)
    shard = sorted(source.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ConvertError, match=f"{shard.name} is missing"):
        convert(UNTIED, source, "bf16", tmp_path / "out.gguf", progress=False)


def test_converter_refuses_wrong_checkpoint(synthetic_dir, tmp_path):
    with pytest.raises(ConvertError, match="does not match registry entry"):
        convert(UNTIED, synthetic_dir(TINY), "bf16", tmp_path / "out.gguf", progress=False)


def test_hf_source_reads_single_and_sharded_folders(synthetic_dir):
    """One reader for the converter and the gates: every tensor of either layout, as stored."""
    for checkpoint_id in (TINY, UNTIED):
        folder = synthetic_dir(checkpoint_id)
        want = _source_tensors(folder)
        with HfSource(folder) as source:
            assert sorted(source.names()) == sorted(want)
            for name, tensor in want.items():
                assert source.tensor(name).tobytes() == tensor.tobytes(), name
                assert source.shape(name) == tensor.shape and source.dtype(name) == "BF16"
            assert source.rows(name, 1, 3).tobytes() == tensor[1:3].tobytes()
        with pytest.raises(ConvertError, match="tensor model.nope is missing"), \
                HfSource(folder) as source:
            source.tensor("model.nope")


def test_hf_source_refuses_a_tensor_in_two_files(synthetic_dir, tmp_path):
    source = tmp_path / "src"
    shutil.copytree(synthetic_dir(UNTIED), source)
    index = json.loads((source / INDEX_FILE).read_text())
    first, second = sorted(set(index["weight_map"].values()))
    shutil.copy(source / first, source / second)  # every tensor of `first` twice
    with pytest.raises(ConvertError, match="appears in two files"):
        HfSource(source)
    with pytest.raises(ConvertError, match=f"no {SINGLE_WEIGHTS_FILE} or {INDEX_FILE}"):
        HfSource(tmp_path)


def test_cli_convert_and_inspect(synthetic_dir, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert cli_main(["convert", "--checkpoint", TINY, "--source", str(synthetic_dir(TINY)),
                     "--scheme", "affine4_gs32", "--out", str(out), "--quiet"]) == 0
    assert cli_main(["inspect", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "valid Kipp artifact" in printed and "affine4_gs32" in printed
    assert cli_main(["inspect", str(tmp_path / "nope.gguf")]) == 1
    assert "cannot be opened" in capsys.readouterr().err
