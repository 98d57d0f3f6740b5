"""Kipp's OpenAI-compatible HTTP server: `kipp serve MODEL` (see kipp.http.serve).

Served by waitress, a production WSGI server: a thread per in-flight request (handlers block on
their ticket's event queue, the engine thread does the work) and every write of a streamed
response goes to the socket at once (its send_bytes is 1), so server-sent events are not
buffered. Flask's development server is never used.

SIGTERM and SIGINT both drain (see _Shutdown): the listening socket closes, queued requests
end at once, running ones may finish until shortly before `drain_timeout` seconds have passed
and are then ended with an error event (streams) or a 503 (plain responses), the handlers write
their last bytes, and `serve` returns (exit status 0) within the drain timeout. A second signal
cuts the wait short.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from kipp.http.app import create_app

__all__ = ["create_app", "serve"]

DEFAULT_THREADS = 96
DEFAULT_DRAIN_SECONDS = 10.0
# Running requests are ended this long before the drain timeout (a third of it when shorter),
# so that their clients get the error event and the process is gone by the timeout.
_END_MARGIN_SECONDS = 1.0


def serve(model, host: str = "127.0.0.1", port: int = 8080, *, max_batch: int = 8,
          max_queue: int = 64, prefill_chunk: int | None = None, threads: int = DEFAULT_THREADS,
          model_name: str | None = None, served_names: tuple[str, ...] = (),
          chat_max_tokens: int | None = None, speculative: bool = False,
          drain_timeout: float = DEFAULT_DRAIN_SECONDS, reasoning_format: str = "auto",
          max_output_tokens: int | None = None, stops: tuple[str, ...] = (),
          access=None, runtime_lora: bool = False, bound=None) -> None:
    """Run the engine thread and the HTTP server until SIGTERM or SIGINT, then drain for up to
    `drain_timeout` seconds and return. `port` 0 picks a free port; the line "kipp: serving
    MODEL on http://HOST:PORT" on stderr says which. `speculative` decodes greedy requests with
    prompt-lookup speculation (same tokens, fewer evals). `served_names` are the model names
    requests may give; `access` (kipp.http.access.Access) the API key and CORS origins. `bound`
    is a listening socket to serve on instead of binding host:port (kipp.http.forming's)."""
    import waitress

    from kipp.engine.scheduler import DEFAULT_PREFILL_CHUNK, Scheduler
    from kipp.http.app import DEFAULT_CHAT_MAX_TOKENS

    scheduler = Scheduler(model, max_batch=max_batch, max_queue=max_queue,
                          prefill_chunk=prefill_chunk or DEFAULT_PREFILL_CHUNK,
                          speculative=speculative)
    app = create_app(model, scheduler, model_name=model_name, served_names=served_names,
                     chat_max_tokens=chat_max_tokens or DEFAULT_CHAT_MAX_TOKENS,
                     reasoning_format=reasoning_format, max_output_tokens=max_output_tokens,
                     stops=stops, access=access, runtime_lora=runtime_lora)
    # channel_request_lookahead: a channel stays readable while its request runs, so a client
    # that closes its connection is seen (waitress.client_disconnected) and its request ends.
    sockets: dict = {}
    where = {"host": host, "port": port} if bound is None else {"sockets": [bound]}
    server = waitress.create_server(app, map=sockets, **where, threads=threads,
                                    connection_limit=max(100, 2 * threads),
                                    channel_timeout=300, channel_request_lookahead=1,
                                    ident="kipp")
    scheduler.start()
    name = served_names[0] if served_names else model_name or model.entry.id
    print(f"kipp: serving {name} on http://{host}:{server.effective_port} "
          f"({model.backend.describe()}, batch {max_batch}, queue {max_queue}, "
          f"{model.pool.num_blocks} KV blocks{', speculative' if speculative else ''})",
          file=sys.stderr, flush=True)
    shutdown = _Shutdown(server, sockets, scheduler, drain_timeout)
    try:
        with shutdown.on_signals():
            shutdown.run()
    finally:
        server.task_dispatcher.shutdown(timeout=1)
        _close_all(sockets)
        scheduler.stop()
    print("kipp: stopped", file=sys.stderr, flush=True)


class _Shutdown:
    """Runs waitress's socket loop until a signal's drain has finished.

    The loop (this thread) does all socket I/O, so it keeps running while a helper thread
    drains: waitress's handlers hand their bytes to it. The listening sockets are closed by the
    loop itself (the socket map is its own), so new connections are refused at once.
    """

    def __init__(self, server, sockets: dict, scheduler, drain_timeout: float):
        self.server, self.sockets, self.scheduler = server, sockets, scheduler
        self.drain_timeout = drain_timeout
        self.requested = threading.Event()  # a signal came: stop listening, drain
        self.finished = threading.Event()  # drained and flushed: the loop may stop
        self.hurry = threading.Event()  # a second signal: stop waiting
        self._listening = True

    def on_signals(self):
        return _SignalHandlers(self.begin, (signal.SIGTERM, signal.SIGINT))

    def begin(self, signum=None, frame=None) -> None:
        """The signal handler (main thread): start draining, or on a second signal hurry."""
        if self.requested.is_set():
            self.hurry.set()
            self.scheduler.drain(0, wait=False)
            return
        self.requested.set()
        name = signal.Signals(signum).name if signum else "shutdown"
        threading.Thread(target=self._drain, args=(name,), name="kipp-drain",
                         daemon=True).start()

    def run(self) -> None:
        from waitress import wasyncore

        use_poll = self.server.adj.asyncore_use_poll
        while not self.finished.is_set():
            if self.requested.is_set() and self._listening:
                self._stop_listening()
            wasyncore.loop(timeout=0.1, use_poll=use_poll, map=self.sockets, count=1)

    def _stop_listening(self) -> None:
        from waitress import wasyncore
        from waitress.server import BaseWSGIServer

        for listener in [d for d in self.sockets.values() if isinstance(d, BaseWSGIServer)]:
            wasyncore.dispatcher.close(listener)  # this socket only (not waitress's trigger)
        self._listening = False

    def _drain(self, reason: str) -> None:
        deadline = time.monotonic() + self.drain_timeout
        # Printed here, not in the signal handler, which may interrupt another write to stderr.
        print(f"kipp: {reason}: draining (up to {self.drain_timeout:g} s)", file=sys.stderr,
              flush=True)
        margin = min(_END_MARGIN_SECONDS, self.drain_timeout / 3)
        self.scheduler.drain(self.drain_timeout - margin)
        # The handlers write their last events; stop with a little room for the exit itself.
        while time.monotonic() < deadline - margin / 2 and not self.hurry.is_set() \
                and self._busy():
            time.sleep(0.02)
        self.finished.set()

    def _busy(self) -> bool:
        """Whether a handler still runs or a connection still has bytes to send."""
        tasks = self.server.task_dispatcher
        if tasks.active_count or tasks.queue:
            return True
        return any(getattr(c, "total_outbufs_len", 0) for c in list(self.sockets.values()))


class _SignalHandlers:
    """Route `signals` to `handler` while in the block (only possible on the main thread)."""

    def __init__(self, handler, signals):
        self.handler, self.signals, self.previous = handler, signals, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self.previous[sig] = signal.signal(sig, self.handler)
        return self

    def __exit__(self, *exc):
        for sig, previous in self.previous.items():
            signal.signal(sig, previous)


def _close_all(sockets: dict) -> None:
    from waitress import wasyncore

    wasyncore.close_all(sockets)
