"""`backend="auto"` picks the fastest installed backend and says why (kipp.chooser)."""

import pytest

import kipp.apple
import kipp.cuda
from kipp import chooser as backends
from kipp.errors import KippError


@pytest.fixture
def machine(monkeypatch):
    """machine(gpu=, apple=, jax=, mlx=): what choose_backend sees, without touching JAX/MLX."""
    def set_up(gpu=False, apple=False, jax=True, mlx=True):
        monkeypatch.setattr(kipp.cuda, "jax_sees_gpu", lambda: gpu)
        monkeypatch.setattr(kipp.cuda, "jax_usable",
                            lambda: (True, "jax 0.x on cpu") if jax else (False, "no jax"))
        monkeypatch.setattr(kipp.apple, "mlx_usable",
                            lambda: (True, "mlx 0.x") if mlx else (False, "no mlx"))
        monkeypatch.setattr(backends, "apple_silicon", lambda: apple)
        return backends.choose_backend("auto")
    return set_up


def test_auto_order(machine):
    assert machine(gpu=True, apple=True).name == "jax"
    assert machine(apple=True).name == "mlx"
    choice = machine()  # a CPU with both installed: JAX's twins are the fastest
    assert choice.name == "jax" and "fastest" in choice.reason
    assert machine(apple=True, mlx=False).name == "jax"
    assert machine(jax=False).name == "mlx"
    choice = machine(jax=False, mlx=False)
    assert choice.name == "reference" and "no jax" in choice.reason and "no mlx" in choice.reason
    assert "kipp[apple]" in machine(apple=True, jax=False, mlx=False).reason


def test_auto_on_this_machine_is_jax_when_jax_imports():
    pytest.importorskip("jax")
    choice = backends.choose_backend("auto")
    assert choice.name == "jax", choice  # this CPU-only machine has jax installed (dev extra)


def test_named_and_unknown_backends():
    assert backends.choose_backend("reference") == backends.Choice("reference", "requested")
    with pytest.raises(KippError, match="unknown backend 'fast'"):
        backends.choose_backend("fast")
    with pytest.raises(KippError, match="unknown backend"):
        backends.open_backend("fast", None, 1)
