"""Which path JaxBackend runs: Pallas kernels on a GPU, jax.numpy twins everywhere else.

One environment switch forces the twins on a GPU for A/B checks: KIPP_JAX_TWINS=1. Tests may
also ask for the kernels in Pallas interpret mode on a CPU (path="interpret"). The decision and
its reason are logged once per backend and returned by `JaxBackend.describe()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax

from kipp.errors import KippError

TWINS_ENV = "KIPP_JAX_TWINS"
PATHS = ("auto", "kernels", "twins", "interpret")


@dataclass(frozen=True)
class Choice:
    kernels: bool
    interpret: bool
    reason: str

    @property
    def label(self) -> str:
        if not self.kernels:
            return "jax.numpy twins"
        return "Pallas kernels (interpret mode)" if self.interpret else "Pallas kernels (Triton)"


def choose_path(requested: str = "auto", platform: str | None = None) -> Choice:
    """Kernels or twins for `requested` ("auto", "kernels", "twins", "interpret")."""
    if requested not in PATHS:
        raise KippError(f"unknown JAX path {requested!r}; choose from {', '.join(PATHS)}")
    platform = platform or jax.default_backend()
    if requested == "interpret":
        return Choice(True, True, "interpret mode requested (kernel semantics on any device)")
    if requested == "twins":
        return Choice(False, False, "twins requested")
    if platform != "gpu":
        if requested == "kernels":
            raise KippError(f"Pallas GPU kernels need a GPU; JAX runs on {platform}")
        return Choice(False, False, f"JAX platform is {platform}, no GPU for the kernels")
    if requested == "auto" and os.environ.get(TWINS_ENV, "") not in ("", "0"):
        return Choice(False, False, f"{TWINS_ENV}={os.environ[TWINS_ENV]} forces the twins")
    return Choice(True, False, f"{'requested' if requested == 'kernels' else 'auto'}: "
                               f"JAX sees a GPU ({jax.devices()[0].device_kind})")

