"""Kipp's JAX backend: Pallas kernels on an NVIDIA GPU, jitted jax.numpy twins elsewhere.

    from kipp.cuda.backend import JaxBackend
    backend = JaxBackend(open_artifact(path), num_blocks)   # kipp.load(path, backend="jax")

Modules: backend (JaxBackend), forward (the jitted step), rounds (items -> padded, bucketed
arrays), layout (weights prepared per device), select (kernels or twins, and why), sharding
(tensor parallelism over a Mesh), bench (speed), and one file per Pallas kernel with its
jax.numpy twin beside it: quant_matmul, decode_attention, prefill_attention.

This package imports JAX only when its modules are imported, so `jax_sees_gpu` and
`jax_usable` can be asked on machines without JAX.
"""


def jax_sees_gpu() -> bool:
    """True when JAX is installed and its default backend is a GPU (backend="auto" asks this)."""
    try:
        import jax

        return jax.default_backend() == "gpu"
    except Exception:  # JAX missing, or its GPU plugin failing to initialise
        return False


def jax_usable() -> tuple[bool, str]:
    """(True, "jax X on <platform>") when JAX imports and has a device, else (False, why)."""
    try:
        import jax

        return True, f"jax {jax.__version__} on {jax.default_backend()}"
    except Exception as e:  # ImportError, or a plugin failing to initialise
        return False, f"jax does not import ({type(e).__name__}: {e})"
