"""The server benchmark's client against a live `kipp serve` on the tiny checkpoint: the records it
writes pass the harness's schema, every number is positive, and every token count is exact.
(The peers, llama.cpp's and vLLM's servers, are not part of the default run.)"""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ is a directory of the repo, not an installed package
    sys.path.insert(0, str(REPO))

pytest.importorskip("flask")
pytest.importorskip("waitress")
pytest.importorskip("prometheus_client")

from bench import records, server_bench, server_client  # noqa: E402

TINY = "kipp-synthetic/qwen3-tiny"
MAX_TOKENS = 4
PROMPT_TOKENS = 16
TTFT_TOKENS = 128
OTHER_TOKENS = 32


def test_prompt_book_gives_exact_distinct_prompts():
    book = server_client.PromptBook()
    tokenizer = server_client._tokenizer()
    seen = set()
    for k, length in enumerate((16, 16, 128, 500)):
        prompt = book.get(("t", k), length)
        ids = tokenizer.encode(prompt["text"])
        assert len(ids) == length and tokenizer.decode(ids) == prompt["text"]
        assert tuple(ids[:16]) not in seen
        seen.add(tuple(ids[:16]))
    assert book.get(("t", 0), 16) is book.get(("t", 0), 16)  # a name always gives its prompt
    assert set(server_client.end_token_ids()) >= {151643, 151645}


def test_server_bench_against_kipp_serve(artifacts, tmp_path):
    artifact = artifacts(TINY, "bf16")
    config = server_bench.ServerBenchConfig(
        checkpoint=TINY, scheme="bf16", servers=["kipp"], clients=[1, 2], rounds=1, warmup=0,
        max_tokens=MAX_TOKENS, prompt_tokens=PROMPT_TOKENS, ttft_tokens=TTFT_TOKENS,
        other_tokens=OTHER_TOKENS, others=1, kipp_backend="reference",
        pythons={"kipp": sys.executable}, artifact=str(artifact), threads=2, kv_tokens=1024,
        results=tmp_path / "results", logs=tmp_path / "logs", ready_timeout=120,
        request_timeout=120, command="pytest")
    paths = server_bench.run(config)
    assert server_bench.exit_status(paths) == 0
    loaded = {}
    for path in paths:
        record = json.loads(path.read_text())
        assert records.validate(record) == []
        loaded[record["workload"]["name"]] = record
    assert set(loaded) == {"server_aggregate", "ttft_prefix"}

    aggregate = loaded["server_aggregate"]
    assert aggregate["type"] == "throughput" and aggregate["provenance"]["git"]
    [server] = aggregate["servers"]
    assert server["status"] == "ok" and server["spec"]["command"][2:4] == ["kipp.cli", "serve"]
    assert server["describe"].startswith("reference")
    assert server["versions"]["packages"]["kipp"]
    assert server["exit_code"] is not None  # stopped
    assert [a["arm"] for a in aggregate["arms"]] == ["kipp-reference/bf16 c=1",
                                                      "kipp-reference/bf16 c=2"]
    for arm, clients in zip(aggregate["arms"], (1, 2)):
        assert arm["status"] == "ok", arm.get("reason")
        assert arm["summary"]["n"] == 1 and arm["summary"]["median"] > 0
        assert arm["peak_rss_bytes"] > 0
        [run] = arm["runs"]
        assert run["clients"] == clients and run["wall_s"] > 0 and run["value"] > 0
        assert run["completion_tokens"] == clients * MAX_TOKENS
        assert len(run["per_client"]) == clients
        for client in run["per_client"]:
            assert client["completion_tokens"] == MAX_TOKENS
            assert client["count_source"] == "usage"
            assert client["finish_reason"] == "length"  # the end tokens were banned
            assert client["prompt_tokens"] == PROMPT_TOKENS
            assert client["ttft_s"] > 0 and client["decode_tok_s"] > 0
            assert client["last_token_s"] <= client["ended_s"]

    ttft = loaded["ttft_prefix"]
    arms = {a["params"]["phase"]: a for a in ttft["arms"]}
    assert set(arms) == {"cold", "reused", "interleaved"}
    for phase, arm in arms.items():
        assert arm["status"] == "ok", arm.get("reason")
        [run] = arm["runs"]
        assert run["value"] > 0 and run["prompt_tokens"] == TTFT_TOKENS
        assert run["completion_tokens"] == 1
    assert arms["cold"]["runs"][0]["cached_tokens"] == 0
    for phase in ("reused", "interleaved"):
        run = arms[phase]["runs"][0]
        assert run["cached_tokens"] > 0  # whole 32-token blocks of the earlier send
        assert run["prefix_metrics_delta"]["kipp_prefix_reused_tokens_total"] == \
            run["cached_tokens"]
    [between] = arms["interleaved"]["runs"][0]["between"]
    assert between["prompt_tokens"] == OTHER_TOKENS and between["cached_tokens"] == 0


@pytest.mark.slow  # CI's longest default checks
def test_engine_bench_against_kipp_serve(artifacts, tmp_path):
    """`bench engine` on the reference backend, tiny sizes: three valid records whose values are
    the same-run ratios they claim, the scheduler's own step time, and a repeated prompt that
    adopts all but its last token (one evaluated) in the server and in the worker's profile."""
    from bench import engine_bench, report

    config = engine_bench.EngineBenchConfig(
        checkpoint=TINY, backend="reference", artifact=str(artifacts(TINY, "bf16")), rounds=1, warmup=0, decode_tokens=3,
        prompt_tokens=PROMPT_TOKENS, clients=2, max_tokens=3, ttft_tokens=70, reuse_tokens=2,
        results=tmp_path / "results", logs=tmp_path / "logs", request_timeout=300,
        command="pytest")
    paths = engine_bench.run(config)
    loaded = {}
    for path in paths:
        record = json.loads(path.read_text())
        assert records.validate(record) == []
        assert record["kipp"]["commit"] and record["workload"]["goal"]
        [arm] = record["arms"]
        assert arm["status"] == "ok", arm.get("reason")
        loaded[record["workload"]["name"]] = arm["runs"][0]
    overhead = loaded["server_overhead"]
    assert overhead["value"] == overhead["server_tok_s"] / overhead["raw_tok_s"] > 0
    assert 0 <= overhead["scheduler_ms"] < overhead["step_ms"]
    assert overhead["engine_steps"] == config.decode_tokens + 1  # one prefill step + decode
    scaling = loaded["batch_scaling"]
    assert scaling["value"] == scaling["c2_tok_s"] / scaling["c1_tok_s"] > 0
    assert scaling["c2"]["completion_tokens"] == 2 * config.max_tokens
    assert scaling["compiles_c2"] == 0  # the reference backend compiles no step programs
    assert scaling["value_net_of_compile"] == pytest.approx(scaling["value"])
    reuse = loaded["reuse_ttft"]
    assert reuse["cached_tokens"] == config.ttft_tokens - 1 and reuse["evaluated_tokens"] == 1
    assert reuse["value"] == pytest.approx(reuse["ttft_ms"] - reuse["step_ms"])
    assert reuse["profile"]["adopted_tokens"] == config.ttft_tokens - 1
    assert reuse["profile"]["evaluated_tokens"] == 1
    lines = report.engine_section(records.load_all(tmp_path / "results"))
    assert sum(line.startswith(f"| `{reuse_commit(paths)}") for line in lines) == 3
    # the reference backend runs no stored CPU matmul: its rows name the scheme alone
    assert sum(line.startswith(f"| `{reuse_commit(paths)}") and ", bf16 |" in line
               for line in lines) == 3
    for path in paths:
        arm_line = engine_bench.summary_lines(path)[1]
        assert arm_line.startswith("  kipp-reference/bf16 @") and " (bf16): " in arm_line, arm_line


def reuse_commit(paths) -> str:
    return json.loads(Path(paths[0]).read_text())["kipp"]["commit"][:10]


def test_engine_bench_runs_another_checkouts_kipp(tmp_path):
    """--kipp-source: processes started with Under's env and cwd import that checkout's kipp
    (a copy of the package here) and this checkout's bench."""
    import shutil
    import subprocess

    from bench import engine_bench, provenance

    other = tmp_path / "old-checkout"
    shutil.copytree(provenance.REPO / "kipp", other / "kipp",
                    ignore=shutil.ignore_patterns("__pycache__", "data"))
    under = engine_bench.Under(other)
    probe = "import kipp, bench; print(kipp.__file__); print(bench.__file__)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=under.cwd, capture_output=True,
                          text=True, env={**__import__("os").environ, **under.env}, check=True)
    kipp_file, bench_file = done.stdout.split()
    assert Path(kipp_file).resolve().is_relative_to(other.resolve())
    assert Path(bench_file).resolve().is_relative_to(provenance.REPO)
    assert under.tag.startswith("@") and engine_bench.Under(None).env == {}
