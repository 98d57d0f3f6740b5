"""Kernel probes: before a backend trusts a kernel, it runs it once on a small input against its
twin, and replaces every kernel that fails to compile, raises or disagrees with that twin.

Why: the first run of a Metal or Pallas kernel on a user's machine is its first meeting with
that machine's compiler and GPU. At load a backend hands `run_probes` one `Probe` per kernel
variant the checkpoint uses (say "matvec/q8_0"): a thunk running the kernel on a probe input, one
running its twin, and the NMSE bound between them. The `KernelReport` says which kernels run and
which fell back, each with a one-line reason; per kernel, so a broken decode matvec costs only
the decode matvec. Each fallback logs one warning, and `Backend.describe()`, `/health` and
`kipp doctor` name it. Results are cached per process under the backend's key (device, format,
interpret mode). `KIPP_KERNEL_FALLBACK=0` (or `fallback=False`) makes a failing probe raise
`KernelError` instead, for benchmarks and hardware checks that must never time a twin.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from kipp.errors import KippError

FALLBACK_ENV = "KIPP_KERNEL_FALLBACK"

_CACHE: dict[tuple, "ProbeResult"] = {}


class KernelError(KippError, RuntimeError):
    """A kernel failed its probe (or its first step) while fallback is off."""


@dataclass(frozen=True)
class Probe:
    """One kernel variant to check: `kernel()` compiles and runs it on a probe input, `twin()`
    runs its twin on the same input; both return arrays the same shape."""

    name: str  # "matvec/q8_0", "decode_attention/bf16", ...
    kernel: Callable[[], np.ndarray]
    twin: Callable[[], np.ndarray]
    bound: float  # NMSE of kernel vs twin above which the kernel is wrong


@dataclass(frozen=True)
class ProbeResult:
    name: str
    ok: bool
    error: str = ""  # one line: the exception, or the disagreement
    nmse: float | None = None
    bound: float = 0.0
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"kernel": self.name, "ok": self.ok, "error": self.error, "nmse": self.nmse,
                "bound": self.bound, "seconds": round(self.seconds, 4)}


@dataclass
class KernelReport:
    """What a backend's kernel path runs: each probed variant's result, in probe order."""

    results: list[ProbeResult] = field(default_factory=list)
    seconds: float = 0.0  # load time the probes added (0 for cached results)

    @property
    def running(self) -> list[str]:
        return [r.name for r in self.results if r.ok]

    @property
    def fell_back(self) -> dict[str, str]:
        return {r.name: r.error for r in self.results if not r.ok}

    def fall_back(self, names: Sequence[str], error: str) -> None:
        """Mark kernels (not yet fallen back) as replaced by their twins for `error`."""
        keep = {n: r for n, r in ((r.name, r) for r in self.results)}
        for name in names:
            old = keep.get(name)
            if old is None or old.ok:
                keep[name] = ProbeResult(name, False, error,
                                         bound=old.bound if old else 0.0)
        self.results = list(keep.values())

    def summary(self) -> str:
        """For describe(): 'kernels: a, b' and, when any fell back, the twins that replace them."""
        if not self.results:
            return "no kernels probed"
        text = f"kernels: {', '.join(self.running) or 'none'}"
        if self.fell_back:
            failed = "; ".join(f"{name} ({error})" for name, error in self.fell_back.items())
            text += f"; fell back to twins: {failed}"
        return text

    def to_json(self) -> dict:
        return {"running": self.running, "fell_back": self.fell_back,
                "probe_seconds": round(self.seconds, 4),
                "probes": [r.to_json() for r in self.results]}


def fallback_enabled(requested: bool | None = None) -> bool:
    """A backend's `fallback` option, else KIPP_KERNEL_FALLBACK (default on; "0" turns it off)."""
    if requested is not None:
        return bool(requested)
    value = os.environ.get(FALLBACK_ENV, "1").strip().lower()
    if value not in ("0", "1", "off", "on", "false", "true", ""):
        raise KippError(f"{FALLBACK_ENV}={value!r}: use 1 (fall back to twins) or 0 (raise)")
    return value not in ("0", "off", "false")


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    """sum((got - want)^2) / sum(want^2) in float64; inf for non-finite output or shape."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or not np.all(np.isfinite(got)):
        return math.inf
    return float(np.sum((got - want) ** 2) / max(np.sum(want ** 2), 1e-300))


def one_line(e: BaseException, limit: int = 160) -> str:
    """An exception as 'Type: first line of its message' (compiler logs run to pages)."""
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0] if lines else ''}".strip().rstrip(":")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check(probe: Probe) -> ProbeResult:
    """Run one probe: the kernel (compile and run), then its twin, then compare."""
    start = time.perf_counter()
    try:
        got = np.asarray(probe.kernel())
    except Exception as e:  # a compile, launch or runtime error of the kernel
        return ProbeResult(probe.name, False, one_line(e), bound=probe.bound,
                           seconds=time.perf_counter() - start)
    want = np.asarray(probe.twin())
    error = nmse(got, want)
    seconds = time.perf_counter() - start
    if error <= probe.bound:
        return ProbeResult(probe.name, True, nmse=error, bound=probe.bound, seconds=seconds)
    why = (f"output shape {got.shape} != {want.shape}" if got.shape != want.shape else
           "non-finite output" if math.isinf(error) else
           f"disagrees with its twin: NMSE {error:.2e} > {probe.bound:.0e}")
    return ProbeResult(probe.name, False, why, nmse=error if math.isfinite(error) else None,
                       bound=probe.bound, seconds=seconds)


def run_probes(probes: Sequence[Probe], key: tuple, fallback: bool,
               log: logging.Logger) -> KernelReport:
    """Check every probe (cached per process under `key` + name); warn once per fallback, or
    raise KernelError on the first failure when `fallback` is off."""
    report = KernelReport()
    start = time.perf_counter()
    for probe in probes:
        cached = _CACHE.get(key + (probe.name,))
        result = cached if cached is not None else check(probe)
        _CACHE[key + (probe.name,)] = result
        report.results.append(result)
        if not result.ok:
            fail(log, probe.name, result.error, fallback)
    report.seconds = time.perf_counter() - start
    return report


def fail(log: logging.Logger, name: str, error: str, fallback: bool) -> None:
    """The one warning line of a kernel replaced by its twin, or KernelError when fallback is
    off."""
    if not fallback:
        raise KernelError(f"kernel {name} failed ({error}); fallback to its twin is off "
                          f"({FALLBACK_ENV}=0 or fallback=False)")
    log.warning("kernel %s failed (%s); running its twin instead", name, error)


def clear_cache() -> None:
    """Forget every cached probe result (tests that swap kernel implementations call this)."""
    _CACHE.clear()
