"""Formula faults planted in the JAX backend (jax.numpy twins): the backend gate against the
numpy reference must catch each. JAX is imported only when a fault is planted."""

from __future__ import annotations

from faults import Fault, register

_GATE = ("gate: jax vs reference", "gate: jax vs transformers")
# Faults small enough to pass a 4-bit artifact's bf16-vs-quantized bound: held against
# transformers on that artifact's dequantized weights too.
_GATE4 = _GATE + ("gate: jax vs transformers (affine4_gs32)",)


def _fresh_programs(patch):
    from kipp.cuda import backend

    patch.setattr(backend, "_PROGRAMS", {})  # compiled steps captured the unpatched code


def _plant_silu(patch):
    import jax.numpy as jnp

    from kipp.cuda import forward

    _fresh_programs(patch)
    patch.setattr(forward, "_silu", lambda x: x / (1.0 + jnp.exp(-1.05 * x)))


def _plant_rms_norm(patch):
    from kipp.cuda import forward

    _fresh_programs(patch)
    original = forward.rms_norm
    patch.setattr(forward, "rms_norm", lambda x, w: original(x, w * 1.02))


def _plant_scale(patch):
    from kipp.cuda.cpu import attention as cpu_attention
    from kipp.cuda.pallas import prefill_attention

    _fresh_programs(patch)
    # on one CPU device Kipp's CPU attention runs every BF16-KV round instead of the twin
    patch.setenv(cpu_attention.ENV, "0")
    original = prefill_attention.paged_attention_reference
    patch.setattr(prefill_attention, "paged_attention_reference",
                  lambda q, *rest: original(q * 1.1, *rest))


def _plant_cpu_attention_scale(patch):
    from kipp.cuda.cpu import attention as cpu_attention

    _fresh_programs(patch)
    original = cpu_attention.decode_attention
    patch.setattr(cpu_attention, "decode_attention", lambda q, *rest: original(q * 1.1, *rest))


def _plant_cpu_prefill_attention_scale(patch):
    from kipp.cuda.cpu import attention as cpu_attention

    _fresh_programs(patch)
    original = cpu_attention.attention
    patch.setattr(cpu_attention, "attention", lambda q, *rest: original(q * 1.1, *rest))


def _plant_theta(patch):
    import dataclasses

    from kipp.cuda import backend

    _fresh_programs(patch)
    original = backend.JaxBackend._load

    def load(self, artifact):
        entry = self.entry
        self.entry = dataclasses.replace(entry, rope_theta=entry.rope_theta * 1.05)
        try:
            original(self, artifact)
        finally:
            self.entry = entry

    patch.setattr(backend.JaxBackend, "_load", load)


for fault in (
    Fault("jax-silu-1.05", "forward pass", "kipp.cuda.forward._silu",
          "SiLU computed as x * sigmoid(1.05 x)", _plant_silu, _GATE4),
    Fault("jax-rms-norm-weight-1.02", "forward pass", "kipp.cuda.forward.rms_norm",
          "every RMSNorm weight read 2% too large", _plant_rms_norm, _GATE),
    Fault("jax-attention-scale-1.1", "forward pass",
          "kipp.cuda.pallas.prefill_attention.paged_attention_reference",
          "scores scaled by 1.1 / sqrt(128)", _plant_scale, _GATE4),
    Fault("jax-cpu-attention-scale-1.1", "forward pass",
          "kipp.cuda.cpu.attention.decode_attention",
          "decode scores scaled by 1.1 / sqrt(128) in Kipp's CPU attention",
          _plant_cpu_attention_scale, ("gate: jax vs reference",)),
    Fault("jax-cpu-prefill-attention-scale-1.1", "forward pass",
          "kipp.cuda.cpu.attention.attention",
          "prefill scores scaled by 1.1 / sqrt(128) in Kipp's CPU attention",
          _plant_cpu_prefill_attention_scale, ("gate: jax vs reference",)),
    Fault("jax-rope-theta-1.05", "forward pass", "kipp.cuda.backend.JaxBackend._load",
          "RoPE tables built with a base theta 5% too large", _plant_theta, _GATE),
):
    register(fault)
