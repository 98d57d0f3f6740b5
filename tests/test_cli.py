"""The `kipp` command line as a newcomer meets it: text alone on stdout, flags checked (and named)
before anything loads, defaults shown and equal to the API's, one-line errors for missing
extras, clean Ctrl-C, and a chat whose KV survives across turns."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kipp import cli
from kipp.cli import main as cli_main
from kipp.model import Model
from kipp.text.sampling import SamplingParams

TINY = "kipp-synthetic/qwen3-tiny"
ROOT = Path(__file__).resolve().parent.parent
STATS = re.compile(r"\[(\d+) prompt tokens \((\d+) reused\)")


def test_run_prints_only_the_text_on_stdout(stock_store, tmp_path, monkeypatch, capsys, models):
    """First use of a registry id: the conversion's status and the stats go to stderr."""
    monkeypatch.setenv("KIPP_HOME", str(stock_store(tmp_path, TINY, schemes=())))
    assert cli_main(["run", TINY, "--backend", "reference", "--prompt", "Hello",
                     "--max-tokens", "4", "--temperature", "0"]) == 0
    printed = capsys.readouterr()
    assert printed.out == models(TINY).generate("Hello", max_tokens=4, temperature=0) + "\n"
    assert "converting" in printed.err and "prefill" in printed.err


@pytest.mark.parametrize("argv, flag", [
    (["run", TINY, "--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["run", TINY, "--prompt", "x", "--top-p", "0"], "--top-p"),
    (["run", TINY, "--prompt", "x", "--top-k", "-1"], "--top-k"),
    (["run", TINY, "--prompt", "x", "--seed", "-3"], "--seed"),
    (["run", TINY, "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
    (["run", TINY, "--prompt", "x", "--temperature", "warm"], "--temperature"),
    (["run", TINY, "--prompt", "x", "--scheme", "q4"], "--scheme"),
    (["run", TINY, "--prompt", "x", "--backend", "cuda"], "--backend"),
    (["chat", TINY, "--kv-scheme", "q4"], "--kv-scheme"),
    (["serve", TINY, "--port", "70000"], "--port"),
    (["serve", TINY, "--max-batch", "0"], "--max-batch"),
    (["serve", TINY, "--kv-tokens", "8"], "--kv-tokens"),
    (["serve", TINY, "--kv-mib", "0"], "--kv-mib"),
    (["run", TINY, "--prompt", "x", "--draft-vocab", "1000"], "--draft-vocab"),
    (["serve", TINY, "--draft-vocab", "0"], "--draft-vocab"),
])
def test_a_bad_flag_is_named_before_anything_loads(argv, flag, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KIPP_HOME", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    assert exit_.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing synthesized or converted


@pytest.mark.parametrize("argv, message", [
    (["run", TINY, "--prompt", "x", "--spec"], "--spec is greedy only"),
    (["run", TINY, "--prompt", "x", "--max-tokens", "40960"],
     "--max-tokens 40960 leaves no room"),
    (["chat", TINY, "--spec", "--temperature", "0.5"], "--spec is greedy only"),
    (["run", TINY, "--prompt", "x", "--draft-vocab", "32768"], "--draft-vocab needs"),
])
def test_flag_combinations_are_checked_before_loading(argv, message, tmp_path, monkeypatch,
                                                      capsys):
    monkeypatch.setenv("KIPP_HOME", str(tmp_path))
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_help_shows_defaults_and_they_are_the_apis(capsys):
    parser = cli._parser()
    run = parser.parse_args(["run", TINY, "--prompt", "x"])
    chat = parser.parse_args(["chat", TINY])
    api = SamplingParams()
    for args in (run, chat):
        assert (args.temperature, args.top_p, args.top_k, args.seed) == (
            api.temperature, api.top_p, api.top_k, api.seed)
    assert run.max_tokens == cli._api_default(Model.generate, "max_tokens") == 128
    assert chat.max_tokens == cli._api_default(Model.chat, "max_tokens") == 256
    for command, max_tokens in (("run", 128), ("chat", 256)):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"most tokens to generate (default: {max_tokens})" in text
        assert "0 is greedy (default: 1.0)" in text and "0 is off (default: 0)" in text
        assert "(default: None)" not in text


def hide_package(monkeypatch, hidden: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == hidden else real(name, *args))


@pytest.mark.parametrize("argv, package, extra", [
    (["serve", TINY], "flask", "server"),
    (["serve", TINY], "prometheus_client", "server"),
    (["gates", TINY], "torch", "gates"),
    (["run", TINY, "--prompt", "x", "--backend", "jax"], "jax", "jax"),
])
def test_a_missing_extra_is_one_line_naming_it(argv, package, extra, tmp_path, monkeypatch,
                                               capsys):
    monkeypatch.setenv("KIPP_HOME", str(tmp_path))
    hide_package(monkeypatch, package)
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kipp: error: kipp {argv[0]} needs {package}") or \
        err.startswith(f"kipp: error: the jax backend needs {package}")
    assert f"pip install 'kipp[{extra}]'" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_a_missing_package_deeper_down_is_still_one_line(monkeypatch, capsys):
    def fail(args):
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    monkeypatch.setattr(cli, "_inspect", fail)
    assert cli_main(["inspect", "x.gguf"]) == 1
    assert capsys.readouterr().err == ("kipp: error: kipp inspect needs transformers, which is "
                                       "not installed: pip install 'kipp[gates]'\n")

    def other(args):
        raise ModuleNotFoundError("No module named 'nonsense'", name="nonsense")

    monkeypatch.setattr(cli, "_inspect", other)
    with pytest.raises(ModuleNotFoundError):  # not an optional package: a real bug, shown
        cli_main(["inspect", "x.gguf"])


def test_convert_refuses_to_overwrite_without_force(tiny_dir, tmp_path, capsys):
    out = tmp_path / "tiny.gguf"
    out.write_bytes(b"precious")
    argv = ["convert", "--checkpoint", TINY, "--source", str(tiny_dir), "--scheme", "bf16",
            "--out", str(out), "--quiet"]
    assert cli_main(argv) == 1
    assert "exists; pass --force to overwrite it" in capsys.readouterr().err
    assert out.read_bytes() == b"precious"
    assert cli_main(argv + ["--force"]) == 0
    assert out.stat().st_size > 1000


def test_inspect_a_folder_is_a_one_line_error(tiny_dir, tmp_path, capsys):
    assert cli_main(["inspect", str(tiny_dir)]) == 1
    err = capsys.readouterr().err
    assert "is a Hugging Face folder, not a Kipp artifact: convert it first" in err
    assert err.count("\n") == 1
    assert cli_main(["inspect", str(tmp_path)]) == 1
    assert "is a directory, not a .gguf artifact" in capsys.readouterr().err


def test_chat_keeps_the_conversation_kv_across_turns(artifacts, models, monkeypatch, capsys):
    path = str(artifacts(TINY))
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\nAnd then?\nWhy?\n"))
    assert cli_main(["chat", path, "--backend", "reference", "--max-tokens", "3",
                     "--temperature", "0"]) == 0
    printed = capsys.readouterr()
    turns = [(int(a), int(b)) for a, b in STATS.findall(printed.err)]
    assert len(turns) == 3 and turns[0][1] == 0
    for (before, _), (_, reused) in zip(turns, turns[1:]):
        assert reused >= before, turns  # the earlier turns are not evaluated again
    model, messages, replies = models(TINY), [], []
    for line in ["Hi", "And then?", "Why?"]:
        messages.append({"role": "user", "content": line})
        replies.append(model.chat(messages, 3, temperature=0).content)
        messages.append({"role": "assistant", "content": replies[-1]})
    assert printed.out == "".join(reply + "\n" for reply in replies)
    assert "> " not in printed.out  # the prompt goes to stderr


def _kipp(*argv, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "kipp.cli", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_default_sigint, **kwargs)


def _default_sigint() -> None:
    """The child gets SIGINT as a user's shell gives it: a child inherits an ignored or blocked
    signal from this pytest process, whatever earlier tests' libraries left there."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def _wait_for_output(proc: subprocess.Popen, timeout: float = 300) -> bytes:
    """The first byte the process writes to stdout (generation has begun)."""
    got = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.read(1)), daemon=True)
    reader.start()
    reader.join(timeout)
    assert got and got[0], "no output before the timeout"
    return got[0]


def test_ctrl_c_ends_run_cleanly(artifacts):
    proc = _kipp("run", str(artifacts(TINY)), "--backend", "reference", "--prompt", "Hello",
                 "--max-tokens", "2000", "--temperature", "0")
    _wait_for_output(proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()
    assert err.decode().rstrip().endswith("kipp: interrupted") and b"Traceback" not in err


def test_ctrl_c_in_chat_stops_the_reply_and_the_chat_goes_on(artifacts):
    proc = _kipp("chat", str(artifacts(TINY)), "--backend", "reference", "--max-tokens", "24",
                 "--temperature", "0", stdin=subprocess.PIPE)
    proc.stdin.write(b"Hi\n")
    proc.stdin.flush()
    _wait_for_output(proc)
    proc.send_signal(signal.SIGINT)
    proc.stdin.write(b"And then?\n")
    proc.stdin.close()
    proc.stdin = None  # communicate must not flush a closed pipe
    out, err = proc.communicate(timeout=600)
    text = err.decode()
    assert proc.returncode == 0, text
    assert "kipp: reply stopped" in text and "Traceback" not in text
    [(prompt, reused)] = [(int(a), int(b)) for a, b in STATS.findall(text)]  # the second turn
    assert reused > 0 and prompt > reused
