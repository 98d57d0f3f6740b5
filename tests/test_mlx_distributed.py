"""The MLX backend over several ranks (kipp.apple.distributed), on loopback.

The fast set checks the pure logic: the group's flags and variables, the shard splitting
math, the shard views of the artifact, a round's inputs as int32 words, and the one-process
emulation of a group against the unsharded backend. The slow set starts ranks directly with
MLX_RANK and MLX_HOSTFILE (not mlx.launch: its output threads spin a core), each with a free
port on 127.0.0.1 and killed by PID at a deadline: two ranks equal their one-process
emulation bitwise and the unsharded backend within the MLX gate bound, tensor and pipeline
parallel; `kipp serve --distributed` answers as one process; a killed or missing rank ends
the others within a bound with one line.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kipp.errors import KippError
from live_server import free_port

mx = pytest.importorskip("mlx.core")

from kipp.apple import distributed  # noqa: E402
from kipp.apple.backend import MLXBackend, RoundInputs  # noqa: E402
from kipp.formats.artifact import open_artifact  # noqa: E402
from kipp.formats.registry import REGISTRY  # noqa: E402

TINY = "kipp-synthetic/qwen3-tiny"
DEADLINE_S = 120  # a whole run of one configuration, both ranks
FAILURE_BOUND_S = 15  # a survivor's exit after its peer is gone (keep-alive 1 s)
STREAMS = "1"  # CPU streams per rank (two ranks share this machine's cores)
BLOCKS = 16  # --kv-tokens 512, as the ranks' default


def write_hostfile(path, ranks=2) -> str:
    path.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]))
    return str(path)


def rank_env(rank: int, hostfile: str) -> dict:
    env = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower()}
    env.update(MLX_RANK=str(rank), MLX_HOSTFILE=hostfile, KIPP_MLX_CPU_STREAMS=STREAMS)
    return env


def start_group(artifact, tmp_path, *extra, ranks=(0, 1)):
    """Popen of each rank in `ranks` of a two-rank group's self-check: [(rank, process, log)]
    and rank 0's dump path."""
    hostfile = write_hostfile(tmp_path / "hostfile.json")
    dump = tmp_path / "group.npz"
    started = []
    for rank in ranks:
        log = tmp_path / f"rank{rank}.log"
        command = [sys.executable, "-m", "kipp.apple.distributed", str(artifact), "--dump",
                   str(dump), *map(str, extra)]
        with open(log, "w") as sink:
            started.append((rank, subprocess.Popen(command, env=rank_env(rank, hostfile),
                                                   stdout=sink, stderr=subprocess.STDOUT), log))
    return started, dump


def wait_all(started, deadline_s=DEADLINE_S) -> dict[int, int]:
    """Each rank's exit status; any still running at the deadline is killed by PID (and the
    test fails)."""
    end = time.monotonic() + deadline_s
    codes, late = {}, []
    for rank, proc, _ in started:
        try:
            codes[rank] = proc.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            late.append(rank)
    kill_all(started)
    assert not late, f"ranks {late} still running after {deadline_s} s: " + logs(started)
    return codes


def kill_all(started) -> None:
    for _, proc, _ in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def logs(started) -> str:
    return "\n".join(f"--- rank {rank}\n{log.read_text()[-3000:]}" for rank, _, log in started)


def broken_lines(log) -> list[str]:
    return [line for line in log.read_text().splitlines()
            if line.startswith("kipp: distributed group broken:")]


def steps(results) -> list[np.ndarray]:
    return [results[f"step{i}"] for i in range(len([k for k in results
                                                    if k.startswith("step")]))]


@pytest.fixture
def streams(monkeypatch):
    """The in-process backends split their projections as the ranks do."""
    monkeypatch.setenv("KIPP_MLX_CPU_STREAMS", STREAMS)


def assert_within_gate(got: dict, want: dict) -> None:
    """A group (or its emulation) against the unsharded backend: the O and down sums split
    over ranks add in another order, so the MLX cached-decode bound; greedy tokens equal."""
    from kipp import gates
    from kipp.gates.bounds import calibrated_bound

    bound = calibrated_bound("mlx", "cached_decode")
    assert len(steps(got)) == len(steps(want)) >= 2
    for a, b in zip(steps(got), steps(want)):
        assert gates.nmse(a, b) <= bound
    assert np.array_equal(got["tokens"], want["tokens"])


# -- the group: flags, then MLX's variables ----------------------------------------------------

def test_group_from_flags_then_environment(tmp_path):
    hostfile = write_hostfile(tmp_path / "hosts.json", 4)
    assert distributed.Group.resolve(1, hostfile) == distributed.Group(1, hostfile)
    env = {"MLX_RANK": "3", "MLX_HOSTFILE": hostfile}
    group = distributed.Group.resolve(env=env)
    assert (group.rank, group.size, group.source) == (3, 4, "MLX_* environment")
    # a flag given overrides its variable only
    group = distributed.Group.resolve(rank=0, env=env)
    assert (group.rank, group.hostfile) == (0, hostfile)
    assert group.source == "MLX_* environment and flags"


@pytest.mark.parametrize("content,args,env,problem", [
    (None, (None, None, None), {}, "--distributed with --backend mlx needs the group"),
    ('[["127.0.0.1:1"], ["127.0.0.1:2"]]', (None, "HOSTS", None), {}, "--process-id is missing"),
    ('[["127.0.0.1:1"], ["127.0.0.1:2"]]', (2, "HOSTS", None), {}, "--process-id 2 is not in 0..1"),
    ('[["127.0.0.1:1"], ["127.0.0.1:2"]]', (0, "HOSTS", 3), {},
     "--num-processes 3 does not match the 2 ranks"),
    ('[["127.0.0.1:1"]]', (0, "HOSTS", None), {}, "lists 1 rank: a group needs at least 2"),
    ('{"hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}]}', (0, "HOSTS", None), {},
     "is mlx.launch's hostfile"),
    ('[["127.0.0.1"], ["127.0.0.1:2"]]', (0, "HOSTS", None), {}, "must be a JSON list"),
    ("not json", (0, "HOSTS", None), {}, "is not JSON"),
    ('[["127.0.0.1:1"], ["127.0.0.1:2"]]', (None, None, None), {"MLX_RANK": "one",
                                                                 "MLX_HOSTFILE": "HOSTS"},
     "MLX_RANK must be an integer, not 'one'"),
    (None, (0, "HOSTS", None), {}, "cannot read it"),
])
def test_bad_group_is_one_clear_error(tmp_path, content, args, env, problem):
    hosts = tmp_path / "hosts.json"
    if content is not None:
        hosts.write_text(content)
    rank, hostfile, ranks = args
    env = {k: (str(hosts) if v == "HOSTS" else v) for k, v in env.items()}
    with pytest.raises(KippError, match=problem):
        distributed.Group.resolve(rank, str(hosts) if hostfile else None, ranks, env=env)


# -- the shard: splitting math and views of the artifact ----------------------------------------

def test_shard_splits_heads_ffn_and_layers():
    entry = REGISTRY[TINY]  # 16 query heads, 8 KV heads, intermediate 768, 2 layers
    a, b = (distributed.plan_shard(entry, r, 2, "tensor") for r in (0, 1))
    assert (a.kv, b.kv) == ((0, 4), (4, 8))
    assert (a.query_heads, b.query_heads) == ((0, 8), (8, 16))  # each KV head's own group
    assert (a.ffn, b.ffn) == ((0, 384), (384, 768))
    assert a.layers == b.layers == (0, 2)
    assert a.holds_head and not b.holds_head and a.embeds and b.embeds
    eight = [distributed.plan_shard(REGISTRY["kipp-synthetic/qwen3-0.6b-shape"], r, 8)
             for r in range(8)]
    assert [s.kv for s in eight] == [(r, r + 1) for r in range(8)]
    assert eight[7].ffn == (7 * 384, 3072)
    first, last = (distributed.plan_shard(entry, r, 2, "pipeline") for r in (0, 1))
    assert (first.layers, last.layers) == ((0, 1), (1, 2))
    assert first.kv == last.kv == (0, 8) and first.embeds and not last.embeds


@pytest.mark.parametrize("ranks,parallel,problem", [
    (3, "tensor", "8 KV heads split over 1, 2, 4 or 8 ranks"),
    (16, "tensor", r"at most 8\)"),
    (3, "pipeline", "has only 2 layers"),
    (2, "data", "unknown parallel 'data'"),
])
def test_a_split_the_model_cannot_take_is_refused(ranks, parallel, problem):
    with pytest.raises(KippError, match=problem):
        distributed.plan_shard(REGISTRY[TINY], 0, ranks, parallel)


@pytest.mark.parametrize("scheme", ["bf16", "q8_0"])
def test_shards_are_views_of_their_own_rows_and_columns(artifacts, scheme):
    artifact = open_artifact(artifacts(TINY, scheme))
    full = artifact.weights.layers[1]
    shards = [distributed.shard_artifact(artifact, distributed.plan_shard(artifact.entry, r, 2))
              for r in range(2)]
    parts = [s.weights.layers[1] for s in shards]
    for name, axis in (("q", 0), ("k", 0), ("gate", 0), ("o", 1), ("down", 1)):
        whole = distributed._row_view(getattr(full, name))
        pieces = [np.asarray(getattr(p, name).raw) for p in parts]
        assert np.array_equal(np.concatenate(pieces, axis=axis), whole), name
        for p in parts:
            assert np.may_share_memory(getattr(p, name).raw, artifact.file.mapping), name
    assert parts[0].q.shape == (8 * 128, 256) and parts[1].down.shape == (256, 384)
    assert distributed.projection_shapes(shards[0]) == tuple(sorted(
        {(scheme, 1024, 256), (scheme, 512, 256), (scheme, 256, 1024), (scheme, 384, 256),
         (scheme, 256, 384)}))


def test_round_inputs_survive_the_words():
    rng = np.random.default_rng(1)
    spans = [(0, 3, rng.integers(0, 500, 7).astype(np.int32)),
             (3, 1, rng.integers(0, 500, 40).astype(np.int32))]
    inputs = RoundInputs(rng.integers(0, 151_000, 4), np.arange(4),
                         rng.integers(0, 500, 4).astype(np.int32), spans,
                         np.asarray([2, 3], np.int32),
                         tables=rng.integers(0, 16, (2, 2)).astype(np.int32),
                         lengths=np.asarray([7, 40], np.int32))
    words = distributed.encode(inputs)
    assert words.dtype == np.int32
    back = distributed.decode(words)
    for field in ("tokens", "positions", "slots", "rows", "tables", "lengths"):
        assert np.array_equal(getattr(back, field), getattr(inputs, field)), field
    assert [(s, n) for s, n, _ in back.spans] == [(0, 3), (3, 1)]
    assert all(np.array_equal(a[2], b[2]) for a, b in zip(back.spans, spans))
    with pytest.raises(KippError, match="held"):
        distributed.decode(np.concatenate([words, [0]]))


# -- load's checks, before any rank waits --------------------------------------------------------

@pytest.mark.parametrize("options,problem", [
    (dict(backend="mlx", distributed="yes"), "with backend='mlx', distributed must be True"),
    (dict(backend="reference", distributed=True), "distributed needs backend='jax' or"),
    (dict(backend="mlx", distributed=True, adapters={"a": "x"}),
     "does not take a draft model, kv_cache_dir or adapters"),
    (dict(backend="mlx", distributed=True), "--distributed with --backend mlx needs the group"),
])
def test_load_refuses_a_bad_distributed_request(options, problem, monkeypatch):
    from kipp.model import load

    monkeypatch.delenv("MLX_RANK", raising=False)
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    with pytest.raises(KippError, match=problem):
        load("no-such-checkpoint", **options)


def test_a_group_the_model_cannot_split_is_refused_before_joining(artifacts, tmp_path):
    from kipp.model import load

    group = distributed.Group(0, write_hostfile(tmp_path / "hosts.json", 3))
    begin = time.monotonic()
    with pytest.raises(KippError, match="split over 1, 2, 4 or 8 ranks"):
        load(artifacts(TINY, "bf16"), backend="mlx", distributed=group, progress=False)
    assert time.monotonic() - begin < 10  # no rank waited for its peers


def test_serve_refuses_the_other_backends_flags(capsys):
    from kipp.cli import main

    assert main(["serve", "x.gguf", "--backend", "mlx", "--distributed", "--coordinator",
                 "h:1"]) != 0
    assert "--coordinator is for --backend jax" in capsys.readouterr().err


# -- the one-process emulation against the unsharded backend -------------------------------------

@pytest.mark.parametrize("parallel", ["tensor", "pipeline"])
def test_emulation_matches_the_unsharded_backend(artifacts, streams, parallel):
    """Two ranks' shards in one process: within the MLX gate bound of one backend, greedy
    tokens equal; each shard holds half the Q/K/V rows (or layers) and no head but rank 0."""
    artifact = open_artifact(artifacts(TINY, "bf16"))
    group = distributed.Emulation(artifact, BLOCKS, 2, parallel)
    got = distributed.check_steps(group)
    want = distributed.check_steps(MLXBackend(artifact, BLOCKS))
    assert_within_gate(got, want)
    facts = [distributed.shard_facts(rank) for rank in group.ranks]
    if parallel == "tensor":
        assert [f["qkv_rows"] for f in facts] == [(2048 + 2048) // 2] * 2
        assert [f["kv_heads"] for f in facts] == [4, 4]
    else:
        assert [f["layers"] for f in facts] == [1, 1]
    assert [f["head"] for f in facts] == [True, False]


def test_a_one_rank_emulation_is_the_unsharded_backend_bitwise(artifacts, streams):
    artifact = open_artifact(artifacts(TINY, "q8_0"))
    got = distributed.check_steps(distributed.Emulation(artifact, BLOCKS, 1))
    want = distributed.check_steps(MLXBackend(artifact, BLOCKS))
    for a, b in zip(steps(got), steps(want)):
        assert np.array_equal(a, b)


def test_the_kernel_path_runs_at_the_shard_shapes(artifacts, streams):
    """The kernel path on two shards (numpy stand-ins for Metal, tests/test_mlx_backend.py):
    its kernels probed at the shard's own shapes, decode attention too (a slab of 4 KV heads
    and 8 query heads), the whole within the gate bound of the unsharded twins."""
    import test_mlx_backend as stand_ins

    artifact = open_artifact(artifacts(TINY, "q8_0"))
    group = distributed.Emulation(artifact, BLOCKS, 2, "tensor",
                                  kernel_runner=stand_ins._standin_runner, fallback=False)
    lead = group.ranks[0]
    assert lead.choice.kernels
    assert {"matvec/q8_0@1024x256", "matmul/q8_0@256x384"} <= set(lead.kernel_report().running)
    assert "decode_attention/bf16" in lead.kernel_report().running
    assert not lead.ops.twins
    assert_within_gate(distributed.check_steps(group),
                       distributed.check_steps(MLXBackend(artifact, BLOCKS)))


# -- two ranks as one model ----------------------------------------------------------------------

def assert_group_matches(artifact, tmp_path, parallel, prompt_len=20, decode_steps=3):
    """Two ranks against their emulation (bitwise) and the unsharded backend (the gate)."""
    started, dump = start_group(artifact, tmp_path, "--parallel", parallel, "--prompt-len",
                                prompt_len, "--decode-steps", decode_steps)
    codes = wait_all(started)
    assert codes == {0: 0, 1: 0}, logs(started)
    got = dict(np.load(dump))
    follower = np.load(dump.with_suffix(".rank1.npz"))
    opened = open_artifact(artifact)
    emulated = distributed.check_steps(distributed.Emulation(opened, BLOCKS, 2, parallel),
                                       prompt_len, decode_steps)
    assert len(steps(got)) == len(steps(emulated)) >= 2
    for a, b in zip(steps(got), steps(emulated)):
        assert np.array_equal(a, b)
    assert_within_gate(got, distributed.check_steps(MLXBackend(opened, BLOCKS), prompt_len,
                                                    decode_steps))
    if parallel == "tensor":  # each rank holds half of Q, K and V
        assert int(got["qkv_rows"]) == int(follower["qkv_rows"]) == (
            opened.weights.layers[0].q.shape[0] + 2048) // 2
    else:
        assert int(got["layers"]) + int(follower["layers"]) == opened.entry.layers
    assert bool(got["head"]) and not bool(follower["head"])


@pytest.mark.slow
@pytest.mark.parametrize("parallel,scheme", [("tensor", "bf16"), ("pipeline", "bf16"),
                                             ("tensor", "q8_0")])
def test_two_ranks_equal_their_emulation_bitwise(artifacts, tmp_path, streams, parallel,
                                                 scheme):
    assert_group_matches(artifacts(TINY, scheme), tmp_path, parallel)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["tensor", "pipeline"])
def test_two_ranks_qwen3_06b_shape(artifacts, tmp_path, streams, parallel):
    assert_group_matches(artifacts("kipp-synthetic/qwen3-0.6b-shape", "bf16"), tmp_path,
                         parallel, prompt_len=12, decode_steps=2)


# -- failure: never a hang ------------------------------------------------------------------------

@pytest.mark.slow
def test_a_rank_that_never_joins(artifacts, tmp_path):
    """Rank 0 alone: it ends within its join timeout (and the backstop's margin) with one
    line naming itself and the missing rank's address. Its init holds the GIL, so the
    watchdog process kills it (SIGKILL) rather than its thread exiting with 3."""
    started, _ = start_group(artifacts(TINY, "bf16"), tmp_path, "--join-timeout", 4, ranks=[0])
    begin = time.monotonic()
    codes = wait_all(started, deadline_s=60)
    took = time.monotonic() - begin
    assert codes[0] in (3, -signal.SIGKILL), logs(started)
    [line] = broken_lines(started[0][2])
    assert "rank 0 of 2 (127.0.0.1:" in line and "did not form within 4 s" in line, line
    assert "waiting for rank 1 (127.0.0.1:" in line, line
    assert took < 4 + FAILURE_BOUND_S, took


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_mid_run(artifacts, tmp_path, victim):
    """SIGKILL of one rank while rank 0 decodes: the other exits within the bound with one
    line naming the lost rank and its address."""
    started, dump = start_group(artifacts(TINY, "bf16"), tmp_path, "--repeat", 1_000_000)
    ready = [dump.with_suffix(".ready"), dump.with_suffix(".rank1.ready")]
    end = time.monotonic() + DEADLINE_S
    try:
        while not all(r.exists() for r in ready) and time.monotonic() < end:
            assert all(p.poll() is None for _, p, _ in started), logs(started)
            time.sleep(0.2)
        time.sleep(1.0)  # well inside the decode loop
        os.kill(started[victim][1].pid, signal.SIGKILL)
        killed = time.monotonic()
        codes = wait_all(started, deadline_s=FAILURE_BOUND_S + 15)
        took = time.monotonic() - killed
    finally:
        kill_all(started)
    survivor = 1 - victim
    assert codes[victim] == -signal.SIGKILL
    assert codes[survivor] == 3, logs(started)
    [line] = broken_lines(started[survivor][2])
    assert f"rank {survivor} of 2: lost rank {victim} (127.0.0.1:" in line, line
    assert took < FAILURE_BOUND_S, took


# -- kipp serve --distributed --------------------------------------------------------------------

SERVE_ARGS = ("--kv-tokens", "512", "--max-batch", "2")


def serve_env(monkeypatch, rank: int, hostfile: str) -> None:
    for key, value in rank_env(rank, hostfile).items():
        monkeypatch.setenv(key, value)
    for key in [k for k in os.environ if "_proxy" in k.lower()]:
        monkeypatch.delenv(key)


def start_follower(artifact, hostfile, tmp_path, parallel="tensor"):
    return subprocess.Popen(
        [sys.executable, "-m", "kipp.cli", "serve", str(artifact), "--backend", "mlx",
         "--distributed", "--parallel", parallel, "--kv-disk-mib", "0", *SERVE_ARGS],
        env=rank_env(1, hostfile), stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "follower.log", "w"))


@pytest.mark.slow
# tensor parallel: tests/test_forming.py, which starts process 0 alone first
@pytest.mark.parametrize("parallel", ["pipeline"])
def test_serve_distributed_answers_as_one_process(artifacts, monkeypatch, tmp_path, parallel):
    """Rank 0 of `kipp serve --backend mlx --distributed` answers the openai client with a
    single-process server's text and tokens; SIGTERM on rank 0 drains it and both exit 0."""
    from live_server import LiveServer, assert_same_replies, chat_replies

    artifact = artifacts(TINY, "bf16")
    hostfile = write_hostfile(tmp_path / "hosts.json")
    monkeypatch.setenv("KIPP_MLX_CPU_STREAMS", STREAMS)
    single = LiveServer(artifact, "--backend", "mlx", *SERVE_ARGS)
    try:
        want = chat_replies(single)
    finally:
        single.stop()
    follower = start_follower(artifact, hostfile, tmp_path, parallel)
    try:
        serve_env(monkeypatch, 0, hostfile)
        leader = LiveServer(artifact, "--backend", "mlx", "--distributed", "--parallel",
                            parallel, *SERVE_ARGS)
        try:
            assert_same_replies(chat_replies(leader), want)
            leader.proc.send_signal(signal.SIGTERM)
            assert leader.proc.wait(DEADLINE_S) == 0
            assert follower.wait(FAILURE_BOUND_S) == 0, (tmp_path / "follower.log").read_text()
        finally:
            if leader.proc.poll() is None:
                leader.proc.kill()
                leader.proc.wait()
    finally:
        if follower.poll() is None:
            follower.kill()
        follower.wait()


@pytest.mark.slow
def test_serve_distributed_ends_when_a_rank_dies_mid_request(artifacts, monkeypatch,
                                                              tmp_path):
    """SIGKILL of rank 1 while rank 0 streams a reply: rank 0 (the server) exits with status
    3 within the bound instead of hanging its clients."""
    from live_server import LiveServer

    artifact = artifacts(TINY, "bf16")
    hostfile = write_hostfile(tmp_path / "hosts.json")
    follower = start_follower(artifact, hostfile, tmp_path)
    try:
        serve_env(monkeypatch, 0, hostfile)
        leader = LiveServer(artifact, "--backend", "mlx", "--distributed", *SERVE_ARGS)
        try:
            stream = leader.client().chat.completions.create(
                model=TINY, max_tokens=400, temperature=0, stream=True,
                messages=[{"role": "user", "content": "Tell a long story."}])
            next(iter(stream))  # the reply has begun
            follower.kill()
            killed = time.monotonic()
            assert leader.proc.wait(FAILURE_BOUND_S) == 3, leader.log_tail()
            assert time.monotonic() - killed < FAILURE_BOUND_S
        finally:
            if leader.proc.poll() is None:
                leader.proc.kill()
                leader.proc.wait()
    finally:
        if follower.poll() is None:
            follower.kill()
        follower.wait()
