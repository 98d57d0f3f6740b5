"""Kipp's JAX backend: Pallas kernels on an NVIDIA GPU, jitted jax.numpy twins elsewhere.

    from kipp.cuda.backend import JaxBackend
    backend = JaxBackend(open_artifact(path), num_blocks)   # kipp.load(path, backend="jax")

Modules: backend (JaxBackend), forward (the jitted step), rounds (items -> padded, bucketed
arrays), layout (weights prepared per device), select (kernels or twins, and why), sharding
(tensor parallelism over a Mesh), bench (speed), one file per Pallas kernel with its
jax.numpy twin beside it: quant_matmul, decode_attention, prefill_attention, and cpu_matmul
(Kipp's own CPU projection kernel, an XLA FFI handler in C++, with its twin).

This package imports JAX only when its modules are imported, so `jax_sees_gpu` can be asked
on machines without JAX.
"""


def jax_sees_gpu() -> bool:
    """True when JAX is installed and its default backend is a GPU (backend="auto" asks this)."""
    try:
        import jax

        return jax.default_backend() == "gpu"
    except Exception:  # JAX missing, or its GPU plugin failing to initialise
        return False
