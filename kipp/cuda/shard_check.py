"""Sharded vs single-device logits: the check of kipp.cuda.sharding's tensor parallelism.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
        python -m kipp.cuda.shard_check ARTIFACT --devices 2 [--layout f32|device]

Prints one JSON line: devices, worst NMSE and argmax agreement over a prefill and a few decode
steps, and how many rows of the Q projection the first device holds. Apart from
kipp.cuda.sharding so that placement never imports the backend that uses it.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import jax
import numpy as np

from kipp import gates
from kipp.backend import EvalItem
from kipp.cuda.backend import JaxBackend
from kipp.cuda.sharding import make_mesh, make_pipeline_mesh
from kipp.formats.artifact import open_artifact

# A mesh multiplies with XLA's float32 dots; the one-device run it is held to keeps that dot,
# whatever $KIPP_JAX_CPU_DOT asks of Kipp's stored CPU matmul.
ORACLE_DOT = "f32"


def compare_with_single_device(artifact_path, devices: int = 2, weight_layout: str = "auto",
                               prompt_len: int = 40, decode_steps: int = 3) -> dict:
    """Logits of the model sharded over `devices` vs on one device: worst NMSE and argmax.

    On a CPU, run under XLA_FLAGS=--xla_force_host_platform_device_count=N (set before JAX
    starts) to get N host devices.
    """
    artifact = open_artifact(artifact_path)
    single = JaxBackend(artifact, 8, path="twins", weight_layout=weight_layout,
                        device=jax.devices()[0], cpu_dot=ORACLE_DOT)
    sharded = JaxBackend(artifact, 8, path="twins", weight_layout=weight_layout,
                         mesh=make_mesh(devices))
    q = sharded.params["layers"][0]["q"].w
    table = (5, 2, 7)
    tokens = tuple(int(t) for t in np.random.default_rng(0).integers(0, 151_643, prompt_len))
    items = [EvalItem(tokens, 0, table, prompt_len)]
    worst, argmax_equal = 0.0, True
    for step in range(decode_steps + 1):
        [a], [b] = sharded.eval(items), single.eval(items)
        worst = max(worst, gates.nmse(a, b))
        differ, ties = gates.argmax_check(a, b)
        argmax_equal &= differ == ties
        items = [EvalItem((int(b[-1].argmax()),), prompt_len + step, table)]
    return {"devices": sharded.mesh.size, "nmse": worst, "argmax_equal": bool(argmax_equal),
            "q_shard_rows": q.addressable_shards[0].data.shape[0], "q_rows": q.shape[0],
            "describe": sharded.describe()}


def greedy_logits(backend: JaxBackend, prompt_len: int = 40, decode_steps: int = 3):
    """A prefill of `prompt_len` seeded random tokens, then `decode_steps` greedy decode
    steps on `backend`: (logits of every step, the greedy tokens, each step's seconds)."""
    table = (5, 2, 7)
    tokens = tuple(int(t) for t in np.random.default_rng(0).integers(0, 151_643, prompt_len))
    items = [EvalItem(tokens, 0, table, prompt_len)]
    logits, chosen, seconds = [], [], []
    for step in range(decode_steps + 1):
        start = time.perf_counter()
        [out] = backend.eval(items)
        seconds.append(time.perf_counter() - start)
        logits.append(out)
        chosen.append(int(out[-1].argmax()))
        items = [EvalItem((chosen[-1],), prompt_len + step, table)]
    return logits, chosen, seconds


def dump(args) -> int:
    """--dump: one run's logits and greedy tokens to an .npz, on one device, a mesh of
    --devices, or (--coordinator) a mesh over --num-processes processes."""
    from kipp.cuda import distributed

    link = None
    if args.coordinator:
        link = distributed.join(distributed.Group.resolve(
            args.coordinator, args.num_processes, args.process_id,
            join_timeout_s=args.join_timeout))
    artifact = open_artifact(args.artifact)
    if link is None and args.devices == 1:
        backend = JaxBackend(artifact, 8, path="twins", weight_layout=args.layout,
                             device=jax.devices()[0], cpu_dot=ORACLE_DOT)
    else:
        mesh = make_pipeline_mesh(tensor=args.tensor) if args.pipeline else make_mesh()
        backend = JaxBackend(artifact, 8, path="twins", weight_layout=args.layout,
                             mesh=mesh, link=link)
    layers = backend.params["layers"]
    q = (layers["q"] if isinstance(layers, dict) else layers[0]["q"]).w  # stacked on one CPU
    # the split axis: the layers of a pipeline, else the output rows (axis 1 when stacked)
    rows = 0 if args.pipeline or not isinstance(layers, dict) else 1
    local_rows = q.addressable_shards[0].data.shape[rows]
    Path(args.dump).with_suffix(".ready").touch()  # loaded: the failure tests' cue
    if link is not None and not link.leader:
        distributed.follow(backend)
        np.savez(args.dump, **_memory(backend))
        return 0
    if link is not None:
        link.start_keepalive()
    logits, chosen, seconds = greedy_logits(backend, args.prompt_len, args.decode_steps)
    time.sleep(args.hold_s)  # idle with the group formed: the keep-alive's test
    if link is not None and args.busy_s:
        with link.lock:  # as a step that compiles: no keep-alive, the followers wait
            Path(args.dump).with_suffix(".busy").touch()
            time.sleep(args.busy_s)
    for _ in range(args.repeat):  # the same run again: the failure tests' busy group
        again, _, _ = greedy_logits(backend, args.prompt_len, args.decode_steps)
        if not all(np.array_equal(a, b) for a, b in zip(logits, again)):
            raise SystemExit("a repeated run's logits differ")
    np.savez(args.dump, tokens=np.asarray(chosen), q_rows=q.shape[rows], local_rows=local_rows,
             step_seconds=np.asarray(seconds), **_memory(backend),
             **{f"step{i}": a for i, a in enumerate(logits)})
    # the first call of each shape compiles: the decode rate is the later steps' median
    later = seconds[2:] or seconds[1:]
    print(json.dumps({"describe": backend.describe(), "first_call_s": round(seconds[0], 3),
                      "decode_ms_median": round(1e3 * float(np.median(later)), 3)
                      if later else None}))
    if link is not None:
        link.stop()
    return 0


def _memory(backend: JaxBackend) -> dict:
    """This process's weight bytes (its own shards) and KV bytes, and its peak RSS."""
    def local(tree):
        return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree)
                   for shard in leaf.addressable_shards)

    return {"local_weight_bytes": local(backend.params), "local_kv_bytes": local(backend.kv),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="sharded vs single-device logits")
    parser.add_argument("artifact")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--layout", default="auto", choices=("auto", "f32", "device"))
    parser.add_argument("--dump", help="write one run's logits and tokens to this .npz")
    parser.add_argument("--coordinator", help="HOST:PORT: a mesh over several processes")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--decode-steps", type=int, default=3)
    parser.add_argument("--hold-s", type=float, default=0.0,
                        help="idle this long after the run")
    parser.add_argument("--busy-s", type=float, default=0.0,
                        help="then hold the group's lock this long, sending nothing")
    parser.add_argument("--repeat", type=int, default=0, help="then run it this many times more")
    parser.add_argument("--join-timeout", type=int, default=60)
    parser.add_argument("--pipeline", action="store_true",
                        help="pipeline stages over the devices instead of tensor parallel")
    parser.add_argument("--tensor", type=int, default=1,
                        help="with --pipeline: tensor parallel over this many devices a stage")
    args = parser.parse_args(argv)
    if args.dump:
        return dump(args)
    print(json.dumps(compare_with_single_device(args.artifact, args.devices, args.layout)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
