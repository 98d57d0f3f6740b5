"""Decode and prefill speed of JaxBackend (and optionally the reference backend) on one artifact.

    python -m kipp.cuda.bench ARTIFACT [--prompt 128] [--decode 32] [--batch 1,8] [--reference]
    python -m kipp.cuda.bench --layouts        # the CPU weight layouts (kipp.cuda.plan)
    python -m kipp.cuda.bench --matvec         # the stored CPU matmul's one-row GB/s
    python -m kipp.cuda.bench --step-matmuls   # its ms over one 0.6B step's projections, 1 and 8 rows
    python -m kipp.cuda.bench ARTIFACT --compare f32,panels --batch 1,8   # layouts side by side

Reports per configuration: compile seconds, prefill tok/s, decode tok/s (aggregate over the
batch), and the decode roofline: the bytes one decode step streams (the layer weights and the
output head, plus the KV read) over a memory bandwidth measured in the same process (a jitted
reduction over a large array on the same device). Timings are medians of the timed steps after
a warm-up that compiles every bucket the timed steps use.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kipp.backend import EvalItem, blocks_needed
from kipp.formats.artifact import open_artifact
from kipp.formats.registry import HEAD_DIM, KV_HEADS


def memory_bandwidth(device=None, megabytes: int = 512) -> float:
    """Bytes per second a jitted sum reads from a large float32 array on `device` (the best of
    seven runs: the roofline is what the memory can do, not what a noisy run got)."""
    device = device or jax.devices()[0]
    x = jax.device_put(jnp.ones(megabytes * (1 << 20) // 4, jnp.float32), device)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        total(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return x.nbytes / min(times)


def decode_bytes(backend, context: int, batch: int = 1) -> int:
    """Bytes a decode step streams: every layer weight and the head once, KV per sequence."""
    params = backend.params
    layers = sum(a.nbytes for a in jax.tree.leaves(params["layers"]))
    head = params["head"] if params["head"] is not None else params["embed"]
    kv = backend.entry.layers * 2 * context * KV_HEADS * HEAD_DIM * 2
    return layers + head.nbytes + batch * kv


def _timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def bench_prefill(backend, prompt: int, repeats: int = 3) -> dict:
    tokens = tuple(int(t) for t in np.random.default_rng(0).integers(0, 151_643, prompt))
    table = tuple(range(blocks_needed(prompt)))
    backend.eval([EvalItem(tokens, 0, table)])  # compiles
    times = _timed(lambda: backend.eval([EvalItem(tokens, 0, table)]), repeats)
    return {"prefill_tokens": prompt, "prefill_tok_s": prompt / statistics.median(times),
            "prefill_s": times}


def bench_decode(backend, prompt: int, steps: int, batch: int) -> dict:
    """`batch` sequences of `prompt` tokens, then `steps` decode tokens each, batched."""
    blocks = blocks_needed(prompt + steps + 2)
    tables = [tuple(range(b * blocks, (b + 1) * blocks)) for b in range(batch)]
    rng = np.random.default_rng(1)
    prompts = [tuple(int(t) for t in rng.integers(0, 151_643, prompt)) for _ in range(batch)]
    backend.eval([EvalItem(p, 0, t) for p, t in zip(prompts, tables)])
    # warm-up: compile the decode buckets of the first and the last timed position (writing
    # a slot ahead is harmless: earlier positions never see it, and it is rewritten in turn)
    backend.eval([EvalItem((1,), prompt + steps, t) for t in tables])
    backend.eval([EvalItem((1,), prompt, t) for t in tables])
    position = prompt + 1
    times = []
    for _ in range(steps):
        items = [EvalItem((1,), position, t) for t in tables]
        start = time.perf_counter()
        backend.eval(items)
        times.append(time.perf_counter() - start)
        position += 1
    step = statistics.median(times)
    spread = statistics.median(abs(t - step) for t in times)
    return {"batch": batch, "decode_steps": steps, "decode_step_ms": step * 1e3,
            "decode_mad_ms": spread * 1e3, "decode_tok_s": batch / step,
            "context": position}


def run(path, prompt: int, decode: int, batches: list[int], reference: bool, kv_tokens: int,
        jax_path: str, weight_layout: str) -> list[dict]:
    from kipp.cuda.backend import JaxBackend

    artifact = open_artifact(path)
    blocks = blocks_needed(kv_tokens)
    start = time.perf_counter()
    backend = JaxBackend(artifact, blocks, path=jax_path, weight_layout=weight_layout)
    load = time.perf_counter() - start
    bandwidth = memory_bandwidth(backend.device)
    rows = []
    base = {"model": artifact.entry.id, "scheme": artifact.scheme.name,
            "backend": backend.describe(), "device": str(backend.device),
            "jax": jax.__version__, "load_s": load, "bandwidth_gb_s": bandwidth / 1e9}
    prefill = bench_prefill(backend, prompt)
    for batch in batches:
        result = dict(base, **prefill, **bench_decode(backend, prompt, decode, batch))
        streamed = decode_bytes(backend, result["context"], batch)
        result["decode_bytes"] = streamed
        result["roofline_ms"] = streamed / bandwidth * 1e3
        result["roofline_ratio"] = result["decode_step_ms"] / result["roofline_ms"]
        rows.append(result)
    rows[0]["compile_s"] = [(str(b), round(s, 2)) for b, s in backend.compile_log]
    if reference:
        rows.append(_reference_row(artifact, base, min(prompt, 32), min(decode, 4)))
    return rows


def compare(path, weight_layouts: list[str], prompt: int, decode: int, batches: list[int],
            rounds: int, kv_tokens: int) -> str:
    """Prefill and decode (per batch size) of one artifact in several weight layouts (e.g.
    "f32,panels": XLA's dots against Kipp's CPU matmul), every backend loaded in this process
    and visited in turn each round after a warm-up round; medians over the rounds."""
    from kipp.cuda.backend import JaxBackend

    artifact = open_artifact(path)
    backends = {name: JaxBackend(artifact, blocks_needed(kv_tokens), weight_layout=name)
                for name in weight_layouts}
    got = {(name, what): [] for name in backends for what in ["prefill"] + batches}
    for r in range(rounds + 1):
        for name, backend in backends.items():
            prefill = bench_prefill(backend, prompt, repeats=1)["prefill_tok_s"]
            decodes = {b: bench_decode(backend, prompt, decode, b)["decode_tok_s"]
                       for b in batches}
            if r:  # round 0 compiles every bucket: discarded
                got[name, "prefill"].append(prefill)
                for b, value in decodes.items():
                    got[name, b].append(value)
    first = weight_layouts[0]
    lines = [f"{artifact.entry.id} {artifact.scheme.name}: prefill {prompt} tokens, decode "
             f"{decode} steps; tok/s, median of {rounds} interleaved rounds (load "
             f"{os.getloadavg()[0]:.1f}); x = over {first}"]
    for name in backends:
        cells = []
        for what in ["prefill"] + batches:
            value = statistics.median(got[name, what])
            ratio = value / statistics.median(got[first, what])
            label = "prefill" if what == "prefill" else f"decode x{what}"
            cells.append(f"{label} {value:7.2f} ({ratio:4.2f}x)")
        lines.append(f"  {name:7} " + "  ".join(cells))
    for b in batches[1:]:
        scaling = {name: statistics.median(got[name, b]) / statistics.median(got[name, batches[0]])
                   for name in backends}
        lines.append(f"  batch {b} over batch {batches[0]} (aggregate tok/s): "
                     + ", ".join(f"{name} {x:.2f}x" for name, x in scaling.items()))
    return "\n".join(lines)


def _reference_row(artifact, base: dict, prompt: int, decode: int) -> dict:
    from kipp.chooser import open_backend  # through the core: backends never import each other

    ref = open_backend("reference", artifact, blocks_needed(prompt + decode + 2))
    result = dict(base, backend=ref.describe(), compile_s=[])
    result.update(bench_prefill(ref, prompt, repeats=1))
    result.update(bench_decode(ref, prompt, decode, 1))
    return result


def format_table(rows: list[dict]) -> str:
    lines = [f"{'model':34} {'scheme':13} {'backend':30} {'batch':>5} {'prefill tok/s':>13} "
             f"{'decode tok/s':>12} {'step ms':>8} {'roofline ms':>11} {'x roof':>6}"]
    for r in rows:
        roof = r.get("roofline_ms")
        lines.append(
            f"{r['model']:34} {r['scheme']:13} {r['backend'][:30]:30} {r['batch']:5d} "
            f"{r['prefill_tok_s']:13.1f} {r['decode_tok_s']:12.2f} {r['decode_step_ms']:8.2f} "
            f"{roof if roof is not None else float('nan'):11.2f} "
            f"{r.get('roofline_ratio', float('nan')):6.2f}")
    return "\n".join(lines)


def layouts(m_values=(1, 8, 16, 64), rows: int = 3072, cols: int = 1024, layers: int = 8,
            repeats: int = 5) -> str:
    """Weights/s of the CPU's projection paths per weight layout (kipp.cuda.plan's choice):
    XLA's dots on float32, BF16 and packed planes, Kipp's CPU matmul on float32 panels, and
    Kipp's stored CPU matmul on the stored planes ("kipp " rows, and "int8 " rows for its int8
    dot); every layout's calls interleaved per repeat, medians."""
    from kipp.cuda.cpu import matmul as cpu_matmul
    from kipp.cuda.cpu import stored_matmul
    from kipp.cuda.forward import Ops
    from kipp.cuda.layout import Linear

    rng = np.random.default_rng(0)
    groups = cols // 32
    dense = rng.standard_normal((rows, cols)).astype(np.float32)
    shapes = {
        "f32": lambda: Linear(jnp.asarray(dense), fmt="f32"),
        "bf16": lambda: Linear(jnp.asarray(dense, jnp.bfloat16), fmt="bf16"),
        "q8_0": lambda: Linear(jnp.asarray(rng.integers(-127, 127, (rows, groups, 32)), jnp.int8),
                               jnp.asarray(rng.random((rows, groups)), jnp.float16), fmt="q8_0"),
        "scale4": lambda: Linear(jnp.asarray(rng.integers(0, 255, (rows, groups, 16)), jnp.uint8),
                                 jnp.asarray(rng.random((rows, groups)), jnp.float16),
                                 fmt="scale4_gs32"),
        "affine4": lambda: Linear(jnp.asarray(rng.integers(0, 255, (rows, groups, 16)),
                                              jnp.uint8),
                                  jnp.asarray(rng.random((rows, groups)), jnp.float16),
                                  jnp.asarray(rng.random((rows, groups)), jnp.float16),
                                  fmt="affine4_gs32"),
    }
    if cpu_matmul.available()[0]:
        shapes["panels"] = lambda: Linear(jnp.asarray(cpu_matmul.pack(dense)), fmt="f32p")
    ops = dict.fromkeys(shapes, Ops())
    if stored_matmul.available()[0]:
        for kind in ("bf16", "q8_0", "scale4", "affine4"):
            shapes[f"kipp {kind}"], ops[f"kipp {kind}"] = shapes[kind], Ops(cpu_stored=True)
    weights = {kind: [make() for _ in range(layers)] for kind, make in shapes.items()}
    calls = {kind: jax.jit(lambda x, ws, o=o: [o.linear(x, w) for w in ws])
             for kind, o in ops.items()}
    if stored_matmul.available()[0]:  # the int8 dot (KIPP_JAX_CPU_DOT=int8) on the same planes
        for kind in ("q8_0", "scale4", "affine4"):
            shapes[f"int8 {kind}"], weights[f"int8 {kind}"] = shapes[kind], weights[kind]
            calls[f"int8 {kind}"] = jax.jit(lambda x, ws: [
                stored_matmul.matmul(x, w, dot=stored_matmul.Dot.INT8) for w in ws])
    times = {(kind, m): [] for kind in shapes for m in m_values}
    xs = {m: jnp.asarray(rng.standard_normal((m, cols)), jnp.float32) for m in m_values}
    for (kind, m) in times:
        jax.block_until_ready(calls[kind](xs[m], weights[kind]))  # compile
    for _ in range(repeats):
        for (kind, m), got in times.items():
            got += _timed(lambda: jax.block_until_ready(calls[kind](xs[m], weights[kind])), 1)
    lines = [f"projections on {jax.devices()[0].platform}, {layers} x [{rows}, {cols}] weights, "
             f"G weights/s (median of {repeats}, interleaved; load {os.getloadavg()[0]:.1f})"]
    for kind in shapes:
        rates = [f"M={m}: {layers * rows * cols / statistics.median(times[kind, m]) / 1e9:6.2f}"
                 for m in m_values]
        lines.append(f"  {kind:12} " + "  ".join(rates))
    return "\n".join(lines)


# The 0.6B shape's one-row projections: (output rows, input columns, how many per call): the
# attention's input and output, the MLP's, the output head.
MATVEC_SHAPES = ((3072, 1024, 8), (1024, 3072, 8), (151936, 1024, 1))


def _stored_planes(rng, fmt: str, rows: int, cols: int):
    """Random stored planes of one scheme (never zeros: every value and scale varies)."""
    from kipp.cuda.layout import Linear

    groups = cols // 32
    scale = jnp.asarray(rng.random((rows, groups)) + 0.5, jnp.float16)
    if fmt == "bf16":
        return Linear(jnp.asarray(rng.integers(0x3c00, 0x3f80, (rows, cols)), jnp.uint16),
                      fmt=fmt)
    if fmt == "q8_0":
        return Linear(jnp.asarray(rng.integers(-127, 128, (rows, groups, 32)), jnp.int8), scale,
                      fmt=fmt)
    low = jnp.asarray(rng.random((rows, groups)) - 0.5, jnp.float16)
    return Linear(jnp.asarray(rng.integers(0, 256, (rows, groups, 16)), jnp.uint8), scale,
                  low if fmt == "affine4_gs32" else None, fmt=fmt)


def matvec(shapes=MATVEC_SHAPES, repeats: int = 9) -> str:
    """GB/s of stored weight bytes of Kipp's stored CPU matmul at one row, per scheme, dot and
    shape (best of `repeats`; the bytes a decode step streams, over the call's wall time)."""
    from kipp.cuda.cpu import stored_matmul

    ok, why = stored_matmul.available()
    if not ok:
        return f"Kipp's stored CPU matmul is unavailable: {why}"
    rng = np.random.default_rng(0)
    lines = [f"one-row stored matmul, GB/s of weight bytes (best of {repeats}; load "
             f"{os.getloadavg()[0]:.1f})"]
    for fmt in stored_matmul.FORMATS:
        dots = [stored_matmul.Dot.F32] + ([stored_matmul.Dot.INT8]
                                          if fmt in stored_matmul.INT8_FORMATS else [])
        for dot in dots:
            cells = []
            for rows, cols, count in shapes:
                ws = [_stored_planes(rng, fmt, rows, cols) for _ in range(count)]
                x = jnp.asarray(rng.standard_normal((1, cols)), jnp.float32)
                call = jax.jit(lambda x, ws, dot=dot: [stored_matmul.matmul(x, w, dot=dot)
                                                       for w in ws])
                jax.block_until_ready(call(x, ws))
                seconds = min(_timed(lambda: jax.block_until_ready(call(x, ws)), repeats))
                size = sum(a.nbytes for w in ws for a in (w.w, w.d, w.m) if a is not None)
                # significant figures, not decimals: a tiny shape's rate does not print as 0
                cells.append(f"{rows}x{cols}: {size / seconds / 1e9:7.3g}")
            lines.append(f"  {fmt:13} {dot.value:5} " + "  ".join(cells))
    return "\n".join(lines)


def step_matmuls(checkpoint: str = "kipp-synthetic/qwen3-0.6b-shape", m_values=(1, 8),
                 schemes=None, repeats: int = 9) -> str:
    """Milliseconds of Kipp's stored CPU matmul over one decode step's projections at a
    registry shape (every layer's q, k, v, o, gate, up and down in the scheme, then the output
    head in BF16, as kipp.formats.convert keeps it) at M rows, per scheme: what the matmul
    alone costs a step, apart from attention and the rest of the step (random planes, never
    zeros; median and range of `repeats`, interleaved)."""
    from kipp.cuda.cpu import stored_matmul
    from kipp.cuda.layout import Linear
    from kipp.formats.registry import VOCAB_SIZE, get

    ok, why = stored_matmul.available()
    if not ok:
        return f"Kipp's stored CPU matmul is unavailable: {why}"
    schemes = schemes or stored_matmul.FORMATS
    entry, rng = get(checkpoint), np.random.default_rng(0)
    h, a, kv, f = entry.hidden, entry.attention_width, entry.kv_width, entry.intermediate
    shapes = ((a, h), (kv, h), (kv, h), (h, a), (f, h), (f, h), (h, f))  # (N, K) per layer

    def stacked(fmt, n, k):  # [L, ...] planes, read at each layer as the backend does
        layers = [_stored_planes(rng, fmt, n, k) for _ in range(entry.layers)]
        return Linear(*(None if getattr(layers[0], p) is None
                        else jnp.stack([getattr(w, p) for w in layers])
                        for p in ("w", "d", "m")), fmt=fmt)

    def step(xs, planes, head, dot):  # each product summed: XLA drops a call left unused
        outs = [stored_matmul.matmul(xs[k], w, layer=layer, dot=dot).sum()
                for layer in range(entry.layers) for (_, k), w in zip(shapes, planes)]
        return sum(outs) + stored_matmul.matmul(xs[h], head, dot=dot).sum()

    call = jax.jit(step, static_argnums=3)
    inputs = {m: {k: jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
                  for k in {h, a, f}} for m in m_values}
    head = _stored_planes(rng, "bf16", VOCAB_SIZE, h)  # the embedding, tied or not: BF16
    weights = {fmt: ([stacked(fmt, n, k) for n, k in shapes],
                     head) for fmt in schemes}
    # each scheme under the float32 dot and each other that changes its layers (the BF16 dot
    # where this CPU runs it); int8+bf16 runs a quantized scheme's head on the BF16 dot too
    modes = ["f32", "int8"] + (["bf16", "int8+bf16"] if stored_matmul.bf16_dot_supported()[0]
                               else [])
    arms = [(fmt, d) for fmt in schemes for d in modes if d == "f32" or fmt in
            stored_matmul.DOT_FORMATS[stored_matmul.Dot(d.split("+")[0])]]
    times = {(fmt, d, m): [] for fmt, d in arms for m in m_values}
    for fmt, d, m in times:
        jax.block_until_ready(call(inputs[m], *weights[fmt], d))  # compile
    for _ in range(repeats):
        for (fmt, d, m), got in times.items():
            got += _timed(lambda: jax.block_until_ready(call(inputs[m], *weights[fmt], d)), 1)
    lines = [f"{checkpoint}: one step's projections through the stored CPU matmul, ms (median "
             f"[min-max] of {repeats}, interleaved; load {os.getloadavg()[0]:.1f})"]
    for fmt, d in arms:
        cells = [f"M={m}: {statistics.median(times[fmt, d, m]) * 1e3:6.1f} "
                 f"[{min(times[fmt, d, m]) * 1e3:.1f}-{max(times[fmt, d, m]) * 1e3:.1f}]"
                 for m in m_values]
        lines.append(f"  {fmt:13} {d:9} " + "  ".join(cells))
    return "\n".join(lines)


def step_attention(contexts=(160, 1000), sequences=(1, 8), layers: int = 28,
                   repeats: int = 9) -> str:
    """Milliseconds of Kipp's CPU decode attention over one step's `layers` layers: S
    sequences, one query each at a context of C positions, 16 query heads over the 8 KV heads
    of a paged BF16 slab (random bits, never zeros) whose blocks are each sequence's own, so a
    step streams S x C x 28 x 4 KB of K and V (median and range of `repeats`)."""
    from kipp.cuda.cpu import attention

    ok, why = attention.available()
    if not ok:
        return f"Kipp's CPU attention is unavailable: {why}"
    rng = np.random.default_rng(0)
    lines = [f"decode attention over {layers} layers, ms (median [min-max] of {repeats})"]
    for s in sequences:
        per = -(-max(contexts) // 32)  # blocks a sequence holds
        shape = (layers, s * per, 32, KV_HEADS, HEAD_DIM)
        k, v = (jnp.asarray(rng.integers(0x3c00, 0x3f80, shape, dtype=np.uint16))
                for _ in range(2))
        tables = jnp.asarray(np.arange(s * per, dtype=np.int32).reshape(s, per))
        q = jnp.asarray(rng.standard_normal((s, 2 * KV_HEADS, HEAD_DIM)), jnp.float32)
        cells = []
        for c in contexts:
            pos = jnp.full((s,), c - 1, jnp.int32)

            def body(i, q, pos=pos):  # each layer's output feeds the next query: none is dropped
                return q + 1e-30 * attention.decode_attention(q, k, v, pos, tables, layer=i)

            call = jax.jit(lambda q, body=body: jax.lax.fori_loop(0, layers, body, q))
            jax.block_until_ready(call(q))
            times = _timed(lambda call=call: jax.block_until_ready(call(q)), repeats)
            ms = [t * 1e3 for t in times]
            cells.append(f"C={c}: {statistics.median(ms):6.2f} [{min(ms):.2f}-{max(ms):.2f}]")
        lines.append(f"  S={s}  " + "  ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", nargs="?")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--batch", default="1", help="comma-separated batch sizes")
    parser.add_argument("--kv-tokens", type=int, default=4096)
    parser.add_argument("--path", default="auto", help="auto, kernels, twins")
    parser.add_argument("--layout", default="auto", help="auto, f32, device")
    parser.add_argument("--reference", action="store_true", help="also time the reference")
    parser.add_argument("--json", help="append result rows to this JSON-lines file")
    parser.add_argument("--layouts", action="store_true", help="the weight-layout measurement")
    parser.add_argument("--matvec", action="store_true",
                        help="GB/s of the stored CPU matmul at one row, 0.6B-shape projections")
    parser.add_argument("--step-matmuls", action="store_true",
                        help="ms of the stored CPU matmul over one 0.6B-shape step's projections "
                        "at --rows rows, per scheme")
    parser.add_argument("--rows", default="1,8", help="--step-matmuls' row counts, e.g. 1,2,4,8")
    parser.add_argument("--step-attention", action="store_true",
                        help="ms of Kipp's CPU decode attention over one step's 28 layers, 1 and 8 "
                        "sequences at --contexts positions")
    parser.add_argument("--contexts", default="160,1000",
                        help="--step-attention's context lengths, e.g. 160,1000,4000")
    parser.add_argument("--compare", help="weight layouts to time side by side, e.g. f32,panels")
    parser.add_argument("--rounds", type=int, default=3, help="--compare's measured rounds")
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    if args.layouts:
        print(layouts())
        return 0
    if args.matvec:
        print(matvec())
        return 0
    if args.step_attention:
        print(step_attention(contexts=tuple(int(c) for c in args.contexts.split(","))))
        return 0
    if args.step_matmuls:
        print(step_matmuls(m_values=tuple(int(m) for m in args.rows.split(","))))
        return 0
    if not args.artifact:
        parser.error("an artifact path is needed (or --layouts)")
    if args.compare:
        print(compare(args.artifact, args.compare.split(","), args.prompt, args.decode,
                      [int(b) for b in args.batch.split(",")], args.rounds, args.kv_tokens))
        return 0
    rows = run(args.artifact, args.prompt, args.decode, [int(b) for b in args.batch.split(",")],
               args.reference, args.kv_tokens, args.path, args.layout)
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    print(format_table(rows))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
