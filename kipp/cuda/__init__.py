"""Kipp's JAX backend: Pallas kernels on an NVIDIA GPU, jitted jax.numpy twins elsewhere.

    from kipp.cuda.backend import JaxBackend
    backend = JaxBackend(open_artifact(path), num_blocks)   # kipp.load(path, backend="jax")

Modules: backend (JaxBackend), forward (the jitted step), rounds (items -> padded, bucketed
arrays), layout (weights prepared per device), select (kernels or twins, and why), sharding
(tensor parallelism over a Mesh), bench (speed), and one file per Pallas kernel with its
jax.numpy twin beside it: quant_matmul, decode_attention, prefill_attention.

This package imports JAX only when its modules are imported, so `jax_sees_gpu` can be asked
on machines without JAX.
"""

from kipp.errors import KippError


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
