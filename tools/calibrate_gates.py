"""Measure each backend's errors on the gates' calibration set; print them and the bounds.

    KIPP_HOME=... PYTHONPATH=. python tools/calibrate_gates.py [--factor 5] [--backends ...]

The calibration set: every tiny synthetic checkpoint, every weight scheme, kipp.gates'
DEFAULT_PROMPTS. For each backend it measures the worst-row NMSE of: the backend vs
transformers (on the artifact's weights), vs the reference (gate_vs_reference), cached decode
vs recompute, batched vs isolated. kipp/gates/bounds.py's BOUNDS hold the worst of each, times the
factor, rounded up to one significant digit, with the measured value beside it.
"""

from __future__ import annotations

import argparse
import math
import sys

TINY = ("kipp-synthetic/qwen3-tiny", "kipp-synthetic/qwen3-tiny-base",
        "kipp-synthetic/qwen3-tiny-untied")
SCHEMES = ("bf16", "q8_0", "affine4_gs32", "scale4_gs32")


def round_up(x: float) -> float:
    """x rounded up to one significant digit (0 stays 0)."""
    if x <= 0:
        return 0.0
    e = math.floor(math.log10(x))
    return math.ceil(x / 10 ** e) * 10 ** e


def measure(model, want) -> dict[str, float]:
    """Worst-row NMSE of each comparison for one model (gates.BOUNDS are infinite here)."""
    from kipp import gates

    tokens = [model.tokenizer.encode(p) for p in gates.DEFAULT_PROMPTS]
    got = [gates.all_position_logits(model, t) for t in tokens]
    out = {"transformers": max(gates.nmse(g, w) for a, b in zip(got, want)
                               for g, w in zip(a, b))}
    if model.backend.name != "reference":
        out["reference"] = gates.gate_vs_reference(model).metric
    out["cached_decode"] = gates.gate_cached_decode(model).metric
    out["batched"] = gates.gate_batched(model).metric
    return out


def main(argv=None) -> int:
    from kipp import gates
    from kipp.formats.store import ensure_artifact, source_folder
    from kipp.model import load

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factor", type=float, default=5.0)
    parser.add_argument("--backends", nargs="+", default=["reference", "jax", "mlx"])
    parser.add_argument("--checkpoints", nargs="+", default=list(TINY))
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    args = parser.parse_args(argv)
    for backend in gates.BOUNDS.values():  # measure, never stop at a bound
        for gate in backend:
            backend[gate] = float("inf")
    worst: dict[str, dict[str, float]] = {}  # by BOUNDS key
    for checkpoint in args.checkpoints:
        source = source_folder(checkpoint, progress=False)
        for scheme in args.schemes:
            path = ensure_artifact(checkpoint, scheme, progress=False)
            want = None
            for backend in args.backends:
                model = load(path, backend=backend, progress=False)
                if want is None:
                    tokens = [model.tokenizer.encode(p) for p in gates.DEFAULT_PROMPTS]
                    want = gates.transformers_logits(source, tokens, scheme)
                row = measure(model, want)
                key = gates.bound_key(model.backend)  # e.g. "jax-int8" under the int8 dot
                cells = "  ".join(f"{k} {v:.2e}" for k, v in row.items())
                print(f"{checkpoint:34} {scheme:13} {key:10} {cells}", flush=True)
                measured = worst.setdefault(key, {})
                for k, v in row.items():
                    measured[k] = max(measured.get(k, 0.0), v)
                del model
    print(f"\nworst per backend and gate -> bound (x{args.factor:g}, one significant digit up)")
    for backend, gates_worst in worst.items():
        for gate, value in gates_worst.items():
            b = round_up(value * args.factor)
            ratio = b / value if value else float("nan")
            print(f"  {backend:10} {gate:14} measured {value:.2e}  bound {b:.0e}  "
                  f"(x{ratio:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
