"""The JAX backend over several processes (kipp.cuda.distributed), on loopback.

Two processes with one CPU device each against one process with two devices (the Mesh path,
bitwise) and one device (the jax gate bound); a process that never joins or dies mid-run ends
the other within a bound with one line. Every process is started here with a free port on
127.0.0.1 and killed by PID at its deadline; XLA_FLAGS gives each one CPU device (several per
process can deadlock cross-process collectives dispatched unsynced).
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kipp.errors import KippError
from live_server import free_port

pytest.importorskip("jax")

DEADLINE_S = 240  # a whole run of one configuration, both processes
FAILURE_BOUND_S = 20  # a survivor's exit after its peer is gone (keep-alive 1 s, gloo ~1 s)


def rank_env(devices: int = 1) -> dict:
    env = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower()}  # can hang init
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu")
    return env


def check_command(artifact, out, *extra) -> list[str]:
    return [sys.executable, "-m", "kipp.cuda.shard_check", str(artifact), "--dump", str(out),
            *map(str, extra)]


def start_group(artifact, tmp_path, *extra, processes=2, ranks=None):
    """Popen of each rank in `ranks` (all by default) of a group on a fresh port: [(rank,
    process, npz path, log path)]."""
    port = free_port()
    started = []
    for rank in (range(processes) if ranks is None else ranks):
        out, log = tmp_path / f"rank{rank}.npz", tmp_path / f"rank{rank}.log"
        command = check_command(artifact, out, "--coordinator", f"127.0.0.1:{port}",
                                "--num-processes", processes, "--process-id", rank, *extra)
        with open(log, "w") as sink:
            started.append((rank, subprocess.Popen(command, env=rank_env(), stdout=sink,
                                                   stderr=subprocess.STDOUT), out, log))
    return started


def wait_all(started, deadline_s=DEADLINE_S) -> dict[int, int]:
    """Each rank's exit status; any still running at the deadline is killed by PID (and the
    test fails)."""
    end = time.monotonic() + deadline_s
    codes, late = {}, []
    for rank, proc, _, _ in started:
        try:
            codes[rank] = proc.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            late.append(rank)
    for rank, proc, _, _ in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not late, f"ranks {late} still running after {deadline_s} s: " + logs(started)
    return codes


def logs(started) -> str:
    return "\n".join(f"--- rank {rank}\n{log.read_text()[-3000:]}" for rank, _, _, log in started)


def broken_lines(log) -> list[str]:
    return [line for line in log.read_text().splitlines()
            if line.startswith("kipp: distributed group broken:")]


def single_run(artifact, tmp_path, devices, *extra):
    out = tmp_path / f"devices{devices}.npz"
    run = subprocess.run(check_command(artifact, out, "--devices", devices, *extra),
                         env=rank_env(devices), capture_output=True, text=True,
                         timeout=DEADLINE_S)
    assert run.returncode == 0, run.stderr[-3000:]
    return np.load(out)


def steps(npz) -> list[np.ndarray]:
    return [npz[f"step{i}"] for i in range(len([k for k in npz.files
                                                if k.startswith("step") and k[4:].isdigit()]))]


def assert_group_matches(artifact, tmp_path, *extra):
    """The gate: two processes x one device vs one process x two devices (bitwise) and vs one
    device (the jax backend's batched bound: the same sums, split; greedy tokens equal)."""
    from kipp import gates
    from kipp.gates.bounds import calibrated_bound

    started = start_group(artifact, tmp_path, *extra)
    codes = wait_all(started)
    assert codes == {0: 0, 1: 0}, logs(started)
    group = np.load(started[0][2])
    assert group["local_rows"] * 2 == group["q_rows"]  # each holds half the Q rows (or layers)
    mesh, one = single_run(artifact, tmp_path, 2, *extra), single_run(artifact, tmp_path, 1,
                                                                      *extra)
    assert len(steps(group)) == len(steps(mesh)) >= 2  # a prefill and decode steps
    for got, want in zip(steps(group), steps(mesh)):
        assert np.array_equal(got, want)
    bound = calibrated_bound("jax", "cached_decode")
    for got, want in zip(steps(group), steps(one)):
        assert gates.nmse(got, want) <= bound
    assert list(group["tokens"]) == list(mesh["tokens"]) == list(one["tokens"])


# -- the group's address and size -------------------------------------------------------------

def test_group_from_flags_then_jax_then_slurm():
    from kipp.cuda.distributed import Group

    assert Group.resolve("10.0.0.1:1234", 2, 1) == Group("10.0.0.1:1234", 2, 1, "flags")
    env = {"JAX_COORDINATOR_ADDRESS": "h0:99", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3",
           "SLURM_NTASKS": "8", "SLURM_PROCID": "5"}
    assert Group.resolve(env=env) == Group("h0:99", 4, 3, "JAX_* environment")
    slurm = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5"}
    assert Group.resolve(env=slurm) == Group(None, 8, 5, "SLURM environment")
    # a flag given overrides its variable only
    assert Group.resolve(process_id=0, env=env) == Group("h0:99", 4, 0,
                                                         "JAX_* environment and flags")


@pytest.mark.parametrize("args,env,problem", [
    ((None, None, None), {}, "--distributed needs the group"),
    (("h0", 2, 0), {}, "--coordinator must be HOST:PORT, not 'h0'"),
    (("h0:0", 2, 0), {}, "--coordinator must be HOST:PORT"),
    (("h0:99", 2, 2), {}, "--process-id 2 is not in 0..1"),
    (("h0:99", 0, 0), {}, "--num-processes must be at least 1"),
    ((None, None, None), {"JAX_COORDINATOR_ADDRESS": "h0:9", "JAX_NUM_PROCESSES": "two"},
     "JAX_NUM_PROCESSES must be an integer, not 'two'"),
    ((None, 2, 0), {}, "--coordinator HOST:PORT is missing"),
    (("h0:99", None, 0), {}, "--num-processes and --process-id are both needed"),
])
def test_bad_group_is_one_clear_error(args, env, problem):
    from kipp.cuda.distributed import Group

    with pytest.raises(KippError, match=problem.replace(".", r"\.")):
        Group.resolve(*args, env=env)


@pytest.mark.parametrize("options,problem", [
    (dict(backend="reference", distributed=True), "distributed needs backend='jax'"),
    (dict(backend="jax", parallel="data"), "unknown parallel 'data'"),
    (dict(backend="jax", distributed="yes"), "distributed must be True or a"),
])
def test_load_refuses_a_bad_distributed_request(options, problem, monkeypatch):
    # checked before JAX starts, any download or any allocation
    from kipp.model import load

    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:9")  # never reached
    with pytest.raises(KippError, match=problem):
        load("no-such-checkpoint", **options)


# -- two processes as one model -----------------------------------------------------------------

@pytest.mark.slow
def test_two_processes_equal_two_devices_bitwise(artifacts, tmp_path):
    # GQA group 5 (20 query heads per process), float32 projections: the Mesh path's layout
    assert_group_matches(artifacts("kipp-synthetic/qwen3-tiny-untied", "bf16"), tmp_path,
                         "--layout", "f32")


@pytest.mark.slow
def test_two_processes_packed_planes(artifacts, tmp_path):
    # q8_0 planes as stored: rows split for Q/K/V/gate/up, whole 32-weight groups for O/down
    assert_group_matches(artifacts("kipp-synthetic/qwen3-tiny", "q8_0"), tmp_path,
                         "--layout", "device")


@pytest.mark.slow
def test_two_processes_qwen3_06b_shape(artifacts, tmp_path):
    assert_group_matches(artifacts("kipp-synthetic/qwen3-0.6b-shape", "bf16"), tmp_path,
                         "--layout", "device", "--prompt-len", 24, "--decode-steps", 2)


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_id,scheme,layout", [
    ("kipp-synthetic/qwen3-tiny-untied", "bf16", "f32"),
    ("kipp-synthetic/qwen3-tiny", "q8_0", "device"),
])
def test_two_pipeline_stages_equal_two_devices_bitwise(artifacts, tmp_path, checkpoint_id,
                                                       scheme, layout):
    # each process holds half the layers and its half of the slab; the hidden state is
    # handed on with ppermute
    assert_group_matches(artifacts(checkpoint_id, scheme), tmp_path, "--layout", layout,
                         "--pipeline")


@pytest.mark.slow
def test_two_pipeline_stages_qwen3_06b_shape(artifacts, tmp_path):
    assert_group_matches(artifacts("kipp-synthetic/qwen3-0.6b-shape", "bf16"), tmp_path,
                         "--layout", "device", "--prompt-len", 24, "--decode-steps", 2,
                         "--pipeline")


# -- failure: never a hang ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("present", [0, 1])
def test_a_process_that_never_joins(artifacts, tmp_path, present):
    """Only one of two processes starts: it exits within the join timeout (plus start-up)
    with one line naming itself and the coordinator."""
    artifact = artifacts("kipp-synthetic/qwen3-tiny", "bf16")
    started = start_group(artifact, tmp_path, "--join-timeout", 5, ranks=[present])
    begin = time.monotonic()
    codes = wait_all(started, deadline_s=60)
    took = time.monotonic() - begin
    log = started[0][3]
    assert codes == {present: 3}, logs(started)
    [line] = broken_lines(log)
    assert f"process {present} of 2: the group did not form at the coordinator 127.0.0.1:" \
        in line, line
    assert took < 5 + FAILURE_BOUND_S, took


def kill_mid_decode(started, victim):
    """Wait until every process of `started` decodes (its .ready file), then SIGKILL process
    `victim`: (its Popen, the monotonic time of the kill)."""
    ready = [out.with_suffix(".ready") for _, _, out, _ in started]
    end = time.monotonic() + DEADLINE_S
    while not all(r.exists() for r in ready) and time.monotonic() < end:
        assert all(p.poll() is None for _, p, _, _ in started), logs(started)
        time.sleep(0.2)
    time.sleep(1.0)  # well inside the decode loop
    _, proc, _, _ = started[victim]
    os.kill(proc.pid, signal.SIGKILL)
    return proc, time.monotonic()


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_process_killed_mid_run(artifacts, tmp_path, victim):
    """SIGKILL of one process while the leader decodes: the other exits within the bound with
    one line naming the lost process and its address."""
    artifact = artifacts("kipp-synthetic/qwen3-tiny", "bf16")
    started = start_group(artifact, tmp_path, "--repeat", 100_000, "--layout", "f32")
    proc, killed = kill_mid_decode(started, victim)
    survivor = 1 - victim
    codes = wait_all(started, deadline_s=FAILURE_BOUND_S + 30)
    took = time.monotonic() - killed
    assert codes[victim] == -signal.SIGKILL
    assert codes[survivor] == 3, logs(started)
    [line] = broken_lines(started[survivor][3])
    where = "coordinator 127.0.0.1:" if victim == 0 else f"127.0.0.1 pid {proc.pid}"
    assert f"process {survivor} of 2: lost process {victim} ({where}" in line, line
    assert took < FAILURE_BOUND_S, took


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 2])
def test_of_four_processes_the_one_killed_is_named(artifacts, tmp_path, victim):
    """Four processes (tensor parallel, a quarter of the heads each); SIGKILL of one while the
    leader decodes: the three survivors exit within the bound, each with one line naming it
    and its address (its beat in the coordinator's store stopped, the others' moved on). A
    survivor whose collective has not failed yet exits on the first survivor's verdict, before
    a killed process 0's service child is gone."""
    artifact = artifacts("kipp-synthetic/qwen3-tiny", "bf16")
    started = start_group(artifact, tmp_path, "--repeat", 100_000, "--layout", "f32",
                          processes=4)
    proc, killed = kill_mid_decode(started, victim)
    codes = wait_all(started, deadline_s=FAILURE_BOUND_S + 30)
    took = time.monotonic() - killed
    assert codes == {i: -signal.SIGKILL if i == victim else 3 for i in range(4)}, \
        logs(started)
    where = "coordinator 127.0.0.1:" if victim == 0 else f"127.0.0.1 pid {proc.pid}"
    for survivor in sorted(set(range(4)) - {victim}):
        [line] = broken_lines(started[survivor][3])
        assert f"process {survivor} of 4: lost process {victim} ({where}" in line, line
    assert took < FAILURE_BOUND_S, took


@pytest.mark.slow
def test_a_follower_killed_while_the_leader_is_busy(artifacts, tmp_path):
    """The follower dies while the leader holds the group for longer than the runtime's old
    10 s heartbeat, sending nothing (as a step compiling under load does): the leader still
    exits with the one line at its next collective, not the runtime's heartbeat abort."""
    artifact = artifacts("kipp-synthetic/qwen3-tiny", "bf16")
    busy_s = 15
    started = start_group(artifact, tmp_path, "--busy-s", busy_s, "--repeat", 1,
                          "--decode-steps", 1)
    busy = started[0][2].with_suffix(".busy")
    end = time.monotonic() + DEADLINE_S
    while not busy.exists() and time.monotonic() < end:
        assert all(p.poll() is None for _, p, _, _ in started), logs(started)
        time.sleep(0.2)
    _, follower, _, _ = started[1]
    os.kill(follower.pid, signal.SIGKILL)
    killed = time.monotonic()
    codes = wait_all(started, deadline_s=busy_s + FAILURE_BOUND_S + 30)
    assert codes == {0: 3, 1: -signal.SIGKILL}, logs(started)
    [line] = broken_lines(started[0][3])
    assert f"process 0 of 2: lost process 1 (127.0.0.1 pid {follower.pid}" in line, line
    assert time.monotonic() - killed < busy_s + FAILURE_BOUND_S


# -- kipp serve --distributed ---------------------------------------------------------------------

SERVE_ARGS = ("--kv-tokens", "512", "--max-batch", "2")


@pytest.mark.slow
# tensor parallel: tests/test_forming.py, which starts process 0 alone first
@pytest.mark.parametrize("parallel", ["pipeline"])
def test_serve_distributed_answers_as_one_process(artifacts, monkeypatch, tmp_path, parallel):
    """Rank 0 of `kipp serve --distributed` answers the openai client with a single-process
    server's text; SIGTERM on rank 0 drains it and both processes exit 0."""
    from live_server import LiveServer, assert_same_replies, chat_replies

    artifact = artifacts("kipp-synthetic/qwen3-tiny", "bf16")
    for key, value in rank_env().items():
        monkeypatch.setenv(key, value)
    for key in [k for k in os.environ if "_proxy" in k.lower()]:
        monkeypatch.delenv(key)
    single = LiveServer(artifact, "--backend", "jax", *SERVE_ARGS)
    try:
        want = chat_replies(single)
    finally:
        single.stop()
    port = free_port()
    group = ("--backend", "jax", "--distributed", "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", "2", "--parallel", parallel)
    follower = subprocess.Popen(
        [sys.executable, "-m", "kipp.cli", "serve", str(artifact), *group, "--process-id", "1",
         "--kv-disk-mib", "0", *SERVE_ARGS], stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "follower.log", "w"))
    try:
        leader = LiveServer(artifact, *group, "--process-id", "0", *SERVE_ARGS)
        try:
            assert_same_replies(chat_replies(leader), want)
            leader.proc.send_signal(signal.SIGTERM)
            assert leader.proc.wait(DEADLINE_S) == 0
            assert follower.wait(FAILURE_BOUND_S) == 0, (tmp_path / "follower.log").read_text()
        finally:
            if leader.proc.poll() is None:
                leader.proc.kill()
    finally:
        if follower.poll() is None:
            follower.kill()
        follower.wait()


@pytest.mark.slow
def test_serve_distributed_ends_when_a_follower_dies_mid_request(artifacts, monkeypatch,
                                                                  tmp_path):
    """SIGKILL of process 1 while process 0 streams a reply: process 0 (the server) exits
    with status 3 within the bound instead of hanging its clients."""
    from live_server import LiveServer

    artifact = artifacts("kipp-synthetic/qwen3-tiny", "bf16")
    for key, value in rank_env().items():
        monkeypatch.setenv(key, value)
    for key in [k for k in os.environ if "_proxy" in k.lower()]:
        monkeypatch.delenv(key)
    group = ("--backend", "jax", "--distributed", "--coordinator", f"127.0.0.1:{free_port()}",
             "--num-processes", "2")
    follower = subprocess.Popen(
        [sys.executable, "-m", "kipp.cli", "serve", str(artifact), *group, "--process-id", "1",
         "--kv-disk-mib", "0", *SERVE_ARGS], stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "follower.log", "w"))
    try:
        leader = LiveServer(artifact, *group, "--process-id", "0", *SERVE_ARGS)
        try:
            stream = leader.client().chat.completions.create(
                model="kipp-synthetic/qwen3-tiny", max_tokens=400, temperature=0, stream=True,
                messages=[{"role": "user", "content": "Tell a long story."}])
            # Mid-decode: the first chunk (the role) comes before the first step compiles, and
            # a leader compiling is the busy case, bounded by its compile time.
            words = (c for c in stream if c.choices and c.choices[0].delta.content)
            for _ in range(3):
                next(words)
            follower.kill()
            killed = time.monotonic()
            try:
                code = leader.proc.wait(FAILURE_BOUND_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the leader still runs {FAILURE_BOUND_S} s after its follower died:\n"
                            + leader.log_tail())
            assert code == 3, leader.log_tail()
            assert time.monotonic() - killed < FAILURE_BOUND_S
        finally:
            if leader.proc.poll() is None:
                leader.proc.kill()
    finally:
        if follower.poll() is None:
            follower.kill()
        follower.wait()
