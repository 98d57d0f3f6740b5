"""KV disk tier restore bandwidth against this machine's disk, and a model of a 20k-token
restore at Qwen3-4B on an M-series SSD.

    python -m bench.kv_restore [--checkpoint ID] [--backend jax] [--tokens 2000] [--runs 3]
                               [--out FILE.json]

One run, same process, same folder (a temporary one under --folder's parent, default
$KIPP_HOME):
1. A prompt of --tokens random ids is evaluated and its blocks written (kipp.engine.kv_disk).
2. Disk read bandwidth: a scratch file of the same bytes (random, not zeros) is written,
   fsynced, dropped from the page cache (posix_fadvise DONTNEED) and read back in 16 MiB
   reads: `disk_read_gbps` (cold) and, read again, `page_cache_gbps`.
3. Restore, --runs times each way: a restarted Model (empty pool and slab) restores the prompt's
   blocks: read + verify (DiskTier.read_run) and the import into the slab
   (Backend.write_blocks, waited for). `cold`: the block files dropped from the page cache
   first; `warm`: left in it. Restore bandwidth is block-file bytes over read + verify + import
   seconds; `restore_over_disk` is the cold restore bandwidth over disk_read_gbps.
4. The 20k-token model (printed with its inputs): a restore is sequential reads, then CPU work
   proportional to the bytes, then the prompt's last partial block evaluated:
       ttft = bytes / ssd_gbps + bytes / pipeline_gbps + tail_tokens / prefill_tok_s
   bytes: 19,968 tokens (624 blocks) of Qwen3-4B BF16 KV (36 layers x K, V x 8 heads x 128 x 2
   bytes = 147,456 bytes a token) plus headers; ssd_gbps (--ssd-gbps, default 5: an M-series
   internal SSD's sequential read); pipeline_gbps: this run's warm restore bandwidth (verify +
   import on this CPU; a Mac's cores are not slower per byte); tail: the prompt's new partial
   block, at most 31 tokens (1 for a repeated prompt, its tail restored too), at
   --prefill-tok-s (default 4,000: ~5 s for 20k tokens at 4B on a Mac).
Every measured figure is a median over the runs, with all runs kept.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kipp.backend import KV_BLOCK

CHUNK = 16 << 20
FOUR_B_LAYERS = 36  # Qwen3-4B (kipp.formats.registry)
PREFIX_20K = 20_000


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_seconds(path: Path) -> float:
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(CHUNK):
            pass
    return time.perf_counter() - start


def disk_bandwidth(folder: Path, size: int) -> dict:
    """Cold (page cache dropped) and warm sequential read GB/s of a `size`-byte file."""
    path = folder / "scratch.bin"
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(CHUNK, left)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n
    _drop_cache(path)
    cold = _read_seconds(path)
    warm = _read_seconds(path)
    path.unlink()
    return {"disk_read_gbps": size / cold / 1e9, "page_cache_gbps": size / warm / 1e9}


def restore_once(model, ids: list[int], cold: bool) -> dict:
    """Seconds to read + verify and to import every full block of `ids` into an empty slab."""
    tier, pool, backend = model.kv_disk.tier, model.pool, model.backend
    full = len(ids) // KV_BLOCK
    if cold:
        for path in tier.dir.glob("*.kvb"):
            _drop_cache(path)
    start = time.perf_counter()
    payloads = tier.read_run(ids, 0, full)
    read = time.perf_counter() - start
    if len(payloads) != full:
        raise SystemExit(f"only {len(payloads)} of {full} blocks were on disk")
    blocks = pool.allocate(full)
    start = time.perf_counter()
    backend.write_blocks(blocks, payloads)
    _wait(backend)
    imported = time.perf_counter() - start
    pool.release(blocks)
    size = full * tier.file_bytes
    return {"read_verify_s": read, "import_s": imported, "bytes": size,
            "restore_gbps": size / (read + imported) / 1e9}


def _wait(backend) -> None:
    kv = getattr(backend, "kv", None)
    if kv is not None:
        import jax

        jax.block_until_ready(kv)


def predict_20k(pipeline_gbps: float, ssd_gbps: float, prefill_tok_s: float,
                file_overhead: int) -> dict:
    tokens = PREFIX_20K // KV_BLOCK * KV_BLOCK
    per_token = FOUR_B_LAYERS * 2 * 8 * 128 * 2
    size = tokens * per_token + tokens // KV_BLOCK * file_overhead
    tail = KV_BLOCK - 1
    parts = {"read_s": size / (ssd_gbps * 1e9), "verify_import_s": size / (pipeline_gbps * 1e9),
             "tail_prefill_s": tail / prefill_tok_s}
    return {"bytes": size, "ssd_gbps": ssd_gbps, "pipeline_gbps": pipeline_gbps,
            "prefill_tok_s": prefill_tok_s, **parts, "ttft_s": sum(parts.values()),
            "cold_prefill_s": PREFIX_20K / prefill_tok_s}


def main(argv: list[str] | None = None) -> int:
    from kipp.formats.store import home
    from kipp.model import load

    p = argparse.ArgumentParser(prog="python -m bench.kv_restore", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="kipp-synthetic/qwen3-0.6b-shape")
    p.add_argument("--backend", default="jax", choices=("jax", "reference"))
    p.add_argument("--tokens", type=int, default=2000, help="prompt tokens (>= 64)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--ssd-gbps", type=float, default=5.0)
    p.add_argument("--prefill-tok-s", type=float, default=4000.0)
    p.add_argument("--folder", type=Path, default=None,
                   help="where the scratch tier goes (default: under $KIPP_HOME)")
    p.add_argument("--out", type=Path, help="also write the record as JSON here")
    args = p.parse_args(argv)
    if args.tokens < 2 * KV_BLOCK or args.runs < 1:
        p.error("--tokens must be >= 64 and --runs >= 1")
    parent = args.folder or home()
    parent.mkdir(parents=True, exist_ok=True)
    ids = [int(t) for t in np.random.default_rng(4).integers(1, 100_000, args.tokens)]
    with tempfile.TemporaryDirectory(dir=parent, prefix="kv-restore-") as tmp:
        folder = Path(tmp)
        kv_tokens = max(2048, -(-args.tokens // KV_BLOCK) * KV_BLOCK * 2)

        def model():
            return load(args.checkpoint, backend=args.backend, kv_tokens=kv_tokens,
                        progress=False, kv_cache_dir=folder)

        first = model()
        first.cache_prompt(ids)
        describe = first.backend.describe()
        del first
        restarted = model()
        tier = restarted.kv_disk.tier
        size = len(ids) // KV_BLOCK * tier.file_bytes
        disk = disk_bandwidth(folder, size)
        restore_once(restarted, ids, cold=False)  # warm-up: compiles the import
        runs = {"cold": [], "warm": []}
        for _ in range(args.runs):
            for kind in runs:
                runs[kind].append(restore_once(restarted, ids, cold=kind == "cold"))
        median = {kind: statistics.median(r["restore_gbps"] for r in rs)
                  for kind, rs in runs.items()}
        record = {
            "bench": "kv_restore", "checkpoint": args.checkpoint, "backend": describe,
            "tokens": args.tokens, "blocks": len(ids) // KV_BLOCK, "bytes": size, **disk,
            "restore_cold_gbps": median["cold"], "restore_warm_gbps": median["warm"],
            "restore_over_disk": median["cold"] / disk["disk_read_gbps"], "runs": runs,
            "predicted_20k_4b_m_series": predict_20k(median["warm"], args.ssd_gbps,
                                                     args.prefill_tok_s,
                                                     tier.file_bytes - tier.block_bytes),
        }
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    pred = record["predicted_20k_4b_m_series"]
    print(f"restore {median['cold']:.2f} GB/s cold, {median['warm']:.2f} GB/s warm; disk read "
          f"{disk['disk_read_gbps']:.2f} GB/s; predicted 20k-token 4B TTFT on an M-series SSD "
          f"{pred['ttft_s']:.2f} s (cold prefill {pred['cold_prefill_s']:.1f} s)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
