"""Kipp's OpenAI-compatible HTTP server: `kipp serve MODEL` (see kipp.http.serve).

Served by waitress, a production WSGI server: a thread per in-flight request (handlers block on
their ticket's event queue, the engine thread does the work) and every write of a streamed
response goes to the socket at once (its send_bytes is 1), so server-sent events are not
buffered. Flask's development server is never used.
"""

from __future__ import annotations

import sys

from kipp.http.app import create_app

__all__ = ["create_app", "serve"]

DEFAULT_THREADS = 96


def serve(model, host: str = "127.0.0.1", port: int = 8080, *, max_batch: int = 8,
          max_queue: int = 64, prefill_chunk: int | None = None, threads: int = DEFAULT_THREADS,
          model_name: str | None = None, chat_max_tokens: int | None = None,
          speculative: bool = False) -> None:
    """Run the engine thread and the HTTP server until interrupted. `port` 0 picks a free port;
    the line "kipp: serving MODEL on http://HOST:PORT" on stderr says which. `speculative`
    decodes greedy requests with prompt-lookup speculation (same tokens, fewer evals)."""
    import waitress

    from kipp.http.app import DEFAULT_CHAT_MAX_TOKENS
    from kipp.scheduler import DEFAULT_PREFILL_CHUNK, Scheduler

    scheduler = Scheduler(model, max_batch=max_batch, max_queue=max_queue,
                          prefill_chunk=prefill_chunk or DEFAULT_PREFILL_CHUNK,
                          speculative=speculative)
    app = create_app(model, scheduler, model_name=model_name,
                     chat_max_tokens=chat_max_tokens or DEFAULT_CHAT_MAX_TOKENS)
    server = waitress.create_server(app, host=host, port=port, threads=threads,
                                    connection_limit=max(100, 2 * threads),
                                    channel_timeout=300, ident="kipp")
    scheduler.start()
    name = model_name or model.entry.id
    print(f"kipp: serving {name} on http://{host}:{server.effective_port} "
          f"({model.backend.describe()}, batch {max_batch}, queue {max_queue}, "
          f"{model.pool.num_blocks} KV blocks{', speculative' if speculative else ''})",
          file=sys.stderr, flush=True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        scheduler.stop()
