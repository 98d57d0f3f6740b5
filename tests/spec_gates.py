"""A speculation gate for tests (kipp.engine.spec's gate protocol): no adaptivity."""


class FixedGate:
    """Always drafts `k` tokens, so every step verifies."""

    def __init__(self, k=7):
        self.k = k

    def budget(self, batch=1):
        return self.k

    def update(self, drafted, accepted):
        pass
