"""Each process's peak RSS against its share of the weights plus its KV, as 1 and 2 processes.

    python -m bench.distributed_memory [--checkpoint ID] [--backends jax mlx]

On the checkpoint's BF16 artifact (kipp.formats.store.ensure_artifact: the synthesize and
convert the tests' `artifacts` fixture runs), each backend's self-check runs as one process and
as a two-process tensor-parallel group on loopback: JAX's `python -m kipp.cuda.shard_check`
(one CPU device a process, weights as stored) and MLX's `python -m kipp.apple.distributed`
(its one-process run is this module's `--mlx-single`, the same check_steps on the unsharded
backend). Each process reports its weight bytes (its own shards), its KV bytes and its peak
RSS; a bare process (the backend imported and started, nothing loaded) gives the baseline
that the runtime itself costs. RSS is not a timing: the run does not need the machine alone.
The record: bench/results/STAMP-memory-CHECKPOINT.json (`records` type "memory").
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import provenance, records  # noqa: E402

CHECKPOINT = "kipp-synthetic/qwen3-0.6b-shape"
DEADLINE_S = 600  # one group's run, every process
JAX_CHECK = ("--layout", "device", "--prompt-len", "24", "--decode-steps", "2")
MLX_CHECK = ("--prompt-len", "12", "--decode-steps", "2")
BASELINE = {  # the backend imported and its runtime started, no model
    "jax": "import jax, kipp.cuda.backend; jax.devices(); jax.numpy.zeros(1).block_until_ready()",
    "mlx": "import mlx.core as mx, kipp.apple.backend; mx.eval(mx.zeros(1))",
}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower()}  # can hang init
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               KIPP_MLX_CPU_STREAMS="1", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_all(commands: list[tuple[list[str], dict]], scratch: Path) -> None:
    """Start every command at once (a group's processes), each logging to a file, and wait
    for all; kill any at the deadline."""
    logs = [scratch / f"process{i}.log" for i in range(len(commands))]
    procs = []
    for (command, env), log in zip(commands, logs):
        with open(log, "w") as sink:
            procs.append(subprocess.Popen(command, env=env, stdout=sink,
                                          stderr=subprocess.STDOUT))
    try:
        for proc, log in zip(procs, logs):
            if proc.wait(timeout=DEADLINE_S) != 0:
                raise RuntimeError(f"{proc.args[:4]} exited {proc.returncode}:\n"
                                   + "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                                                for p in logs))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _rank(weights: int, kv: int, rss: int, baseline: int) -> dict:
    above = rss - baseline
    return {"weight_bytes": weights, "kv_bytes": kv, "peak_rss_bytes": rss,
            "above_baseline_bytes": above, "above_baseline_over_weights_kv": above / (weights + kv)}


def jax_runs(artifact: Path, scratch: Path, baseline: int) -> list[dict]:
    check = [sys.executable, "-m", "kipp.cuda.shard_check", str(artifact), *JAX_CHECK]
    single = scratch / "jax1.npz"
    _run_all([([*check, "--dump", str(single), "--devices", "1"], _env())], scratch)
    port = _free_port()
    outs = [scratch / f"jax2-rank{i}.npz" for i in range(2)]
    _run_all([([*check, "--dump", str(out), "--coordinator", f"127.0.0.1:{port}",
                "--num-processes", "2", "--process-id", str(i)], _env())
              for i, out in enumerate(outs)], scratch)
    runs = []
    for processes, dumps in ((1, [single]), (2, outs)):
        ranks = []
        for path in dumps:
            d = np.load(path)
            ranks.append(_rank(int(d["local_weight_bytes"]), int(d["local_kv_bytes"]),
                               int(d["peak_rss_bytes"]), baseline))
        runs.append({"backend": "jax", "processes": processes, "parallel": "tensor",
                     "check": " ".join(JAX_CHECK), "ranks": ranks})
    return runs


def mlx_runs(artifact: Path, scratch: Path, baseline: int) -> list[dict]:
    single = scratch / "mlx1.json"
    _run_all([([sys.executable, "-m", "bench.distributed_memory", "--mlx-single",
                str(artifact), "--out", str(single)], _env())], scratch)
    hostfile = scratch / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{_free_port()}"] for _ in range(2)]))
    dump = scratch / "mlx2.npz"
    check = [sys.executable, "-m", "kipp.apple.distributed", str(artifact), "--dump", str(dump),
             *MLX_CHECK]
    _run_all([(check, _env(MLX_RANK=str(i), MLX_HOSTFILE=str(hostfile))) for i in range(2)],
             scratch)
    facts = [json.loads(single.read_text())]
    group = [np.load(dump), np.load(dump.with_suffix(".rank1.npz"))]
    runs = []
    for processes, dumps in ((1, facts), (2, group)):
        ranks = [_rank(int(d["weight_bytes"]), int(d["kv_bytes"]), int(d["peak_rss_bytes"]),
                       baseline) for d in dumps]
        runs.append({"backend": "mlx", "processes": processes, "parallel": "tensor",
                     "check": " ".join(MLX_CHECK), "ranks": ranks})
    return runs


def mlx_single(artifact: str, out: Path) -> None:
    """The one-process MLX run: the ranks' check_steps on the unsharded backend."""
    from kipp.apple import distributed
    from kipp.apple.backend import MLXBackend
    from kipp.backend import blocks_needed
    from kipp.formats.artifact import open_artifact

    backend = MLXBackend(open_artifact(artifact), blocks_needed(512))  # the ranks' --kv-tokens
    distributed.check_steps(backend, 12, 2)
    facts = distributed.shard_facts(backend)
    out.write_text(json.dumps({k: facts[k] for k in ("weight_bytes", "kv_bytes",
                                                     "peak_rss_bytes")}))


def baseline_rss(backend: str) -> int:
    code = (BASELINE[backend] + "; import resource, sys; print(resource.getrusage("
            "resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == 'darwin' else 1024))")
    return int(subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                              text=True, check=True, timeout=DEADLINE_S).stdout.split()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.distributed_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=CHECKPOINT)
    p.add_argument("--backends", nargs="+", choices=("jax", "mlx"), default=["jax", "mlx"])
    p.add_argument("--results", type=Path, default=records.RESULTS)
    p.add_argument("--mlx-single", metavar="ARTIFACT", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mlx_single:
        mlx_single(args.mlx_single, args.out)
        return 0
    from kipp.formats.artifact import open_artifact
    from kipp.formats.store import ensure_artifact

    artifact = ensure_artifact(args.checkpoint, "bf16", progress=False)
    largest = max(open_artifact(artifact).file.tensors.values(), key=lambda t: t.nbytes)
    runs, baselines = [], {}
    with tempfile.TemporaryDirectory(prefix="kipp-memory-") as scratch:
        for backend in args.backends:
            baselines[backend] = baseline_rss(backend)
            measure = jax_runs if backend == "jax" else mlx_runs
            runs += measure(artifact, Path(scratch), baselines[backend])
    command = "python -m bench.distributed_memory " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    record = records.new(
        "memory", command, records.checkpoint_block(args.checkpoint), provenance.collect(),
        artifact={"scheme": "bf16", "bytes": artifact.stat().st_size,
                  "largest_tensor": largest.name, "largest_tensor_bytes": int(largest.nbytes)},
        baseline_rss_bytes=baselines, runs=runs)
    path = records.write(record, args.results)
    mib = 2 ** 20
    for run in runs:
        for i, r in enumerate(run["ranks"]):
            print(f"{run['backend']} x{run['processes']} rank {i}: weights "
                  f"{r['weight_bytes'] / mib:7.0f} MiB  KV {r['kv_bytes'] / mib:5.1f} MiB  "
                  f"peak RSS {r['peak_rss_bytes'] / mib:7.0f} MiB  above the bare runtime "
                  f"{r['above_baseline_bytes'] / mib:7.0f} MiB "
                  f"({r['above_baseline_over_weights_kv']:.2f} x weights + KV)")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
