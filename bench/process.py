"""A worker process for one arm: start it, send it requests with a deadline, close it."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path

from bench.engines.base import ArmSpec
from bench.provenance import REPO

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


class WorkerError(RuntimeError):
    """The worker died, timed out or answered an error; `refused` marks a fallback refusal."""

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


def exit_text(returncode: int | None) -> str:
    """`-11` -> `-11, crashed: SIGSEGV`: a killed worker says which signal in the record."""
    if returncode is None or returncode >= 0:
        return str(returncode)
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"{returncode}, crashed: {name}"


def worker_env(spec: ArmSpec) -> dict[str, str]:
    """The arm's environment: thread counts pinned, the repo importable, engine extras."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if spec.engine == "vllm":
        from bench.engines.vllm_engine import vllm_env

        env.update(vllm_env(spec.threads))
    else:
        env.update({name: str(spec.threads) for name in THREAD_VARIABLES})
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


class ArmProcess:
    """`python -m bench.worker` for one arm; its stderr goes to `log`; `env` adds to (and
    overrides) the arm's environment; `cwd` (first on its sys.path) defaults to the repo."""

    def __init__(self, spec: ArmSpec, python: str, log: Path,
                 env: dict[str, str] | None = None, cwd: Path = REPO):
        self.spec = spec
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(log, "wb")
        self.proc = subprocess.Popen([python, "-m", "bench.worker"], cwd=cwd,
                                     env={**worker_env(spec), **(env or {})},
                                     stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log_file,
                                     start_new_session=True)  # its group: vLLM's children too
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._replies.put(line)
        self._replies.put(None)

    def request(self, payload: dict, timeout: float) -> dict:
        """Send one request and wait for its reply; WorkerError on anything but ok."""
        try:
            self.proc.stdin.write((json.dumps(payload) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerError(f"worker exited ({exit_text(self.proc.poll())}); log tail:\n"
                              f"{self.log_tail()}")
        try:
            line = self._replies.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise WorkerError(f"no reply to {payload['op']} within {timeout:.0f} s; "
                              f"log tail:\n{self.log_tail()}") from None
        if line is None:
            self.proc.wait(timeout=30)
            raise WorkerError(f"worker exited ({exit_text(self.proc.returncode)}) during "
                              f"{payload['op']}; log tail:\n{self.log_tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            detail = reply.get("traceback") or ""
            raise WorkerError(f"{reply.get('error')}\n{detail}".strip(),
                              refused=bool(reply.get("refused")))
        return reply

    def close(self, timeout: float = 120) -> dict:
        """Close the engine, let the worker exit, and return its rusage (peak RSS)."""
        try:
            reply = self.request({"op": "close"}, timeout)
        finally:
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
            self.kill()  # also any process the engine left behind in the worker's group
            self._log_file.close()
        return reply["rusage"]

    def kill(self) -> None:
        """Kill the worker and whatever it started (its own process group, by id)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            self._log_file.flush()
            text = self.log.read_bytes()[-chars:]
        except OSError:
            return ""
        return text.decode("utf-8", "replace")
