"""y = x @ W^T on XLA's CPU through Kipp's own kernel: float32 weights packed in 8-column panels,
read once per round for every row in it.

Why: XLA's CPU dots repack the weight matrix on every call once a dot has more than one row, so
a batched decode step or a short prefill chunk paid several times a one-row step for the same
weight read (`python -m kipp.cuda.bench --layouts` measures both). Layout (`pack`): W [N, K] ->
panels [N/8, K, 8], one 8-float vector per k, streamed front to back; the embedding shares the
tied head's panels (`rows`). The kernel (matmul.cc, an XLA FFI handler) is compiled at first use
with the system's C++ compiler against the JAX headers, for the instruction set this CPU
reports at load (`cpu_isa()`: AMX, AVX-512 + VNNI, AVX2 + FMA or portable on x86; $KIPP_CPU_ISA
picks a narrower one), into $KIPP_HOME/build keyed by source, compiler, JAX and instruction
set, in one library with Kipp's CPU attention (attention.cc) and stored-format matmul
(stored_matmul.cc). Each output is one FMA
chain over k: a row's result is bitwise the same alone or batched. `available()` says why when
it cannot be built (the backend then keeps XLA's dot); KIPP_JAX_CPU_MATMUL=0 turns it off.
Twin: `matmul_reference`.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("kipp.cuda")

PANEL = 8  # output columns per panel (one 8-float vector)
TARGET = "kipp_cpu_matmul_f32"
HERE = Path(__file__).parent
SOURCES = (HERE / "matmul.cc", HERE / "attention.cc", HERE / "stored_matmul.cc")  # one library
HEADERS = (HERE / "kernels.h", HERE / "stored_avx2.h", HERE / "stored_amx.h",
           HERE / "stored_int8.h")
# FFI target -> the handler symbol the library exports
TARGETS = {TARGET: "KippCpuMatmulF32", "kipp_cpu_decode_attention": "KippCpuDecodeAttention",
           "kipp_cpu_attention": "KippCpuAttention",
           "kipp_cpu_stored_matmul_bf16": "KippCpuStoredMatmulBf16",
           "kipp_cpu_stored_matmul_q8_0": "KippCpuStoredMatmulQ8_0",
           "kipp_cpu_stored_matmul_scale4_gs32": "KippCpuStoredMatmulScale4",
           "kipp_cpu_stored_matmul_affine4_gs32": "KippCpuStoredMatmulAffine4",
           "kipp_cpu_stored_matmul_q8_0_int8": "KippCpuStoredMatmulQ8_0Int8",
           "kipp_cpu_stored_matmul_scale4_gs32_int8": "KippCpuStoredMatmulScale4Int8",
           "kipp_cpu_stored_matmul_affine4_gs32_int8": "KippCpuStoredMatmulAffine4Int8",
           "kipp_cpu_stored_matmul_bf16_bf16": "KippCpuStoredMatmulBf16Bf16Dot"}
ENV = "KIPP_JAX_CPU_MATMUL"
FLAGS = ("-O3", "-ffp-contract=off", "-std=c++17", "-fPIC", "-shared")
COMPILERS = ("c++", "g++", "clang++")
PROBE = HERE / "isa.cc"  # asks the CPU which build it runs (__builtin_cpu_supports)


class Isa(str, enum.Enum):
    """The instruction sets the library is built for: a fixed set each (the same code on every
    CPU that has it), chosen at load by the CPU's own answer (isa.cc), never -march=native on
    x86. NATIVE is the rest (Arm: -march=native)."""

    AMX = "amx"  # AVX512_VNNI's set + AMX tiles (BF16) + AVX-512 BF16, the OS granting tiles
    AVX512_VNNI = "avx512_vnni"  # AVX-512 F/BW/VL/DQ + VNNI (+ AVX2, FMA, F16C)
    AVX2 = "avx2"  # AVX2 + FMA + F16C
    PORTABLE = "portable"  # the baseline x86-64 set: plain C++ and std::fma
    NATIVE = "native"


_AVX512 = ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
           "-mavx512vnni")
ISA_FLAGS = {
    Isa.AMX: (*_AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
    Isa.AVX512_VNNI: _AVX512,
    Isa.AVX2: ("-mavx2", "-mfma", "-mf16c"),
    Isa.PORTABLE: (),
    Isa.NATIVE: ("-march=native",),
}


def pack(w: np.ndarray) -> np.ndarray:
    """W [N, K] -> panels [N/8, K, 8] (float32, contiguous)."""
    n, k = w.shape
    if n % PANEL:
        raise ValueError(f"{n} output rows are not a multiple of {PANEL}")
    return np.ascontiguousarray(np.asarray(w, np.float32).reshape(n // PANEL, PANEL, k)
                                .transpose(0, 2, 1))


def unpack(panels):
    """panels [N/8, K, 8] -> W [N, K] (numpy or jax arrays)."""
    p, k, _ = panels.shape
    return panels.transpose(0, 2, 1).reshape(p * PANEL, k)


def rows(panels: jax.Array, index: jax.Array) -> jax.Array:
    """Rows `index` of the packed W, [len(index), K]: the embedding lookup of a tied table."""
    return panels[index // PANEL, :, index % PANEL]


def matmul(x: jax.Array, panels: jax.Array, layer=None) -> jax.Array:
    """x [M, K] float32 @ W^T -> [M, N] float32 with W packed as panels [N/8, K, 8], or stacked
    over layers [L, N/8, K, 8] and read at `layer` (the kernel indexes the stack: no copy)."""
    ok, why = library()  # built and registered (the switch is the backend's choice)
    if not ok:
        raise RuntimeError(f"Kipp's CPU matmul is unavailable: {why}")
    if layer is None:
        panels, layer = panels[None], 0
    out = jax.ShapeDtypeStruct((x.shape[0], panels.shape[1] * PANEL), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x.astype(jnp.float32), panels,
                                         jnp.asarray(layer, jnp.int32).reshape(1))


def matmul_reference(x: jax.Array, panels: jax.Array) -> jax.Array:
    """The jax.numpy twin: x @ unpack(panels)^T."""
    return jnp.dot(x, unpack(panels).T, precision=jax.lax.Precision.HIGHEST)


def available() -> tuple[bool, str]:
    """(True, how it was built) once the kernel is registered with XLA, else (False, why)."""
    return library(ENV)


def library(switch_env: str | None = None) -> tuple[bool, str]:
    """(True, how it was built) once Kipp's CPU kernel library is built and every target in it
    registered with XLA, else (False, why); `switch_env` set to 0/off/false turns its kernel
    off."""
    switch = os.environ.get(switch_env, "") if switch_env else ""
    if switch in ("0", "off", "false"):
        return False, f"{switch_env}={switch} turns it off"
    return _load()


@functools.lru_cache(maxsize=1)
def _load() -> tuple[bool, str]:
    try:
        chosen, path = _chosen_build()
        library = ctypes.CDLL(str(path))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        return False, str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    _LIBRARIES.append(library)  # keep the handlers' code mapped for the life of the process
    return True, f"built for {chosen.value} at {path}"


_LIBRARIES: list = []


def _chosen_build() -> tuple[Isa, Path]:
    """(build, library path) this process loads: cpu_isa()'s, or the AVX-512 set's where the
    AMX build fails to compile (a compiler too old for its flags)."""
    chosen = cpu_isa()
    try:
        return chosen, build(isa=chosen)
    except RuntimeError as e:
        if chosen is not Isa.AMX:
            raise
        log.warning("Kipp's CPU kernels: the AMX build failed (%s); using avx512_vnni",
                    str(e).splitlines()[0][:200])
        return Isa.AVX512_VNNI, build(isa=Isa.AVX512_VNNI)


def build(directory: Path | None = None, extra_flags: tuple[str, ...] = (),
          isa: Isa | None = None) -> Path:
    """The kernels' shared library for `isa` (default: the one this CPU runs, `cpu_isa()`),
    compiled once into `directory` (default $KIPP_HOME/build); raises RuntimeError naming what
    is missing or the compiler's error. `extra_flags` follow the ISA's flags."""
    isa = Isa(isa) if isa is not None else cpu_isa()
    flags = (*FLAGS, *ISA_FLAGS[isa], *extra_flags)
    machine = _cpu_id() if isa is Isa.NATIVE else platform.machine()
    return _compile(SOURCES, HEADERS, flags, ("-isystem", jax.ffi.include_dir()), machine,
                    Path(directory or _home() / "build"), "cpu_kernels")


X86_ORDER = (Isa.PORTABLE, Isa.AVX2, Isa.AVX512_VNNI, Isa.AMX)  # narrowest first
ISA_ENV = "KIPP_CPU_ISA"  # a narrower build than the CPU's widest (to compare builds)


def cpu_isa() -> Isa:
    """The build this process loads: the CPU's widest (`widest_isa()`), or a narrower one
    $KIPP_CPU_ISA names; raises RuntimeError naming the variable for a build this CPU cannot
    run or a name it does not know."""
    widest = widest_isa()
    value = os.environ.get(ISA_ENV, "")
    if not value:
        return widest
    try:
        wanted = Isa(value)
    except ValueError:
        raise RuntimeError(f"{ISA_ENV}={value!r}: expected one of "
                           f"{', '.join(i.value for i in Isa)}") from None
    runs = X86_ORDER[:X86_ORDER.index(widest) + 1] if widest in X86_ORDER else (widest,)
    if wanted not in runs:
        raise RuntimeError(f"{ISA_ENV}={value}: this CPU runs at most {widest.value}")
    return wanted


@functools.lru_cache(maxsize=1)
def widest_isa() -> Isa:
    """The widest build this CPU runs: on x86 asked of the CPU (and, for AMX, of the OS) by a
    baseline-compiled probe (isa.cc); NATIVE elsewhere."""
    if not _x86():
        return Isa.NATIVE
    return X86_ORDER[ctypes.CDLL(str(_probe())).KippCpuIsa()]


@functools.lru_cache(maxsize=1)
def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU reports AVX-512 BF16 (isa.cc's probe; False off x86)."""
    return _x86() and bool(ctypes.CDLL(str(_probe())).KippCpuAvx512Bf16())


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _probe() -> Path:
    """isa.cc built for the baseline set (it loads on any x86 CPU, and asks it)."""
    return _compile((PROBE,), (), ("-O2", "-fPIC", "-shared"), (), platform.machine(),
                    _home() / "build", "cpu_isa")


def _home() -> Path:
    from kipp.formats import store

    return store.home()


def _compile(sources, headers, flags, includes, machine: str, directory: Path,
             stem: str) -> Path:
    """sources compiled with flags into directory/stem-KEY.so, KEY hashing everything the
    output depends on; an existing file is reused."""
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=60).stdout.splitlines()[:1]
    key = hashlib.sha256(b"\0".join(s.encode() for s in [
        *(f.read_text() for f in (*sources, *headers)), compiler, *version, *flags,
        jax.__version__, machine]))
    path = directory / f"{stem}-{key.hexdigest()[:16]}.so"
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        out = Path(scratch) / path.name
        command = [compiler, *flags, *includes, "-I", str(HERE), *map(str, sources), "-o",
                   str(out)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-400:]}")
        os.replace(out, path)  # atomic: a concurrent build of the same key is harmless
    log.info("built %s", path)
    return path


def _compiler() -> str:
    for name in ([os.environ["CXX"]] if os.environ.get("CXX") else []) + list(COMPILERS):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("no C++ compiler found ($CXX, c++, g++ or clang++); install one "
                       "(Debian: build-essential) for Kipp's CPU matmul")


def _cpu_id() -> str:
    """What -march=native (Isa.NATIVE) depends on: the machine and, on Linux, the CPU's
    feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                flags += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"
