"""Which backend runs a model, and opening it: the core's one door to the backend packages.

    choice = choose_backend("auto")     # Choice(name="jax", reason="auto: ...")
    backend = open_backend(choice.name, artifact, num_blocks, kv_scheme="q8_0")

`auto` picks the fastest backend that is installed and usable here, in this order, and says
why (kipp.load prints the reason):
1. `jax` when JAX sees a GPU (Pallas kernels);
2. `mlx` on Apple silicon when MLX imports (Metal kernels);
3. `jax` when JAX imports at all: its twins are the fastest CPU path (bench/README.md);
4. `mlx` when MLX imports (its MLX-op twins on `mlx[cpu]`);
5. `reference`, the numpy oracle, which is always there.
Every one of them is gated against the reference and `transformers` in the test suite, so the
fastest installed is also a correct one.

Backend packages (kipp.reference, kipp.apple, kipp.cuda) depend only on the core and their own
framework; the core reaches them only here, by name, importing each one lazily.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass

from kipp.errors import KippError

BACKENDS = ("reference", "mlx", "jax")


@dataclass(frozen=True)
class Choice:
    name: str
    reason: str


def apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def choose_backend(requested: str = "auto") -> Choice:
    """The backend for `requested` ("auto" or a name), with the reason (module docstring)."""
    if requested not in BACKENDS + ("auto",):
        raise KippError(f"unknown backend {requested!r}; choose from auto, {', '.join(BACKENDS)}")
    if requested != "auto":
        return Choice(requested, "requested")
    from kipp.apple import mlx_usable
    from kipp.cuda import jax_sees_gpu, jax_usable

    if jax_sees_gpu():
        return Choice("jax", "auto: JAX sees a GPU (Pallas kernels)")
    mlx_ok, mlx_why = mlx_usable()
    if apple_silicon() and mlx_ok:
        return Choice("mlx", f"auto: Apple silicon with {mlx_why} (Metal kernels)")
    jax_ok, jax_why = jax_usable()
    if jax_ok:
        return Choice("jax", f"auto: no GPU kernels here; {jax_why} is the fastest installed "
                             f"CPU path (jax.numpy twins)")
    if mlx_ok:
        return Choice("mlx", f"auto: no GPU kernels here and no JAX; {mlx_why} runs its "
                             f"MLX-op twins on the CPU")
    hint = " (pip install 'kipp[apple]')" if apple_silicon() else ""
    return Choice("reference", f"auto: neither JAX nor MLX imports ({jax_why}; {mlx_why}): "
                               f"the numpy reference{hint}")


def open_backend(name: str, artifact, num_blocks: int, **options):
    """Construct backend `name` on `artifact` with `num_blocks` KV blocks; options are the
    backend's own keywords (kv_scheme, weight_memory, fallback, path, ...)."""
    if name == "mlx":
        from kipp.apple.backend import make_backend
    elif name == "jax":
        from kipp.cuda.backend import make_backend
    elif name == "reference":
        from kipp.reference.backend import make_backend
    else:
        raise KippError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    return make_backend(artifact, num_blocks, **options)


def group_runtime(backend: str):
    """The module that runs `backend` over several processes (kipp.cuda.distributed for
    "jax", kipp.apple.distributed for "mlx"): its Group, join and follow."""
    if backend == "jax":
        from kipp.cuda import distributed
    elif backend == "mlx":
        from kipp.apple import distributed
    else:
        raise KippError(f"distributed needs backend='jax' or backend='mlx' (got {backend!r})")
    return distributed


def jax_group_mesh(parallel: str):
    """The mesh a JAX group's processes place the model on: every device in tensor parallel,
    or one pipeline stage per process with tensor parallel over its own devices."""
    import jax

    from kipp.cuda import sharding

    if parallel == "pipeline":
        return sharding.make_pipeline_mesh(tensor=jax.local_device_count())
    return sharding.make_mesh()
