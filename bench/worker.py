"""One engine arm in its own process, driven by JSON lines on stdin.

    {"op": "load", "spec": {...ArmSpec...}}            -> {"ok": true, "info": {...}}
    {"op": "run", "workload": {...}, "prompt": [ids]}   -> {"ok": true, "result": {...}}
    {"op": "close"}                                     -> {"ok": true, "rusage": {...}}

Replies go to the process's original stdout; file descriptor 1 is pointed at stderr first, so
whatever an engine prints (llama.cpp, vLLM) lands in the arm's log, never in the protocol. A
refusal (bench.fallback.FallbackError) is a reply with "refused": true. Peak RSS is the process's
own ru_maxrss, and its children's (vLLM's engine process) after `close` has reaped them.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import traceback


def peak_rss_bytes(who: int) -> int:
    """ru_maxrss in bytes (Linux reports KiB, macOS bytes)."""
    value = resource.getrusage(who).ru_maxrss
    return value if sys.platform == "darwin" else value * 1024


def rusage() -> dict:
    return {"self_peak_rss_bytes": peak_rss_bytes(resource.RUSAGE_SELF),
            "children_peak_rss_bytes": peak_rss_bytes(resource.RUSAGE_CHILDREN)}


class Worker:
    def __init__(self):
        self.engine = None

    def handle(self, request: dict) -> dict:
        op = request.get("op")
        if op == "load":
            return self.load(request["spec"])
        if op == "run":
            return self.run(request["workload"], request["prompt"])
        if op == "close":
            return self.close()
        raise ValueError(f"unknown op {op!r}")

    def load(self, spec_json: dict) -> dict:
        from bench import provenance
        from bench.engines import engine_class
        from bench.engines.base import ArmSpec

        spec = ArmSpec.from_json(spec_json)
        self.engine = engine_class(spec.engine)(spec)
        info = self.engine.load()
        info.update(pid=os.getpid(), python=provenance.python(),
                    packages=provenance.package_versions(), blas=provenance.blas(),
                    environment=provenance.environment())
        return {"ok": True, "info": info}

    def run(self, workload_json: dict, prompt: list[int]) -> dict:
        from bench.workloads import Workload, measure

        workload = Workload(**workload_json)
        result = measure(workload, self.engine, prompt)
        if hasattr(self.engine, "recheck"):
            self.engine.recheck()  # raises FallbackError: the run is refused, not recorded
        return {"ok": True, "result": result}

    def close(self) -> dict:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        gc.collect()
        return {"ok": True, "rusage": rusage()}


def main() -> None:
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from bench.fallback import FallbackError

    worker = Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            reply = worker.handle(request)
        except FallbackError as e:
            reply = {"ok": False, "refused": True, "error": str(e)}
        except BaseException as e:  # report everything; the orchestrator decides
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc(limit=8)}
        channel.write(json.dumps(reply) + "\n")
        if request.get("op") == "close":
            break
    channel.close()


if __name__ == "__main__":  # the guard vLLM's spawned engine process needs
    main()
