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

import jax
import numpy as np

from kipp import gates
from kipp.backend import EvalItem
from kipp.cuda.backend import JaxBackend
from kipp.cuda.sharding import make_mesh
from kipp.formats.artifact import open_artifact


def compare_with_single_device(artifact_path, devices: int = 2, weight_layout: str = "auto",
                               prompt_len: int = 40, decode_steps: int = 3) -> dict:
    """Logits of the model sharded over `devices` vs on one device: worst NMSE and argmax.

    On a CPU, run under XLA_FLAGS=--xla_force_host_platform_device_count=N (set before JAX
    starts) to get N host devices.
    """
    artifact = open_artifact(artifact_path)
    single = JaxBackend(artifact, 8, path="twins", weight_layout=weight_layout,
                        device=jax.devices()[0])
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="sharded vs single-device logits")
    parser.add_argument("artifact")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--layout", default="auto", choices=("auto", "f32", "device"))
    args = parser.parse_args(argv)
    print(json.dumps(compare_with_single_device(args.artifact, args.devices, args.layout)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
