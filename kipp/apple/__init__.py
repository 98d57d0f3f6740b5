"""Kipp's MLX backend: Metal kernels on Apple silicon, MLX-op twins elsewhere (mlx[cpu]).

    from kipp.apple.backend import MLXBackend
    backend = MLXBackend(open_artifact(path), num_blocks)   # kipp.load(path, backend="mlx")

Modules: backend (MLXBackend, make_backend), forward (one round's graph and the kernel/twin
dispatcher), select (which path and why), repack (the artifact's quantized blocks as MLX affine
group-32 arrays and as kernel planes, numpy), kvcache (the paged BF16 / q8_0 slab), and one file
per kernel family with its Metal source, checked wrapper and MLX-op twin side by side: linear
(decode matvec, prefill matmul) and attention (paged split-K decode attention); metal (who runs
a kernel's Metal source: MLX, or an injected kernel runner).

Where the kernels have been checked: off Apple hardware the tests run their exact MLX-generated
source on the Metal emulator (tools/metal_emulator), under ASan, UBSan and TSan, against the
twins and the numpy reference, and the whole model on them against the reference backend. That
covers kernel logic, indexing, bounds, barriers and numerics up to the order of operations. What
only a Mac shows (bench/mac_check.sh): that Apple's Metal compiler accepts the source, speed,
fast-math and Apple's exact rounding.

This package imports MLX only when its modules are imported, so `mlx_usable` can be asked on
any machine.
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
