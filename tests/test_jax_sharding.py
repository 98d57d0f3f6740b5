"""Tensor parallelism over a jax.sharding.Mesh: two CPU devices vs one, logits within 1e-4.

XLA_FLAGS must be set before JAX initialises, so the comparison runs in a subprocess
(`python -m kipp.cuda.shard_check`).
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")


@pytest.mark.parametrize("checkpoint_id,scheme,layout", [
    pytest.param("kipp-synthetic/qwen3-tiny-untied", "bf16", "f32",  # GQA group 5: 20 heads
                 marks=pytest.mark.slow),  # per device (CI's longest default checks)
    ("kipp-synthetic/qwen3-tiny", "q8_0", "device"),  # packed int8 planes, split rows/groups
])
def test_two_devices_match_one(artifacts, checkpoint_id, scheme, layout):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-m", "kipp.cuda.shard_check", str(artifacts(checkpoint_id, scheme)),
         "--devices", "2", "--layout", layout],
        env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["devices"] == 2
    assert result["q_shard_rows"] * 2 == result["q_rows"]  # really split over heads
    assert result["nmse"] <= 1e-4 and result["argmax_equal"], result
