"""Running an emulated kernel: numpy buffers in, the binary, numpy buffers out; and `Emulator`,
a kernel runner with the interface of mx.fast.metal_kernel (kipp.apple.metal's hook).

Every output starts filled with a poison pattern (a NaN payload for floats) unless the call
gives `init_value`, so an element the kernel never writes is counted and reported, not read as
whatever memory held.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from metal_emulator import source, toolchain
from metal_emulator.errors import EmulatorError, KernelFault

WORKERS_ENV = "METAL_EMULATOR_WORKERS"
MAX_THREADS_PER_THREADGROUP = 1024
POISON = {4: np.uint32(0x7FC0DEAD), 2: np.uint16(0x7E5A), 1: np.uint8(0xA5), 8: np.uint64(0x7FF8DEADDEADDEAD)}
SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:detect_stack_use_after_return=0",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    "TSAN_OPTIONS": "halt_on_error=1:report_signal_unsafe=0",
}
_EVIDENCE = re.compile(r"metal-emulator:|ERROR: AddressSanitizer|runtime error:|"
                       r"WARNING: ThreadSanitizer|SUMMARY:|^    #\d+ .* kernel\.metal:", re.M)


def default_workers() -> int:
    """OS threads running threadgroups side by side: $METAL_EMULATOR_WORKERS, else 1 (the test
    machines are shared)."""
    value = os.environ.get(WORKERS_ENV, "1")
    try:
        return max(1, int(value))
    except ValueError:
        raise EmulatorError(f"{WORKERS_ENV}={value!r} is not an integer") from None


def _scratch(nbytes: int) -> str | None:
    """Where the buffers go on their way to the kernel: memory-backed /dev/shm when it has room
    (containers often give it 64 MiB), else the usual temporary directory."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    room = stat.f_bavail * stat.f_frsize
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) and room > 2 * nbytes + (64 << 20) else None


def _evidence(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if _EVIDENCE.search(line)]
    return " | ".join(lines[:6]) if lines else (stderr.strip().splitlines() or ["no output"])[-1]


def launch(exe, buffers: list[tuple[np.ndarray, bool]], grid, threadgroup,
           workers: int | None = None, timeout: float = 1800) -> list[np.ndarray]:
    """Run a built kernel: `buffers` in [[buffer(i)]] order as (array, is_output); returns every
    buffer's contents afterwards (outputs changed, inputs as given)."""
    threads = int(np.prod(threadgroup))
    if threads > MAX_THREADS_PER_THREADGROUP:
        raise KernelFault(f"threadgroup {tuple(threadgroup)} has {threads} threads: Metal allows "
                          f"at most {MAX_THREADS_PER_THREADGROUP}")
    workers = workers or default_workers()
    nbytes = sum(a.nbytes for a, _ in buffers)
    with tempfile.TemporaryDirectory(dir=_scratch(nbytes), prefix="metal-emulator-") as tmp:
        args = [str(exe), *map(str, grid), *map(str, threadgroup), str(workers)]
        for i, (array, is_output) in enumerate(buffers):
            path = os.path.join(tmp, f"b{i}")
            np.ascontiguousarray(array).tofile(path)
            args.append(("o:" if is_output else "i:") + path)
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **SANITIZER_ENV})
        if done.returncode:
            raise KernelFault(f"the kernel failed (exit {done.returncode}): "
                              f"{_evidence(done.stderr)}", done.stderr[-12000:])
        return [np.fromfile(os.path.join(tmp, f"b{i}"), dtype=a.dtype).reshape(a.shape)
                if out else a for i, (a, out) in enumerate(buffers)]


def poisoned(shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    bits = np.full(shape, POISON[dtype.itemsize], dtype=POISON[dtype.itemsize].dtype)
    return bits.view(dtype)


def unwritten(array: np.ndarray) -> int:
    """Elements of an output still holding the poison pattern."""
    poison = POISON[array.dtype.itemsize]
    return int(np.count_nonzero(array.view(poison.dtype) == poison))


@dataclass
class Timing:
    calls: int = 0
    seconds: float = 0.0


@dataclass
class Emulator:
    """A kernel runner (kipp.apple.metal): `Emulator()(spec)` is an object called exactly as
    an mx.fast.metal_kernel is, that runs the kernel's MLX-generated source on the CPU.

    mode: "asan" (AddressSanitizer + UndefinedBehaviorSanitizer, the default), "tsan"
    (ThreadSanitizer: races between GPU threads), "fast" (no sanitizer).
    check_outputs: every element of every output must be written (else KernelFault).
    `timings` records calls and seconds per kernel name (build time excluded)."""

    mode: str = "asan"
    workers: int | None = None
    check_outputs: bool = True
    timings: dict = field(default_factory=lambda: defaultdict(Timing))

    @property
    def label(self) -> str:
        return f"the Metal emulator ({self.mode})"

    def __call__(self, spec) -> "EmulatedKernel":
        return EmulatedKernel(self, spec)

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other


class EmulatedKernel:
    """One kernel (a kipp.apple.metal.KernelSpec) bound to an Emulator."""

    def __init__(self, emulator: Emulator, spec):
        self.emulator, self.spec = emulator, spec
        self._sources: dict = {}

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup,
                 template=None, init_value=None, verbose=False, stream=None):

        arrays = [_to_numpy(a) for a in inputs]
        call = dict(template=list(template or []), grid=tuple(grid),
                    threadgroup=tuple(threadgroup), output_shapes=[tuple(s) for s in output_shapes],
                    output_dtypes=list(output_dtypes))
        metal = self.source(inputs, call)
        exe = toolchain.build(metal, self.emulator.mode)
        outputs = [_output(shape, dtype, init_value)
                   for shape, dtype in zip(call["output_shapes"], call["output_dtypes"])]
        named = dict(zip(self.spec.input_names, arrays))
        named.update(zip(self.spec.output_names, outputs))
        buffers = [_buffer(p.name, named, self.spec.output_names)
                   for p in source.parse(metal).buffers]
        start = time.perf_counter()
        results = launch(exe, buffers, call["grid"], call["threadgroup"], self.emulator.workers)
        timing = self.emulator.timings[self.spec.name]
        timing.calls += 1
        timing.seconds += time.perf_counter() - start
        by_name = {p.name: r for p, r in zip(source.parse(metal).buffers, results)}
        out = [by_name[name] for name in self.spec.output_names]
        if self.emulator.check_outputs and init_value is None:
            for name, array in zip(self.spec.output_names, out):
                missing = unwritten(array)
                if missing:
                    raise KernelFault(f"{self.spec.name}: {missing} of {array.size} elements of "
                                      f"output {name!r} were never written")
        return [_to_mlx(a, dtype) for a, dtype in zip(out, call["output_dtypes"])]

    def source(self, inputs, call: dict) -> str:
        """MLX's generated source for this call (asked of MLX once per distinct signature)."""
        import mlx.core as mx

        key = (repr(call["template"]), tuple(map(str, call["output_dtypes"])),
               tuple((str(a.dtype), a.ndim, a.size < 8) for a in inputs))
        if key not in self._sources:
            kernel = mx.fast.metal_kernel(
                name=self.spec.name, input_names=list(self.spec.input_names),
                output_names=list(self.spec.output_names), source=self.spec.source,
                header=self.spec.header)
            stand_ins = [mx.zeros(a.shape, a.dtype) for a in inputs]
            self._sources[key] = source.mlx_source(kernel, stand_ins, call)
        return self._sources[key]


def _to_numpy(a) -> np.ndarray:
    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.asarray(a))


def _storage(dtype) -> np.dtype:
    """The numpy dtype holding an MLX dtype's bytes (bfloat16 as its uint16 bits)."""
    name = str(dtype).rsplit(".", 1)[-1]
    return np.dtype(np.uint16 if name == "bfloat16" else name)


def _to_mlx(array: np.ndarray, dtype):
    import mlx.core as mx

    return mx.array(array).view(dtype) if str(dtype).endswith("bfloat16") else mx.array(array)


def _output(shape, dtype, init_value) -> np.ndarray:
    storage = _storage(dtype)
    if init_value is not None:
        if str(dtype).endswith("bfloat16"):
            import mlx.core as mx

            bits = mx.array(init_value, mx.bfloat16).view(mx.uint16).item()
            return np.full(shape, bits, storage)
        return np.full(shape, init_value, storage)
    return poisoned(shape, storage)


def _buffer(name: str, named: dict, outputs) -> tuple[np.ndarray, bool]:
    """The array for buffer `name`: an input, an output, or MLX's x_shape / x_strides / x_ndim."""
    if name in named:
        return named[name], name in outputs
    for suffix, make in (("_shape", lambda a: np.array(a.shape or (1,), np.int32)),
                         ("_strides", lambda a: np.array(
                             [s // a.itemsize for s in a.strides] or [1], np.int64)),
                         ("_ndim", lambda a: np.array(a.ndim, np.int32))):
        if name.endswith(suffix) and name[:-len(suffix)] in named:
            return make(named[name[:-len(suffix)]]), False
    raise EmulatorError(f"the kernel takes a buffer {name!r} the call does not provide")
