"""Every fenced code block of the README and of docs/ runs, so they cannot drift from the code.

The convention (docs/testing.md, "Blocks in the documents"): `python` and `sh` blocks run, each
in a fresh process and an empty scratch folder, with KIPP_HOME at a store holding the tiny
synthetic checkpoint and `kipp` on PATH; `text` blocks are display only; a block without a
language is an error. A line `<!-- readme-test: skip (why) -->` above a block skips it (the
reason is required), and `<!-- readme-test: server -->` runs it while
`kipp serve kipp-synthetic/qwen3-tiny` listens, its port replacing `8080` in the block.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# markdown files whose blocks are executed (bench/README.md's need the peers' environments)
DOCUMENTS = ["README.md"] + sorted(p.relative_to(ROOT).as_posix()
                                   for p in (ROOT / "docs").rglob("*.md"))
RUNNABLE = ("python", "sh")
LANGUAGES = RUNNABLE + ("text",)
MARKER = re.compile(r"<!--\s*readme-test:\s*(?P<kind>\S+)\s*(?P<rest>.*?)\s*-->")
TIMEOUT = 600  # seconds one block may take on a loaded 2-core machine


@dataclass(frozen=True)
class Block:
    document: str
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    marker: str | None  # "skip", "server", or None
    reason: str

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}-{self.language or 'none'}"


def parse(document: str, text: str) -> list[Block]:
    """The fenced blocks of a markdown text, each with the marker on the line above it."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^(```+)(.*)$", lines[i])
        if not fence:
            i += 1
            continue
        start, ticks = i, fence.group(1)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(ticks)
                    and not lines[j].strip("`")), None)
        if end is None:
            raise AssertionError(f"{document}:{start + 1}: fence never closed")
        above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        found = MARKER.fullmatch(above.strip())
        blocks.append(Block(document, start + 1, fence.group(2).strip(),
                            "\n".join(lines[start + 1:end]) + "\n",
                            found.group("kind") if found else None,
                            found.group("rest").strip("() ") if found else ""))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for doc in DOCUMENTS for b in parse(doc, (ROOT / doc).read_text(encoding="utf-8"))]


def runnable_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.language in RUNNABLE and b.marker != "skip"]


def test_every_block_follows_the_convention():
    blocks = all_blocks()
    assert len([b for b in runnable_blocks() if b.document == "README.md"]) >= 5, (
        "the README's examples were not found")
    for b in blocks:
        assert b.language in LANGUAGES, (
            f"{b.id}: a fenced block needs a language: {', '.join(LANGUAGES)}")
        assert b.marker in (None, "skip", "server"), f"{b.id}: unknown marker {b.marker!r}"
        if b.marker == "skip":
            assert b.reason, f"{b.id}: a skipped block must say why"
        if b.marker == "server":
            assert "8080" in b.code, f"{b.id}: a server block talks to port 8080"


def test_the_parser_reads_markers_and_rejects_an_unclosed_fence():
    text = ("intro\n\n<!-- readme-test: skip (needs a GPU) -->\n```sh\nnvidia-smi\n```\n"
            "```python\nprint(1)\n```\n\n<!-- readme-test: server -->\n\n"
            "```python\nx = 8080\n```\n")
    skip, plain, server = parse("doc.md", text)
    assert (skip.marker, skip.reason, skip.code, skip.line) == ("skip", "needs a GPU",
                                                                "nvidia-smi\n", 4)
    assert (plain.marker, plain.language) == (None, "python")
    assert server.marker == "server" and server.code == "x = 8080\n"
    with pytest.raises(AssertionError, match="never closed"):
        parse("doc.md", "```sh\nls\n")


@pytest.fixture(scope="module")
def block_env(stock_store, tmp_path_factory):
    """The environment a block runs in: a store with the tiny checkpoint made, the worktree's
    kipp, `kipp` on PATH. The store's kernel builds are this process's (kipp.cuda.cpu.matmul
    keys each by everything it depends on), so no block pays the C++ compile again."""
    from kipp.formats import store

    home = stock_store(tmp_path_factory.mktemp("kipp-home"), "kipp-synthetic/qwen3-tiny",
                       ("bf16", "q8_0"))
    builds = store.home() / "build"
    builds.mkdir(parents=True, exist_ok=True)
    (home / "build").symlink_to(builds, target_is_directory=True)
    bin_dir = tmp_path_factory.mktemp("bin")
    shim = bin_dir / "kipp"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kipp.cli "$@"\n')
    shim.chmod(0o755)
    env = dict(os.environ, KIPP_HOME=str(home), PYTHONUNBUFFERED="1",
               PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent),
                                     os.environ.get("PATH", "")]),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                          if p))
    return env


class Server:
    """`kipp serve kipp-synthetic/qwen3-tiny` on a free port, for blocks marked `server`."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kipp.cli", "serve", "kipp-synthetic/qwen3-tiny",
             "--backend", "reference", "--port", "0", "--kv-tokens", "1024"],
            env=env, stderr=subprocess.PIPE, text=True)
        self.log, self.port = [], None
        deadline = time.monotonic() + 300
        while self.port is None and time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            found = re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)", line)
            self.port = int(found.group(1)) if found else None
        if self.port is None:
            self.stop()
            raise RuntimeError("kipp serve did not start:\n" + "".join(self.log))
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server(block_env):
    started = []

    def get() -> Server:
        if not started:
            started.append(Server(block_env))
        return started[0]

    yield get
    for s in started:
        s.stop()


def run_block(block: Block, env: dict, cwd: Path, port: int | None = None):
    code = block.code if port is None else block.code.replace("8080", str(port))
    if block.language == "python":
        command = [sys.executable, "-c", code]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", code]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)


@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda b: b.id)
def test_readme_block_runs(block, block_env, server, tmp_path):
    port = server().port if block.marker == "server" else None
    done = run_block(block, block_env, tmp_path, port)
    assert done.returncode == 0, (
        f"{block.id} failed (exit {done.returncode}):\n{block.code}\n--- stdout\n"
        f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-5000:]}")


def test_a_failing_block_fails_the_test(block_env, tmp_path):
    """The runner is not blind: a false claim or a failing command is a non-zero exit."""
    claim = Block("doc.md", 1, "python", "import kipp\nassert kipp.load is None\n", None, "")
    assert run_block(claim, block_env, tmp_path).returncode != 0
    mid = Block("doc.md", 1, "sh", "kipp inspect missing.gguf | cat\necho reached\n", None, "")
    done = run_block(mid, block_env, tmp_path)
    assert done.returncode != 0 and "reached" not in done.stdout  # -e and pipefail hold
