"""Which path MLXBackend runs: the Metal kernels when Metal is there, the MLX-op twins otherwise.

One environment switch forces the twins on a Mac for A/B checks: KIPP_MLX_TWINS=1. The decision
and its reason are logged once per backend and named by `MLXBackend.describe()`, which the
benchmark harness reads (bench/fallback.py wants "metal" for the kernels; "twin" marks the
slower path, so a run that meant to measure the kernels refuses to record the twins).

On the CPU the twins spread each projection's output rows over several MLX CPU streams, each
its own thread (the Linux wheel's BLAS is single-threaded). KIPP_MLX_CPU_STREAMS sets how many;
the default is the usable cores, at most 8.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kipp.errors import KippError

TWINS_ENV = "KIPP_MLX_TWINS"
STREAMS_ENV = "KIPP_MLX_CPU_STREAMS"
PATHS = ("auto", "kernels", "twins")
MAX_CPU_STREAMS = 8


@dataclass(frozen=True)
class Choice:
    kernels: bool
    reason: str

    @property
    def label(self) -> str:
        return "Metal kernels" if self.kernels else "MLX-op twins"


def choose_path(requested: str = "auto", metal: bool | None = None) -> Choice:
    """Kernels or twins for `requested` ("auto", "kernels", "twins"); `metal` defaults to
    `mx.metal.is_available()`."""
    if requested not in PATHS:
        raise KippError(f"unknown MLX path {requested!r}; choose from {', '.join(PATHS)}")
    if metal is None:
        import mlx.core as mx

        metal = mx.metal.is_available()
    if requested == "twins":
        return Choice(False, "twins requested")
    if not metal:
        if requested == "kernels":
            raise KippError("the Metal kernels need Metal; mx.metal.is_available() is False")
        return Choice(False, "no Metal device (mx.metal.is_available() is False)")
    forced = os.environ.get(TWINS_ENV, "")
    if requested == "auto" and forced not in ("", "0"):
        return Choice(False, f"{TWINS_ENV}={forced} forces the twins")
    return Choice(True, f"{'requested' if requested == 'kernels' else 'auto'}: Metal is available")


def cpu_streams(device_is_gpu: bool) -> int:
    """MLX streams a twin projection is split over: 1 on a GPU, else KIPP_MLX_CPU_STREAMS or
    the usable cores (at most MAX_CPU_STREAMS)."""
    if device_is_gpu:
        return 1
    value = os.environ.get(STREAMS_ENV, "")
    if value:
        try:
            n = int(value)
        except ValueError:
            raise KippError(f"{STREAMS_ENV}={value!r} is not an integer") from None
        if n < 1:
            raise KippError(f"{STREAMS_ENV} must be at least 1, got {n}")
        return n
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no sched_getaffinity
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_CPU_STREAMS))
