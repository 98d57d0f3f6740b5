"""Each documented environment, installed from scratch into a fresh virtualenv, runs what the
docs say it runs (slow: pip installs; `.ci/run` runs these as a required step). pip is used as
configured on the machine (its index and its cache, so wheels `make test` fetched are not fetched
again), without byte-compiling what it installs (Python compiles on first import).

- base (`pip install -e .`): `kipp run` and `kipp.load` on the tiny checkpoint, and one-line
  errors naming the extra for `kipp serve`, `kipp gates` and `--backend jax`.
- `server`: `kipp serve` answers /health.
- `jax`: `kipp run --backend jax`.
- `bench`: bench/README.md's set-up block itself (llama-cpp-python built with its flags), then
  `bench peers` and `kipp serve` from that interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = "kipp-synthetic/qwen3-tiny"
# Seconds per install, bounded so a hung one fails CI's step instead of eating its 90 minutes.
INSTALL_TIMEOUT = 900
BENCH_SETUP_TIMEOUT = 1800  # the bench set-up builds llama-cpp-python from source

pytestmark = pytest.mark.slow


def clean_env(home: Path) -> dict:
    """The environment of a fresh shell: no PYTHONPATH into the checkout, the test store."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(KIPP_HOME=str(home), PIP_PROGRESS_BAR="off", PIP_NO_COMPILE="1")
    return env


def make_venv(path: Path, extra: str | None, env: dict) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, env=env)
    target = str(ROOT) + (f"[{extra}]" if extra else "")
    done = subprocess.run([str(path / "bin" / "pip"), "install", "-e", target], env=env,
                          capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return path / "bin"


def run(command: list[str], env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def assert_serves_health(kipp: str, env: dict) -> None:
    proc = subprocess.Popen([kipp, "serve", TINY, "--backend", "reference", "--port", "0",
                             "--kv-tokens", "256"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        port, log, deadline = None, [], time.monotonic() + 300
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            log.append(line)
            found = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            port = found and int(found.group(1))
        assert port, "kipp serve did not start:\n" + "".join(log)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60) as answer:
            assert answer.status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_the_base_install_runs_and_names_each_missing_extra(tmp_path, stocked_home):
    env = clean_env(stocked_home)
    bin_dir = make_venv(tmp_path / "venv", None, env)
    kipp = str(bin_dir / "kipp")
    done = run([kipp, "run", TINY, "--backend", "reference", "--prompt", "Hello",
                "--max-tokens", "3", "--temperature", "0"], env)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    code = f"import kipp; print(kipp.load({TINY!r}, backend='reference').generate('Hello', 3, " \
           f"temperature=0))"
    via_python = run([str(bin_dir / "python"), "-c", code], env)
    assert via_python.stdout == done.stdout, via_python.stderr
    for argv, extra in ((["serve", TINY], "server"), (["gates", TINY], "gates"),
                        (["run", TINY, "--prompt", "x", "--backend", "jax"], "jax")):
        missing = run([kipp, *argv], env)
        assert missing.returncode == 1
        assert missing.stderr.count("\n") == 1 and "Traceback" not in missing.stderr
        assert f"pip install 'kipp[{extra}]'" in missing.stderr, missing.stderr


def test_the_server_extra_serves(tmp_path, stocked_home):
    env = clean_env(stocked_home)
    bin_dir = make_venv(tmp_path / "venv", "server", env)
    assert_serves_health(str(bin_dir / "kipp"), env)


def test_the_jax_extra_runs_the_jax_backend(tmp_path, stocked_home):
    env = clean_env(stocked_home)
    bin_dir = make_venv(tmp_path / "venv", "jax", env)
    done = run([str(bin_dir / "kipp"), "run", TINY, "--backend", "jax", "--prompt", "Hello",
                "--max-tokens", "3", "--temperature", "0"], env)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    assert "kipp: backend jax" in done.stderr


def bench_setup_block() -> str:
    """The sh block of bench/README.md that sets up .venv-bench, as written there."""
    text = (ROOT / "bench" / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```sh\n(.*?)```", text, re.DOTALL)
    [block] = [b for b in blocks if "pip install -e '.[bench]'" in b]
    return block


def test_the_bench_set_up_of_bench_readme_works(tmp_path, stocked_home):
    env = clean_env(stocked_home)
    venv = tmp_path / "venv-bench"
    script = bench_setup_block().replace(".venv-bench", str(venv))
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=BENCH_SETUP_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    peers = dict(line.split(None, 2)[:2] for line in done.stdout.splitlines() if line.strip())
    assert peers.get("llama_cpp") == "yes" and peers.get("transformers") == "yes", done.stdout
    assert_serves_health(str(venv / "bin" / "kipp"), env)  # `bench server` needs kipp serve
