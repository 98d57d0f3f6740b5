"""JAX's coordination service, hosted in a child process of process 0.

Inside process 0, the service dies with it, and every other process's runtime client sees the
service's socket close at once and aborts (a page of logs, before Kipp can name what was lost).
Hosted here, it outlives a killed process 0 by GRACE_S: the survivors' collectives fail (or
another survivor's verdict reaches them through its key-value store) first, and each exits
with Kipp's one line (kipp.cuda.distributed). An orderly shutdown stops it
at once.

    service = coordinator.start(address, processes, heartbeat_timeout=60)  # as JAX's own
    ...
    service.shutdown()

The child runs `python -m kipp.cuda.coordinator SPEC` (SPEC: JSON of the arguments JAX's
get_distributed_runtime_service takes), answers one line ("ready", or "error: ..."), then
waits for "stop" on its stdin; end of file without it means process 0 died.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

GRACE_S = 10.0  # how long the service outlives a process 0 that died without stopping it
READY_S = 60.0  # how long process 0 waits for the child's first line


class ServiceError(RuntimeError):
    """The child could not host the service (its one line says why)."""


class HostedService:
    """The child process, standing in for the service object JAX keeps."""

    def __init__(self, proc: subprocess.Popen, shutdown_timeout: float):
        self.proc, self.shutdown_timeout = proc, shutdown_timeout

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=self.shutdown_timeout + 5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(*args, **kwargs) -> HostedService:
    """get_distributed_runtime_service(*args, **kwargs), hosted in a child process; raises
    ServiceError when the child cannot start it (an address in use, say)."""
    spec = json.dumps({"args": list(args), "kwargs": kwargs})
    proc = subprocess.Popen([sys.executable, "-m", "kipp.cuda.coordinator", spec],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # a terminal's Ctrl-C is process 0's
    answer: list[str] = []
    reader = threading.Thread(target=lambda: answer.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(READY_S)
    line = answer[0].strip() if answer else ""
    if line != "ready":
        proc.kill()
        proc.wait()
        why = line.removeprefix("error: ") or f"no answer within {READY_S:.0f} s"
        raise ServiceError(f"the coordination service did not start: {why}")
    return HostedService(proc, float(kwargs.get("shutdown_timeout") or 0))


def main(spec: str) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    call = json.loads(spec)
    from jax._src.lib import _jax

    try:
        service = _jax.get_distributed_runtime_service(*call["args"], **call["kwargs"])
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"error: {first[:300]}", flush=True)
        return 1
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "stop":
        time.sleep(GRACE_S)  # process 0 died: let the survivors see it in their collectives
    service.shutdown()
    sys.stdout.flush()
    os._exit(0)  # the runtime's threads are done; nothing else to wait for


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
