"""The real agent CLIs, run once each against a loopback server (`make agent-clients` installs
them under .agents/): Codex (`codex exec`, the Responses API) and Claude Code (`claude -p`,
the Messages API). Each run gets a throwaway home, so no config of the user's is read or
written, and an environment built from scratch, so no key, proxy or setting leaks in.

`base_url` is the server's root (http://127.0.0.1:PORT; a trailing /v1 is accepted). What each
setting is for:

Codex ($CODEX_HOME/config.toml and flags):
- model_providers.kipp (base_url ROOT/v1, wire_api "responses", env_key KIPP_API_KEY): the
  server, spoken to with POST /v1/responses, the key sent as Authorization: Bearer.
- model, model_provider: the served model name, and that provider instead of OpenAI's.
- request_max_retries, stream_max_retries = 0: a failed request fails the run at once (the
  defaults retry a 5xx or a stream without response.completed for ~25 s).
- analytics.enabled = false: no events to ab.chatgpt.com.
- features.plugins = false: no plugin marketplace sync (git ls-remote of github.com, then
  api.github.com and chatgpt.com).
- check_for_update_on_startup = false: no release check.
- approval_policy "never", sandbox_mode "read-only": no prompt waits for a human; model
  commands run read-only (the bundled bubblewrap works in a container; a command leaves an
  empty /tmp/codex-daemon-UID behind, whatever TMPDIR says).
- --skip-git-repo-check: the work directory is an empty temp folder, not a git repository.
- --ephemeral: no session files are written.
- --color never: plain text on stdout (the final message) and stderr (the transcript).

Claude Code (environment and flags):
- ANTHROPIC_BASE_URL=ROOT, ANTHROPIC_API_KEY: the server (POST /v1/messages?beta=true), the
  key sent as x-api-key.
- CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1: no telemetry, error reports, update checks or
  feature flags (api.anthropic.com), and no HEAD /api/hello probe of the server.
- CLAUDE_CODE_MAX_RETRIES=0: a 5xx fails the run at once (by default it backs off for minutes).
- HOME, CLAUDE_CONFIG_DIR, TMPDIR: its config, sessions and scratch files (/tmp/claude-UID
  otherwise) stay in the temp folder.
- --model: the served model name (an unknown name only draws a warning on stderr).
- --no-session-persistence: no session transcript is written.
Both take the prompt after `--`: a prompt such as "review" or "--help" stays a prompt, and one
after a variadic flag (claude's --allowedTools, --tools) is not read as that flag's value.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

AGENTS = Path(__file__).resolve().parent.parent / ".agents" / "node_modules" / ".bin"
CODEX, CLAUDE = AGENTS / "codex", AGENTS / "claude"

CODEX_CONFIG = """\
model = {model}
model_provider = "kipp"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[model_providers.kipp]
name = "Kipp"
base_url = {base_url}
env_key = "KIPP_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[features]
plugins = false
"""


def codex_available() -> bool:
    return CODEX.exists() and shutil.which("node") is not None  # its launcher is a node script


def claude_available() -> bool:
    return CLAUDE.exists()  # a native binary


def _root(base_url: str) -> str:
    return base_url.rstrip("/").removesuffix("/v1")


def _env(home: Path, **extra: str) -> dict[str, str]:
    """A fresh environment: PATH (node, bash, git), the temp home, loopback never proxied."""
    (home / "tmp").mkdir()
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
            "TMPDIR": str(home / "tmp"), "LANG": "C.UTF-8", "NO_PROXY": "127.0.0.1,localhost",
            **extra}


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float):
    return subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout, check=False)


def run_codex(base_url: str, prompt: str, model: str, api_key: str = "test-key",
              timeout: float = 120, extra_args: tuple[str, ...] = ()):
    """`codex exec PROMPT` against the server at `base_url`: the CompletedProcess (the reply on
    stdout, the transcript on stderr)."""
    with tempfile.TemporaryDirectory(prefix="kipp-codex-") as tmp:
        home, work = Path(tmp), Path(tmp) / "work"
        (home / ".codex").mkdir()
        work.mkdir()
        config = CODEX_CONFIG.format(model=json.dumps(model),  # a JSON string is a TOML one
                                     base_url=json.dumps(_root(base_url) + "/v1"))
        (home / ".codex" / "config.toml").write_text(config)
        env = _env(home, CODEX_HOME=str(home / ".codex"), KIPP_API_KEY=api_key)
        return _run([str(CODEX), "exec", "--skip-git-repo-check", "--ephemeral", "--color",
                     "never", *extra_args, "--", prompt], env, work, timeout)


def run_claude(base_url: str, prompt: str, model: str, api_key: str = "test-key",
               timeout: float = 120, extra_args: tuple[str, ...] = ()):
    """`claude -p PROMPT` against the server at `base_url`: the CompletedProcess (the reply on
    stdout)."""
    with tempfile.TemporaryDirectory(prefix="kipp-claude-") as tmp:
        home, work = Path(tmp), Path(tmp) / "work"
        work.mkdir()
        env = _env(home, CLAUDE_CONFIG_DIR=str(home / ".claude"),
                   ANTHROPIC_BASE_URL=_root(base_url), ANTHROPIC_API_KEY=api_key,
                   CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", CLAUDE_CODE_MAX_RETRIES="0")
        return _run([str(CLAUDE), "-p", "--model", model, "--no-session-persistence",
                     *extra_args, "--", prompt], env, work, timeout)
