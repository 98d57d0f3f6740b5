"""A live `kipp serve` for tests: a subprocess on 127.0.0.1, driven over raw HTTP or clients."""

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

TINY = "kipp-synthetic/qwen3-tiny"


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`kipp serve ARTIFACT --backend reference --port 0 ARGS...` in a subprocess, ready once it
    prints the port and /health answers; raw HTTP helpers and an `openai` client. The KV disk
    tier is off unless ARGS turn it on (a later flag wins), so no test reads another's blocks."""

    def __init__(self, artifact, *args):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kipp.cli", "serve", str(artifact), "--backend", "reference",
             "--port", "0", "--kv-disk-mib", "0", *args], stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        self.log = []
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("kipp serve exited:\n" + "".join(self.log))
            self.log.append(line)
            found = re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)", line)
            if found:
                self.port = int(found.group(1))
                break
        else:
            raise RuntimeError("kipp serve did not start:\n" + "".join(self.log))
        threading.Thread(target=self._drain, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {}  # sent with every raw request (an API key, say)
        assert self.get("/health")[0] == 200

    def _drain(self):
        """Keep reading the log (so the server never blocks on a full pipe), holding its tail
        for a failing test to show."""
        for line in self.proc.stderr:
            self.log.append(line)
            del self.log[:-200]

    def log_tail(self) -> str:
        return "".join(self.log[-40:])

    def request(self, method, path, body=None, raw: bytes | None = None, headers=None):
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **self.headers, **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=120) as response:
                return response.status, response.read().decode(), dict(response.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(), dict(e.headers)

    def get(self, path):
        return self.request("GET", path)

    def post(self, path, body=None, **kwargs):
        return self.request("POST", path, body, **kwargs)

    def metrics(self) -> dict[str, float]:
        _, text, _ = self.get("/metrics")
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                             timeout=120)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def chat_replies(server, model: str = TINY) -> list:
    """Each greedy reply's text, tokens and their logprobs (the synthetic model's text alone
    hardly depends on its input: the logprobs are what tell two servers apart)."""
    import numpy as np

    client = server.client()
    replies = []
    for prompt in ("Name three colours.", "Count from one to five."):
        reply = client.chat.completions.create(
            model=model, max_tokens=12, temperature=0, logprobs=True,
            messages=[{"role": "user", "content": prompt}])
        content = reply.choices[0].logprobs.content
        replies.append((reply.choices[0].message.content, [t.token for t in content],
                        np.array([t.logprob for t in content])))
    return replies


def assert_same_replies(got, want) -> None:
    """A group's replies against one process's: the same text and tokens; logprobs within
    float32's noise (the sums split over processes add in another order)."""
    import numpy as np

    assert all(text for text, _, _ in want)  # some text to compare
    for (text, tokens, logprobs), (want_text, want_tokens, want_logprobs) in zip(got, want):
        assert (text, tokens) == (want_text, want_tokens)
        np.testing.assert_allclose(logprobs, want_logprobs, rtol=0, atol=1e-4)
