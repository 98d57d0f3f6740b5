"""Process 0's port while its distributed group forms (kipp.http.forming), on loopback.

The fast set runs the forming responder alone: 503 with Retry-After in each API's error shape
(the openai and anthropic clients read them), the socket handed to a waitress server as
kipp.http.serve takes it with no connection refused in between, and closed when loading fails.
The slow set starts process 0 of a two-process `kipp serve --distributed` group alone (JAX
and MLX): its port answers 503 until the other process starts, then the same port serves a
single process's replies; a group that never forms ends with the one line and a closed port.
Every process is killed by PID at its deadline.
"""

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from kipp.errors import KippError
from kipp.http.forming import RETRY_AFTER_S, Forming
from live_server import TINY, LiveServer, assert_same_replies, chat_replies, free_port

SERVE_ARGS = ("--kv-tokens", "512", "--max-batch", "2", "--kv-disk-mib", "0")
START_S = 120  # a process's start, load or exit, on two shared cores
FORMING = r"forming the group; http://127\.0\.0\.1:(\d+) answers 503"
BROKEN = "kipp: distributed group broken:"


def get(url: str, path: str, body: dict | None = None) -> tuple[int, dict, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"{}"), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def assert_forming(url: str) -> None:
    """/health, chat completions (the openai client), /v1/models and Messages (the anthropic
    client): 503 with Retry-After, each in its API's error shape."""
    import anthropic
    import openai

    status, body, headers = get(url, "/health")
    assert status == 503 and headers["Retry-After"] == str(RETRY_AFTER_S), (status, headers)
    assert body["error"]["code"] == "group_forming" and body["error"]["message"], body
    status, body, _ = get(url, "/v1/models")
    assert status == 503 and body["error"]["type"] == "server_error", body
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "Hi"}])
    assert raised.value.status_code == 503
    assert raised.value.response.headers["retry-after"] == str(RETRY_AFTER_S)
    assert raised.value.response.json()["error"]["code"] == "group_forming"
    messages = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=10)
    with pytest.raises(anthropic.APIStatusError) as raised:
        messages.messages.create(model=TINY, max_tokens=8,
                                 messages=[{"role": "user", "content": "Hi"}])
    assert raised.value.status_code == 503
    assert raised.value.response.headers["retry-after"] == str(RETRY_AFTER_S)
    body = raised.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error", body


def refused(port: int, within_s: float = 3.0) -> bool:
    """Whether connecting to the port is refused (soon: a child's exit follows its parent's)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        except ConnectionResetError:  # the socket closed under this connection
            pass
        time.sleep(0.05)
    return False


# -- the responder alone ------------------------------------------------------------------------

def test_forming_answers_503_in_each_api_shape():
    with Forming("127.0.0.1", 0) as forming:
        assert_forming(f"http://127.0.0.1:{forming.port}")
        status, body, _ = get(f"http://127.0.0.1:{forming.port}", "/v1/responses",
                              {"model": TINY, "input": "Hi"})
        assert status == 503 and body["error"]["code"] == "group_forming", body
        head = urllib.request.Request(f"http://127.0.0.1:{forming.port}/health", method="HEAD")
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(head, timeout=10)
        assert raised.value.code == 503 and raised.value.read() == b""
        assert raised.value.headers["Retry-After"] == str(RETRY_AFTER_S)
    forming.socket.close()


LOCKED = "s3cret-key"
ORIGIN = "http://localhost:3000"
# (method, path, headers): the requests a locked server and the forming responder must refuse,
# preflight or tag alike
ACCESS_CASES = [
    ("POST", "/v1/chat/completions", {}),
    ("POST", "/v1/chat/completions", {"Authorization": "Bearer nope"}),
    ("POST", "/v1/chat/completions?stream=1", {"x-api-key": LOCKED[:-1]}),
    ("POST", "/v1/messages", {}),
    ("POST", "/v1/messages", {"x-api-key": "nope", "Origin": ORIGIN}),
    ("POST", "/v1/responses", {"Authorization": LOCKED}),
    ("GET", "/health", {}),
    ("GET", "/metrics", {}),
    ("OPTIONS", "/v1/chat/completions", {"Origin": ORIGIN,
                                         "Access-Control-Request-Method": "POST",
                                         "Access-Control-Request-Headers": "x-api-key"}),
    ("OPTIONS", "/v1/messages", {"Origin": "http://evil.example",
                                 "Access-Control-Request-Method": "POST"}),
]
CORS_HEADERS = ("Access-Control-Allow-Origin", "Access-Control-Allow-Methods",
                "Access-Control-Allow-Headers", "Access-Control-Max-Age", "Vary")


def send(url: str, method: str, path: str, headers: dict) -> tuple[int, dict, dict]:
    data = json.dumps({"model": TINY}).encode() if method == "POST" else None
    request = urllib.request.Request(url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status, raw, got = response.status, response.read(), response.headers
    except urllib.error.HTTPError as e:
        status, raw, got = e.code, e.read(), e.headers
    return status, json.loads(raw) if raw else {}, {h: got.get(h) for h in CORS_HEADERS}


@pytest.mark.parametrize("protect_info", [False, True])
def test_forming_refuses_and_tags_as_the_locked_server_would(artifacts, protect_info):
    """With an API key and CORS origins, the forming responder's 401s, preflights and CORS
    headers are the Flask app's (same access settings, a loaded model: the oracle); whatever
    passes the key check gets the 503, and the right key reaches it."""
    from kipp.engine.scheduler import Scheduler
    from kipp.http.access import Access
    from kipp.http.app import create_app
    from kipp.model import load

    access = Access(api_key=LOCKED, protect_info=protect_info, cors_origins=(ORIGIN,))
    model = load(artifacts(TINY), backend="reference", kv_tokens=512, progress=False)
    scheduler = Scheduler(model).start()
    try:
        app = create_app(model, scheduler, access=access).test_client()
        with Forming("127.0.0.1", 0, access) as forming:
            url = f"http://127.0.0.1:{forming.port}"
            for method, path, headers in ACCESS_CASES:
                status, body, tags = send(url, method, path, headers)
                want = app.open(path, method=method, headers=headers,
                                json={"model": TINY} if method == "POST" else None)
                case = (method, path, headers)
                if want.status_code in (401, 204):
                    assert status == want.status_code and body == (want.json or {}), case
                else:  # what the server would serve, the forming responder defers
                    assert status == 503 and body["error"]["code"] == "group_forming", case
                assert tags == {h: want.headers.get(h) for h in CORS_HEADERS}, case
            status, body, _ = send(url, "POST", "/v1/messages", {"x-api-key": LOCKED})
            assert status == 503 and body["type"] == "error", body
            assert body["error"]["message"] == "the distributed group is forming: the model " \
                                               "is not loaded yet", body
        forming.socket.close()
    finally:
        scheduler.stop()


class Poller(threading.Thread):
    """GET /health over and over until stopped: each status, or the error of a connection
    refused, reset or cut short."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.url, self.answers, self.stopped = f"http://127.0.0.1:{port}", [], threading.Event()

    def run(self):
        while not self.stopped.is_set():
            try:
                self.answers.append(get(self.url, "/health")[0])
            except (OSError, ValueError) as e:
                self.answers.append(e)
            time.sleep(0.02)

    def until_ok(self, timeout_s: float = 10) -> None:
        """Stop once the real server has answered; check 503s, then 200s only, no error."""
        end = time.monotonic() + timeout_s
        while 200 not in self.answers[-3:] and time.monotonic() < end:
            time.sleep(0.05)
        self.stopped.set()
        self.join(15)
        errors = [a for a in self.answers if not isinstance(a, int)]
        assert not errors, errors[:3]
        assert set(self.answers) == {503, 200}, self.answers
        first_ok = self.answers.index(200)
        assert all(a == 200 for a in self.answers[first_ok:]), self.answers


def test_forming_hands_its_socket_over_without_refusing():
    """A client polls all along: 503s, then the server that took the socket over (as
    kipp.http.serve takes it) answers 200; never a refused or reset connection, even while
    nothing accepts (the backlog holds it)."""
    import waitress
    from waitress import wasyncore

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "application/json")])
        return [b"{}"]

    with Forming("127.0.0.1", 0) as forming:
        poller = Poller(forming.port)
        poller.start()
        end = time.monotonic() + 10
        while len(poller.answers) < 5 and time.monotonic() < end:
            time.sleep(0.05)
    time.sleep(0.3)  # nothing accepts now
    sockets: dict = {}
    server = waitress.create_server(app, map=sockets, sockets=[forming.socket], threads=2)
    assert int(server.effective_port) == forming.port
    done = threading.Event()

    def serve():  # as kipp.http.serve's loop
        while not done.is_set():
            wasyncore.loop(timeout=0.05, map=sockets, count=1)

    serving = threading.Thread(target=serve, daemon=True)
    serving.start()
    try:
        poller.until_ok()
    finally:
        done.set()
        serving.join(10)
        server.task_dispatcher.shutdown(timeout=1)
        wasyncore.close_all(sockets)


def test_forming_closes_its_port_when_loading_fails():
    with pytest.raises(KippError, match="no such model"):
        with Forming("127.0.0.1", 0) as forming:
            raise KippError("no such model")
    assert forming._child.poll() is not None
    assert refused(forming.port, within_s=0.5)


def test_a_port_in_use_is_one_clear_error():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(KippError, match=f"--port {port}: cannot listen there"):
            Forming("127.0.0.1", port)


# -- process 0 of kipp serve --distributed, alone then joined ------------------------------------

class Leader(LiveServer):
    """Process 0 of `kipp serve --distributed`, from its first line on: its port, printed
    while the group forms (LiveServer's helpers, without its wait for a ready server)."""

    def __init__(self, command, env):
        self.proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        self.log, self.headers, self._lines = [], {}, queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.port = int(self.wait_for(FORMING).group(1))
        self.url = f"http://127.0.0.1:{self.port}"

    def _read(self):
        for line in self.proc.stderr:
            self.log.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def wait_for(self, pattern: str, timeout_s: float = START_S) -> re.Match:
        end = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {pattern!r} within {timeout_s} s:\n"
                                     + self.log_tail()) from None
            if line is None:
                raise AssertionError(f"exited before {pattern!r}:\n" + self.log_tail())
            found = re.search(pattern, line)
            if found:
                return found


def serve_command(artifact, *args) -> list[str]:
    return [sys.executable, "-m", "kipp.cli", "serve", str(artifact), *args, *SERVE_ARGS]


def kill(*procs) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()


def forms_after_503(single, leader_command, follower_command, env, follower_env,
                    tmp_path) -> None:
    """A single process's replies; then process 0 alone answers 503, process 1 starts, and
    the same port answers as the single process did, with no refused connection in between;
    SIGTERM ends both with status 0. The follower's own --port stays free: only process 0
    binds."""
    try:
        want = chat_replies(single)
    finally:
        single.stop()
    spare = free_port()
    leader = follower = poller = None
    try:
        leader = Leader(leader_command, env)
        assert_forming(leader.url)
        poller = Poller(leader.port)
        poller.start()
        with open(tmp_path / "follower.log", "w") as log:
            follower = subprocess.Popen([*follower_command, "--port", str(spare)],
                                        env=follower_env, stdout=subprocess.DEVNULL, stderr=log)
        served = leader.wait_for(r"serving \S+ on http://127\.0\.0\.1:(\d+)")
        assert int(served.group(1)) == leader.port
        poller.until_ok()
        assert_same_replies(chat_replies(leader), want)
        with socket.create_server(("127.0.0.1", spare)):
            pass
        leader.proc.send_signal(signal.SIGTERM)
        assert leader.proc.wait(START_S) == 0, leader.log_tail()
        assert follower.wait(30) == 0, (tmp_path / "follower.log").read_text()[-3000:]
    finally:
        if poller is not None:
            poller.stopped.set()
        kill(leader and leader.proc, follower)


def never_forms(command, env, statuses) -> None:
    """Process 0 alone, with a short join timeout: 503 meanwhile, then the one line, an exit
    status of `statuses`, and a closed port."""
    leader = Leader(command, env)
    try:
        assert leader.get("/health")[0] == 503
        leader.wait_for(BROKEN, timeout_s=60)
        assert leader.proc.wait(30) in statuses, leader.log_tail()
    finally:
        kill(leader.proc)
    assert len([line for line in leader.log if line.startswith(BROKEN)]) == 1, leader.log_tail()
    assert refused(leader.port)


def jax_env() -> dict:
    pytest.importorskip("jax")
    from test_distributed import rank_env

    return rank_env()


def jax_group(port: int, rank: int, parallel: str = "tensor") -> tuple[str, ...]:
    return ("--backend", "jax", "--distributed", "--coordinator", f"127.0.0.1:{port}",
            "--num-processes", "2", "--process-id", str(rank), "--parallel", parallel)


@pytest.mark.slow
def test_jax_process_0_answers_503_until_the_group_forms(artifacts, monkeypatch, tmp_path):
    artifact = artifacts(TINY, "bf16")
    env = jax_env()
    for key in [k for k in os.environ if "_proxy" in k.lower()]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    single = LiveServer(artifact, "--backend", "jax", *SERVE_ARGS)
    port = free_port()
    forms_after_503(single,
                    serve_command(artifact, *jax_group(port, 0), "--port", "0"),
                    serve_command(artifact, *jax_group(port, 1)), env, env, tmp_path)


@pytest.mark.slow
def test_jax_a_group_that_never_forms(artifacts):
    artifact = artifacts(TINY, "bf16")
    never_forms(serve_command(artifact, *jax_group(free_port(), 0), "--port", "0",
                              "--join-timeout", "3"), jax_env(), {3})


def mlx_envs(tmp_path) -> tuple[dict, dict]:
    pytest.importorskip("mlx.core")
    from test_mlx_distributed import rank_env, write_hostfile

    hostfile = write_hostfile(tmp_path / "hosts.json")
    return rank_env(0, hostfile), rank_env(1, hostfile)


MLX_GROUP = ("--backend", "mlx", "--distributed")


@pytest.mark.slow
def test_mlx_rank_0_answers_503_until_the_group_forms(artifacts, monkeypatch, tmp_path):
    artifact = artifacts(TINY, "bf16")
    env, follower_env = mlx_envs(tmp_path)
    from test_mlx_distributed import STREAMS

    monkeypatch.setenv("KIPP_MLX_CPU_STREAMS", STREAMS)
    single = LiveServer(artifact, "--backend", "mlx", *SERVE_ARGS)
    forms_after_503(single, serve_command(artifact, *MLX_GROUP, "--port", "0"),
                    serve_command(artifact, *MLX_GROUP), env, follower_env, tmp_path)


@pytest.mark.slow
def test_mlx_a_group_that_never_forms(artifacts, tmp_path):
    # rank 0's ring init holds the GIL: the join's backstop process kills it (SIGKILL)
    artifact = artifacts(TINY, "bf16")
    env, _ = mlx_envs(tmp_path)
    never_forms(serve_command(artifact, *MLX_GROUP, "--port", "0", "--join-timeout", "3"),
                env, {3, -signal.SIGKILL})
