"""How kipp/apple's Metal kernels are built: by MLX (mx.fast.metal_kernel), or by an injected
kernel runner.

A runner is a callable taking a KernelSpec and returning an object that is called exactly as
MLX calls a metal_kernel: `kernel(inputs=..., template=..., grid=..., threadgroup=...,
output_shapes=..., output_dtypes=...) -> [arrays]`. `MLXBackend(..., kernel_runner=r)` (through
forward.Ops) and the kernel wrappers (`linear.matvec(x, w, runner=r)`, ...) take one; None means
MLX. The tests inject the Metal emulator (tools/metal_emulator), which runs the kernels' exact
MLX-generated source on a CPU, and kernels that fail on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelSpec:
    """What mx.fast.metal_kernel is built from."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str = ""

    def __post_init__(self):  # hashed once: the kernel path looks specs up on every call
        object.__setattr__(self, "_hash", hash((self.name, self.input_names, self.output_names,
                                                self.source, self.header)))

    def __hash__(self):
        return self._hash


def mlx_runner(spec: KernelSpec):
    """The real thing: MLX compiles the source for the Metal device at the first call."""
    import mlx.core as mx

    return mx.fast.metal_kernel(name=spec.name, input_names=list(spec.input_names),
                                output_names=list(spec.output_names), source=spec.source,
                                header=spec.header)


_BUILT: dict = {}


def kernel(spec: KernelSpec, runner=None):
    """The kernel object for `spec` from `runner` (None: MLX), built once per process."""
    runner = mlx_runner if runner is None else runner
    key = (runner, spec)
    built = _BUILT.get(key)
    if built is None:
        built = _BUILT[key] = runner(spec)
    return built
