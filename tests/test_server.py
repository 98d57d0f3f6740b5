"""`kipp serve` as users run it: a live server on 127.0.0.1 (a subprocess), driven by the official
`openai` client, raw HTTP and many threads. The oracle is Model.generate in this process, on the
same artifact and backend: the server's tokens must equal an isolated generation's, bitwise.
"""

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from live_server import LiveServer as Server

openai = pytest.importorskip("openai")
pytest.importorskip("waitress")
pytest.importorskip("prometheus_client")

from kipp.http.app import MAX_BODY_BYTES  # noqa: E402
from kipp.model import load  # noqa: E402

TINY = "kipp-synthetic/qwen3-tiny"
NO_END = {"151643": -100, "151645": -100}  # no <|endoftext|>, no <|im_end|>: runs to max_tokens


@pytest.fixture(scope="module")
def artifact(artifacts):
    return artifacts(TINY)


@pytest.fixture(scope="module")
def server(artifact):
    s = Server(artifact, "--kv-tokens", "8192", "--max-batch", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oracle(artifact):
    return load(artifact, backend="reference", kv_tokens=4096, progress=False)


def isolated(model, prompt, max_tokens, **sampling):
    generation = model.generate(prompt, max_tokens, stream=True, **sampling)
    text = "".join(generation)
    return text, generation.stats.tokens


def token_strings(model, ids):
    return [model.tokenizer.decode_bytes([t]).decode("utf-8", errors="replace") for t in ids]


def test_openai_completions_plain_and_streamed(server, oracle):
    client = server.client()
    prompt = "Kipp runs the Qwen3 family"
    expected, ids = isolated(oracle, prompt, 12, temperature=0.9, seed=7)
    r = client.completions.create(model=TINY, prompt=prompt, max_tokens=12, temperature=0.9,
                                  seed=7, n=2, logprobs=2)
    assert r.object == "text_completion" and len(r.choices) == 2
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "length"
    assert r.choices[0].logprobs.tokens == token_strings(oracle, ids)
    assert all(len(top) == 2 for top in r.choices[0].logprobs.top_logprobs)
    assert r.usage.prompt_tokens == len(oracle.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 24
    assert r.model_extra["timings"]["predicted_n"] == 24
    again = client.completions.create(model=TINY, prompt=prompt, max_tokens=12,
                                      temperature=0.9, seed=7, n=2)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # same seed

    chunks = list(client.completions.create(model=TINY, prompt=prompt, max_tokens=12,
                                            temperature=0.9, seed=7, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_openai_stop_strings(server, oracle):
    client = server.client()
    prompt = "Stop strings end the text"
    text, _ = isolated(oracle, prompt, 16, temperature=0)
    stop = text[len(text) // 2: len(text) // 2 + 4]
    r = client.completions.create(model=TINY, prompt=prompt, max_tokens=16, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=TINY, prompt=prompt, max_tokens=16,
                                              temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text[: text.index(stop)]


def test_openai_chat_plain_and_streamed(server, oracle):
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What does Kipp do?"}]
    expected = oracle.chat(messages, 10, temperature=0.8, seed=3, enable_thinking=False).content
    r = client.chat.completions.create(
        model=TINY, messages=messages, max_tokens=10, temperature=0.8, seed=3, n=3,
        logprobs=True, top_logprobs=4, extra_body={"chat_template_kwargs":
                                                   {"enable_thinking": False}})
    assert r.object == "chat.completion" and len(r.choices) == 3
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    lp = r.choices[0].logprobs.content
    assert len(lp) == 10 and all(len(t.top_logprobs) == 4 for t in lp)
    assert b"".join(bytes(t.bytes) for t in lp).decode() == expected
    for t in lp:
        tops = [a.logprob for a in t.top_logprobs]
        assert tops == sorted(tops, reverse=True) and t.logprob <= tops[0] + 1e-9
    stream = client.chat.completions.create(
        model=TINY, messages=messages, max_tokens=10, temperature=0.8, seed=3, stream=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].model_extra["timings"]["predicted_n"] == 10


def test_models_and_health(server):
    status, body, _ = server.get("/v1/models")
    assert status == 200
    data = json.loads(body)["data"]
    assert [m["id"] for m in data] == [TINY] and data[0]["kipp"]["scheme"] == "bf16"
    assert server.client().models.list().data[0].id == TINY
    health = json.loads(server.get("/health")[1])
    assert health["status"] == "ok" and health["backend"].startswith("reference (numpy")
    assert health["kernels"] == {"running": [], "fell_back": {}, "probe_seconds": 0.0,
                                 "probes": []}  # the reference runs no kernels


@pytest.mark.slow  # CI's longest default checks
def test_concurrent_clients_get_their_isolated_generation(server, oracle):
    prompts = [f"Client number {i} asks about {w}" for i, w in
               enumerate(["rope", "norms", "kv blocks", "sampling", "gguf", "metal"])]
    expected = [isolated(oracle, p, 14, temperature=1.0, seed=100 + i)[0]
                for i, p in enumerate(prompts)]
    got = [None] * len(prompts)

    def run(i):
        r = server.client().completions.create(model=TINY, prompt=prompts[i], max_tokens=14,
                                               temperature=1.0, seed=100 + i)
        got[i] = r.choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected


def _ttft(server, prompt) -> tuple[float, dict]:
    """Seconds to the first streamed text, and the final usage chunk."""
    body = {"model": TINY, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    start = time.perf_counter()
    first, usage = None, None
    with urllib.request.urlopen(req, timeout=120) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    return first, usage


def test_shared_prefix_is_adopted_and_ttft_drops(server, oracle):
    prompt = "The engine thread owns the model and the block pool. " * 60  # ~660 tokens
    before = server.metrics()["kipp_prefix_reused_tokens_total"]
    cold, cold_usage = _ttft(server, prompt)
    warm, warm_usage = _ttft(server, prompt)
    reused = server.metrics()["kipp_prefix_reused_tokens_total"] - before
    n = len(oracle.tokenizer.encode(prompt))
    assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0
    # Every full block, then the cold request's partial last block: only the last token is
    # evaluated again.
    assert warm_usage["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert reused == n - 1
    print(f"\nTTFT of a {n}-token prompt: cold {cold * 1000:.0f} ms, reused "
          f"{warm * 1000:.0f} ms")
    assert warm < cold


def _stream_text(server, body, results, key, kill_after=None):
    """Read one SSE stream; with kill_after, drop the connection after that many chunks."""
    host, port = "127.0.0.1", server.port
    payload = json.dumps(body).encode()
    # A stream queued behind three full batches sees its first byte only when it is admitted:
    # on a busy machine that can take minutes; the callers bound the whole run instead.
    sock = socket.create_connection((host, port), timeout=280)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    f = sock.makefile("rb")
    text, chunks, done, usage = "", 0, False, None
    try:
        for line in f:
            if line.startswith(b"data: [DONE]"):
                done = True
                break
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    results[key] = ("error", chunk)
                    return
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                    chunks += 1
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if kill_after is not None and chunks >= kill_after:
                    results[key] = ("killed", text)
                    return
    finally:
        f.close()
        sock.close()
    results[key] = ("ok" if done else "truncated", text, usage)


def _wait_idle(server, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = server.metrics()
        if (m['kipp_active_sequences'] == 0 and m["kipp_queue_depth"] == 0
                and m['kipp_kv_blocks{state="in_use"}'] == 0):
            return m
        time.sleep(0.2)
    raise AssertionError(f"server not idle: {server.metrics()}")


@pytest.mark.slow  # one of the default suite's longest (CI: 'longest default checks')
def test_load_32_streams_with_a_killed_client(server, oracle):
    prompts = [f"Load test prompt {i}: the pool must not leak." for i in range(8)]
    expected = [isolated(oracle, p, 20, temperature=0)[0] for p in prompts]
    cancelled_before = server.metrics()["kipp_requests_cancelled_total"]
    results = {}
    threads = []
    for k in range(32):
        body = {"model": TINY, "prompt": prompts[k % 8], "max_tokens": 20, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        threads.append(threading.Thread(target=_stream_text, args=(server, body, results, k)))
    victim = {"model": TINY, "prompt": "a client that goes away", "max_tokens": 400,
              "temperature": 0, "stream": True}
    threads.append(threading.Thread(target=_stream_text,
                                    args=(server, victim, results, "victim", 3)))
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert time.time() - start < 300
    assert results["victim"][0] == "killed"
    for k in range(32):
        status, text, usage = results[k]
        assert status == "ok", results[k]
        assert text == expected[k % 8], f"stream {k} lost or duplicated tokens"
        assert usage["completion_tokens"] == 20
    m = _wait_idle(server)
    assert m["kipp_requests_cancelled_total"] == cancelled_before + 1
    assert m["kipp_kv_pool_occupancy"] == 0
    assert m['kipp_kv_blocks{state="reserved"}'] == 0


BAD_REQUESTS = [
    # (path, body or raw bytes, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"prompt": "x"}, 400, "model"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": TINY}, 400, "prompt"),
    ("/v1/completions", {"model": TINY, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": TINY, "prompt": [1.0, 2.5]}, 400, "prompt"),
    ("/v1/completions", b"[" * 50_000 + b"]" * 50_000, 400, None),
    ("/v1/completions", {"model": TINY, "prompt": [1, 999999]}, 400, "prompt"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "n": 9}, 400, "n"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "n": "2"}, 400, "n"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "temperature": "hot"}, 400,
     "temperature"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "echo": 1}, 400, "echo"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "stop": ["a"] * 5}, 400, "stop"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "logit_bias": {"abc": 1}}, 400,
     "logit_bias"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "logit_bias": {"5": 101}}, 400,
     "logit_bias"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "logit_bias": {"200000": 1}}, 400,
     "logit_bias"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "logit_bias": {"7": 1, "007": 2}}, 400,
     "logit_bias"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "n": 8, "max_tokens": 3000}, 400,
     "max_tokens"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "frequency_penalty": 3}, 400,
     "frequency_penalty"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "stream_options": {}}, 400,
     "stream_options"),
    ("/v1/completions", {"model": TINY, "prompt": "x", "tools": []}, 400, "tools"),
    ("/v1/chat/completions", {"model": TINY, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": TINY, "messages": [{"role": "robot", "content": "x"}]},
     400, "messages"),
    ("/v1/chat/completions", {"model": TINY, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": TINY, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": TINY, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "nope"}}}}, 400,
     "response_format"),
    ("/v1/chat/completions", {"model": TINY, "messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"foo": 1}}, 400, "chat_template_kwargs"),
    ("/v1/chat/completions", {"model": TINY, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 10_000}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": TINY, "messages": [{"role": "user",
                                                           "content": "x " * 41_000}]}, 400,
     "messages"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{(b if isinstance(b, bytes) else json.dumps(b))[:60]}"
                              for i, (_, b, _, _) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    if isinstance(body, bytes):
        got, text, _ = server.post(path, raw=body)
    else:
        got, text, _ = server.post(path, body)
    assert got == status, text
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["param"] == param


def test_server_keeps_serving_after_bad_input_and_odd_requests(server):
    status, text, _ = server.post("/v1/completions", raw=b"x" * (MAX_BODY_BYTES + 1))
    assert status == 413 and json.loads(text)["error"]["code"] == "request_too_large"
    status, text, _ = server.get("/v1/nope")
    assert status == 404 and "error" in json.loads(text)
    status, text, _ = server.get("/v1/completions")
    assert status == 405 and "error" in json.loads(text)
    assert server.get("/health")[0] == 200
    status, text, _ = server.post("/v1/completions", {"model": TINY, "prompt": "still here",
                                                      "max_tokens": 3})
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3


def test_base_checkpoint_refuses_chat_and_a_full_queue_answers_503(artifacts):
    """In-process app over a scheduler whose engine thread is not started: nothing runs, so the
    queue fills deterministically."""
    from kipp.engine.scheduler import Scheduler
    from kipp.http.app import create_app

    model = load(artifacts("kipp-synthetic/qwen3-tiny-base"), backend="reference",
                 kv_tokens=1024, progress=False)
    scheduler = Scheduler(model, max_queue=1)
    client = create_app(model, scheduler).test_client()
    name = model.entry.id
    r = client.post("/v1/chat/completions", json={"model": name, "messages": [
        {"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json["error"]["code"] == "no_chat_template"
    # The first request takes the one queue slot; its handler waits on it.
    first = threading.Thread(target=client.post, args=("/v1/completions",),
                             kwargs={"json": {"model": name, "prompt": "a", "max_tokens": 2}},
                             daemon=True)
    first.start()
    deadline = time.time() + 10
    while not scheduler._fifo and time.time() < deadline:
        time.sleep(0.01)
    r = client.post("/v1/completions", json={"model": name, "prompt": "b", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert r.json["error"]["code"] == "queue_full"
    scheduler.start()  # let the waiting request finish
    first.join(30)
    scheduler.stop()
    assert model.pool.num_in_use == 0


def _active(server) -> float:
    return server.metrics()["kipp_active_requests"]


def test_a_plain_request_whose_client_left_is_cancelled(server):
    """A non-streamed request stops when its client goes away (it used to run to max_tokens,
    holding its KV blocks, while clients that retry on timeout piled up more)."""
    _wait_idle(server)
    before = server.metrics()
    cancelled = before["kipp_requests_cancelled_total"]
    generated = before["kipp_generated_tokens_total"]
    body = json.dumps({"model": TINY, "prompt": "a client that times out", "max_tokens": 3000,
                       "temperature": 0, "logit_bias": NO_END}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.time() + 60
    while _active(server) < 1:
        assert time.time() < deadline, "the request never started"
        time.sleep(0.05)
    sock.close()  # like curl --max-time
    gone = time.time()
    m = _wait_idle(server, timeout=30)
    print(f"\nplain request cancelled {time.time() - gone:.2f} s after its client left")
    assert m["kipp_requests_cancelled_total"] == cancelled + 1
    assert m["kipp_generated_tokens_total"] - generated < 3000


def _read_sse(port: int, body: dict, results: dict, key, first: threading.Event):
    """Read a whole response with http.client: a stream that ends mid-chunk raises."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        if not body.get("stream"):
            results[key] = (response.status, json.loads(response.read()))
            return
        events = []
        while True:
            line = response.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                events.append(line[6:].strip().decode())
                first.set()
        results[key] = (response.status, events)
    except Exception as e:  # a reset or a truncated chunk: not a clean end
        results[key] = ("broken", repr(e))
    finally:
        conn.close()


@pytest.mark.parametrize("signum", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.slow)])
def test_a_signal_drains_and_every_client_gets_a_clean_end(artifact, signum):
    import signal

    drain = 3.0
    s = Server(artifact, "--kv-tokens", "16384", "--max-batch", "8", "--drain-timeout",
               str(drain))  # room for every request at once: they all run when the signal comes
    results, started = {}, []
    long = {"model": TINY, "prompt": "a long stream", "max_tokens": 3000, "temperature": 0,
            "logit_bias": NO_END}
    bodies = {f"stream{i}": {**long, "prompt": f"stream {i}", "stream": True} for i in range(3)}
    bodies["short"] = {**long, "max_tokens": 3, "stream": True}
    bodies["plain"] = long
    threads = []
    for key, body in bodies.items():
        first = threading.Event()
        started.append(first)
        threads.append(threading.Thread(target=_read_sse, args=(s.port, body, results, key,
                                                                first)))
        threads[-1].start()
    try:
        for first in started[:4]:  # every stream has sent its first chunk
            assert first.wait(120)
        s.proc.send_signal(getattr(signal, signum))
        sent = time.time()
        rc = s.proc.wait(drain + 30)
        took = time.time() - sent
        for t in threads:
            t.join(30)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    print(f"\n{signum}: exit {rc} after {took:.2f} s (drain timeout {drain} s)")
    assert rc == 0
    assert took < drain + 1.0  # the timeout, and some slack for a loaded machine
    assert results["short"][0] == 200 and results["short"][1][-1] == "[DONE]"
    assert json.loads(results["short"][1][-2])["choices"][0]["finish_reason"] == "length"
    for i in range(3):
        status, events = results[f"stream{i}"]
        assert status == 200 and events[-1] == "[DONE]", results[f"stream{i}"]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "shutting_down"
    status, body = results["plain"]
    assert status == 503 and body["error"]["code"] == "shutting_down"
    with pytest.raises(OSError):  # the listening socket is closed
        socket.create_connection(("127.0.0.1", s.port), timeout=5).close()
