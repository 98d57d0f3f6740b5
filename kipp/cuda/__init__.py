"""Kipp's JAX backend: Pallas kernels on an NVIDIA GPU, jitted jax.numpy twins elsewhere.

    from kipp.cuda.backend import JaxBackend
    backend = JaxBackend(open_artifact(path), num_blocks)   # kipp.load(path, backend="jax")

Modules: backend (JaxBackend), forward (the jitted step), rounds (items -> padded, bucketed
arrays), layout (weights prepared per device), select (kernels or twins, and why), sharding
(tensor parallelism over a Mesh), bench (speed), one file per Pallas kernel with its
jax.numpy twin beside it: quant_matmul, decode_attention, prefill_attention, and cpu_matmul
(Kipp's own CPU projection kernel, an XLA FFI handler in C++, with its twin).

This package imports JAX only when its modules are imported, so `jax_sees_gpu` and
`jax_usable` can be asked on machines without JAX. On a machine with no NVIDIA driver it sets
JAX_PLATFORMS=cpu (unless already set) before JAX is imported: an installed CUDA plugin would
otherwise print a traceback ("Unable to load CUDA") on every start before JAX falls back to
the CPU. The deviceless H200 compile (kipp.cuda.aot) works under that setting.
"""

import ctypes.util
import os
import sys

from kipp.errors import KippError


def nvidia_driver_present() -> bool:
    """True when an NVIDIA kernel driver or its user-space library (libcuda) is visible."""
    return os.path.exists("/proc/driver/nvidia/version") or bool(ctypes.util.find_library("cuda"))


def _quiet_cuda_plugin_without_driver() -> None:
    if "JAX_PLATFORMS" in os.environ or "jax" in sys.modules or sys.platform != "linux":
        return  # the user's choice, or too late to matter, or no CUDA plugin to begin with
    if not nvidia_driver_present():
        os.environ["JAX_PLATFORMS"] = "cpu"


_quiet_cuda_plugin_without_driver()


def jax_sees_gpu() -> bool:
    """True when JAX is installed and its default backend is a GPU (backend="auto" asks this).

    JAX missing is "no GPU"; JAX failing to initialise its backend (a broken CUDA plugin, a
    JAX_PLATFORMS naming an unavailable platform) is an error, not a silent CPU fallback."""
    try:
        import jax
    except ImportError:
        return False
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError as e:
        raise KippError(f"JAX is installed but could not initialise its backend ({e}); fix "
                        "the CUDA install or choose --backend reference") from e


def jax_usable() -> tuple[bool, str]:
    """(True, "jax X on <platform>") when JAX imports and has a device, else (False, why)."""
    try:
        import jax

        return True, f"jax {jax.__version__} on {jax.default_backend()}"
    except Exception as e:  # ImportError, or a plugin failing to initialise
        return False, f"jax does not import ({type(e).__name__}: {e})"
