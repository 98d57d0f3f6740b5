"""The fault catalogue: bugs Kipp's gates and tests must catch, planted on purpose.

A check that cannot fail is a defect, so every gate family is shown to fail on bugs of the
kind it exists for. Each `Fault` says where the bug goes, how it is planted (a function that
monkeypatches Kipp's code: `plant(patch)` calls `patch.setattr(...)`, with pytest's
MonkeyPatch or `faults.Patcher` outside pytest) and which named checks must catch it.
tests/test_faults.py plants every registered fault, runs the checks it names and asserts that
each one fails, and runs every check on the unplanted code and asserts that it passes.
docs/faults.md is the table of the catalogue (a test keeps it in step).

Adding faults is one call per fault, from any module of this package (every module in
tests/faults/ is imported by `catalogue()`), for example a Metal-kernel fault in
tests/faults/metal.py:

    from faults import Fault, register

    register(Fault(
        name="metal-decode-attention-skips-last-key",
        family="Metal kernels",
        where="kipp.apple.attention decode kernel source",
        description="the split-K loop stops one key early",
        plant=lambda patch: patch.setattr(attention, "DECODE_SOURCE", broken_source),
        caught_by=("metal emulator vs twin",),
    ))

`caught_by` names are keys of the checks table in tests/test_faults.py (a test fails on an
unknown name); a new family may add its checks there.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

FAMILIES = ("forward pass", "KV addressing", "block pool", "sampling", "speculation",
            "scheduler", "KV disk tier", "Metal kernels")


@dataclass(frozen=True)
class Fault:
    """One planted bug: what it breaks and which checks must notice."""

    name: str  # unique, kebab-case
    family: str  # one of FAMILIES (new families are fine: add them there)
    where: str  # the code it corrupts (module.function)
    description: str  # what the bug does, in one line
    plant: Callable[[Any], None]  # plant(patch): patch.setattr(...) the bug in
    caught_by: tuple[str, ...]  # names of checks (tests/test_faults.py) that must fail

    def __post_init__(self):
        if not self.caught_by:
            raise ValueError(f"fault {self.name}: name at least one check that catches it")
        if self.family not in FAMILIES:
            raise ValueError(f"fault {self.name}: family {self.family!r} is not in FAMILIES")


_REGISTRY: dict[str, Fault] = {}


def register(fault: Fault) -> Fault:
    """Add `fault` to the catalogue (names are unique)."""
    if fault.name in _REGISTRY and _REGISTRY[fault.name] is not fault:
        raise ValueError(f"fault {fault.name!r} is registered twice")
    _REGISTRY[fault.name] = fault
    return fault


def catalogue() -> list[Fault]:
    """Every registered fault, after importing every module of this package."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return sorted(_REGISTRY.values(), key=lambda f: (FAMILIES.index(f.family), f.name))


def get(name: str) -> Fault:
    """The registered fault called `name`."""
    catalogue()
    return _REGISTRY[name]


class Patcher:
    """A minimal MonkeyPatch for planting faults outside pytest: `with Patcher() as p:
    fault.plant(p)` undoes every setattr and setenv on exit."""

    def __init__(self):
        self._undo: list = []  # callables, last first

    def setattr(self, target, name: str, value) -> None:
        old = getattr(target, name)
        self._undo.append(lambda: setattr(target, name, old))
        setattr(target, name, value)

    def setenv(self, name: str, value: str) -> None:
        old = os.environ.get(name)
        self._undo.append(lambda: os.environ.__setitem__(name, old) if old is not None
                          else os.environ.pop(name, None))
        os.environ[name] = value

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> "Patcher":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()
