"""Load on a live `kipp serve` (slow): 64 concurrent clients, streamed and plain, with mixed stop
strings, some of them leaving early. Run twice on one server: once with every stop string short,
once with one client's stop string 100 kB long. The long stop string must not slow the others
(the hold-back check once cost the square of its length per token, on the engine thread): every
stream's longest and median inter-token gaps stay under three times the longest and the slowest
median without it, and everything ends with the metrics back to zero.
"""

import http.client
import json
import statistics
import threading
import time

import pytest
from test_server import NO_END, TINY, Server, _wait_idle

pytestmark = pytest.mark.slow

CLIENTS = 64
NEVER = "\u2603"  # a character the tiny model does not write: these stop strings never match


def mix(long_stop: str, clients: int = CLIENTS) -> list[tuple[dict, object]]:
    """(body, leave_after) per client: leave_after chunks (streams) or seconds (plain)."""
    clients, count = [], clients
    for i in range(count):
        stream = i % 3 != 0
        stop = [None, "\n\n", NEVER * 3, NEVER * 1000][i % 4]
        body = {"model": TINY, "prompt": f"Client {i} under load: " + "word " * (i % 7),
                "max_tokens": 12 + i % 5, "temperature": 0, "stream": stream,
                "logit_bias": NO_END}
        if stop is not None:
            body["stop"] = [stop, "xyzzy"]
        leave = None
        if i % 8 == 5:  # eight clients go away early, on long requests
            body["max_tokens"] = 400
            leave = 3 if stream else 1.0
        clients.append((body, leave))
    hostile = clients[1][0]
    hostile["stop"] = [long_stop]
    return clients


def run_client(port: int, body: dict, leave, out: dict, key: int):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        if not body["stream"]:
            if leave is not None:
                time.sleep(leave)
                out[key] = ("left", None, [])
                return
            response = conn.getresponse()
            result = json.loads(response.read())
            out[key] = (response.status, result["choices"][0]["text"], [])
            return
        response = conn.getresponse()
        text, times = "", []
        while True:
            line = response.readline()
            if not line or line.startswith(b"data: [DONE]"):
                break
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    text += chunk["choices"][0]["text"]
                    times.append(time.perf_counter())
                    if leave is not None and len(times) >= leave:
                        out[key] = ("left", text, times)
                        return
        out[key] = (response.status, text, times)
    finally:
        conn.close()


def run_phase(server, long_stop: str, count: int = CLIENTS) -> dict:
    out: dict = {}
    clients = mix(long_stop, count)
    threads = [threading.Thread(target=run_client, args=(server.port, body, leave, out, i))
               for i, (body, leave) in enumerate(clients)]
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(1800)
    assert len(out) == count, f"{count - len(out)} clients did not finish"
    print(f"\nphase with a {len(long_stop)}-character stop string: {time.time() - start:.1f} s")
    return out


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def test_a_long_stop_string_does_not_slow_other_streams_and_nothing_leaks(artifacts):
    server = Server(artifacts(TINY), "--kv-tokens", "32768", "--max-batch", "8",
                    "--max-queue", "64")
    try:
        run_phase(server, NEVER * 8, 8)  # warm-up: first-use costs out of the comparison
        _wait_idle(server)
        cancelled = server.metrics()["kipp_requests_cancelled_total"]
        short = run_phase(server, NEVER * 8)
        _wait_idle(server)
        long = run_phase(server, NEVER * 100_000)
        m = _wait_idle(server)
    finally:
        server.stop()
    leavers = {i for i, (_, leave) in enumerate(mix("")) if leave is not None}
    assert m["kipp_requests_cancelled_total"] - cancelled == 2 * len(leavers)
    assert m["kipp_kv_pool_occupancy"] == 0 and m['kipp_kv_blocks{state="reserved"}'] == 0
    assert m["kipp_active_requests"] == 0 and m["kipp_queue_depth"] == 0
    streams = {}  # per stream: its gaps without the long stop string, and with it
    for i in range(CLIENTS):
        if i in leavers:
            continue
        assert short[i][0] == long[i][0] == 200
        assert short[i][1] == long[i][1], f"client {i}: the texts differ between the phases"
        if i != 1 and short[i][2]:  # not the client with the long stop string; streams only
            streams[i] = (gaps(short[i][2]), gaps(long[i][2]))
    # A stream's gaps depend on which requests share its steps, and that differs between two
    # runs of 64 clients (by up to ~2.5x between streams here, on a loaded machine). So each
    # stream is held to what the streams had without the long stop string: its longest gap to
    # three times the longest gap, its median to three times the slowest stream's median; and
    # over all streams the median of their median-gap ratios, under 2, shows any general
    # slowdown. On correct builds, 2-core machines: longest gap up to x2.13 (CI), slowest median
    # up to x1.74, median ratio 0.82-1.54 (seven runs). A hold-back check with a prefix copy per
    # stop-string length (planted) made the gaps of the streams sharing steps with it 0.33-0.38 s:
    # longest gap x3.4 and x4.7 (two runs), slowest median x7.2 (the median ratio stayed 0.93).
    longest = max(max(a) for a, _ in streams.values())
    slowest = max(statistics.median(a) for a, _ in streams.values())
    ratios = sorted(statistics.median(b) / statistics.median(a) for a, b in streams.values())
    print(f"{len(streams)} streams without the long stop string: longest gap "
          f"{longest * 1000:.0f} ms, slowest median {slowest * 1000:.0f} ms; with it: longest gap "
          f"x{max(max(b) for _, b in streams.values()) / longest:.2f}, slowest median "
          f"x{max(statistics.median(b) for _, b in streams.values()) / slowest:.2f}; per-stream "
          f"median-gap ratios: median {statistics.median(ratios):.2f}, max {ratios[-1]:.2f}")
    assert len(streams) > 30
    for i, (_, b) in streams.items():
        assert max(b) < 3 * longest, f"stream {i}: a gap of {max(b):.2f} s"
        assert statistics.median(b) < 3 * slowest, f"stream {i}: median gap {statistics.median(b)}"
    assert statistics.median(ratios) < 2
