"""The physical ceiling: measured memory read bandwidth and the decode tok/s it allows.

Single-stream decode reads every projection, the output head and the sequence's KV once per
token, so no engine can decode faster than bandwidth / bytes-per-token (short of keeping weights
in cache, which a 32 MiB L3 cannot do for a 0.6B model). The bandwidth is measured here, in the
same session as the engines, by streaming a large array through numpy reductions on every
usable core; several reduction kernels are tried because some are compute-bound on one core,
and the best kernel's median is the ceiling. Bytes per token come from the artifact's tensor
table (`kipp.formats.artifact.expected_tensors`), so they are the bytes each scheme really stores.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.stats import summarize

# Reductions that read every byte once; numpy releases the GIL inside them, so threads scale.
KERNELS = {
    "max_f32": lambda chunk: np.max(chunk),
    "or_i64": lambda chunk: np.bitwise_or.reduce(chunk.view(np.int64)),
    "sum_f32": lambda chunk: np.sum(chunk),
}


def measure_bandwidth(size_mb: int = 1024, runs: int = 7, threads: int | None = None,
                      kernels=tuple(KERNELS)) -> dict:
    """Read bandwidth in GB/s (1e9 bytes/s): per kernel, every run, and the best median.

    One untimed pass first faults the array in and warms the thread pool."""
    from bench.provenance import usable_cores

    threads = threads or usable_cores()
    data = np.ones(size_mb * (1 << 20) // 4, np.float32)
    chunks = np.array_split(data, threads)
    results = {}
    with ThreadPoolExecutor(threads) as pool:
        for name in kernels:
            kernel = KERNELS[name]
            list(pool.map(kernel, chunks))
            speeds = []
            for _ in range(runs):
                start = time.perf_counter()
                list(pool.map(kernel, chunks))
                speeds.append(data.nbytes / (time.perf_counter() - start) / 1e9)
            results[name] = {"runs": speeds, "summary": summarize(speeds)}
    best = max(results, key=lambda k: results[k]["summary"]["median"])
    return {"unit": "GB/s", "bytes": int(data.nbytes), "threads": threads, "kernels": results,
            "best_kernel": best, "gb_s": results[best]["summary"]["median"],
            "mad": results[best]["summary"]["mad"]}


def decode_bytes_per_token(checkpoint: str, scheme: str, context: int) -> dict:
    """Bytes one decode step streams: every layer tensor, the final norm, the output head (the
    embedding when tied), one embedding row, and K and V of `context` positions."""
    from kipp.formats import registry
    from kipp.formats.artifact import expected_tensors
    from kipp.formats.gguf import tensor_nbytes
    from kipp.formats.quant import scheme as get_scheme

    entry = registry.get(checkpoint)
    specs = expected_tensors(entry, get_scheme(scheme))
    sizes = {s.name: tensor_nbytes(s.ggml_type, s.shape) for s in specs}
    embedding = sizes["token_embd.weight"]
    head = embedding if entry.tied else sizes["output.weight"]
    layers = sum(size for name, size in sizes.items() if name.startswith("blk."))
    row = embedding // registry.VOCAB_SIZE
    kv = entry.kv_bytes_per_token * context
    weights = layers + sizes["output_norm.weight"] + head + row
    return {"weights": weights, "kv": kv, "total": weights + kv, "layers": layers,
            "head": head, "context": context}


def implied_decode(bandwidth_gb_s: float, bytes_per_token: int) -> float:
    """The decode tok/s that `bandwidth_gb_s` allows at `bytes_per_token`."""
    return bandwidth_gb_s * 1e9 / bytes_per_token


def ceiling_block(bandwidth: dict, checkpoint: str, schemes, context: int) -> dict:
    """Bandwidth plus, per scheme, bytes per token and the decode tok/s it implies."""
    per_scheme = {}
    for name in schemes:
        streamed = decode_bytes_per_token(checkpoint, name, context)
        per_scheme[name] = {"bytes_per_token": streamed,
                            "decode_tok_s": implied_decode(bandwidth["gb_s"], streamed["total"])}
    return {"bandwidth": bandwidth, "checkpoint": checkpoint, "mean_context": context,
            "schemes": per_scheme}
