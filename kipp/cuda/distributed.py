"""Several JAX processes as one model: JAX's multi-controller runtime, nothing home-made.

    group = distributed.Group.resolve()        # flags, else JAX_* or SLURM variables
    link = distributed.join(group)             # jax.distributed.initialize, bounded
    backend = JaxBackend(artifact, 64, mesh=sharding.make_mesh(), link=link)
    if not link.leader:
        distributed.follow(backend)            # runs until process 0 stops the group

Every process maps the artifact and places only its own shards (kipp.cuda.sharding.put); the
mesh spans every process's devices, so one step's program is the same everywhere and XLA's
SPMD partitioner inserts the collectives (gloo on CPUs, NCCL on GPUs). Process 0 (the leader)
runs the scheduler: before each step it broadcasts the step's shape and inputs with
`multihost_utils.broadcast_one_to_all`, and the followers run the same step on them. While
the leader is idle it broadcasts a keep-alive every KEEPALIVE_S, so a follower never sits in a
collective long and a dead peer is seen within seconds.

A peer that dies or never joins: every survivor writes one line naming the lost process and
its address (published in the coordinator's key-value store at join) and exits with
EXIT_GROUP_BROKEN, rather than hang or wait for the runtime's heartbeat abort. Of two
processes the lost one is the other; of more, the one whose beat (a counter each process
advances in the key-value store every BEAT_S) has stopped. JAX's
coordination service runs in a child of process 0 (kipp.cuda.coordinator): hosted in process 0
itself, it would die with it and the runtime would abort every survivor first.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kipp.errors import KippError

log = logging.getLogger("kipp.cuda")

EXIT_GROUP_BROKEN = 3  # the exit status of a process whose group lost a member
KEEPALIVE_S = 1.0  # the idle leader's broadcast interval
JOIN_TIMEOUT_S = 60  # how long jax.distributed.initialize waits for every process
JOIN_MARGIN_S = 10  # the runtime's own join timeout is this much later than Kipp's
# A peer silent this long makes the coordination service abort every process (SIGABRT and a
# page of logs; its callback cannot be replaced from Python). Kipp sees a dead peer first, at
# the next collective, so this must outlast the longest stretch without one: a step compiling
# under load. It remains the backstop for a peer that hangs without dying.
HEARTBEAT_S = 60
SHUTDOWN_S = 10  # how long jax.distributed.shutdown waits for every process at its barrier
# A follower that hears nothing this long while it waits gives up: the leader is alive but
# stuck (a dead one fails the collective at once). It must outlast the leader's longest quiet
# stretch, a step compiling under load with the lock held.
SILENCE_S = 120.0
HEADER = 8  # int32 words of a step's header: command, then the Bucket's five fields
BEAT_S = 1.0  # how often each process advances its beat in the key-value store
BEAT_WAIT_S = 3.0  # a beat that has not moved this long (a few BEAT_S) is a lost process's


class Command(enum.IntEnum):
    """What the leader's header tells the followers to do."""

    IDLE = 0  # a keep-alive: nothing to run
    STEP = 1  # a Bucket and its RoundArrays follow; run that step
    STOP = 2  # leave the follower loop; the group shuts down


@dataclass(frozen=True)
class Group:
    """Where the group's coordinator is, how many processes it has and which one this is."""

    coordinator: str | None  # host:port of process 0's coordination service
    processes: int | None
    process_id: int | None
    source: str = "flags"  # where the values came from, for messages
    join_timeout_s: int = JOIN_TIMEOUT_S

    @classmethod
    def resolve(cls, coordinator: str | None = None, processes: int | None = None,
                process_id: int | None = None, env=None, **options) -> Group:
        """Each value from its flag, else JAX's variables (JAX_COORDINATOR_ADDRESS,
        JAX_NUM_PROCESSES, JAX_PROCESS_ID), else SLURM's (SLURM_NTASKS, SLURM_PROCID; the
        coordinator is then left to JAX's SLURM detection). Raises KippError for a bad or
        missing value, naming the flag."""
        env = os.environ if env is None else env
        flags = (coordinator, processes, process_id)
        jax_env = (env.get("JAX_COORDINATOR_ADDRESS") or None,
                   _int(env.get("JAX_NUM_PROCESSES"), "JAX_NUM_PROCESSES"),
                   _int(env.get("JAX_PROCESS_ID"), "JAX_PROCESS_ID"))
        slurm = (None, _int(env.get("SLURM_NTASKS"), "SLURM_NTASKS"),
                 _int(env.get("SLURM_PROCID"), "SLURM_PROCID"))
        values, sources = [], set()
        for flag, from_jax, from_slurm in zip(flags, jax_env, slurm):
            for value, source in ((flag, "flags"), (from_jax, "JAX_* environment"),
                                  (from_slurm, "SLURM environment")):
                if value is not None:
                    values.append(value)
                    sources.add(source)
                    break
            else:
                values.append(None)
        if not sources:
            raise KippError("--distributed needs the group: give --coordinator HOST:PORT, "
                            "--num-processes and --process-id, or set "
                            "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID")
        source = " and ".join(sorted(sources))
        group = cls(*values, source, **options)
        group.check()
        return group

    @property
    def leader(self) -> bool:
        """Process 0, which serves (False while SLURM's detection has yet to say)."""
        return self.process_id == 0

    def check(self) -> None:
        if not self.join_timeout_s > 0:
            raise KippError(f"the join timeout must be positive, not {self.join_timeout_s}")
        if self.processes is not None and self.processes < 1:
            raise KippError(f"--num-processes must be at least 1, not {self.processes} "
                            f"({self.source})")
        if self.process_id is not None and not (
                0 <= self.process_id < (self.processes or self.process_id + 1)):
            raise KippError(f"--process-id {self.process_id} is not in 0..{self.processes - 1}"
                            f" ({self.source})")
        if self.coordinator is not None:
            host, _, port = self.coordinator.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise KippError(f"--coordinator must be HOST:PORT, not {self.coordinator!r} "
                                f"({self.source})")
        if "SLURM" in self.source:
            return  # JAX's SLURM detection finds what is missing
        if self.coordinator is None:
            raise KippError(f"--coordinator HOST:PORT is missing ({self.source})")
        if self.processes is None or self.process_id is None:
            raise KippError(f"--num-processes and --process-id are both needed ({self.source})")


def _int(value: str | None, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise KippError(f"{name} must be an integer, not {value!r}") from None


def join(group: Group, *, heartbeat_s: int = HEARTBEAT_S) -> Link:
    """jax.distributed.initialize for `group` (before any other JAX call of the process),
    the coordinator bound to its own address only; then this process's address is published
    for the others' failure messages. A group that does not form within its join timeout: one
    line naming the process and the coordinator, and the process exits (EXIT_GROUP_BROKEN)."""
    import jax

    timeout_s = group.join_timeout_s

    bind = group.coordinator if group.process_id == 0 else None
    who = "?" if group.process_id is None else group.process_id
    failed = (f"process {who} of {group.processes}: the group did not form at the coordinator "
              f"{group.coordinator} within {timeout_s} s")
    # the runtime aborts the process (a fatal log, not an exception) when its own timeout
    # passes, so a watchdog that fires first gives the one line; the runtime's is a margin later
    joined = threading.Event()

    def watchdog():
        if not joined.wait(timeout_s):
            _exit(failed)

    threading.Thread(target=watchdog, daemon=True, name="kipp-distributed-join").start()
    try:
        with _service_in_a_child():
            jax.distributed.initialize(
                coordinator_address=group.coordinator, num_processes=group.processes,
                process_id=group.process_id, coordinator_bind_address=bind,
                initialization_timeout=timeout_s + JOIN_MARGIN_S,
                heartbeat_timeout_seconds=heartbeat_s, shutdown_timeout_seconds=SHUTDOWN_S)
    except Exception as e:  # JaxRuntimeError: DEADLINE_EXCEEDED, UNAVAILABLE, ...
        _exit(f"{failed} ({_first_line(e)})")
    joined.set()
    link = Link(jax.process_index(), jax.process_count(), group.coordinator or "")
    link.publish_address()
    link.start_beat()
    return link


class Link:
    """This process's end of the step channel (see module docstring). Thread-safe: the
    leader's keep-alive thread and its scheduler share it under one lock."""

    def __init__(self, process_id: int, processes: int, coordinator: str):
        self.process_id, self.processes, self.coordinator = process_id, processes, coordinator
        self.leader = process_id == 0
        self.lock = threading.RLock()
        self._last = time.monotonic()
        self._stopped = False
        self._keepalive: threading.Thread | None = None
        self._running = False  # a follower running a step (its own compile is not silence)
        self._doing = "idle"  # what the guarded action in flight is, for the failure line

    # -- the leader ---------------------------------------------------------------------------

    def step(self, bucket, arrays, run: Callable[[], object]):
        """Broadcast one step's shape and inputs, then `run()` it (the same program every
        process runs), under the lock; returns what `run` returns."""
        with self.lock:
            self._guard("broadcasting a step", lambda: self._send(Command.STEP, bucket, arrays))
            result = self._guard("running a step", run)
            self._last = time.monotonic()
            return result

    def start_keepalive(self) -> None:
        """The leader's idle broadcasts (a daemon thread), so followers hear within
        KEEPALIVE_S and a dead follower is noticed while nothing is asked."""
        if self.leader and self.processes > 1 and self._keepalive is None:
            self._keepalive = threading.Thread(target=self._keep_alive, daemon=True,
                                               name="kipp-distributed-keepalive")
            self._keepalive.start()

    def _keep_alive(self) -> None:
        while not self._stopped:
            time.sleep(KEEPALIVE_S / 4)
            with self.lock:
                if self._stopped:
                    return
                if time.monotonic() - self._last >= KEEPALIVE_S:
                    self._guard("a keep-alive", lambda: self._send(Command.IDLE))
                    self._last = time.monotonic()

    def stop(self) -> None:
        """Tell the followers to leave their loop, then shut the runtime down (every process
        meets at JAX's shutdown barrier)."""
        with self.lock:
            if self._stopped:
                return
            self._stopped = True
            if self.leader and self.processes > 1:
                self._guard("stopping the group", lambda: self._send(Command.STOP))
        _shutdown()

    def _send(self, command: Command, bucket=None, arrays=None) -> None:
        from jax.experimental import multihost_utils

        header = np.zeros(HEADER, np.int32)
        header[0] = command
        if bucket is not None:
            header[1:6] = (bucket.tokens, bucket.seqs, bucket.queries, bucket.blocks,
                           bucket.rows)
        multihost_utils.broadcast_one_to_all(header)
        if arrays is not None:
            multihost_utils.broadcast_one_to_all(tuple(arrays))

    # -- a follower -----------------------------------------------------------------------------

    def receive(self, num_blocks: int):
        """(Command, Bucket or None, RoundArrays or None): the leader's next message."""
        from jax.experimental import multihost_utils

        from kipp.cuda import rounds

        header = self._guard("waiting for the leader", lambda: np.asarray(
            multihost_utils.broadcast_one_to_all(np.zeros(HEADER, np.int32))))
        self._last = time.monotonic()
        command = Command(int(header[0]))
        if command is not Command.STEP:
            return command, None, None
        bucket = rounds.Bucket(*(int(v) for v in header[1:6]))
        shapes = rounds.placeholder_arrays(bucket, num_blocks)
        arrays = self._guard("receiving a step", lambda: multihost_utils.broadcast_one_to_all(
            tuple(shapes)))
        return command, bucket, rounds.RoundArrays(*(np.asarray(a) for a in arrays))

    def watch_silence(self, silence_s: float = SILENCE_S) -> None:
        """A follower's watchdog (a daemon thread): no message for `silence_s` while the
        leader should send one every KEEPALIVE_S means the leader is stuck: exit."""
        def watch():
            while not self._stopped:
                time.sleep(min(1.0, silence_s / 4))
                waited = time.monotonic() - self._last
                if not self._stopped and not self._running and waited > silence_s:
                    self._broken(f"no message from the leader for {silence_s:.0f} s", None)

        threading.Thread(target=watch, daemon=True, name="kipp-distributed-watch").start()

    # -- failures -------------------------------------------------------------------------------

    def publish_address(self) -> None:
        client = _client()
        if client is not None:
            with contextlib.suppress(Exception):
                client.key_value_set(f"kipp/address/{self.process_id}",
                                     f"{_own_address()} pid {os.getpid()}")

    def start_beat(self) -> None:
        """Advance this process's beat every BEAT_S (a daemon thread), so that of more than
        two processes a survivor can tell which one was lost (lost_processes). The same
        thread watches for another survivor's verdict: a process whose collective has not
        failed yet (gloo need not wake a wait on a live peer) exits with it all the same,
        before process 0's service child is gone and the runtime aborts it."""
        client = _client()
        if client is None or self.processes <= 2:
            return

        def beat():
            count = 0
            while not self._stopped:
                count += 1
                with contextlib.suppress(Exception):  # a broken group: the guard reports it
                    client.key_value_set(f"kipp/beat/{self.process_id}", str(count),
                                         allow_overwrite=True)
                if self._verdict() and not self._stopped:
                    self._broken(f"{self._doing} (another process saw it first)", None)
                time.sleep(BEAT_S)

        threading.Thread(target=beat, daemon=True, name="kipp-distributed-beat").start()

    def _guard(self, what: str, action: Callable[[], object]):
        self._doing = what
        try:
            return action()
        except Exception as e:  # a collective over a lost peer: JaxRuntimeError
            log.debug("distributed failure while %s", what, exc_info=True)
            self._broken(what, e)
        finally:
            self._doing = "idle"

    def _broken(self, what: str, error: Exception | None) -> None:
        lost = self.lost_processes()
        if lost:
            names = ", ".join(f"process {i} ({self.address_of(i)})" for i in lost)
            problem = f"lost {names}"
        else:
            problem = "lost a peer"
        cause = f": {_first_line(error)}" if error is not None else ""
        _exit(f"process {self.process_id} of {self.processes}: {problem} while {what}{cause}")

    def lost_processes(self) -> list[int]:
        """The peers this process lost: of two, the other; of more, those whose beat did not
        move in BEAT_WAIT_S (the coordination service's live-node query is itself a barrier
        every process must join, so it cannot be asked here). The first survivor to judge
        records its verdict in the store, and later ones take it: by the time they see the
        failure, the first survivors may have exited and stopped beating too. [] when it
        cannot tell (the store is gone with process 0's service)."""
        if self.processes == 2:
            return [1 - self.process_id]
        recorded = self._verdict()
        if recorded:
            return recorded
        peers = [i for i in range(self.processes) if i != self.process_id]
        before = self._beats(peers)
        if before is None:
            return []
        time.sleep(BEAT_WAIT_S)
        after = self._beats(peers)
        if after is None:
            return []
        lost = [i for i in peers if after[i] is None or after[i] == before[i]]
        client = _client()
        if lost and client is not None:
            with contextlib.suppress(Exception):  # another survivor recorded one first
                client.key_value_set("kipp/lost", ",".join(map(str, lost)))
            return self._verdict() or lost
        return lost

    def _verdict(self) -> list[int]:
        """The lost processes the first survivor recorded; [] when none is (or the store
        cannot be read)."""
        client = _client()
        if client is None:
            return []
        try:
            recorded = client.key_value_try_get("kipp/lost")
        except Exception:  # NOT_FOUND, or the service is gone
            return []
        return [int(i) for i in recorded.split(",")] if recorded else []

    def _beats(self, peers: list[int]) -> dict[int, str | None] | None:
        """Each peer's beat (None: never set), or None when the store cannot be read."""
        client = _client()
        if client is None:
            return None
        beats = {}
        for i in peers:
            try:
                beats[i] = client.key_value_try_get(f"kipp/beat/{i}")
            except Exception as e:  # try_get raises NOT_FOUND for a key never set
                if "NOT_FOUND" not in str(e):
                    return None
                beats[i] = None
        return beats

    def address_of(self, process_id: int) -> str:
        if process_id == 0:
            return f"coordinator {self.coordinator}"
        client = _client()
        if client is not None:
            with contextlib.suppress(Exception):
                value = client.key_value_try_get(f"kipp/address/{process_id}")
                if value:
                    return value
        return "address unknown"


def follow(backend) -> None:
    """A follower's loop: run every step the leader broadcasts, until it says STOP."""
    link = backend.link
    link.watch_silence()
    while True:
        command, bucket, arrays = link.receive(backend.num_blocks)
        if command is Command.STOP:
            link._stopped = True
            _shutdown()
            return
        if command is Command.STEP:
            link._running = True
            program = backend._program(bucket, arrays)
            _, backend.kv = link._guard("running a step", lambda: backend._run(program, arrays))
            link._last, link._running = time.monotonic(), False


@contextlib.contextmanager
def _service_in_a_child():
    """While jax.distributed.initialize runs, the coordination service it starts (process 0)
    is hosted by kipp.cuda.coordinator in a child process, so it outlives a killed process 0
    long enough for the survivors to name it. A JAX whose layout differs keeps its own."""
    from jax._src import distributed

    from kipp.cuda import coordinator

    runtime = getattr(distributed, "_jax", None)
    if not hasattr(runtime, "get_distributed_runtime_service"):
        yield
        return

    class Runtime:
        get_distributed_runtime_service = staticmethod(coordinator.start)

        def __getattr__(self, name):
            return getattr(runtime, name)

    distributed._jax = Runtime()
    try:
        yield
    finally:
        distributed._jax = runtime


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def _shutdown() -> None:
    import jax

    with contextlib.suppress(Exception):
        jax.distributed.shutdown()


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


_exiting = threading.Lock()  # the first thread to see the failure writes the one line


def _exit(line: str) -> None:
    """The group cannot go on (a tensor-parallel step needs every process): one line on
    stderr, then exit at once (JAX's runtime would abort later, with a page of logs)."""
    _exiting.acquire()  # a second thread waits here until os._exit ends the process
    sys.stderr.write(f"kipp: distributed group broken: {line}\n")
    sys.stderr.flush()  # not logging.shutdown: it waits for a handler lock another thread may hold
    os._exit(EXIT_GROUP_BROKEN)
