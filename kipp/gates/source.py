"""Gates against the Hugging Face source folder: its weights, and `transformers` running them.

For a quantized artifact transformers runs the source weights passed through the scheme's
numpy quantizer and dequantizer: the very values the artifact stores (gate_source checks that
bitwise), so quantization noise cannot hide a backend bug and the bound is as tight as BF16's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kipp.formats.hf_source import HfSource
from kipp.gates.bounds import calibrated_bound
from kipp.gates.compare import GateResult, compare
from kipp.gates.runs import DEFAULT_PROMPTS, all_position_logits


def _is_projection(name: str) -> bool:
    return name.endswith("_proj.weight") and ".layers." in name


def transformers_model(source_dir, scheme: str = "bf16"):
    """The `transformers` Qwen3 model (float32) on the source folder's weights; for a quantized
    scheme its seven projections per layer are replaced by kipp.formats.quant's encoding of them,
    decoded: the values a Kipp artifact of that scheme stores."""
    import torch
    import transformers

    from kipp.formats import quant

    hf = transformers.Qwen3ForCausalLM.from_pretrained(source_dir, dtype=torch.float32)
    hf.eval()
    if scheme != "bf16":
        with torch.no_grad():
            for name, parameter in hf.named_parameters():
                if _is_projection(name):
                    w = parameter.detach().numpy()
                    decoded = quant.dequantize(quant.quantize(w, scheme), quant.scheme(scheme),
                                               w.shape[1])
                    parameter.copy_(torch.from_numpy(np.ascontiguousarray(decoded)))
    return hf


def transformers_logits(source_dir, token_lists: Sequence[Sequence[int]],
                        scheme: str = "bf16") -> list[np.ndarray]:
    """Every position's logits from `transformers_model(source_dir, scheme)`."""
    import torch

    hf = transformers_model(source_dir, scheme)
    with torch.no_grad():
        return [hf(torch.tensor([list(t)])).logits[0].numpy() for t in token_lists]


def gate_transformers(model, source_dir, prompts=DEFAULT_PROMPTS,
                      limit: float | None = None) -> GateResult:
    """The model's backend against transformers on the artifact's weights, every position."""
    scheme = model.artifact.scheme.name
    token_lists = [model.tokenizer.encode(p) for p in prompts]
    want = transformers_logits(source_dir, token_lists, scheme)
    got = [all_position_logits(model, t) for t in token_lists]
    limit = calibrated_bound(model.backend, "transformers") if limit is None else limit
    what = "dequantized " if scheme != "bf16" else ""
    return compare(f"vs transformers ({what}{scheme})", np.concatenate(got),
                   np.concatenate(want), limit, f"{len(prompts)} prompts;")


def gate_source(artifact, source_dir) -> GateResult:
    """The artifact's tensors against the source folder's: BF16 bitwise, norms widened
    exactly, projections byte for byte kipp.formats.quant's encoding of the source weights. The
    metric is the largest |artifact - source| over max |source| of any tensor."""
    from kipp.formats.artifact import expected_tensors

    specs = expected_tensors(artifact.entry, artifact.scheme)
    held = {t.name: t for t in _tensors(artifact)}
    worst, differing = 0.0, []
    with HfSource(source_dir) as folder:
        for spec in specs:  # one source tensor in memory at a time
            error = _weight_error(held[spec.name], folder.tensor(spec.source), spec.kind,
                                  artifact.scheme)
            if error is not None:
                differing.append(spec.source)
                worst = max(worst, error)
    detail = f"{len(specs) - len(differing)}/{len(specs)} tensors equal"
    if differing:
        detail += f"; differ: {', '.join(differing[:3])}" + (" ..." if len(differing) > 3 else "")
    return GateResult("artifact = source", not differing, worst, 0.0, detail,
                      "max relative weight error")


def _weight_error(tensor, source: np.ndarray, kind: str, scheme) -> float | None:
    """None when the artifact's `tensor` holds exactly `source` (a quantized projection: its
    encoding), else max |tensor - source| / max |source|."""
    from kipp.formats import quant

    if kind == "proj" and scheme.name != "bf16":
        same = np.array_equal(tensor.raw.reshape(-1), quant.quantize(source, scheme).reshape(-1))
    else:
        same = np.array_equal(tensor.f32(), source.astype(np.float32))
    if same:
        return None
    scale = float(np.max(np.abs(source.astype(np.float32)))) or 1.0
    return float(np.max(np.abs(tensor.f32() - source.astype(np.float32))) / scale)


def _tensors(artifact):
    w = artifact.weights
    out = [w.token_embd, w.output_norm] + ([] if w.tied else [w.output])
    for layer in w.layers:
        out += [getattr(layer, f) for f in layer.__dataclass_fields__]
    return out
