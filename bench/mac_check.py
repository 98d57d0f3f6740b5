"""The Mac check's tables: every MLX kernel against its twin and the numpy reference, and the
whole model on the Metal kernels against the reference backend (bench/mac_check.sh runs this).

    python -m bench.mac_check kernels     # kernel vs twin vs reference, one row per case
    python -m bench.mac_check gates       # whole model, kernels on, every scheme

Each row prints the NMSE of the kernel against the reference (numpy in float64 on the weights
kipp.formats.quant decodes; for attention, the gathered-page twin), of the twin against the same,
and the median time of each over a few runs (after one warm-up that compiles the kernel). Exit
status 1 when any row misses its bound. Without Metal it says so and exits 2: there is nothing
to compare.
"""

from __future__ import annotations

import sys
import time

import numpy as np

KERNEL_BOUND = 1e-10  # float32 arithmetic on exact weights: only summation order differs
MODEL_BOUND = 1e-4


def _median_ms(fn, runs: int = 5) -> float:
    import mlx.core as mx

    mx.eval(fn())  # warm-up: compiles the kernel for these template values
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def _linear_rows(rng) -> list[tuple]:
    import mlx.core as mx

    from kipp.apple import layout, linear, repack
    from kipp.formats import quant

    rows = []
    for fmt in linear.FORMATS:
        for n, k, m in ((1024, 1024, 1), (3072, 1024, 1), (1024, 3072, 4), (3072, 1024, 77),
                        (1024, 1024, 512)):
            w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
            raw = quant.quantize(w, fmt)
            dense = quant.dequantize(raw, fmt, k)
            if fmt == "bf16":
                kern = linear.Linear(fmt, n, k, planes=(mx.array(raw.view("<u2")),))
                twin = layout.twin_of(dense, "f32", k)
            else:
                p = repack.to_planes(raw, fmt, k)
                kern = linear.Linear(fmt, n, k, planes=tuple(
                    mx.array(a) for a in (p.q, p.d, p.m) if a is not None))
                twin = layout.twin_of(raw, fmt, k)
            x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
            want = np.asarray(x, np.float64) @ dense.astype(np.float64).T
            got_k = np.array(linear.linear_kernel(x, kern))
            got_t = np.array(linear.linear_twin(x, twin))
            name = "matvec" if m <= linear.MATVEC_ROWS else "matmul"
            rows.append((f"{name} {fmt}", f"M={m} N={n} K={k}", _nmse(got_k, want),
                         _nmse(got_t, want), _median_ms(lambda: linear.linear_kernel(x, kern)),
                         _median_ms(lambda: linear.linear_twin(x, twin))))
    return rows


def _attention_rows(rng) -> list[tuple]:
    import mlx.core as mx

    from kipp.apple import attention
    from kipp.apple.kvcache import dequantize_q8_0
    from kipp.formats import kvquant

    rows = []
    for kv in ("bf16", "q8_0"):
        for heads, length in ((16, 40), (16, 2000), (32, 8000)):
            blocks = -(-length // 32)
            slots = (blocks + 8) * 32
            k = rng.standard_normal((slots, 8, 128)).astype(np.float32)
            v = rng.standard_normal((slots, 8, 128)).astype(np.float32)
            if kv == "bf16":
                kb, vb = (mx.array(a).astype(mx.bfloat16) for a in (k, v))
                planes = (kb.view(mx.uint16), vb.view(mx.uint16))
                dense = (kb.astype(mx.float32), vb.astype(mx.float32))
            else:
                (kq, kd), (vq, vd) = kvquant.quantize(k), kvquant.quantize(v)
                planes = (mx.array(kq), mx.array(kd.view(np.uint16)), mx.array(vq),
                          mx.array(vd.view(np.uint16)))
                dense = (dequantize_q8_0(mx.array(kq), mx.array(kd)),
                         dequantize_q8_0(mx.array(vq), mx.array(vd)))
            table = rng.permutation(blocks + 8)[:blocks].astype(np.int32)
            q = mx.array(rng.standard_normal((1, heads, 128)).astype(np.float32))
            tables, lengths = mx.array(table[None]), mx.array([length], mx.int32)
            visible = mx.array((table[np.arange(length) // 32] * 32 + np.arange(length) % 32)
                               .astype(np.int32))

            def kernel():
                return attention.decode_attention(q, planes, tables, lengths, kv)

            def twin():
                return attention.attention_twin(q, dense[0][visible], dense[1][visible])

            want = _attend64(np.array(q), np.array(dense[0][visible]),
                             np.array(dense[1][visible]))
            rows.append((f"decode attention {kv} KV", f"H={heads} context={length}",
                         _nmse(np.array(kernel()), want), _nmse(np.array(twin()), want),
                         _median_ms(kernel), _median_ms(twin)))
    return rows


def _attend64(q, k, v):
    """numpy float64 attention of one query per head over all positions: [1, H * 128]."""
    heads = q.shape[1]
    group = heads // 8
    out = np.empty((heads, 128))
    for h in range(heads):
        scores = k[:, h // group].astype(np.float64) @ q[0, h].astype(np.float64) / np.sqrt(128)
        w = np.exp(scores - scores.max())
        out[h] = (w / w.sum()) @ v[:, h // group].astype(np.float64)
    return out.reshape(1, -1)


def _nmse(a, b) -> float:
    from kipp.gates import nmse

    return nmse(a, b)


def kernels() -> int:
    rng = np.random.default_rng(0)
    rows = _linear_rows(rng) + _attention_rows(rng)
    print(f"{'kernel':<28} {'shape':<26} {'NMSE kernel':>12} {'NMSE twin':>12} "
          f"{'kernel ms':>10} {'twin ms':>10}  verdict")
    failed = 0
    for name, shape, nk, nt, tk, tt in rows:
        ok = nk <= KERNEL_BOUND
        failed += not ok
        print(f"{name:<28} {shape:<26} {nk:12.2e} {nt:12.2e} {tk:10.3f} {tt:10.3f}  "
              f"{'ok' if ok else 'FAIL'}")
    print(f"{len(rows) - failed}/{len(rows)} kernel rows within NMSE {KERNEL_BOUND:g} of the "
          f"reference")
    return 1 if failed else 0


def gates() -> int:
    """Whole model on the kernels vs the reference: prefill (every position) and decode."""
    from kipp import gates as g
    from kipp.apple.backend import MLXBackend
    from kipp.backend import EvalItem
    from kipp.formats.artifact import open_artifact
    from kipp.formats.store import ensure_artifact
    from kipp.reference.backend import ReferenceBackend

    print(f"{'checkpoint':<34} {'scheme':<13} {'KV':<5} {'worst NMSE':>11} {'argmax':>8}  verdict")
    failed = 0
    for checkpoint in ("kipp-synthetic/qwen3-tiny", "kipp-synthetic/qwen3-tiny-untied"):
        for scheme in ("bf16", "q8_0", "affine4_gs32", "scale4_gs32"):
            artifact = open_artifact(ensure_artifact(checkpoint, scheme, progress=False))
            for kv in ("bf16", "q8_0"):
                ref = ReferenceBackend(artifact, 8, kv_scheme=kv)
                mb = MLXBackend(artifact, 8, path="kernels", kv_scheme=kv)
                table = (5, 2, 7)
                tokens = tuple(int(t) for t in np.random.default_rng(0).integers(0, 151_643, 30))
                items = [EvalItem(tokens, 0, table, 30)]
                worst, agree, total = 0.0, 0, 0
                for step in range(5):
                    [want], [got] = ref.eval(items), mb.eval(items)
                    worst = max(worst, g.nmse(got, want))
                    differ, ties = g.argmax_check(got, want)
                    agree += len(want) - (differ - ties)
                    total += len(want)
                    items = [EvalItem((int(want[-1].argmax()),), 30 + step, table)]
                ok = worst <= MODEL_BOUND and agree == total
                failed += not ok
                print(f"{checkpoint:<34} {scheme:<13} {kv:<5} {worst:11.2e} "
                      f"{agree:>4}/{total:<3}  {'ok' if ok else 'FAIL'}")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    import mlx.core as mx

    if not mx.metal.is_available():
        print("no Metal device (mx.metal.is_available() is False): nothing to check here")
        return 2
    commands = {"kernels": kernels, "gates": gates}
    if len(argv) != 1 or argv[0] not in commands:
        print(f"usage: python -m bench.mac_check {{{','.join(commands)}}}")
        return 2
    return commands[argv[0]]()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
