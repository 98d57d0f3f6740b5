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
standard library only, for the child, which applies the server's own API key and CORS rules
(kipp.http.access, loaded from beside this file): a request without the key gets the 401 it
would get once the model is loaded, a browser's preflight its 204.
"""

from __future__ import annotations

import http.server
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

RETRY_AFTER_S = 5
MESSAGE = "the distributed group is forming: the model is not loaded yet"
READ_TIMEOUT_S = 5  # a client that sends nothing cannot hold up the handover for longer
BACKLOG = 1024  # waitress's own


class Forming:
    """A listening socket on host:port, answered by the forming responder inside the block;
    after it, `socket` is the server's to take over (closed if the block raised)."""

    def __init__(self, host: str, port: int, access=None):
        from kipp.errors import KippError
        from kipp.http.access import Access

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self.socket = socket.create_server((host, port), family=family, backlog=BACKLOG)
        except OSError as e:
            raise KippError(f"--host {host} --port {port}: cannot listen there "
                            f"({e.strerror})") from None
        self.host, self.port = host, self.socket.getsockname()[1]
        self.access = access or Access()
        self._child = None

    def __enter__(self) -> Forming:
        fd = self.socket.fileno()
        self._child = subprocess.Popen([sys.executable, "-I", __file__, str(fd)],
                                       stdin=subprocess.PIPE, pass_fds=(fd,))
        # the settings go down the pipe, not the command line: the API key is not for `ps`
        settings = dict(bodies=error_bodies(), api_key=self.access.api_key,
                        protect_info=self.access.protect_info,
                        cors_origins=list(self.access.cors_origins))
        self._child.stdin.write(json.dumps(settings).encode() + b"\n")
        self._child.stdin.flush()
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


def error_bodies() -> dict[str, dict[str, dict]]:
    """For each answer (the 503, and each 401 of kipp.http.access.KEY_ERRORS), its body for each
    API path prefix, in that API's own error shape ("": OpenAI's, every other path)."""
    from kipp.http import messages_shape  # noqa: F401  (registers the Messages API's shape)
    from kipp.http.access import KEY_ERRORS
    from kipp.http.fields import APIError
    from kipp.http.shape import error_prefixes, error_shape

    errors = {"group_forming": APIError(503, MESSAGE, code="group_forming", type="server_error")}
    errors |= {code: APIError(401, message, code=code, type="authentication_error")
               for code, message in KEY_ERRORS.items()}
    return {code: {prefix: error_shape(prefix).body(error)
                   for prefix in (*error_prefixes(), "")} for code, error in errors.items()}


class _Answer(http.server.BaseHTTPRequestHandler):
    """Every request: the API key check and CORS as the server applies them, then 503 with
    Retry-After; each body that of the longest matching API path prefix."""

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
        access, origin = self.server.access, self.headers.get("Origin")
        if self.command == "OPTIONS" and access.cors_origins:
            preflight = access.preflight_headers(
                origin, self.headers.get("Access-Control-Request-Headers"))
            return self._reply(204, preflight, None)
        path = self.path.split("?", 1)[0]
        code = access.key_error(path, self.headers.get) or "group_forming"
        bodies = self.server.bodies[code]
        body = bodies[max((p for p in bodies if path.startswith(p)), key=len)]
        headers = {"Retry-After": str(RETRY_AFTER_S)} if code == "group_forming" else {}
        allowed = access.allowed_origin(origin)
        if allowed is not None:
            headers |= {"Access-Control-Allow-Origin": allowed, "Vary": "Origin"}
        self._reply(503 if code == "group_forming" else 401, headers, body)

    def _reply(self, status: int, headers: dict[str, str], body: dict | None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Connection", "close")  # the next request may find the real server
        self.end_headers()
        if self.command != "HEAD":  # a HEAD reply has the GET's headers and no body
            self.wfile.write(data)
        self.close_connection = True

    do_GET = do_HEAD = do_POST = do_DELETE = do_PUT = do_OPTIONS = _answer

    def log_message(self, *args) -> None:
        pass


def _respond(fd: int) -> None:
    """The child: read the settings line from stdin, answer on the inherited socket until stdin
    closes, then finish the replies in flight and exit (closing only this process's descriptor
    of the socket)."""
    import threading

    sys.path.insert(0, str(Path(__file__).parent))  # access.py, by file: not kipp's package
    from access import Access

    settings = json.loads(sys.stdin.buffer.readline())

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for process 0; this follows it
    server = http.server.ThreadingHTTPServer(("", 0), _Answer, bind_and_activate=False)
    server.socket.close()
    server.socket, server.bodies = socket.socket(fileno=fd), settings["bodies"]
    server.access = Access(api_key=settings["api_key"], protect_info=settings["protect_info"],
                           cors_origins=tuple(settings["cors_origins"]))
    server.daemon_threads = False  # server_close waits for the replies in flight
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    sys.stdin.buffer.read()  # returns at EOF
    server.shutdown()
    server.server_close()


if __name__ == "__main__":
    _respond(int(sys.argv[1]))
