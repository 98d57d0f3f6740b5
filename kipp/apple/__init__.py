"""Kipp's MLX backend: Metal kernels on Apple silicon, MLX-op twins elsewhere (mlx[cpu]).

    from kipp.apple.backend import MLXBackend
    backend = MLXBackend(open_artifact(path), num_blocks)   # kipp.load(path, backend="mlx")

Modules: backend (MLXBackend), forward (one round's graph, the kernel/twin dispatcher), select
(which path and why), layout (the projections prepared per path), repack (quantized blocks as
MLX affine arrays and as kernel planes), kvcache (the paged BF16 / q8_0 slab), metal (who runs
a kernel's Metal source), probe (the kernels' load-time checks), and one file per kernel family
with its Metal source, checked wrapper and MLX-op twin: linear and attention. Off Apple hardware
the tests run the kernels' exact source on the Metal emulator (tools/metal_emulator) under
sanitizers, against the twins and the reference; only a Mac shows that Apple's compiler takes
the source, its speed and its fast-math rounding (bench/mac_check.sh). This package imports MLX
only when its modules are imported, so `mlx_usable` can be asked on any machine.
"""

import platform
import sys


def apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def mlx_usable() -> tuple[bool, str]:
    """(True, version) when mlx imports, else (False, why): backend="auto" asks this on a Mac."""
    try:
        import mlx.core as mx

        return True, f"mlx {mx.__version__}"
    except Exception as e:  # ImportError, or a broken install failing to load its library
        return False, f"mlx does not import ({type(e).__name__}: {e})"
