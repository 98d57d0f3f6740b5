"""Strict loading of LoRA adapters in PEFT's and mlx-lm's formats, for one registry checkpoint.

    adapter = load_adapter("my-adapter/", registry.get("kipp-synthetic/qwen3-tiny"))
    a, b = adapter.weights[(0, "q")]     # A [r, in], B [out, r], float32
    adapter.scale                        # s in W x + s * B (A x)

PEFT (`adapter_config.json` + `adapter_model.safetensors`): `base_model_name_or_path` must be
the checkpoint's registry id; s = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora); tensors
`base_model.model.model.layers.N.{self_attn,mlp}.P.lora_{A,B}.weight`. mlx-lm
(`adapter_config.json` + `adapters.safetensors`): `model` names the base, `lora_parameters`
gives rank and scale (s itself); tensors `model.layers.N.{self_attn,mlp}.P.lora_{a,b}`, stored
transposed (A^T [in, r], B^T [r, out]). Anything Kipp cannot apply exactly (DoRA, trained
biases, embedding or lm_head adapters, modules_to_save, per-module ranks, a shape that does not
match the checkpoint) is refused with an error naming the field or tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 for safetensors' numpy reader)
import numpy as np

from kipp.errors import KippError
from kipp.formats.registry import HEAD_DIM, KV_HEADS, Checkpoint

CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
MLX_WEIGHTS = "adapters.safetensors"
# Hugging Face module name -> (submodule, Kipp's projection name)
MODULES = {"q_proj": ("self_attn", "q"), "k_proj": ("self_attn", "k"),
           "v_proj": ("self_attn", "v"), "o_proj": ("self_attn", "o"),
           "gate_proj": ("mlp", "gate"), "up_proj": ("mlp", "up"), "down_proj": ("mlp", "down")}
PROJECTIONS = tuple(kipp for _, kipp in MODULES.values())
# PEFT options that change what the adapter computes; each must be off (false, null, empty)
_PEFT_OFF = {"use_dora": "DoRA adapters (a learned magnitude) are not supported",
             "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
             "trainable_token_indices": "trained embedding rows are not supported",
             "lora_bias": "a trained LoRA bias is not supported",
             "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not Qwen3's layout",
             "rank_pattern": "per-module ranks are not supported",
             "alpha_pattern": "per-module alphas are not supported",
             "layer_replication": "layer replication is not supported",
             "target_parameters": "adapters on parameters (not modules) are not supported",
             "use_qalora": "QALoRA is not supported", "use_bdlora": "BD-LoRA is not supported",
             "alora_invocation_tokens": "activated LoRA is not supported",
             "megatron_config": "Megatron-sharded adapters are not supported",
             "arrow_config": "Arrow routing is not supported",
             "kasa_config": "KaSA is not supported", "velora_config": "VeLoRA is not supported",
             "monteclora_config": "MonteCLoRA is not supported"}
_PEFT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                       r"\.lora_(A|B)\.weight")
_MLX_KEY = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(a|b)")


class AdapterError(KippError, ValueError):
    """An adapter that is malformed or cannot be applied to this checkpoint; nothing loaded."""


@dataclass(frozen=True)
class LoraAdapter:
    """One validated adapter: per (layer, projection) A [r, in] and B [out, r], float32."""

    name: str
    base: str  # the registry id it was trained on
    rank: int
    scale: float  # s in W x + s * B (A x)
    format: str  # "peft" or "mlx"
    path: Path
    weights: dict = field(repr=False)  # (layer, projection) -> (A, B)
    digest: bytes = field(default=b"", repr=False)  # of scale and weights: the prefix-cache salt

    def __post_init__(self):
        if not self.digest:
            h = hashlib.blake2b(b"kipp-lora", digest_size=16)
            h.update(struct.pack("<d", self.scale))
            for (layer, proj), (a, b) in sorted(self.weights.items()):
                h.update(f"{layer}.{proj}".encode())
                h.update(a.tobytes())
                h.update(b.tobytes())
            object.__setattr__(self, "digest", h.digest())

    @property
    def targets(self) -> tuple[str, ...]:
        """The projections this adapter changes somewhere, in Kipp's order."""
        held = {proj for _, proj in self.weights}
        return tuple(p for p in PROJECTIONS if p in held)


def projection_shape(entry: Checkpoint, proj: str) -> tuple[int, int]:
    """(out, in) of projection `proj` of `entry`."""
    attn, kv = entry.query_heads * HEAD_DIM, KV_HEADS * HEAD_DIM
    return {"q": (attn, entry.hidden), "k": (kv, entry.hidden), "v": (kv, entry.hidden),
            "o": (entry.hidden, attn), "gate": (entry.intermediate, entry.hidden),
            "up": (entry.intermediate, entry.hidden),
            "down": (entry.hidden, entry.intermediate)}[proj]


def load_adapter(path, entry: Checkpoint, name: str | None = None) -> LoraAdapter:
    """The adapter in folder `path` (PEFT or mlx-lm, told apart by its weights file),
    validated against `entry`; AdapterError naming the field or tensor otherwise."""
    folder = Path(path)
    name = folder.name if name is None else name
    if not name or not isinstance(name, str):
        raise AdapterError(f"an adapter needs a non-empty name, got {name!r}")
    if not folder.is_dir():
        raise AdapterError(f"adapter {name}: {folder} is not a folder holding {CONFIG_FILE}")
    config = _read_config(folder)
    if (folder / PEFT_WEIGHTS).is_file():
        return _load_peft(folder, config, entry, name)
    if (folder / MLX_WEIGHTS).is_file():
        return _load_mlx(folder, config, entry, name)
    raise AdapterError(f"adapter {name}: {folder} holds neither {PEFT_WEIGHTS} (PEFT) nor "
                       f"{MLX_WEIGHTS} (mlx-lm)")


def _read_config(folder: Path) -> dict:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{folder}: {CONFIG_FILE} is missing")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file}: must hold a JSON object")
    return config


def _fail(folder: Path, key: str, problem: str):
    raise AdapterError(f"{folder / CONFIG_FILE}: {key}: {problem}")


def _check_base(folder: Path, key: str, base, entry: Checkpoint) -> None:
    if base != entry.id:
        _fail(folder, key, f"the adapter was trained on {base!r}, not on {entry.id!r} (it must "
                           f"name the registry checkpoint it is loaded with)")


def _positive_int(folder: Path, key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        _fail(folder, key, f"must be a positive integer, got {value!r}")
    return int(value)


def _finite(folder: Path, key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not math.isfinite(value):
        _fail(folder, key, f"must be a finite number, got {value!r}")
    return float(value)


def _peft_targets(folder: Path, value) -> set[str]:
    if value == "all-linear":
        return set(MODULES)
    if isinstance(value, str) or not isinstance(value, list) or not value or \
            not all(isinstance(v, str) for v in value):
        _fail(folder, "target_modules", f"must be a list of projection names (or "
                                        f"'all-linear'), got {value!r}")
    for v in value:
        short = v.rsplit(".", 1)[-1]
        if short in ("embed_tokens", "lm_head"):
            _fail(folder, "target_modules", f"{v}: embedding and lm_head adapters are not "
                                            f"supported")
        if short not in MODULES:
            _fail(folder, "target_modules", f"{v!r} is not one of Qwen3's projections "
                                            f"({', '.join(MODULES)})")
    return {v.rsplit(".", 1)[-1] for v in value}


def _load_peft(folder: Path, config: dict, entry: Checkpoint, name: str) -> LoraAdapter:
    if config.get("peft_type", "LORA") != "LORA":
        _fail(folder, "peft_type", f"only LORA adapters are supported, got "
                                   f"{config.get('peft_type')!r}")
    _check_base(folder, "base_model_name_or_path", config.get("base_model_name_or_path"), entry)
    for key, problem in _PEFT_OFF.items():
        if config.get(key):
            _fail(folder, key, problem)
    if config.get("bias", "none") != "none":
        _fail(folder, "bias", f"trained biases are not supported (got {config['bias']!r}, "
                              f"need 'none')")
    rank = _positive_int(folder, "r", config.get("r"))
    alpha = _finite(folder, "lora_alpha", config.get("lora_alpha"))
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        _fail(folder, "use_rslora", f"must be true or false, got {rslora!r}")
    targets = _peft_targets(folder, config.get("target_modules"))
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    tensors = _read_tensors(folder / PEFT_WEIGHTS)
    weights = _pair_up(folder / PEFT_WEIGHTS, tensors, _PEFT_KEY, entry, rank, targets,
                       transposed=False)
    return LoraAdapter(name, entry.id, rank, scale, "peft", folder, weights)


def _load_mlx(folder: Path, config: dict, entry: Checkpoint, name: str) -> LoraAdapter:
    kind = "dora" if config.get("use_dora") else config.get("fine_tune_type", "lora")
    if kind != "lora":
        _fail(folder, "fine_tune_type", f"only 'lora' adapters are supported, got {kind!r}")
    _check_base(folder, "model", config.get("model"), entry)
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        _fail(folder, "lora_parameters", f"must be an object with rank and scale, got "
                                         f"{params!r}")
    rank = _positive_int(folder, "lora_parameters.rank", params.get("rank"))
    scale = _finite(folder, "lora_parameters.scale", params.get("scale"))
    keys = params.get("keys")
    targets = set(MODULES)
    if keys is not None:
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            _fail(folder, "lora_parameters.keys", f"must be a list of module paths, got {keys!r}")
        targets = _peft_targets(folder, keys) if keys else set()
    num_layers = config.get("num_layers", config.get("lora_layers", -1))
    if num_layers != -1:
        num_layers = _positive_int(folder, "num_layers", num_layers)
    first = 0 if num_layers == -1 else max(0, entry.layers - num_layers)
    tensors = _read_tensors(folder / MLX_WEIGHTS)
    weights = _pair_up(folder / MLX_WEIGHTS, tensors, _MLX_KEY, entry, rank, targets,
                       transposed=True)
    early = sorted(layer for layer, _ in weights if layer < first)
    if early:
        _fail(folder, "num_layers", f"{num_layers} adapts layers {first}.. only, but the "
                                    f"weights hold layer {early[0]}")
    return LoraAdapter(name, entry.id, rank, scale, "mlx", folder, weights)


def _read_tensors(file: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterError(f"{file}: cannot be read as safetensors ({e})") from None


def _pair_up(file: Path, tensors: dict, pattern: re.Pattern, entry: Checkpoint, rank: int,
             targets: set[str], transposed: bool) -> dict:
    """(layer, projection) -> (A [r, in], B [out, r]) float32, every tensor name and shape
    checked against `entry`."""
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = pattern.fullmatch(key)
        if m is None:
            raise AdapterError(f"{file}: tensor {key}: not a LoRA A/B weight of one of Qwen3's "
                               f"projections (embedding, lm_head, bias, DoRA magnitude and "
                               f"other trained tensors are not supported)")
        layer, module, hf_name, which = int(m[1]), m[2], m[3], m[4].upper()
        if MODULES.get(hf_name, (None,))[0] != module:
            raise AdapterError(f"{file}: tensor {key}: {module}.{hf_name} is not a Qwen3 "
                               f"projection")
        if hf_name not in targets:
            raise AdapterError(f"{file}: tensor {key}: {hf_name} is not in the config's "
                               f"target modules")
        if layer >= entry.layers:
            raise AdapterError(f"{file}: tensor {key}: layer {layer}, but {entry.id} has "
                               f"{entry.layers} layers")
        found.setdefault((layer, MODULES[hf_name][1]), {})[which] = (value, f"lora_{m[4]}")
    if not found:
        raise AdapterError(f"{file}: holds no LoRA weights")
    weights = {}
    for (layer, proj), pair in sorted(found.items()):
        out, inp = projection_shape(entry, proj)
        want = {"A": (rank, inp), "B": (out, rank)}
        for which in "AB":
            label = f"lora_{which.lower() if transposed else which}"
            if which not in pair:
                raise AdapterError(f"{file}: layer {layer} {proj}: {label} is missing")
            value, label = pair[which]
            value = value.T if transposed else value
            if value.ndim != 2 or value.shape != want[which]:
                raise AdapterError(f"{file}: layer {layer} {proj}: {label} has shape "
                                   f"{_stored(value.shape, transposed)}, {entry.id} with rank "
                                   f"{rank} needs {_stored(want[which], transposed)}")
            if value.dtype.kind != "f" and value.dtype != ml_dtypes.bfloat16:
                raise AdapterError(f"{file}: layer {layer} {proj}: {label} is "
                                   f"{value.dtype}, not a float tensor")
            pair[which] = np.ascontiguousarray(value, dtype=np.float32)
            if not np.isfinite(pair[which]).all():
                raise AdapterError(f"{file}: layer {layer} {proj}: {label} holds a "
                                   f"non-finite value")
        weights[(layer, proj)] = (pair["A"], pair["B"])
    return weights


def _stored(shape: tuple, transposed: bool) -> list[int]:
    return list(shape[::-1] if transposed else shape)
