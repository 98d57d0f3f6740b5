"""Compiling an emulated kernel: compiler discovery, sanitizer modes, the compile cache, and the
strict syntax check.

A kernel binary is two objects: the runtime (runtime/runtime.cpp: buffers, dispatch, fibers),
compiled once per compiler and mode, and the kernel's translation unit (metal_emulator.h, MLX's
source as C++, the entry), compiled once per distinct source; MLX specialises a source per
template value, so a light kernel unit keeps each new shape to about a second. Both are cached
on disk under `cache_dir()`, keyed by everything that goes into them (text, headers, compiler
version, flags), and written atomically so concurrent processes can share the cache.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from metal_emulator import source
from metal_emulator.errors import CompileError, CompilerMissing

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
RUNTIME = HERE / "runtime" / "runtime.cpp"

CXX_ENV = "METAL_EMULATOR_CXX"
CACHE_ENV = "METAL_EMULATOR_CACHE"
STRICT_CLANGS = ("clang++-19", "clang++")

# mode -> (flags for the kernel unit and the link, flags for the runtime unit)
MODES = {
    "asan": (["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
              "-fno-omit-frame-pointer"],
             ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
              "-fno-omit-frame-pointer", "-DMSLEMU_ASAN=1"]),
    # The runtime stays uninstrumented under TSan: it tells TSan about fibers and barriers itself.
    "tsan": (["-O1", "-g", "-fsanitize=thread"], ["-O1", "-g", "-DMSLEMU_TSAN=1"]),
    "fast": (["-O2"], ["-O2"]),
}


def _fma_flags() -> list[str]:
    """-mfma where the CPU has FMA3, so the kernels' fma() is one instruction, not a libm call
    (the same value either way: fma rounds once)."""
    try:
        with open("/proc/cpuinfo") as f:
            return ["-mfma"] if " fma " in f.read() else []
    except OSError:
        return []


# -ffp-contract=off: a * b + c stays two roundings unless the kernel writes fma().
COMMON = ["-std=c++17", "-pthread", "-ffp-contract=off", "-Wno-attributes",
          f"-I{INCLUDE}", *_fma_flags()]


def cache_dir() -> Path:
    """$METAL_EMULATOR_CACHE, else $KIPP_HOME/metal-emulator, else ~/.cache/kipp/metal-emulator."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    home = os.environ.get("KIPP_HOME") or os.path.join(Path.home(), ".cache", "kipp")
    return Path(home) / "metal-emulator"


@functools.lru_cache(maxsize=None)
def compiler() -> tuple[str, str]:
    """(path, version line) of the C++ compiler: $METAL_EMULATOR_CXX, g++, clang++ or c++."""
    wanted = os.environ.get(CXX_ENV)
    for name in ([wanted] if wanted else ["g++", "clang++", "c++"]):
        path = shutil.which(name)
        if path:
            version = subprocess.run([path, "--version"], capture_output=True, text=True)
            return path, version.stdout.splitlines()[0] if version.stdout else name
    looked = wanted if wanted else "g++, clang++, c++"
    raise CompilerMissing(f"the Metal emulator needs a C++17 compiler and found none ({looked}); "
                          f"install g++ (apt-get install g++) or set {CXX_ENV}")


def strict_compiler() -> str:
    for name in STRICT_CLANGS:
        path = shutil.which(name)
        if path:
            return path
    raise CompilerMissing("strict mode needs clang (clang++-19 or clang++) for Metal's address "
                          "spaces; install it with apt-get install clang-19")


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else str(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def _headers() -> bytes:
    return b"".join(p.read_bytes() for p in sorted(INCLUDE.glob("*.h")))


def _compile(args: list[str], out: Path, what: str) -> None:
    """Run the compiler writing `out` through a temporary name (atomic for other processes)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".")
    os.close(fd)
    try:
        done = subprocess.run([*args, "-o", tmp], capture_output=True, text=True)
        if done.returncode:
            raise CompileError(f"{what} did not compile", done.stderr[-8000:])
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def runtime_object(mode: str) -> Path:
    cxx, version = compiler()
    _, runtime_flags = MODES[mode]
    key = _digest(RUNTIME.read_bytes(), _headers(), version, mode, runtime_flags, COMMON)
    out = cache_dir() / f"runtime-{mode}-{key}.o"
    if not out.exists():
        _compile([cxx, *COMMON, *runtime_flags, "-c", str(RUNTIME)], out, "the emulator runtime")
    return out


def kernel_unit(metal: str) -> str:
    """The kernel's C++ translation unit: shim header, MLX's source as C++, the entry."""
    signature = source.parse(metal)
    return ('#include "metal_emulator.h"\n' + source.to_cpp(metal) + source.entry(signature))


def build(metal: str, mode: str = "asan") -> Path:
    """The path of the executable running `metal` (MLX's generated source) in `mode`."""
    if mode not in MODES:
        raise ValueError(f"unknown emulator mode {mode!r}; choose from {', '.join(MODES)}")
    cxx, version = compiler()
    flags, _ = MODES[mode]
    unit = kernel_unit(metal)
    runtime = runtime_object(mode)
    key = _digest(unit, _headers(), version, mode, flags, COMMON, runtime.name)
    exe = cache_dir() / f"kernel-{mode}-{key}"
    if exe.exists():
        return exe
    with tempfile.TemporaryDirectory() as tmp:
        cpp = Path(tmp) / "kernel.cpp"
        cpp.write_text(unit)
        obj = Path(tmp) / "kernel.o"
        _compile([cxx, *COMMON, *flags, "-c", str(cpp)], obj, "the kernel (as C++)")
        _compile([cxx, *COMMON, *flags, str(obj), str(runtime)], exe, "the kernel binary")
    return exe


def check_strict(metal: str) -> None:
    """Compile `metal` with clang, -fsyntax-only, Metal's address spaces as clang address
    spaces (metal_emulator_strict.h); raise CompileError with clang's diagnostics."""
    clang = strict_compiler()
    text = '#include "metal_emulator_strict.h"\n' + source.to_cpp(metal, strict=True)
    with tempfile.TemporaryDirectory() as tmp:
        cpp = Path(tmp) / "kernel.cpp"
        cpp.write_text(text)
        done = subprocess.run([clang, "-std=c++17", "-fsyntax-only", "-Wno-unknown-attributes",
                               f"-I{INCLUDE}", str(cpp)], capture_output=True, text=True)
    if done.returncode:
        raise CompileError("strict mode (Metal address spaces) rejects the kernel",
                           done.stderr[-8000:])
