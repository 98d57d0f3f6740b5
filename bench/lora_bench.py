"""LoRA overhead: decode and prefill with an unmerged adapter vs the base, and a batch over many.

    .venv/bin/python bench/lora_bench.py                 # the record run: JAX, the 0.6B shape
    .venv/bin/python bench/lora_bench.py --checkpoint kipp-synthetic/qwen3-tiny \\
        --backend reference --ranks 8 --decode 2 --prefill 16 --runs 1 --warmup 0  # smoke

Adapters are written here in PEFT's layout (every projection of every layer, random nonzero A
and B, seeded) at each `--ranks` rank, and loaded through kipp.lora like a user's. Arms, each
interleaved per round after `--warmup` rounds that compile every shape:
- `base` and `rank R`: one stream, a `--prefill`-token prompt (prefill tok/s), then `--decode`
  tokens fed one at a time (decode tok/s);
- `8 streams base` and `8 streams over 4 adapters` (rank 16; streams i under adapter i % 4):
  one decode step of all eight per eval, aggregate tok/s.
The overhead is the median over rounds of 1 - arm / base. Goal: <= 15% at rank 16, one stream.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import provenance, records  # noqa: E402

CHECKPOINT = "kipp-synthetic/qwen3-0.6b-shape"
RANKS = (8, 16, 64)
MULTI_RANK, STREAMS, ADAPTERS = 16, 8, 4
GOALS = {"rank 16 decode overhead": 0.15}
MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
           "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
           "down": "mlp.down_proj"}


def write_adapter(folder: Path, entry, rank: int, seed: int) -> Path:
    """A PEFT-layout adapter on every projection: A ~ U(+-1/sqrt(in)) (PEFT's bound), B
    random and nonzero, alpha = rank (s = 1)."""
    from safetensors.numpy import save_file

    from kipp.lora.adapter import projection_shape

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(entry.layers):
        for proj, module in MODULES.items():
            out, inp = projection_shape(entry, proj)
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.uniform(
                -inp ** -0.5, inp ** -0.5, (rank, inp)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out, rank)) * 0.01
                                               ).astype(np.float32)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "base_model_name_or_path": entry.id, "r": rank,
        "lora_alpha": rank, "target_modules": [m.split(".")[1] for m in MODULES.values()],
        "bias": "none"}))
    return folder


def single_stream(model, adapter, prompt, decode: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one stream."""
    with model.session(len(prompt) + decode + 1, adapter=adapter) as s:
        start = time.perf_counter()
        logits = s.eval(prompt)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(decode):
            logits = s.eval([int(logits[-1].argmax())])
        return len(prompt) / prefill, decode / (time.perf_counter() - start)


def many_streams(model, adapters, prompts, decode: int) -> float:
    """Aggregate decode tok/s of one eval per step over every stream."""
    sessions = [model.session(len(p) + decode + 1, adapter=a) for p, a in zip(prompts, adapters)]
    try:
        rows = model.eval_batch([(s, p, 1) for s, p in zip(sessions, prompts)])
        start = time.perf_counter()
        for _ in range(decode):
            rows = model.eval_batch([(s, [int(r[-1].argmax())], 1)
                                     for s, r in zip(sessions, rows)])
        return len(sessions) * decode / (time.perf_counter() - start)
    finally:
        for s in sessions:
            s.close(publish=False)  # every round prefills afresh


def measure(model, args) -> dict[str, list]:
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, 151_643, args.prefill)]
    prompts = [[int(t) for t in rng.integers(0, 151_643, args.prefill)] for _ in range(STREAMS)]
    multi = [f"multi-{i % ADAPTERS}" for i in range(STREAMS)]
    arms = {"base": None, **{f"rank {r}": f"rank-{r}" for r in args.ranks}}
    values: dict[str, list] = {}
    for round_ in range(args.warmup + args.runs):
        keep = round_ >= args.warmup
        for arm, adapter in arms.items():
            prefill, decode = single_stream(model, adapter, prompt, args.decode)
            if keep:
                values.setdefault(f"{arm} prefill", []).append(prefill)
                values.setdefault(f"{arm} decode", []).append(decode)
        for arm, names in ((f"{STREAMS} streams base", [None] * STREAMS),
                           (f"{STREAMS} streams over {ADAPTERS} adapters", multi)):
            rate = many_streams(model, names, prompts, args.decode)
            if keep:
                values.setdefault(arm, []).append(rate)
    return values


def overheads(values: dict[str, list], ranks) -> dict[str, float]:
    """Median over rounds of 1 - arm / base, per arm."""
    out = {}
    for r in ranks:
        for kind in ("prefill", "decode"):
            ratio = np.asarray(values[f"rank {r} {kind}"]) / np.asarray(values[f"base {kind}"])
            out[f"rank {r} {kind} overhead"] = float(np.median(1 - ratio))
    multi = np.asarray(values[f"{STREAMS} streams over {ADAPTERS} adapters"])
    out[f"{STREAMS} streams over {ADAPTERS} adapters overhead"] = float(
        np.median(1 - multi / np.asarray(values[f"{STREAMS} streams base"])))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=CHECKPOINT)
    parser.add_argument("--backend", default="jax", choices=("jax", "mlx", "reference"))
    parser.add_argument("--scheme", default="bf16")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS))
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens")
    parser.add_argument("--decode", type=int, default=64, help="decode steps per arm")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--results", type=Path, default=records.RESULTS)
    args = parser.parse_args(argv)

    import kipp
    from kipp.formats import registry

    entry = registry.get(args.checkpoint)
    with tempfile.TemporaryDirectory() as scratch:
        folders = {f"rank-{r}": write_adapter(Path(scratch) / f"rank-{r}", entry, r, r)
                   for r in args.ranks}
        folders.update({f"multi-{i}": write_adapter(Path(scratch) / f"multi-{i}", entry,
                                                    MULTI_RANK, 100 + i)
                        for i in range(ADAPTERS)})
        model = kipp.load(args.checkpoint, backend=args.backend, scheme=args.scheme,
                          kv_tokens=max(4096, 2 * STREAMS * (args.prefill + args.decode + 32)),
                          progress=False, adapters=folders)
        start = time.perf_counter()
        values = measure(model, args)
    summary = overheads(values, args.ranks)
    command = "python bench/lora_bench.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    record = records.new(
        "throughput", command, records.checkpoint_block(args.checkpoint), provenance.collect(),
        workload={"name": "lora", "prefill": args.prefill, "decode": args.decode,
                  "ranks": args.ranks, "streams": STREAMS, "adapters": ADAPTERS,
                  "scheme": args.scheme, "backend": model.backend.describe()},
        protocol={"warmup": args.warmup, "runs": args.runs, "interleaved": True,
                  "seconds": time.perf_counter() - start},
        arms=[], values=values, overheads=summary, goals=GOALS)
    path = records.write(record, args.results)
    for arm, rates in values.items():
        print(f"{arm:32s} {np.median(rates):10.1f} tok/s")
    for name, value in summary.items():
        print(f"{name:40s} {value:+.1%}")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
