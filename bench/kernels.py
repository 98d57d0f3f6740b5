"""`python -m bench kernels`: compile every Pallas kernel at every registry shape for an H200
(sm_90a) on this CPU-only machine, and write what ptxas and the launch say about each, with a
roofline estimate, to bench/results/<time>-kernels-h200.json; then render the kernel tables of
bench/results/kernels-h200.md from the newest such file (`--render-only` skips the compile).

Per kernel and shape (kipp.cuda.pallas.kernel_shapes): registers, spill stores and loads, stack
frame, dynamic shared memory, tensor-core instructions in the PTX, compile seconds, and the
FLOPs and bytes the call must do. Roofline time = max(bytes / 4.8 TB/s, FLOPs / peak), where
peak is the H200's dense BF16 tensor rate for kernels whose PTX holds BF16 tensor-core
instructions and its float32 CUDA-core rate otherwise. The predicted tok/s add up those
times over one step of a checkpoint (every layer's projections and attention, and the head),
nothing else: XLA's own ops between the kernels (norms, RoPE, the KV store) and launch gaps
are left out, so the predictions are upper bounds that a lent GPU checks
(bench/device_check.sh).
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from bench.provenance import REPO

RESULTS = Path(__file__).resolve().parent / "results"
PAGE = Path(__file__).resolve().parent / "results" / "kernels-h200.md"
SCHEMA = "kipp-kernels/1"
HBM_BYTES_PER_S = 4.8e12  # H200 SXM HBM3e
BF16_TENSOR_FLOPS = 989e12  # H200 SXM dense BF16 tensor cores
F32_FLOPS = 67e12  # H200 SXM float32 on the CUDA cores
PREDICTED = ("0.6B", "4B", "8B")
BEGIN, END = "<!-- bench:kernels:begin", "<!-- bench:kernels:end -->"
HOSTS_BEGIN, HOSTS_END = "<!-- bench:multihost:begin", "<!-- bench:multihost:end -->"
HOSTS_CHECKPOINT = "Qwen/Qwen3-32B"


def compile_all(cases, log=print) -> list[dict]:
    """One row per case: the compile's kernel stats, or the error it raised."""
    from kipp.cuda import aot

    rows = []
    for i, case in enumerate(cases):
        fn, args = case.build()
        row = {"kernel": case.kernel, "variant": case.variant, "shape": case.shape,
               "where": case.where, "flops": case.flops, "bytes": case.bytes}
        try:
            build = aot.compile_for_h200(fn, *args)
            [k] = build.kernels
            row.update(status="ok", name=k.name, registers=k.registers,
                       spill_stores=k.spill_stores, spill_loads=k.spill_loads, stack=k.stack,
                       shared_memory=k.shared_memory, grid=list(k.grid), threads=k.threads,
                       mma=k.mma, f32_ops=k.f32_ops, compile_s=round(build.seconds, 2))
        except Exception as e:  # the report records a failed compile; it does not stop
            row.update(status="failed", error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
        row.update(roofline(row))
        rows.append(row)
        log(f"[{i + 1}/{len(cases)}] {case.id:44s} {_brief(row)}")
    return rows


def roofline(row: dict) -> dict:
    """Predicted seconds of one call at the H200's bandwidth or its compute peak."""
    tensor = any(k.endswith("bf16") for k in row.get("mma", {}))
    peak = BF16_TENSOR_FLOPS if tensor else F32_FLOPS
    memory, compute = row["bytes"] / HBM_BYTES_PER_S, row["flops"] / peak
    return {"roofline_s": max(memory, compute),
            "bound": "memory" if memory >= compute else "compute"}


def _brief(row: dict) -> str:
    if row["status"] != "ok":
        return "FAILED " + row["error"][:120]
    tensor = ",".join(row["mma"]) or "cuda-cores"
    return (f"{row['registers']:3d} regs  spill {row['spill_stores']}/{row['spill_loads']} B  "
            f"smem {row['shared_memory'] // 1024} KiB  {tensor}  {row['compile_s']:.1f} s")


def predictions(rows: list[dict]) -> list[dict]:
    """Predicted decode (1 sequence, 2,048 positions) and prefill (a 512-token chunk) tok/s
    per checkpoint and weight format, from the kernels' roofline times."""
    from kipp.cuda.pallas import kernel_shapes as ks
    from kipp.formats import registry

    out = []
    for size in PREDICTED:
        entry = registry.get(f"Qwen/Qwen3-{size}")
        for fmt in ks.WEIGHT_FORMATS:
            decode = _step_seconds(rows, entry, fmt, 1, "decode_attention", "S=1 ")
            prefill = _step_seconds(rows, entry, fmt, ks.PREFILL_TOKENS, "prefill_attention",
                                    "S=1 ")
            out.append({"checkpoint": size, "scheme": fmt,
                        "decode_tok_s": None if decode is None else 1 / decode,
                        "prefill_tok_s": None if prefill is None else
                        ks.PREFILL_TOKENS / prefill})
    return out


def _step_seconds(rows, entry, fmt, m, attention, prefix):
    from kipp.cuda.pallas import kernel_shapes as ks

    by_shape = {(r["kernel"], r["variant"], r["shape"]): r for r in rows}
    calls = {"q": 1, "k/v": 2, "o": 1, "gate/up": 2, "down": 1}
    total = 0.0
    for name, (n, k) in ks.projections(entry).items():
        head = name == "head"
        key = ("matmul", "bf16" if head else fmt, f"M={1 if head else m} N={n} K={k}")
        if key not in by_shape:
            return None
        total += by_shape[key]["roofline_s"] * (1 if head else calls[name] * entry.layers)
    found = [r for r in rows if r["kernel"] == attention and r["variant"] == "bf16"
             and r["shape"].startswith(prefix) and f" H={entry.query_heads} " in r["shape"]]
    if not found:
        return None
    return total + found[0]["roofline_s"] * entry.layers


def record(rows: list[dict], command: str, seconds: float) -> dict:
    import jax

    from kipp.cuda import aot

    return {"schema": SCHEMA, "type": "kernels", "target": f"{aot.DEVICE_KIND} {aot.ARCH}",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command,
            "provenance": {"git": _git(), "jax": jax.__version__, "ptxas": _ptxas_version(),
                           "python": platform.python_version(), "machine": platform.node(),
                           "load_average": _load(), "seconds": round(seconds, 1)},
            "roofline": {"hbm_bytes_per_s": HBM_BYTES_PER_S,
                         "bf16_tensor_flops": BF16_TENSOR_FLOPS, "f32_flops": F32_FLOPS},
            "kernels": rows, "predicted": predictions(rows)}


def _git() -> str:
    import subprocess

    run = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                         capture_output=True, text=True)
    return run.stdout.strip()


def _ptxas_version() -> str:
    import subprocess

    from kipp.cuda import aot

    run = subprocess.run([str(aot.ptxas()), "--version"], capture_output=True, text=True)
    return run.stdout.strip().splitlines()[-1] if run.stdout else "unknown"


def _load() -> list[float]:
    import os

    return [round(x, 2) for x in os.getloadavg()]


def write(rec: dict, results: Path = RESULTS, kind: str = "kernels") -> Path:
    results.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d-%H%M%S", time.gmtime())
    path = results / f"{stamp}-{kind}-h200.json"
    path.write_text(json.dumps(rec, indent=1) + "\n")
    return path


def latest(results: Path = RESULTS, kind: str = "kernels") -> dict | None:
    found = sorted(results.glob(f"*-{kind}-h200.json"))
    return json.loads(found[-1].read_text()) if found else None


def compile_hosts(hosts: int = 2, per_host: int = 8) -> dict:
    """The pipelined decode step of HOSTS_CHECKPOINT on hosts x per_host abstract H200s
    (kipp.cuda.aot_hosts): its kernels' registers and spills, and its collectives."""
    from kipp.cuda import aot_hosts
    from kipp.formats import registry

    entry = registry.get(HOSTS_CHECKPOINT)
    row = {"checkpoint": entry.id, "scheme": "bf16", "hosts": hosts, "per_host": per_host,
           "step": "decode, 8 sequences", "layers_per_host": entry.layers // hosts}
    try:
        build, counts, _ = aot_hosts.compile_pipelined(entry, hosts, per_host)
    except Exception as e:  # the report records a failed compile
        return dict(row, status="failed", error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    ks = build.kernels
    return dict(row, status="ok", compile_s=round(build.seconds, 2), kernels=len(ks),
                registers=max(k.registers for k in ks), spill_bytes=sum(k.spills for k in ks),
                stack_bytes=sum(k.stack for k in ks), collectives=counts)


def hosts_record(row: dict, command: str, seconds: float) -> dict:
    rec = record([], command, seconds)
    del rec["kernels"], rec["predicted"], rec["roofline"]
    return dict(rec, type="multihost", step=row)


def render_hosts(rec: dict) -> str:
    r = rec["step"]
    head = (f"{r['checkpoint']} {r['scheme'].upper()} {r['step']}, pipeline parallel over "
            f"{r['hosts']} hosts ({r['layers_per_host']} layers each) and tensor parallel "
            f"over each host's {r['per_host']} H200s, an abstract topology compiled at "
            f"{rec['provenance']['git']} (jax {rec['provenance']['jax']}, "
            f"{rec['provenance']['ptxas']}; `{rec['command']}`, kipp/cuda/aot_hosts.py): ")
    if r["status"] != "ok":
        return head + f"failed: {r['error']}"
    collectives = ", ".join(f"{name} {n}" for name, n in r["collectives"].items() if n)
    return head + (f"compiled in {r['compile_s']:.1f} s, {r['kernels']} kernels (XLA's "
                   f"fusions) at most {r['registers']} registers, {r['spill_bytes']} spill "
                   f"and {r['stack_bytes']} stack bytes. Collectives in the step: "
                   f"{collectives}.")


def render(rec: dict) -> str:
    """Markdown: a summary per kernel, variant and rows, the predicted tok/s, then every shape."""
    rows = rec["kernels"]
    ok = [r for r in rows if r["status"] == "ok"]
    spill = sum(r["spill_stores"] + r["spill_loads"] + r["stack"] for r in ok)
    lines = [f"H200 (sm_90a) compile of {len(rows)} kernel shapes at "
             f"{rec['provenance']['git']} (jax {rec['provenance']['jax']}, "
             f"{rec['provenance']['ptxas']}): {len(ok)} compiled, "
             f"{len(rows) - len(ok)} failed; spill and stack bytes in all: {spill}.",
             f"Command: `{rec['command']}`.", "",
             "| kernel | variant | rows | shapes | registers | spill B | smem KiB | "
             "dots | compile s |", "|---|---|---|---:|---:|---:|---:|---|---:|"]
    for key, group in _groups(rows).items():
        good = [r for r in group if r["status"] == "ok"]
        regs = [r["registers"] for r in good]
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {len(good)}/{len(group)} | "
            f"{_span(regs)} | {sum(r['spill_stores'] + r['spill_loads'] for r in good)} | "
            f"{_span([r['shared_memory'] // 1024 for r in good])} | "
            f"{_dots(good)} | {_span([round(r['compile_s'], 1) for r in good])} |")
    lines += ["", f"Predicted from the roofline (HBM {rec['roofline']['hbm_bytes_per_s'] / 1e12:g}"
              f" TB/s, BF16 tensor {rec['roofline']['bf16_tensor_flops'] / 1e12:g} TFLOP/s): "
              "decode of one sequence at 2,048 positions, prefill of a 512-token chunk; "
              "kernels only (bench/kernels.py says what is left out).", "",
              "| checkpoint | weights | decode tok/s | prefill tok/s |", "|---|---|---:|---:|"]
    for p in rec["predicted"]:
        lines.append(f"| {p['checkpoint']} | {p['scheme']} | {_num(p['decode_tok_s'])} | "
                     f"{_num(p['prefill_tok_s'])} |")
    lines += ["", "<details><summary>Every kernel shape</summary>", "",
              "| kernel | variant | shape | used by | regs | spill st/ld B | smem KiB | dots | "
              "compile s | GFLOP | MB | roofline µs | bound |",
              "|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(_row(r))
    return "\n".join(lines + ["", "</details>"])


def _groups(rows):
    groups: dict[tuple, list] = {}
    for r in rows:
        m = r["shape"].split(" ")[0]
        rows_label = m if r["kernel"] == "matmul" else (
            "T=512" if r["kernel"] == "prefill_attention" else m)
        groups.setdefault((r["kernel"], r["variant"], rows_label), []).append(r)
    return groups


def _span(values) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def _dots(rows) -> str:
    kinds = sorted({k for r in rows for k in r["mma"]})
    return ", ".join(kinds) or "CUDA cores"


def _num(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _row(r: dict) -> str:
    head = f"| {r['kernel']} | {r['variant']} | {r['shape']} | {r['where']} |"
    tail = (f" {r['flops'] / 1e9:.3g} | {r['bytes'] / 1e6:.3g} | "
            f"{r['roofline_s'] * 1e6:.3g} | {r['bound']} |")
    if r["status"] != "ok":
        return head + f" failed: {r['error'][:60]} | | | | |" + tail
    return head + (f" {r['registers']} | {r['spill_stores']}/{r['spill_loads']} | "
                   f"{r['shared_memory'] / 1024:.0f} | {_dots([r])} | {r['compile_s']:.1f} |"
                   + tail)


def update_page(rec: dict, page: Path = PAGE, begin: str = BEGIN, end: str = END,
                render=render) -> None:
    """Replace the text between a pair of markers in bench/results/kernels-h200.md."""
    text = page.read_text()
    start, stop = text.index(begin), text.index(end)
    start = text.index("\n", start) + 1
    page.write_text(text[:start] + render(rec) + "\n" + text[stop:])


def main(args, command: str) -> int:
    from kipp.cuda import aot
    from kipp.cuda.pallas import kernel_shapes as ks

    if not args.render_only:
        reason = aot.unavailable_reason()
        if reason:
            raise SystemExit(f"cannot compile for the H200 here: {reason}")
        start = time.perf_counter()
        row = compile_hosts()
        path = write(hosts_record(row, command, time.perf_counter() - start), kind="multihost")
        print(f"wrote {path.relative_to(REPO)}: {row['status']}")
    if not args.render_only and not args.multihost:
        cases = ks.all_cases()
        if args.only:
            cases = [c for c in cases if args.only in c.id or args.only in c.where]
        start = time.perf_counter()
        rows = compile_all(cases)
        path = write(record(rows, command, time.perf_counter() - start))
        print(f"wrote {path.relative_to(REPO)}")
    rec = latest()
    if rec is None:
        raise SystemExit("no kernels record in bench/results (run `python -m bench kernels`)")
    if not args.no_readme:
        update_page(rec)
        hosts = latest(kind="multihost")
        if hosts is not None:
            update_page(hosts, begin=HOSTS_BEGIN, end=HOSTS_END, render=render_hosts)
        print(f"updated {PAGE.relative_to(REPO)}")
    return 0
