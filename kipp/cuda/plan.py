"""JaxBackend's platform flags, derived once from the machine's facts and the request.

    facts = Facts("cpu", cpu_matmul=(True, "built"), cpu_attention=(True, "built"),
                  cpu_stored=(True, "built"))
    p = make_plan(facts, scheme="bf16", weight_memory=memory.WeightMemory("float32", "auto"))
    p.layout, p.stacked, p.cpu_attention, p.lean_compile  # ('panels', True, True, False)

`gather` reads the machine (the device's platform, the KIPP_JAX_TWINS switch, whether Kipp's
CPU kernels build); `make_plan` is a pure function of those facts and the backend's options,
so every platform's flags are testable without its device. The weight-memory decision
(kipp.memory, which reads the memory budget) comes in resolved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kipp import memory
from kipp.cuda import select
from kipp.cuda.layout import LAYOUTS
from kipp.errors import KippError

NOT_ASKED = (False, "not asked: not one CPU device")


@dataclass(frozen=True)
class Facts:
    """What the plan depends on that the backend's options do not say."""

    platform: str  # the device's (or the mesh's first device's) JAX platform
    device_kind: str = ""  # the GPU's name, for the path's reason
    sharded: bool = False  # a mesh: tensor parallel over several devices
    twins_env: str = ""  # KIPP_JAX_TWINS
    cpu_matmul: tuple[bool, str] = NOT_ASKED  # kipp.cuda.cpu.matmul.available()
    cpu_attention: tuple[bool, str] = NOT_ASKED  # kipp.cuda.cpu.attention.available()
    cpu_stored: tuple[bool, str] = NOT_ASKED  # kipp.cuda.cpu.stored_matmul.available()

    @property
    def gpu(self) -> bool:
        return self.platform in ("gpu", "cuda")

    @property
    def one_cpu(self) -> bool:
        return self.platform == "cpu" and not self.sharded


def gather(device, mesh=None) -> Facts:
    """The facts of `device` (or of `mesh`'s devices); Kipp's CPU kernels are asked about
    (built at first use) only on one CPU device, the only place they run."""
    first = mesh.devices.flat[0] if mesh is not None else device
    facts = Facts(first.platform, getattr(first, "device_kind", ""), mesh is not None,
                  os.environ.get(select.TWINS_ENV, ""))
    if not facts.one_cpu:
        return facts
    from kipp.cuda.cpu import attention, matmul, stored_matmul

    return Facts(facts.platform, facts.device_kind, False, facts.twins_env,
                 matmul.available(), attention.available(), stored_matmul.available())


@dataclass(frozen=True)
class Plan:
    """Every flag that decides how JaxBackend loads and runs."""

    platform: str
    choice: select.Choice  # Pallas kernels or the jax.numpy twins, interpret mode, and why
    memory: memory.WeightMemory  # "stored" or "float32", and why
    layout: str  # weight layout (kipp.cuda.layout): "device", "f32" or "panels"
    bits: bool  # BF16 weights held as uint16 bits (the CPU twins: `layout._bf16`)
    stacked: bool  # layers stacked [layers, ...] and the step scanned over them
    cpu_attention: bool  # the twins' decode attention on Kipp's CPU kernel
    lean_compile: bool  # steps compile with backend.LEAN_CPU_COMPILE
    cpu_steps: bool  # each step waited on inside kipp.memory.large_blocks_returned
    first_step: bool  # one decode step runs on the kernels at load
    probe_formats: tuple[str, ...]  # quant_matmul weight formats the kernel probes cover
    warnings: tuple[str, ...] = ()  # a kernel that cannot be built, and what runs instead
    cpu_stored: bool = False  # the twins' stored-format projections on Kipp's CPU matmul


def stored_kernel(facts: Facts, path: str = "auto") -> bool:
    """Whether Kipp's stored CPU matmul will run the stored format (one CPU device, the twins,
    the kernel built): then weight_memory "auto" keeps the stored format."""
    choice = select.choose_path(path, "gpu" if facts.gpu else facts.platform,
                                facts.device_kind, facts.twins_env)
    return facts.one_cpu and not choice.kernels and facts.cpu_stored[0]


def explicit_layout(weight_layout: str | None) -> bool:
    """Whether `weight_layout` overrides weight_memory (tests and tools name one)."""
    return weight_layout not in (None, "auto")


def make_plan(facts: Facts, *, scheme: str, path: str = "auto",
              weight_memory: memory.WeightMemory | None = None,
              weight_layout: str | None = None, kv_scheme: str = "bf16") -> Plan:
    """The plan for `facts` and the backend's options; `weight_memory` is
    kipp.memory.choose_weight_memory's decision, unused (may be None) under an explicit
    `weight_layout`."""
    choice = select.choose_path(path, "gpu" if facts.gpu else facts.platform,
                                facts.device_kind, facts.twins_env)
    if facts.sharded and choice.kernels:
        choice = select.Choice(False, False, "sharded over a mesh: twins")
    warnings = []
    chosen, layout = _layout(facts, choice, weight_memory, weight_layout, warnings)
    twins = not choice.kernels
    cpu = facts.platform == "cpu"
    cpu_attention = facts.one_cpu and twins and kv_scheme == "bf16"
    if cpu_attention and not facts.cpu_attention[0]:
        warnings.append(f"Kipp's CPU attention is unavailable ({facts.cpu_attention[1]}); "
                        f"decode attention runs its jax.numpy twin")
    cpu_stored = facts.one_cpu and twins and layout == "device"
    if cpu_stored and not facts.cpu_stored[0]:
        warnings.append(f"Kipp's stored CPU matmul is unavailable ({facts.cpu_stored[1]}); "
                        f"stored weights run XLA's dots")
    return Plan(
        platform=facts.platform, choice=choice, memory=chosen, layout=layout,
        bits=cpu and layout == "device" and twins,
        # one layer's code scanned over stacked weights compiles once instead of per layer,
        # which keeps the compiled programs small; XLA's CPU copies a slice of a stacked plain
        # float32 weight before its dot, so "f32" stays a per-layer list
        stacked=facts.one_cpu and twins and layout in ("device", "panels"),
        cpu_attention=cpu_attention and facts.cpu_attention[0],
        lean_compile=facts.one_cpu and chosen.mode == "stored",
        cpu_steps=cpu, first_step=choice.kernels and not choice.interpret,
        probe_formats=_probe_formats(choice, scheme, layout), warnings=tuple(warnings),
        cpu_stored=cpu_stored and facts.cpu_stored[0])


def _layout(facts: Facts, choice: select.Choice, chosen: memory.WeightMemory | None,
            weight_layout: str | None, warnings: list) -> tuple[memory.WeightMemory, str]:
    """(how the weights are held and why, layout name): an explicit weight_layout taken as
    given, else weight_memory's decision in the platform's layout."""
    if explicit_layout(weight_layout):
        if weight_layout not in LAYOUTS:
            raise KippError(f"unknown weight layout {weight_layout!r}; choose from "
                            f"{', '.join(LAYOUTS)}")
        mode = "stored" if weight_layout == "device" else "float32"
        chosen, layout = memory.WeightMemory(mode, f"weight_layout={weight_layout!r}"), \
            weight_layout
    elif chosen is None:
        raise ValueError("make_plan needs the weight_memory decision without a weight_layout")
    elif chosen.mode != "float32":
        layout = "device"
    else:
        layout = _float32_layout(facts, choice, warnings)
    usable, why = facts.cpu_matmul
    if layout == "panels" and not (facts.one_cpu and usable):
        raise KippError(f"the panels weight layout needs Kipp's CPU matmul on one CPU device "
                        f"({why if facts.one_cpu else facts.platform})")
    return chosen, layout


def _float32_layout(facts: Facts, choice: select.Choice, warnings: list) -> str:
    """weight_memory "float32": panels for Kipp's CPU matmul on one CPU device running the
    twins, else plain float32 (the Pallas kernels, in interpret mode, read plain float32).
    On a CPU float32 is worth its 4 bytes a weight: XLA's dot runs a widened BF16 or planar
    operand far slower for more than one row (`python -m kipp.cuda.bench --layouts`)."""
    if not facts.one_cpu or choice.kernels:
        return "f32"
    usable, why = facts.cpu_matmul
    if not usable:
        warnings.append(f"Kipp's CPU matmul is unavailable ({why}); using the float32 layout "
                        f"and XLA's dot")
    return "panels" if usable else "f32"


def _probe_formats(choice: select.Choice, scheme: str, layout: str) -> tuple[str, ...]:
    """The weight formats quant_matmul sees: the projections' in `layout`, and the head's
    (interpret mode runs the head on its twin: forward.Ops)."""
    if not choice.kernels:
        return ()
    formats = ["f32" if layout == "f32" else scheme]
    if not choice.interpret:
        formats.append("f32" if layout == "f32" else "bf16")
    return tuple(dict.fromkeys(formats))
