"""Process 0's port while its distributed group forms: 503 and Retry-After, then the server.

    with Forming(host, port) as forming:        # binds now; a child process answers 503
        model = load(..., distributed=group)    # joins the group, loads this process's shards
    serve(model, host, bound=forming.socket)    # the same listening socket takes over

MLX's ring init holds the GIL while it waits for the other ranks, so no thread of process 0
could answer meanwhile: a child process (this file, run with the standard library alone)
accepts on the inherited listening socket. It stops once its stdin closes: when the block
ends, or when process 0 exits (a broken group's one line, then exit), so it never outlives
it. The socket listens throughout, so a connection made during the handover waits in the
backlog for the real server instead of being refused. The module's top level imports the
standard library only, for the child.
"""

from __future__ import annotations

import http.server
import json
import signal
import socket
import subprocess
import sys

RETRY_AFTER_S = 5
MESSAGE = "the distributed group is forming: the model is not loaded yet"
READ_TIMEOUT_S = 5  # a client that sends nothing cannot hold up the handover for longer
BACKLOG = 1024  # waitress's own


class Forming:
    """A listening socket on host:port, answered by the forming responder inside the block;
    after it, `socket` is the server's to take over (closed if the block raised)."""

    def __init__(self, host: str, port: int):
        from kipp.errors import KippError

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self.socket = socket.create_server((host, port), family=family, backlog=BACKLOG)
        except OSError as e:
            raise KippError(f"--host {host} --port {port}: cannot listen there "
                            f"({e.strerror})") from None
        self.host, self.port = host, self.socket.getsockname()[1]
        self._child = None

    def __enter__(self) -> Forming:
        fd = self.socket.fileno()
        self._child = subprocess.Popen(
            [sys.executable, "-I", __file__, str(fd), json.dumps(error_bodies())],
            stdin=subprocess.PIPE, pass_fds=(fd,))
        print(f"kipp: forming the group; http://{self.host}:{self.port} answers 503 until it "
              f"is whole and the model is loaded", file=sys.stderr, flush=True)
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self._child.stdin.close()
        try:
            self._child.wait(READ_TIMEOUT_S + 5)
        except subprocess.TimeoutExpired:  # it must not answer beside the real server
            self._child.kill()
            self._child.wait()
        if kind is not None:
            self.socket.close()


def error_bodies() -> dict[str, dict]:
    """The 503's body for each API path prefix, in that API's own error shape ("": OpenAI's,
    every other path)."""
    from kipp.http import messages_shape  # noqa: F401  (registers the Messages API's shape)
    from kipp.http.fields import APIError
    from kipp.http.shape import error_prefixes, error_shape

    error = APIError(503, MESSAGE, code="group_forming", type="server_error")
    return {prefix: error_shape(prefix).body(error) for prefix in (*error_prefixes(), "")}


class _Answer(http.server.BaseHTTPRequestHandler):
    """Every request: 503 with Retry-After, the body of the longest matching prefix."""

    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S

    def _answer(self) -> None:
        # read the body: closing with unread bytes would reset the connection under the reply
        left = int(self.headers.get("Content-Length") or 0)
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                break
            left -= len(chunk)
        prefix = max((p for p in self.server.bodies if self.path.startswith(p)), key=len)
        body = json.dumps(self.server.bodies[prefix]).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Retry-After", str(RETRY_AFTER_S))
        self.send_header("Connection", "close")  # the next request may find the real server
        self.end_headers()
        if self.command != "HEAD":  # a HEAD reply has the GET's headers and no body
            self.wfile.write(body)
        self.close_connection = True

    do_GET = do_HEAD = do_POST = do_DELETE = do_PUT = do_OPTIONS = _answer

    def log_message(self, *args) -> None:
        pass


def _respond(fd: int, bodies: dict[str, dict]) -> None:
    """The child: answer on the inherited socket until stdin closes, then finish the replies
    in flight and exit (closing only this process's descriptor of the socket)."""
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for process 0; this follows it
    server = http.server.ThreadingHTTPServer(("", 0), _Answer, bind_and_activate=False)
    server.socket.close()
    server.socket, server.bodies = socket.socket(fileno=fd), bodies
    server.daemon_threads = False  # server_close waits for the replies in flight
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    sys.stdin.buffer.read()  # returns at EOF
    server.shutdown()
    server.server_close()


if __name__ == "__main__":
    _respond(int(sys.argv[1]), json.loads(sys.argv[2]))
