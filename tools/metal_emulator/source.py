"""The exact Metal source MLX compiles for one mx.fast.metal_kernel call, and its C++ translation.

MLX builds the source from the kernel's header and body, a `template <...>` line for the
template arguments, a `[[kernel]] void custom_kernel_<name>_<suffix>(...)` signature (each input
`const device T* name [[buffer(i)]]`, `constant` for arrays of fewer than 8 elements and `&` for
0-d ones; `name_shape`/`name_strides`/`name_ndim` only if the body mentions them; outputs
`device T*`; then each thread attribute the body names) and an explicit instantiation
(mlx/backend/metal/custom_kernel.cpp). Rather than rebuild that text by those rules, `mlx_source`
asks MLX for it: on Linux, mlx >= 0.32 records a custom kernel inside `mx.export_function`
without a Metal back-end, and `verbose=True` prints the generated source.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass

from metal_emulator.errors import EmulatorError

MAX_BUFFERS = 31  # Metal's buffer argument table


@dataclass(frozen=True)
class Param:
    """One parameter of the generated kernel: a buffer (`index` set) or a thread attribute."""

    ctype: str  # C type with the address-space words removed, e.g. "const float*"
    name: str
    index: int | None  # [[buffer(index)]]


@dataclass(frozen=True)
class Signature:
    function: str  # the instantiated kernel, e.g. "custom_kernel_x<3, 64, 256>"
    params: tuple[Param, ...]

    @property
    def buffers(self) -> tuple[Param, ...]:
        return tuple(sorted((p for p in self.params if p.index is not None),
                            key=lambda p: p.index))


@contextlib.contextmanager
def _stdout_to(path: str):
    """Send file descriptor 1 (where MLX's C++ prints) to `path` for the block."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(path, "wb") as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


def mlx_source(kernel, inputs, call: dict) -> str:
    """The Metal source MLX generates for `kernel` (an mx.fast.metal_kernel) called with
    `inputs` (arrays standing for the real ones: same shapes and dtypes) and `call` (template,
    grid, threadgroup, output_shapes, output_dtypes)."""
    import mlx.core as mx

    def traced(*arrays):
        return kernel(inputs=list(arrays), verbose=True, **call)

    with tempfile.TemporaryDirectory() as tmp:
        printed = os.path.join(tmp, "printed")
        with _stdout_to(printed):
            mx.export_function(os.path.join(tmp, "kernel.mlxfn"), traced, *inputs)
        with open(printed, encoding="utf-8", errors="replace") as f:
            text = f.read()
    found = re.search(r"```\n(.*?)```", text, re.S)
    if not found:
        raise EmulatorError("MLX did not print the kernel's generated source (needs mlx >= 0.32 "
                            f"on Linux; this is mlx {mx.__version__})")
    return found.group(1)


_PARAM = re.compile(r"(?P<ctype>.*?)\s*\b(?P<name>\w+)\s*\[\[(?:buffer\((?P<index>\d+)\)|\w+)\]\]$")


def parse(source: str) -> Signature:
    """The kernel's instantiated name and parameters, from MLX's generated source."""
    head = re.search(r"\[\[kernel\]\] void (\w+)\((.*?)\) \{\n", source, re.S)
    if not head:
        raise EmulatorError("no `[[kernel]] void name(...)` signature in the source")
    instance = re.search(r"decltype\((\w+<.*?>)\)", source)
    params = []
    for text in head.group(2).split(",\n"):
        m = _PARAM.match(text.strip())
        if not m:
            raise EmulatorError(f"cannot read the kernel parameter {text.strip()!r}")
        ctype = re.sub(r"\b(device|constant)\b\s*", "", m["ctype"]).strip()
        index = int(m["index"]) if m["index"] is not None else None
        params.append(Param(ctype, m["name"], index))
    signature = Signature(instance.group(1) if instance else head.group(1), tuple(params))
    if len(signature.buffers) > MAX_BUFFERS:
        raise EmulatorError(f"{len(signature.buffers)} buffers: Metal allows {MAX_BUFFERS}")
    return signature


_THREADGROUP = re.compile(
    r"^(?P<indent>[ \t]*)threadgroup\s+(?P<type>[\w:<>, ]+?)\s+(?P<name>\w+)\s*"
    r"(?P<dims>(?:\[[^\]]+\])*)\s*;", re.M)


def _threadgroup_array(m: re.Match, strict: bool) -> str:
    indent, ctype, name, dims = m["indent"], m["type"], m["name"], m["dims"]
    if strict:  # syntax only: a static keeps the address space legal on a declaration
        return f"{indent}static threadgroup {ctype} {name}{dims};"
    ref = f"(&{name}){dims}" if dims else f"&{name}"
    pointer = f"{ctype} (*){dims}" if dims else f"{ctype}*"
    return (f"{indent}{ctype} {ref} = *reinterpret_cast<{pointer}>(::mslemu::threadgroup_alloc("
            f"\"{name}\", __LINE__, sizeof({ctype}{dims}), alignof({ctype})));")


def to_cpp(source: str, strict: bool = False) -> str:
    """MLX's Metal text as C++ for metal_emulator.h (strict: for metal_emulator_strict.h).

    `#include <metal_*>` lines go (the header stands for them); the explicit instantiation loses
    its Metal attributes; each `threadgroup` array becomes a reference to its threadgroup's
    allocation. A #line directive keeps diagnostics and divergence reports on MLX's lines."""
    text = re.sub(r"^\s*#include <metal_\w+>\s*$", "", source, flags=re.M)
    text = re.sub(r"^template \[\[host_name\([^)]*\)\]\] \[\[kernel\]\] ", "template ", text,
                  flags=re.M)
    text = _THREADGROUP.sub(lambda m: _threadgroup_array(m, strict), text)
    return '#line 1 "kernel.metal"\n' + text


def entry(signature: Signature) -> str:
    """The C++ that calls the kernel for one GPU thread (metal_emulator_abi.h's mslemu_kernel)."""
    args = []
    for p in signature.params:
        if p.index is None:
            args.append(f"::mslemu::attr::{p.name}(id)")
        elif p.ctype.endswith("&"):
            args.append(f"*({p.ctype[:-1].strip()}*)b[{signature.buffers.index(p)}]")
        else:
            args.append(f"({p.ctype})b[{signature.buffers.index(p)}]")
    joined = ",\n      ".join(args)
    return (f'\n#line 1 "metal-emulator-entry"\n'
            f"extern \"C\" const int mslemu_buffer_count = {len(signature.buffers)};\n"
            f"extern \"C\" void mslemu_kernel(void* const* b, const ::mslemu::Ids& id) {{\n"
            f"  {signature.function}(\n      {joined});\n}}\n")
