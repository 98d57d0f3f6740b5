"""How JAX starts on a Linux machine without an NVIDIA driver: on the CPU, and quietly.

An installed CUDA plugin (jax[cuda12-local], for the deviceless H200 compile) would print a
traceback ("Unable to load CUDA") on every start before JAX falls back to the CPU, so `prepare`
sets JAX_PLATFORMS=cpu unless the user chose. Its libraries also log "Could not find cuda drivers
on your machine, GPU will not be used." as they load, each through its own static copy of absl,
which neither TF_CPP_MIN_LOG_LEVEL nor a Python logger reaches: three lines at `import jax`, one
when JAX registers its plugins. So where the platforms leave CUDA out, JAX's first import and
the plugins' registration run with file descriptor 2 captured, and everything captured is
written back except those lines (and absl's preamble line before each).
"""

from __future__ import annotations

import contextlib
import ctypes.util
import importlib.abc
import importlib.util
import os
import re
import sys
import tempfile

DRIVER_LINE = re.compile(rb"I\d{4} \S+\s+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers "
                         rb"on your machine, GPU will not be used\.")
ABSL_PREAMBLE = (b"WARNING: All log messages before absl::InitializeLog() is called are written "
                 b"to STDERR")


def nvidia_driver_present() -> bool:
    """True when an NVIDIA kernel driver or its user-space library (libcuda) is visible."""
    return os.path.exists("/proc/driver/nvidia/version") or bool(ctypes.util.find_library("cuda"))


def prepare() -> None:
    """Called by kipp.cuda's import: does nothing once JAX is imported, off Linux (no CUDA
    plugin), or where a driver is present (the lines are then news)."""
    if "jax" in sys.modules or sys.platform != "linux" or nvidia_driver_present():
        return
    platforms = os.environ.setdefault("JAX_PLATFORMS", "cpu")
    leaves_out_cuda = platforms and not {"cuda", "gpu"} & {p.strip() for p in platforms.split(",")}
    if leaves_out_cuda and not any(isinstance(f, _FirstJaxImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _FirstJaxImport())


class _FirstJaxImport(importlib.abc.MetaPathFinder):
    """Finds `jax` once, through the usual finders, and wraps its loading in the capture."""

    def find_spec(self, name, path=None, target=None):
        if name != "jax":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            with without_driver_lines():
                load(module)
                _register_plugins()

        spec.loader.exec_module = exec_module  # this spec's own loader object
        return spec


def _register_plugins() -> None:
    """JAX's plugin registration, done now rather than at JAX's first backend use (with the
    platforms leaving CUDA out, the plugin skips its CUDA checks either way). A failure is left
    for that first use, which retries and raises it."""
    from jax._src import xla_bridge

    register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
    if register is not None:
        with contextlib.suppress(Exception):
            register()


@contextlib.contextmanager
def without_driver_lines():
    """Runs the body with file descriptor 2 captured, then writes back what it caught, less the
    CUDA plugin's driver lines."""
    try:
        if sys.stderr is not None:
            sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no descriptor 2, or a closed sys.stderr: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                if sys.stderr is not None:
                    sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            _write_all(2, drop_driver_lines(captured.read()))


def drop_driver_lines(data: bytes) -> bytes:
    """`data` without the driver lines and the absl preamble line just before each."""
    kept: list[bytes] = []
    for line in data.splitlines(keepends=True):
        if DRIVER_LINE.fullmatch(line.rstrip(b"\r\n")):
            if kept and kept[-1].rstrip(b"\r\n") == ABSL_PREAMBLE:
                kept.pop()
            continue
        kept.append(line)
    return b"".join(kept)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]
