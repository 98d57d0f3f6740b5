"""Which path JaxBackend runs: Pallas kernels on a GPU, jax.numpy twins everywhere else.

One environment switch forces the twins on a GPU for A/B checks: KIPP_JAX_TWINS=1. Tests may
also ask for the kernels in Pallas interpret mode on a CPU (path="interpret"). The decision and
its reason are logged once per backend and returned by `JaxBackend.describe()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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


def choose_path(requested: str = "auto", platform: str | None = None,
                device_kind: str | None = None, twins_env: str | None = None) -> Choice:
    """Kernels or twins for `requested` ("auto", "kernels", "twins", "interpret") on JAX
    platform `platform` ("gpu" or another; default: JAX's default backend). `device_kind`
    names the GPU in the reason (default: the first device's); `twins_env` is KIPP_JAX_TWINS'
    value (default: read from the environment)."""
    if requested not in PATHS:
        raise KippError(f"unknown JAX path {requested!r}; choose from {', '.join(PATHS)}")
    if platform is None:
        import jax

        platform = jax.default_backend()
    if requested == "interpret":
        return Choice(True, True, "interpret mode requested (kernel semantics on any device)")
    if requested == "twins":
        return Choice(False, False, "twins requested")
    if platform != "gpu":
        if requested == "kernels":
            raise KippError(f"Pallas GPU kernels need a GPU; JAX runs on {platform}")
        return Choice(False, False, f"JAX platform is {platform}, no GPU for the kernels")
    forced = os.environ.get(TWINS_ENV, "") if twins_env is None else twins_env
    if requested == "auto" and forced not in ("", "0"):
        return Choice(False, False, f"{TWINS_ENV}={forced} forces the twins")
    if device_kind is None:
        import jax

        device_kind = jax.devices()[0].device_kind
    return Choice(True, False, f"{'requested' if requested == 'kernels' else 'auto'}: "
                               f"JAX sees a GPU ({device_kind})")
