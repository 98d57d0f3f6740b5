"""Where a synthetic checkpoint's circuit lives: residual-stream dimensions and structured heads.

kipp.synthetic.rule draws its token clusters from the NOISE dimensions; kipp.synthetic.circuit
builds every weight on this layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Dims:
    """Where each part of the residual stream lives (block-aligned for quantization: no
    structured row reads two kinds of dimension inside one 32-weight block)."""

    hidden: int

    bias = 0
    sigma2 = 32
    sigma = 64

    def __post_init__(self):
        if self.hidden < 256:
            raise ValueError("the synthetic circuit needs hidden >= 256")

    @property
    def prev(self) -> np.ndarray:
        return np.r_[1:32, 33:64, 65:67]

    @property
    def switch(self) -> np.ndarray:
        return np.arange(96, 160)

    @property
    def code(self) -> np.ndarray:
        return np.arange(160, 224)

    @property
    def noise(self) -> np.ndarray:
        return np.r_[67:96, 224:self.hidden]

    @property
    def channels(self) -> np.ndarray:
        """Every dimension only the circuit writes (bias, sigma, sigma2, prev, switch)."""
        return np.r_[self.bias, self.sigma, self.sigma2, self.prev, self.switch]

    @property
    def clusters(self) -> int:
        """Clusters of non-live tokens: one orthonormal NOISE direction each."""
        return len(self.noise) // 32 * 32


@dataclass(frozen=True)
class Roles:
    """Which heads and units of the first and last layer are structured."""

    group: int  # query heads per KV head

    @property
    def self_head(self) -> int:
        return 0

    @property
    def scale_head(self) -> int:
        return 1

    @property
    def prev_head(self) -> int:
        return self.group  # first query head of KV head 1

    transport_head = 0  # last layer: first query head of KV head 0

    def structured_heads(self, first: bool) -> set[int]:
        return {0, 1, self.group} if first else {0}
