"""How a backend holds the weights its twins multiply: as stored, or as a float32 copy.

`weight_memory` (kipp.load, `--weight-memory`) is one of:
- "stored": the artifact's own format (BF16, or the quantized planes / MLX's affine repack),
  widened or dequantized per chunk inside each matmul. What the kernels read; never more
  memory than the artifact's weights.
- "float32": BF16 weights widened once at load (4 bytes per weight). On a CPU that is the
  fast path for multi-row matmuls (see kipp.cuda.plan, kipp.apple.layout), at twice the
  memory of BF16.
- "auto": on a GPU (Metal or CUDA) always "stored" (a fallback must fit where the kernels fit);
  on a CPU "stored" where a kernel reads the stored format at least as fast as float32
  (`stored_kernel`: the JAX backend's stored CPU matmul on one CPU device), else "float32"
  when the copy fits the budget, half the memory available now, else "stored". The choice and
  its reason go into `Backend.describe()`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from dataclasses import dataclass

from kipp.errors import KippError

WEIGHT_MEMORY = ("auto", "stored", "float32")
BUDGET_FRACTION = 0.5  # of the available memory: room for the KV slab, activations, the OS
STEP_MMAP_THRESHOLD = 1 << 20  # inside large_blocks_returned: blocks this large are mapped
GLIBC_MMAP_CEILING = 32 << 20  # where glibc's own threshold stops rising (64-bit); trim: twice
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)
# a user's own glibc malloc settings, which large_blocks_returned leaves alone
_USER_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@dataclass(frozen=True)
class WeightMemory:
    mode: str  # "stored" or "float32"
    reason: str


def check_weight_memory(requested: str) -> str:
    if requested not in WEIGHT_MEMORY:
        raise KippError(f"unknown weight_memory {requested!r}; choose from "
                        f"{', '.join(WEIGHT_MEMORY)}")
    return requested


def available_bytes() -> int:
    """Memory available to a new allocation: Linux's MemAvailable, else the physical memory."""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def weight_budget() -> int:
    """Bytes a float32 weight copy may take before "auto" keeps the stored format instead."""
    return int(BUDGET_FRACTION * available_bytes())


def choose_weight_memory(requested: str, *, gpu: bool, float32_bytes: int,
                         stored_kernel: bool = False) -> WeightMemory:
    """"stored" or "float32" for `requested` (module docstring); `float32_bytes` is what the
    backend's float32 copy would take; `stored_kernel`: a CPU kernel will read the stored
    format, so a float32 copy buys no speed."""
    check_weight_memory(requested)
    if gpu:
        if requested == "float32":
            raise KippError("weight_memory='float32' is a CPU layout; on a GPU the twins read "
                            "the stored format (use 'auto' or 'stored')")
        return WeightMemory("stored", "a GPU reads the stored format")
    if requested != "auto":
        return WeightMemory(requested, f"weight_memory={requested!r} requested")
    if stored_kernel:
        return WeightMemory("stored", "auto: Kipp's stored CPU matmul reads the stored format")
    budget = weight_budget()
    size = f"{float32_bytes / 2**30:.2f} GiB float32 copy"
    if float32_bytes <= budget:
        return WeightMemory("float32", f"auto: the {size} fits the budget "
                                       f"({budget / 2**30:.1f} GiB, half the available memory)")
    return WeightMemory("stored", f"auto: a {size} would exceed the budget "
                                  f"({budget / 2**30:.1f} GiB, half the available memory)")


@contextlib.contextmanager
def large_blocks_returned():
    """Inside, every allocation of STEP_MMAP_THRESHOLD bytes or more gets its own mapping, which
    goes back to the OS when freed; after, the mmap threshold is GLIBC_MMAP_CEILING and the trim
    threshold twice that, where glibc's own adjustment stops (mallopt). The JAX backend on a CPU
    runs each step inside. Process-wide: from the first use on, glibc no longer adjusts its
    thresholds by itself. A no-op off glibc, and where the user set glibc's malloc thresholds
    (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, glibc.malloc tunables).

    Why: glibc raises its mmap threshold to the size of each large block freed, so after a load
    XLA's per-execution temporaries come from the executing thread's heap, and a non-main heap
    keeps its top resident when freed (malloc_trim does not return it): resident memory grew
    with each new step shape. Why only inside: a 1 MiB threshold for the whole process makes
    numpy-heavy code map and fault in every 1-32 MiB array, which slows it markedly. The
    weight-memory records in bench/results (`--weight-memory stored,float32`) hold the figures."""
    mallopt = _libc_function("mallopt")
    if mallopt is None or _user_malloc_settings():
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD)
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, GLIBC_MMAP_CEILING)
        mallopt(_M_TRIM_THRESHOLD, 2 * GLIBC_MMAP_CEILING)


@functools.lru_cache(maxsize=None)
def _user_malloc_settings() -> bool:
    """Whether the user set glibc's malloc thresholds: glibc reads them once, at start-up."""
    return (any(name in os.environ for name in _USER_MALLOC_SETTINGS)
            or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""))


def trim_heap() -> None:
    """Return the C heap's free memory to the OS (glibc's malloc_trim; a no-op elsewhere).

    glibc keeps what a large, short-lived allocation freed (XLA's compiler scratch, numpy's
    copies while weights are packed) in the process, counted in its resident set, tens of MiB
    per compiled step at the 0.6B shape. Backends call this after loading and after each
    compile."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=None)
def _libc_function(name: str):
    """glibc's malloc_trim or mallopt, or None (not Linux, or a libc without them: musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
