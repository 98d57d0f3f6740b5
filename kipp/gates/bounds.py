"""Each backend's calibrated bound for each gate (NMSE; 0.0 means bitwise).

A bound is the backend's worst error on the calibration set (every tiny synthetic checkpoint,
every weight scheme, kipp.gates.runs.DEFAULT_PROMPTS) times a factor of at most 10, rounded up
to one significant digit. Re-measure after any change to a backend's numerics or to the
synthetic checkpoints with

    PYTHONPATH=. python tools/calibrate_gates.py          # prints measured worst and bounds

and keep the measured values beside BOUNDS.
"""

from __future__ import annotations

GATES = ("transformers", "reference", "cached_decode", "batched")
# BOUNDS[backend][gate], measured on synthetic-v6 by `KIPP_JAX_CPU_DOT=f32 PYTHONPATH=. python
# tools/calibrate_gates.py` over the three tiny checkpoints and every scheme (x5, one significant
# digit up). Worst rows: transformers on qwen3-tiny-base q8_0 (every backend alike: the BF16 K/V
# rounding against float32 K/V), JAX vs reference on qwen3-tiny-untied bf16, JAX cached decode on
# qwen3-tiny bf16, JAX batched on qwen3-tiny-untied affine4_gs32, MLX vs reference on
# qwen3-tiny-untied scale4_gs32.
BOUNDS: dict[str, dict[str, float]] = {
    "reference": {
        "transformers": 2e-5,  # measured 2.65e-6 (x 7.5)
        "cached_decode": 0.0,  # measured 0: the reference promises bitwise
        "batched": 0.0,  # bitwise by construction (kipp.reference.ops.linear)
        "reference": 0.0,  # a reference against another: bitwise
    },
    "jax": {
        "transformers": 2e-5,  # measured 2.65e-6 (x 7.5)
        "reference": 2e-8,  # measured 2.85e-9 (x 7.0): float32 order flips BF16 K/V roundings
        "cached_decode": 2e-8,  # measured 3.01e-9 (x 6.6)
        "batched": 6e-10,  # measured 1.15e-10 (x 5.2)
    },
    "mlx": {
        "transformers": 2e-5,  # measured 2.65e-6 (x 7.5)
        "reference": 5e-8,  # measured 9.21e-9 (x 5.4)
        # measured 0 (bitwise) on every calibration case; MLX does not promise it, so the
        # JAX twins' bounds:
        "cached_decode": 2e-8,
        "batched": 6e-10,
    },
}
# The Metal kernels, on the Metal emulator (`pytest -m slow tests/test_metal_kernels.py -k
# every_scheme_under_asan`): up to 2.3e-9 against the reference (qwen3-tiny-untied bf16),
# within the twins' 9.21e-9; their sums are float32 like the twins', so the twins' bounds (the
# slow tests there run transformers, cached decode and batched through them).
BOUNDS["mlx-kernels"] = dict(BOUNDS["mlx"])
# The Pallas kernels: 1e-4, the bound between backends, until tools/calibrate_gates.py runs on
# a GPU; against the reference, measured in interpret mode (the three tiny checkpoints, every
# scheme, a 20-token prefill and a decode step as tests/test_jax_backend.py's interpret gate):
# their dots take BF16 operands on tensor cores, which the synthetic circuits amplify to at most
# 5.18e-4 (qwen3-tiny-base bf16) -> 4e-3 (x 7.7).
BOUNDS["jax-kernels"] = {**dict.fromkeys(GATES, 1e-4), "reference": 4e-3}
# The JAX backend where Kipp's stored CPU matmul rounds the activations (one CPU device):
# "jax-int8" the int8 dot (the default for a quantized artifact), measured by
# `KIPP_JAX_CPU_DOT=int8 PYTHONPATH=. python tools/calibrate_gates.py --backends jax --schemes
# q8_0 affine4_gs32 scale4_gs32`; "jax-bf16" and "jax-int8+bf16" the opt-in BF16 dot, alone on a
# BF16 artifact and with the int8 dot on a quantized one (its BF16 head), by
# `KIPP_JAX_CPU_DOT=int8+bf16 ... --backends jax`; each over the three tiny checkpoints. Their
# "reference" gate's oracle rounds the same activations (gate_vs_reference); what is left is
# float32 order flipping roundings, which the synthetic circuits amplify. Worst rows: qwen3-tiny
# scale4_gs32 and affine4_gs32, qwen3-tiny-untied affine4_gs32 and bf16.
BOUNDS["jax-int8"] = {
    "transformers": 5e-4,  # measured 9.21e-5 (x 5.4): the rounding, against unrounded x
    "reference": 4e-5,  # measured 6.30e-6 (x 6.4)
    "cached_decode": 2e-5,  # measured 3.28e-6 (x 6.1)
    "batched": 4e-6,  # measured 6.34e-7 (x 6.3)
}
BOUNDS["jax-bf16"] = {
    "transformers": 8e-3,  # measured 1.49e-3 (x 5.4)
    "reference": 1e-3,  # measured 1.90e-4 (x 5.3)
    "cached_decode": 2e-6,  # measured 3.14e-7 (x 6.4)
    "batched": 6e-7,  # measured 1.03e-7 (x 5.8)
}
BOUNDS["jax-int8+bf16"] = {
    "transformers": 5e-4,  # measured 9.81e-5 (x 5.1)
    "reference": 7e-5,  # measured 1.21e-5 (x 5.8)
    "cached_decode": 4e-5,  # measured 7.05e-6 (x 5.7)
    "batched": 8e-6,  # measured 1.55e-6 (x 5.2)
}


def bound_key(backend) -> str:
    """BOUNDS' key for a Backend object: its name, with "-kernels" on the kernel path
    (Pallas, Metal), whose sums run in another order than the twins', and "-" and the dots
    where Kipp's stored CPU matmul rounds the activations ("-int8", "-bf16", "-int8+bf16": the
    backend's `cpu_dot`, the dots its artifact's formats run; kipp.cuda.cpu.stored_matmul)."""
    kernels = getattr(getattr(backend, "choice", None), "kernels", False)
    if kernels:
        return f"{backend.name}-kernels"
    dots = getattr(backend, "cpu_dot", "f32")
    return backend.name if dots == "f32" else f"{backend.name}-{dots}"


def calibrated_bound(backend, gate: str) -> float:
    """The calibrated bound for `gate` (GATES) of `backend`: a BOUNDS key ("reference", "jax",
    "mlx", "jax-kernels", "mlx-kernels") or a Backend object (see bound_key)."""
    key = backend if isinstance(backend, str) else bound_key(backend)
    try:
        return BOUNDS[key][gate]
    except KeyError:
        raise KeyError(f"no calibrated {gate!r} bound for backend {key!r}") from None
