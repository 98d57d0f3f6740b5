"""The agent CLIs people run on a local Qwen3, as they run them: Codex CLI (`codex exec`, the
Responses API) and Claude Code (`claude -p`, the Messages API), installed from npm by
`make agent-clients`, each completing a turn against a live `kipp serve` on loopback with an API
key and a served-model alias, and nothing reachable beyond loopback (tests/agent_clients.py
builds their offline homes).

Slow (each sends tens of thousands of tokens of system prompt and tools): CI installs the CLIs
and runs these with KIPP_REQUIRE_AGENTS=1, where a missing CLI fails instead of skipping.
"""

import os
import re

import pytest

from agent_clients import claude_available, codex_available, run_claude, run_codex
from live_server import LiveServer

pytestmark = pytest.mark.slow

TINY = "kipp-synthetic/qwen3-tiny"
KEY = "kipp-agent-test-key"
ALIAS = "qwen3-agent"  # the name the agents are configured with, served beside the id
REQUIRED = os.environ.get("KIPP_REQUIRE_AGENTS") == "1"


def _need(available: bool, name: str) -> None:
    if not available:
        if REQUIRED:
            pytest.fail(f"{name} is not installed under .agents/ (make agent-clients)")
        pytest.skip(f"{name} is not installed (make agent-clients)")


@pytest.fixture(scope="module")
def server(artifacts):
    # The JAX backend prefills an agent's ~10k-token prompt in seconds, with a pool that holds
    # it. Synthetic weights never end a turn, and both CLIs take a reply cut at max_tokens for
    # an error: the server's stop strings (punctuation, which the synthetic text is full of)
    # end it, and the output cap bounds it when none comes.
    stops = [arg for s in (".", ",", "!", "?", "\n") for arg in ("--stop", s)]
    s = LiveServer(artifacts(TINY), "--backend", "jax", "--kv-tokens", "40960", "--api-key", KEY,
                   "--served-model-name", ALIAS, "--served-model-name", TINY,
                   "--max-output-tokens", "400", *stops)
    yield s
    s.stop()


def _count(server, path: str, status: str) -> float:
    return server.metrics().get(f'kipp_http_responses_total{{path="{path}",status="{status}"}}',
                                0.0)


def _idle(server) -> None:
    metrics = server.metrics()
    assert metrics["kipp_active_sequences"] == 0
    assert metrics['kipp_kv_blocks{state="in_use"}'] == 0


def test_codex_exec_completes_a_turn(server):
    _need(codex_available(), "Codex CLI")
    before = _count(server, "/v1/responses", "200")
    result = run_codex(server.url, "Say hi", ALIAS, api_key=KEY, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _count(server, "/v1/responses", "200") == before + 1
    _idle(server)


def test_claude_code_completes_a_turn(server):
    _need(claude_available(), "Claude Code")
    before = _count(server, "/v1/messages", "200")
    result = run_claude(server.url, "Say hi", ALIAS, api_key=KEY, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _count(server, "/v1/messages", "200") >= before + 1
    _idle(server)


def test_a_wrong_key_is_refused_in_each_api_shape(server):
    _need(codex_available(), "Codex CLI")
    result = run_codex(server.url, "Say hi", ALIAS, api_key="wrong", timeout=300)
    assert result.returncode != 0
    assert re.search(r"401|API key", result.stderr + result.stdout)
