"""`kipp doctor [MODEL] [--backend B] [--json FILE]`: the report a user pastes into a bug.

    kipp doctor                      # the tiny synthetic checkpoint on the backend auto picks
    kipp doctor Qwen/Qwen3-0.6B --json doctor.json

In order: platform, Python and package versions, devices (Metal's name and memory, JAX's
devices), the environment switches Kipp reads, which backend `auto` picks and why, every kernel
probe's result (kipp.probe: what runs and what fell back to its twin, and why), the gates on the
tiny synthetic checkpoint through the chosen backend (against the numpy reference and, when
torch and transformers are installed, against `transformers`; cached decode, scrambled block
table, batched vs isolated), and a short prefill/decode measurement on MODEL (default: the tiny
checkpoint). It ends with a summary of a dozen lines to paste. Exit status 0 when every gate
passes and no kernel fell back, 1 otherwise: bench/mac_check.sh and bench/device_check.sh run
it first and record its verdict.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kipp import gates
from kipp.backend import KV_BLOCK, EvalItem, blocks_needed
from kipp.chooser import choose_backend, open_backend

TINY = "kipp-synthetic/qwen3-tiny"
PACKAGES = ("kipp", "numpy", "ml_dtypes", "jax", "jaxlib", "jax-cuda12-plugin", "mlx",
            "mlx-metal", "torch", "transformers", "tokenizers", "flask", "waitress")
# docs/backends.md's table of switches, and the frameworks' own that change what runs
SWITCHES = ("KIPP_HOME", "KIPP_KERNEL_FALLBACK", "KIPP_MLX_TWINS", "KIPP_JAX_TWINS",
            "KIPP_JAX_CPU_MATMUL", "KIPP_JAX_CPU_ATTENTION", "KIPP_JAX_CPU_STORED",
            "KIPP_CPU_ISA", "KIPP_JAX_CPU_DOT", "KIPP_MLX_CPU_STREAMS", "JAX_PLATFORMS",
            "XLA_FLAGS", "CUDA_VISIBLE_DEVICES")
GATE_BLOCKS = 16
GATE_PROMPTS = gates.DEFAULT_PROMPTS  # the prompts of `kipp gates`
SPEED_PROMPT = 128  # prefill tokens timed
SPEED_DECODE = 16  # decode steps timed
SPEED_RUNS = 3


def main(args) -> int:
    """The CLI's entry point (kipp.cli wires `kipp doctor` here)."""
    report = collect(args.model, args.backend, progress=_stderr)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        _stderr(f"report written to {args.json}")
    return 0 if report["healthy"] else 1


def collect(model: str | None = None, backend: str = "auto", *, tiny: str | Path | None = None,
            tiny_source: str | Path | None = None, progress=lambda line: None) -> dict:
    """The whole report as a JSON-able dict. `tiny` and `tiny_source` name the tiny synthetic
    checkpoint's artifact and Hugging Face folder (default: made under KIPP_HOME)."""
    from kipp.formats.artifact import open_artifact

    report = {"kipp": _kipp_version(), "platform": platform_info(),
              "packages": package_versions(), "switches": switches()}
    progress("devices...")
    report["devices"] = devices()
    choice = choose_backend(backend)
    report["backend"] = {"requested": backend, "chosen": choice.name, "reason": choice.reason}
    if tiny is None:
        from kipp.formats.store import ensure_artifact

        tiny = ensure_artifact(TINY, "bf16", progress=False)
    progress(f"loading {TINY} on {choice.name} (kernel probes)...")
    artifact = open_artifact(tiny)
    start = time.perf_counter()
    chosen = open_backend(choice.name, artifact, GATE_BLOCKS)
    report["backend"].update(describe=chosen.describe(),
                             load_seconds=round(time.perf_counter() - start, 3))
    report["kernels"] = chosen.kernel_report().to_json()
    report["kv_disk"] = kv_disk_info(chosen.supports_kv_io)
    progress("gates...")
    report["gates"] = [_gate_json(g) for g in run_gates(artifact, chosen, tiny_source)]
    progress("speed...")
    report["speed"] = measure(model, choice.name, chosen if model is None else None)
    gated = [g for g in report["gates"] if g["passed"] is not None]
    report["healthy"] = all(g["passed"] for g in gated) and not report["kernels"]["fell_back"]
    report["summary"] = summary(report)
    return report


def kv_disk_info(supported: bool, folder: Path | None = None) -> dict:
    """The KV disk tier's folder (default $KIPP_HOME/kv): what it holds, whether it can be
    written, the default size bound, and whether the chosen backend can use it."""
    import os

    from kipp.engine import kv_files
    from kipp.formats.store import home

    folder = home() / "kv" if folder is None else Path(folder)
    listing = kv_files.listing(folder)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return {"folder": str(folder), "backend_supported": supported,
            "writable": os.access(probe, os.W_OK),
            "default_limit_mib": kv_files.default_limit(folder) // 2**20,
            "files": sum(n for n, _ in listing.values()),
            "mib": round(sum(b for _, b in listing.values()) / 2**20, 1),
            "namespaces": {name: {"files": n, "mib": round(b / 2**20, 1)}
                           for name, (n, b) in listing.items()}}


def _kv_disk_line(d: dict) -> str:
    state = ("" if d["backend_supported"] else "not supported by this backend; ") + \
        ("" if d["writable"] else "NOT writable; ")
    return (f"{state}{d['files']:,} blocks, {d['mib']:,} MiB in {d['folder']} "
            f"(default bound {d['default_limit_mib']:,} MiB)")


def platform_info() -> dict:
    from kipp.memory import available_bytes

    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {"system": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor() or None, "cpus": os.cpu_count(),
            "python": sys.version.split()[0], "implementation": platform.python_implementation(),
            "memory_gib": round(total / 2**30, 1),
            "available_gib": round(available_bytes() / 2**30, 1)}


def package_versions() -> dict:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def switches() -> dict:
    return {name: os.environ[name] for name in SWITCHES if name in os.environ}


def devices() -> dict:
    """Metal (through MLX) and JAX's devices; each entry says why when it cannot look."""
    return {"metal": _metal(), "jax": _jax_devices()}


def _metal() -> dict:
    try:
        import mlx.core as mx
    except Exception as e:  # not installed, or a broken install
        return {"available": False, "why": f"mlx does not import ({type(e).__name__})"}
    if not mx.metal.is_available():
        return {"available": False, "why": "mx.metal.is_available() is False",
                "default_device": str(mx.default_device())}
    info = (getattr(mx, "device_info", None) or mx.metal.device_info)()
    keep = ("device_name", "architecture", "memory_size", "max_recommended_working_set_size")
    return {"available": True, "default_device": str(mx.default_device()),
            **{k: info[k] for k in keep if k in info}}


def _jax_devices() -> dict:
    try:
        import jax

        found = []
        for d in jax.devices():
            stats = d.memory_stats() if hasattr(d, "memory_stats") else None
            found.append({"platform": d.platform, "kind": d.device_kind, "id": d.id,
                          "memory_bytes": (stats or {}).get("bytes_limit")})
        return {"available": True, "backend": jax.default_backend(), "devices": found}
    except Exception as e:
        return {"available": False, "why": f"jax: {type(e).__name__}: {e}"}


def run_gates(artifact, chosen, source=None) -> list[gates.GateResult]:
    """The gates on the tiny checkpoint through `chosen` (a Backend on `artifact`)."""
    from kipp.model import Model

    results = []
    model = Model(artifact, chosen)
    if chosen.name != "reference":
        results.append(gates.gate_vs_reference(model))
    results.append(_transformers_gate(model, source))
    counting = GATE_PROMPTS[min(2, len(GATE_PROMPTS) - 1)]  # `kipp gates`' scrambled prompt
    results += [gates.gate_cached_decode(model, GATE_PROMPTS[0]),
                gates.gate_scrambled_table(model, counting),
                gates.gate_batched(model, GATE_PROMPTS)]  # the backend's calibrated bound
    return results


def _transformers_gate(model, source) -> gates.GateResult:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return gates.GateResult("vs transformers (every position)", None, float("nan"),
                                gates.calibrated_bound(model.backend, "transformers"),
                                f"skipped: {e.name} is not installed")
    if source is None:
        from kipp.formats.store import source_folder

        source = source_folder(TINY, progress=False)
    return gates.gate_transformers(model, source, GATE_PROMPTS)


def _gate_json(g: gates.GateResult) -> dict:
    metric = None if g.metric != g.metric else float(g.metric)  # NaN: skipped
    return {"name": g.name, "passed": g.passed, "metric": metric, "bound": g.bound,
            "measure": g.measure, "detail": g.detail}


def measure(model: str | None, backend: str, loaded=None) -> dict:
    """Median prefill tok/s of SPEED_PROMPT tokens and decode tok/s over SPEED_DECODE steps,
    after one warm-up run (compiles), on `model` (default: `loaded`, the tiny one)."""
    if loaded is None:
        from kipp.model import load

        loaded = load(model, backend=backend, kv_tokens=SPEED_PROMPT + SPEED_DECODE + KV_BLOCK,
                      progress=False).backend
    tokens = tuple(int(t) for t in np.random.default_rng(2).integers(0, 151_643, SPEED_PROMPT))
    table = tuple(range(blocks_needed(SPEED_PROMPT + SPEED_DECODE)))
    prefill, decode = [], []
    for _ in range(SPEED_RUNS + 1):
        start = time.perf_counter()
        [logits] = loaded.eval([EvalItem(tokens, 0, table)])
        prefill.append(time.perf_counter() - start)
        start = time.perf_counter()
        for step in range(SPEED_DECODE):
            [logits] = loaded.eval([EvalItem((int(logits[-1].argmax()),),
                                             SPEED_PROMPT + step, table)])
        decode.append(time.perf_counter() - start)
    return {"model": model or TINY, "backend": loaded.describe(),
            "prefill_tokens": SPEED_PROMPT, "decode_tokens": SPEED_DECODE, "runs": SPEED_RUNS,
            "prefill_tok_s": round(SPEED_PROMPT / statistics.median(prefill[1:]), 1),
            "decode_tok_s": round(SPEED_DECODE / statistics.median(decode[1:]), 2),
            "warmup_seconds": round(prefill[0] + decode[0], 2)}


def summary(report: dict) -> list[str]:
    p, b, k, s = report["platform"], report["backend"], report["kernels"], report["speed"]
    metal = report["devices"]["metal"]
    jax_devices = report["devices"]["jax"]
    accelerators = [f"Metal: {metal.get('device_name', 'yes')}" if metal["available"]
                    else "Metal: no"]
    if jax_devices["available"]:
        accelerators.append("JAX: " + ", ".join(sorted({f"{d['platform']} ({d['kind']})"
                                                          for d in jax_devices["devices"]})))
    gated = [g for g in report["gates"] if g["passed"] is not None]
    failed = [g["name"] for g in gated if not g["passed"]]
    kernels = ("none (this path runs no kernels)" if not k["probes"] else
               f"{len(k['running'])} run, {len(k['fell_back'])} fell back"
               + "".join(f"; {name}: {why}" for name, why in k["fell_back"].items())
               + f" (probes {k['probe_seconds']:.2f} s)")
    versions = ", ".join(f"{n} {v}" for n, v in report["packages"].items()
                         if v and n in ("numpy", "jax", "mlx", "torch"))
    return [
        f"kipp {report['kipp']} on {p['system']} ({p['cpus']} CPUs, {p['memory_gib']} GiB)",
        f"python {p['python']}; {versions}",
        f"devices: {'; '.join(accelerators)}",
        f"backend: {b['chosen']} ({b['reason']})",
        f"path: {b['describe']}",
        f"kernels: {kernels}",
        f"kv disk: {_kv_disk_line(report['kv_disk'])}",
        f"gates: {len(gated) - len(failed)}/{len(gated)} pass"
        + (f"; FAILED: {', '.join(failed)}" if failed else ""),
        f"speed ({s['model']}): prefill {s['prefill_tok_s']} tok/s ({s['prefill_tokens']} "
        f"tokens), decode {s['decode_tok_s']} tok/s",
        f"verdict: {'healthy' if report['healthy'] else 'NOT healthy'}",
    ]


def format_report(report: dict) -> str:
    lines = [f"kipp doctor (kipp {report['kipp']})", "", "platform:"]
    lines += [f"  {k:15} {v}" for k, v in report["platform"].items()]
    lines += ["packages:"] + [f"  {k:18} {v or '-'}" for k, v in report["packages"].items()]
    lines += ["switches:"] + ([f"  {k}={v}" for k, v in report["switches"].items()]
                              or ["  (none set)"])
    lines += ["devices:", f"  metal: {json.dumps(report['devices']['metal'])}",
              f"  jax:   {json.dumps(report['devices']['jax'])}"]
    b = report["backend"]
    lines += ["backend:", f"  auto picks {b['chosen']}: {b['reason']}" if b["requested"] ==
              "auto" else f"  {b['chosen']} (requested)", f"  {b['describe']}",
              f"  loaded the tiny checkpoint in {b['load_seconds']:.2f} s"]
    lines += ["kernel probes:"] + [_probe_line(p) for p in report["kernels"]["probes"]]
    if not report["kernels"]["probes"]:
        lines += ["  none: this path runs no kernels"]
    lines += ["kv disk tier:", f"  {_kv_disk_line(report['kv_disk'])}"]
    lines += [f"  {name}: {v['files']:,} blocks, {v['mib']:,} MiB"
              for name, v in report["kv_disk"]["namespaces"].items()]
    lines += ["gates (tiny synthetic checkpoint):"] + [_gate_line(g) for g in report["gates"]]
    s = report["speed"]
    lines += ["speed:", f"  {s['model']} on {s['backend']}",
              f"  prefill {s['prefill_tok_s']} tok/s ({s['prefill_tokens']} tokens), decode "
              f"{s['decode_tok_s']} tok/s ({s['decode_tokens']} steps), median of {s['runs']}"]
    lines += ["", "summary (paste this):", "```"] + report["summary"] + ["```"]
    return "\n".join(lines)


def _gate_line(g: dict) -> str:
    """Verdict, name, what was measured against its bound, then the gate's own detail."""
    verdict = "skip" if g["passed"] is None else "PASS" if g["passed"] else "FAIL"
    measured = "" if g["metric"] is None else \
        f"{g['measure']} {g['metric']:.2e} (bound {g['bound']:g}); "
    return f"  {verdict:4}  {g['name']}: {measured}{g['detail']}"


def _probe_line(p: dict) -> str:
    line = f"  {p['kernel']:26} {'ok' if p['ok'] else 'FELL BACK'}"
    if p["nmse"] is not None:
        line += f"  NMSE {p['nmse']:.1e} (bound {p['bound']:.0e})"
    return line + ("" if p["ok"] else f"  {p['error']}")


def _kipp_version() -> str:
    import kipp

    root = Path(kipp.__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{kipp.__version__}" + (f" ({commit})" if commit else "")


def _stderr(line: str) -> None:
    print(f"kipp doctor: {line}", file=sys.stderr, flush=True)
