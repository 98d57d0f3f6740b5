"""Kipp's JAX backend: Pallas kernels on an NVIDIA GPU, jitted jax.numpy twins elsewhere.

    from kipp.cuda.backend import JaxBackend
    backend = JaxBackend(open_artifact(path), num_blocks)   # kipp.load(path, backend="jax")

Modules: backend (JaxBackend), plan (its platform flags), forward (the jitted step), rounds
(items -> padded, bucketed arrays), layout (the weights per device), kvcache (the KV slab),
select (kernels or twins, and why), sharding (tensor parallelism over a Mesh), probe (the
kernels' load-time checks), aot (the deviceless H200 compile), bench (speed); pallas/ (one file
per Pallas kernel with its jax.numpy twin) and cpu/ (Kipp's CPU kernels, XLA FFI handlers in
C++, with their twins).

This package imports JAX only when its modules are imported, so `jax_sees_gpu` and
`jax_usable` can be asked on machines without JAX; on a Linux machine without an NVIDIA driver
it first sets how JAX starts there (kipp.cuda.startup).
"""

from kipp.cuda import startup
from kipp.errors import KippError

startup.prepare()


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
