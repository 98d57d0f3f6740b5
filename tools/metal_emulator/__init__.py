"""A Metal emulator for Kipp's kernels: the exact source MLX generates for an
mx.fast.metal_kernel call, compiled as C++ against a Metal shim and run on the CPU.

    from metal_emulator import Emulator
    backend = MLXBackend(artifact, blocks, kernel_runner=Emulator())   # every kernel emulated
    y = linear.matvec(x, w, runner=Emulator(mode="tsan"))              # one kernel, under TSan

What a run proves and what it cannot: README.md beside this file.
"""

from metal_emulator.errors import CompileError, CompilerMissing, EmulatorError, KernelFault
from metal_emulator.runner import Emulator, launch
from metal_emulator.toolchain import build, cache_dir, check_strict, compiler

__all__ = ["Emulator", "build", "cache_dir", "check_strict", "compiler", "launch",
           "CompileError", "CompilerMissing", "EmulatorError", "KernelFault"]
