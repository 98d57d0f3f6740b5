"""y = x @ W^T on XLA's CPU straight from the artifact's stored bytes: BF16, q8_0, scale4_gs32
(Q4_0) and affine4_gs32 (Q4_1), in the "device" layout (kipp.cuda.layout), never a float32 copy.

Why: a CPU decode step is bound by the bytes it streams; the float32 panels (kipp.cuda.cpu.
matmul) stream 4 bytes a weight whatever the artifact holds, and XLA's own dots over the stored
planes run far slower. The kernel (stored_matmul.cc, built into the library kipp.cuda.cpu.matmul
builds for the instruction set the CPU reports at load: AMX, AVX-512 + VNNI, AVX2 + FMA, or plain
C++) decodes the weights exactly as kipp.formats.quant.dequantize does,
into registers for a decode round and into an L2-sized float32 scratch for a longer one, and
multiplies every row of x against them: each stored byte is read once per call, however many
rows; a long round runs about as fast as the float32 panels, so weight_memory "auto" keeps the
stored format where this kernel runs (kipp.memory). Under the float32 dot the
activation stays float32, so the only error against the float64 oracle is float32 summation
(tests/test_cpu_stored_matmul.py); under every dot a row's result is bitwise the same alone or
batched. `available()` says why when it cannot be built;
KIPP_JAX_CPU_STORED=0 turns it off. Twin: kipp.cuda.pallas.quant_matmul.quant_matmul_reference.

On a CPU with AMX tiles the BF16 dot runs on the tile unit (stored_amx.h): x as three bf16 parts
that sum to it exactly, the weights read in place, about 2.5 times the AVX-512 rate for a
prefill chunk; its own summation order (still bitwise the same alone or batched), inside the
same bound against float64.

Dot.INT8 (the default) rounds each row of x to int8 per 32-block (llama.cpp's
q8_0 activation) and runs the quantized formats as integer dots (AVX-512 VNNI where present,
AVX2's vpmaddubsw where that is the widest; stored_int8.h): each block's whole integer sum,
then one float32 multiply-add per block, so a round of several rows or a prompt runs about
twice the float32 dot's rate. The rounding is an error the float32 dot does
not make: a backend that runs it is gated against a reference that rounds x the same way, by
bounds of its own (kipp.gates.bounds, "jax-int8"), and the synthetic checkpoints' designed
rule holds under it. BF16 weights keep the float32 dot; KIPP_JAX_CPU_DOT=f32 gives every
format the float32 dot.

Dot.BF16 (KIPP_JAX_CPU_DOT=bf16, opt-in, a CPU with AVX-512 BF16) rounds each row of x to bf16
for BF16 weights and runs vdpbf16ps over the weights in place: twice the multiply-adds per
instruction, so a decode round of several rows costs about its weight stream and a prefill
chunk runs faster; each row bitwise the same alone or batched; gate bounds of its own
("jax-bf16", "jax-int8+bf16").

Dots join with "+" (KIPP_JAX_CPU_DOT=int8+bf16): each format runs the first that names it, so
a quantized artifact's BF16 output head takes the BF16 dot while its layers take the int8 one.
"""

from __future__ import annotations

import enum
import os

import jax
import jax.numpy as jnp

from kipp.cuda.cpu import matmul as cpu_matmul
from kipp.cuda.layout import Linear

ENV = "KIPP_JAX_CPU_STORED"
DOT_ENV = "KIPP_JAX_CPU_DOT"
FORMATS = ("bf16", "q8_0", "scale4_gs32", "affine4_gs32")


class Dot(str, enum.Enum):
    """How a row of x meets the weights: float32 as it is (the default); quantized to int8 per
    32-block first, an integer dot per block (the quantized formats); or rounded to bf16, a
    BF16 dot product (BF16 weights, on a CPU with AVX-512 BF16). A format a dot does not name
    keeps float32."""

    F32 = "f32"
    INT8 = "int8"
    BF16 = "bf16"


INT8_FORMATS = ("q8_0", "scale4_gs32", "affine4_gs32")
DOT_FORMATS = {Dot.F32: FORMATS, Dot.INT8: INT8_FORMATS, Dot.BF16: ("bf16",)}
# Where $KIPP_JAX_CPU_DOT is unset: the quantized formats' faster dot, llama.cpp's rounding of
# x. BF16 weights keep the float32 dot, exact on the AMX build's tile unit, where the BF16 dot
# runs on AVX-512 instead.
DEFAULT_DOT = Dot.INT8


def target(fmt: str, dot: Dot) -> str:
    """The FFI target that runs `fmt` under `dot` (the float32 one where `dot` leaves `fmt`
    as it is)."""
    suffix = f"_{dot.value}" if dot is not Dot.F32 and fmt in DOT_FORMATS[dot] else ""
    return f"kipp_cpu_stored_matmul_{fmt}{suffix}"


def bf16_dot_supported() -> tuple[bool, str]:
    """(True, "") where the loaded build runs the BF16 dot (AVX-512 with the CPU reporting
    AVX-512 BF16), else (False, why)."""
    isa = cpu_matmul.cpu_isa()
    if isa not in (cpu_matmul.Isa.AVX512_VNNI, cpu_matmul.Isa.AMX):
        return False, f"the {isa.value} build has no BF16 dot (it needs AVX-512 BF16)"
    if not cpu_matmul.cpu_has_avx512_bf16():
        return False, "this CPU does not report AVX-512 BF16"
    return True, ""


def dots(value: str) -> tuple[Dot, ...]:
    """The dots a $KIPP_JAX_CPU_DOT value names, in order: one ("int8") or several joined by
    "+" ("int8+bf16"); raises naming the variable for one it does not know, or for the BF16 dot
    where this CPU or build has none."""
    try:
        named = tuple(Dot(part) for part in value.split("+"))
    except ValueError:
        raise ValueError(f"{DOT_ENV}={value!r}: expected one of "
                         f"{', '.join(d.value for d in Dot)}, or several joined by '+'") from None
    if Dot.BF16 in named:
        ok, why = bf16_dot_supported()
        if not ok:
            raise ValueError(f"{DOT_ENV}={value}: {why}")
    return named


def dot_for(fmt: str, named: tuple[Dot, ...]) -> Dot:
    """The dot format `fmt` runs under `named`: the first that names it, else the float32 dot."""
    return next((d for d in named if fmt in DOT_FORMATS[d]), Dot.F32)


def running(mode: str, formats) -> str:
    """The dots of `mode` (dot_mode's string) that some format of `formats` (the weights a
    step multiplies) runs, in mode's order; "f32" where each keeps the float32 dot. What a
    backend says it runs, and what picks its gate bounds."""
    named = dots(mode)
    used = {dot_for(fmt, named) for fmt in formats if fmt in FORMATS}
    return "+".join(d.value for d in named if d in used and d is not Dot.F32) or Dot.F32.value


def dot_mode(value: str | None = None) -> str:
    """The dots `value` (default: $KIPP_JAX_CPU_DOT, else DEFAULT_DOT) asks for, checked
    (`dots`), as a string: JaxBackend reads it at load and keys its programs by it."""
    return "+".join(d.value for d in dots(value or _asked()))


def _asked() -> str:
    """$KIPP_JAX_CPU_DOT as set, unchecked (DEFAULT_DOT when unset)."""
    return os.environ.get(DOT_ENV, DEFAULT_DOT.value)


def available() -> tuple[bool, str]:
    """(True, how it was built) once the kernel is registered with XLA, else (False, why)."""
    return cpu_matmul.library(ENV)


def matmul(x: jax.Array, w: Linear, layer=None, dot: Dot | str | None = None) -> jax.Array:
    """x [M, K] float32 @ W^T -> [M, N] float32, W a "device"-layout Linear of one of FORMATS
    (BF16 and fp16 as themselves or their uint16 bits: no conversion runs), or its planes
    stacked over layers `[L, ...]` and read at `layer` (the kernel indexes the stack: no
    copy). `dot` (a Dot, or a $KIPP_JAX_CPU_DOT value such as "int8+bf16"; default:
    $KIPP_JAX_CPU_DOT, else DEFAULT_DOT): Dot.INT8 quantizes x per block for the quantized
    formats, Dot.BF16 rounds it to bf16 for BF16 weights."""
    if w.fmt not in FORMATS:
        raise ValueError(f"Kipp's stored CPU matmul reads {', '.join(FORMATS)}, not {w.fmt!r}")
    ok, why = cpu_matmul.library()  # built and registered (the switch is the backend's choice)
    if not ok:
        raise RuntimeError(f"Kipp's stored CPU matmul is unavailable: {why}")
    planes = [a for a in (w.w, w.d, w.m) if a is not None]
    if layer is None:
        planes, layer = [a[None] for a in planes], 0
    out = jax.ShapeDtypeStruct((x.shape[0], planes[0].shape[1]), jnp.float32)
    dot = dot_for(w.fmt, dots(dot.value if isinstance(dot, Dot) else dot or _asked()))
    return jax.ffi.ffi_call(target(w.fmt, dot), out)(
        x.astype(jnp.float32), *planes, jnp.asarray(layer, jnp.int32).reshape(1))
