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
# BOUNDS[backend][gate], measured on synthetic-v4 by tools/calibrate_gates.py over qwen3-tiny
# (every scheme) and qwen3-tiny-base (bf16), and with `--checkpoints
# kipp-synthetic/qwen3-tiny-untied --schemes bf16` (transformers 1.04e-6, JAX vs reference
# 4.2e-10, MLX 2.3e-9: within the worst below). Worst rows: transformers on affine4_gs32 (its
# BF16 K/V rounding vs float32 K/V), JAX vs reference on q8_0, JAX cached decode on affine4_gs32.
BOUNDS: dict[str, dict[str, float]] = {
    "reference": {
        "transformers": 1e-5,  # measured 1.27e-6 (x 7.9)
        "cached_decode": 0.0,  # measured 0: the reference promises bitwise
        "batched": 0.0,  # bitwise by construction (kipp.reference.ops.linear)
        "reference": 0.0,  # a reference against another: bitwise
    },
    "jax": {
        "transformers": 1e-5,  # measured 1.27e-6 (x 7.9)
        "reference": 5e-8,  # measured 5.35e-9 (x 9.3): float32 order flips BF16 K/V roundings
        "cached_decode": 2e-7,  # measured 2.27e-8 (x 8.8)
        "batched": 1e-10,  # measured 1.31e-11 (x 7.6)
    },
    "mlx": {
        "transformers": 1e-5,  # measured 1.27e-6 (x 7.9)
        "reference": 8e-8,  # measured 8.99e-9 (x 8.9)
        # measured 0 (bitwise) on every calibration case; MLX does not promise it, so the
        # JAX twins' bounds:
        "cached_decode": 2e-7,
        "batched": 1e-10,
    },
}
# The Metal kernels, on the Metal emulator (`pytest -m slow tests/test_metal_kernels.py -k
# every_scheme_under_asan`): up to 9.44e-9 against the reference (qwen3-tiny-untied
# scale4_gs32), like the twins' 8.99e-9; their sums are float32 like the twins', so the twins'
# bounds (the slow tests there run transformers, cached decode and batched through them).
BOUNDS["mlx-kernels"] = dict(BOUNDS["mlx"])
# The Pallas kernels: 1e-4, the bound between backends, until tools/calibrate_gates.py runs on
# a GPU; against the reference, measured in interpret mode: their dots take BF16 operands on
# tensor cores, which the synthetic circuits amplify to at most 3.76e-4 (affine4_gs32,
# qwen3-tiny-untied, a 20-token prefill and a decode step) -> 3e-3 (x 8.0).
BOUNDS["jax-kernels"] = {**dict.fromkeys(GATES, 1e-4), "reference": 3e-3}
# The JAX backend on the opt-in int8 dot of Kipp's stored CPU matmul (a quantized artifact on
# one CPU), measured by `KIPP_JAX_CPU_DOT=int8 PYTHONPATH=. python tools/calibrate_gates.py
# --backends jax --schemes q8_0 affine4_gs32 scale4_gs32` over the three tiny checkpoints. Its
# "reference" gate's oracle rounds the same activations (gate_vs_reference): against the plain
# reference the rounding itself, amplified by the synthetic circuits on the gate's repeated
# prompt, measured up to 1.37.
# Worst rows: transformers on qwen3-tiny-untied q8_0, reference on qwen3-tiny-base
# affine4_gs32, cached decode on qwen3-tiny-base q8_0 (a few roundings flip between the
# prefill's and the decode's float32 orders), batched on qwen3-tiny-untied scale4_gs32.
BOUNDS["jax-int8"] = {
    "transformers": 5e-4,  # measured 9.51e-5 (x 5.3): the rounding, against unrounded x
    "reference": 4e-5,  # measured 7.04e-6 (x 5.7)
    "cached_decode": 1e-5,  # measured 1.86e-6 (x 5.4)
    "batched": 3e-8,  # measured 5.62e-9 (x 5.3)
}


def bound_key(backend) -> str:
    """BOUNDS' key for a Backend object: its name, with "-kernels" on the kernel path
    (Pallas, Metal), whose sums run in another order than the twins', and "-int8" where Kipp's
    stored CPU matmul rounds the activations of a quantized artifact to int8 (the opt-in int8
    dot, alone; kipp.cuda.cpu.stored_matmul). The opt-in BF16 dots, alone or with it, have no
    bounds of their own: their gates hold them to the float32 dot's."""
    kernels = getattr(getattr(backend, "choice", None), "kernels", False)
    if kernels:
        return f"{backend.name}-kernels"
    if getattr(backend, "cpu_dot", "f32") == "int8":
        return f"{backend.name}-int8"
    return backend.name


def calibrated_bound(backend, gate: str) -> float:
    """The calibrated bound for `gate` (GATES) of `backend`: a BOUNDS key ("reference", "jax",
    "mlx", "jax-kernels", "mlx-kernels") or a Backend object (see bound_key)."""
    key = backend if isinstance(backend, str) else bound_key(backend)
    try:
        return BOUNDS[key][gate]
    except KeyError:
        raise KeyError(f"no calibrated {gate!r} bound for backend {key!r}") from None
