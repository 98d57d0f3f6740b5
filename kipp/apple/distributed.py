"""Several MLX processes (ranks) as one model, on MLX's own mx.distributed (ring over TCP).

    group = distributed.Group.resolve()          # flags, else MLX_RANK and MLX_HOSTFILE
    shard = distributed.plan_shard(artifact.entry, group.rank, group.size, "tensor")
    link = distributed.join(group)               # mx.distributed.init, bounded
    backend = MLXBackend(artifact, 64, shard=shard, link=link)
    if not link.leader:
        distributed.follow(backend)              # runs until rank 0 stops the group

Tensor parallel: a rank holds its share of Q, K, V, gate and up by output rows (whole heads:
with 8 KV heads over 2 ranks, rank i holds KV heads 4i..4i+3 and exactly the query heads that
share them) and the matching input columns of O and down; a block's partial outputs meet in
one `mx.distributed.all_sum`, two a layer. Its KV slab holds its KV heads only, so at most 8
ranks. Pipeline parallel: rank i runs the i-th contiguous range of the layers with all their
heads; the hidden state goes to the next rank with send/recv, and the last rank hands it back
to rank 0, which alone holds the output head (every hop is to a ring neighbour). Each rank
prepares its weights from views of its own rows and columns of the mapped artifact.

Rank 0 (the leader) runs the scheduler. Before each round it shares the round's inputs: a
header, then one int32 vector, each an all_sum to which the other ranks add zeros; then
every rank runs the same round. While idle the leader sends a keep-alive header every
KEEPALIVE_S, so a dead peer is seen within seconds. A rank that dies, or a group that does
not form within the join timeout: every survivor writes one line naming the rank and its
address (from the hostfile) and exits with EXIT_GROUP_BROKEN.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from kipp.errors import KippError
from kipp.formats.quant import BLOCK, GGML_BF16, GGML_F32, SCHEMES_BY_GGML_TYPE
from kipp.formats.registry import HEAD_DIM, KV_HEADS

log = logging.getLogger("kipp.apple")

RANK_ENV, HOSTFILE_ENV = "MLX_RANK", "MLX_HOSTFILE"  # what mlx.launch sets for each rank
EXIT_GROUP_BROKEN = 3  # the exit status of a rank whose group lost a member
KEEPALIVE_S = 1.0  # the idle leader's keep-alive interval
JOIN_TIMEOUT_S = 60.0  # how long a rank waits for the whole ring to connect
SILENCE_S = 30.0  # a follower that hears nothing this long gives up (the leader is stuck)
STALL_S = 60.0  # the leader gives up on a round the ranks have not finished by then (a CPU
# round of the 0.6B shape takes over 10 s on two shared cores: this is a backstop, not a bound)
WATCHDOG_MARGIN_S = 2.0  # the join's backstop process fires this much after its thread
HEADER = 4  # int32 words of a message's header: command, then the body's length


class Command(enum.IntEnum):
    """What the leader's header tells the other ranks to do."""

    IDLE = 0  # a keep-alive: nothing to run
    STEP = 1  # a round's inputs follow; run that round
    STOP = 2  # leave the follower loop; the group shuts down


class Parallel(str, enum.Enum):
    """How a group splits the model (kipp.model.PARALLEL's names)."""

    TENSOR = "tensor"
    PIPELINE = "pipeline"


# -- the group: which rank this is, and every rank's address ----------------------------------

@dataclass(frozen=True)
class Group:
    """This process's rank and the ring's hostfile (a JSON list, one entry per rank, of that
    rank's "ip:port" addresses: what mlx.launch writes to MLX_HOSTFILE)."""

    rank: int | None
    hostfile: str | None
    ranks: int | None = None  # --num-processes, when given: checked against the hostfile
    source: str = "flags"  # where the values came from, for messages
    join_timeout_s: float = JOIN_TIMEOUT_S

    @classmethod
    def resolve(cls, rank: int | None = None, hostfile: str | None = None,
                ranks: int | None = None, env=None, **options) -> Group:
        """Each value from its flag (--process-id, --hostfile, --num-processes), else from
        MLX_RANK and MLX_HOSTFILE. Raises KippError for a bad or missing value, naming it."""
        env = os.environ if env is None else env
        sources = set()
        if rank is not None or hostfile is not None or ranks is not None:
            sources.add("flags")
        if rank is None and env.get(RANK_ENV, "") != "":
            rank = _int(env[RANK_ENV], RANK_ENV)
            sources.add("MLX_* environment")
        if hostfile is None and env.get(HOSTFILE_ENV):
            hostfile = env[HOSTFILE_ENV]
            sources.add("MLX_* environment")
        if not sources:
            raise KippError("--distributed with --backend mlx needs the group: give --hostfile "
                            "FILE and --process-id, or set MLX_HOSTFILE and MLX_RANK "
                            "(mlx.launch sets both)")
        group = cls(rank, hostfile, ranks, " and ".join(sorted(sources)), **options)
        group.check()
        return group

    def check(self) -> None:
        if self.hostfile is None:
            raise KippError(f"--hostfile FILE is missing ({self.source}; or set MLX_HOSTFILE)")
        if self.rank is None:
            raise KippError(f"--process-id is missing ({self.source}; or set MLX_RANK)")
        size = len(self.hosts())
        if size < 2:
            raise KippError(f"the hostfile {self.hostfile} lists {size} rank: a group needs "
                            f"at least 2")
        if self.ranks is not None and self.ranks != size:
            raise KippError(f"--num-processes {self.ranks} does not match the {size} ranks of "
                            f"the hostfile {self.hostfile}")
        if not 0 <= self.rank < size:
            raise KippError(f"--process-id {self.rank} is not in 0..{size - 1} (the hostfile "
                            f"{self.hostfile} lists {size} ranks; {self.source})")
        if not self.join_timeout_s > 0:
            raise KippError(f"the join timeout must be positive, not {self.join_timeout_s}")

    @property
    def size(self) -> int:
        return len(self.hosts())

    @property
    def leader(self) -> bool:
        """Rank 0, which serves."""
        return self.rank == 0

    def hosts(self) -> list[list[str]]:
        """Each rank's addresses, from the hostfile; KippError naming the file if malformed."""
        path = Path(self.hostfile)
        try:
            hosts = json.loads(path.read_text())
        except OSError as e:
            raise KippError(f"--hostfile {path}: cannot read it ({e.strerror})") from None
        except ValueError as e:
            raise KippError(f"--hostfile {path} is not JSON ({e})") from None
        if isinstance(hosts, dict) and "hosts" in hosts:
            raise KippError(f"--hostfile {path} is mlx.launch's hostfile; a rank started by "
                            f"hand needs the ring's: [[\"IP:PORT\"], [\"IP:PORT\"], ...]")
        if not isinstance(hosts, list) or not all(
                isinstance(h, list) and h and all(_address(a) for a in h) for h in hosts):
            raise KippError(f"--hostfile {path} must be a JSON list of each rank's "
                            f"[\"IP:PORT\", ...] addresses")
        return hosts


def _address(value) -> bool:
    if not isinstance(value, str):
        return False
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise KippError(f"{name} must be an integer, not {value!r}") from None


# -- the shard: which part of the model a rank holds ------------------------------------------

@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `ranks`' share of the model (see module docstring)."""

    rank: int
    ranks: int
    parallel: Parallel
    layers: tuple[int, int]  # [lo, hi) of the model's layers this rank runs
    kv: tuple[int, int]  # [lo, hi) of the KV heads in this rank's slab
    query_heads: tuple[int, int]  # [lo, hi) of the query heads it computes
    ffn: tuple[int, int]  # [lo, hi) of the intermediate (FFN) columns it holds

    @property
    def kv_heads(self) -> int:
        return self.kv[1] - self.kv[0]

    @property
    def holds_head(self) -> bool:
        """Only rank 0 reads logits: the other ranks hold no output head."""
        return self.rank == 0

    @property
    def embeds(self) -> bool:
        """Every tensor-parallel rank starts from the embedding; of a pipeline, the first."""
        return self.parallel is Parallel.TENSOR or self.rank == 0

    # what MLXBackend asks of its shard (so the backend imports nothing of this module)

    def view(self, artifact):
        return shard_artifact(artifact, self)

    def probes(self, artifact, runner=None) -> tuple:
        """(shapes, Probes) of this shard's projections (projection_shapes, shard_probes)."""
        shapes = projection_shapes(artifact)
        return shapes, shard_probes(shapes, runner)

    def run(self, backend, r):
        return run_round(backend, r)

    def describe(self) -> str:
        where = f"rank {self.rank} of {self.ranks}, {self.parallel.value} parallel"
        if self.parallel is Parallel.PIPELINE:
            return f"{where}: layers {self.layers[0]}..{self.layers[1] - 1}"
        return (f"{where}: KV heads {self.kv[0]}..{self.kv[1] - 1}, FFN columns "
                f"{self.ffn[0]}..{self.ffn[1] - 1}")


def plan_shard(entry, rank: int, ranks: int, parallel: str | Parallel = Parallel.TENSOR
               ) -> Shard:
    """Rank `rank`'s Shard of the checkpoint `entry` over `ranks` ranks; KippError when the
    model does not split that way."""
    try:
        parallel = Parallel(parallel)
    except ValueError:
        raise KippError(f"unknown parallel {parallel!r}; choose from "
                        f"{', '.join(p.value for p in Parallel)}") from None
    if ranks < 1 or not 0 <= rank < ranks:
        raise KippError(f"rank {rank} is not in 0..{ranks - 1}")
    everything = dict(layers=(0, entry.layers), kv=(0, KV_HEADS),
                      query_heads=(0, entry.query_heads), ffn=(0, entry.intermediate))
    if parallel is Parallel.PIPELINE:
        if ranks > entry.layers:
            raise KippError(f"pipeline parallel over {ranks} ranks: {entry.id} has only "
                            f"{entry.layers} layers")
        lo, hi = entry.layers * rank // ranks, entry.layers * (rank + 1) // ranks
        return Shard(rank, ranks, parallel, **{**everything, "layers": (lo, hi)})
    if ranks > KV_HEADS or KV_HEADS % ranks:
        raise KippError(f"tensor parallel over {ranks} ranks: Qwen3's {KV_HEADS} KV heads split "
                        f"over 1, 2, 4 or 8 ranks (at most {KV_HEADS})")
    if entry.intermediate % (ranks * BLOCK):
        raise KippError(f"tensor parallel over {ranks} ranks: {entry.id}'s intermediate width "
                        f"{entry.intermediate} is not a multiple of {ranks} x {BLOCK}")
    per_kv, per_q, per_ffn = (KV_HEADS // ranks, entry.query_heads // ranks,
                              entry.intermediate // ranks)
    return Shard(rank, ranks, parallel, (0, entry.layers), _part(rank, per_kv),
                 _part(rank, per_q), _part(rank, per_ffn))


def _part(rank: int, width: int) -> tuple[int, int]:
    return rank * width, (rank + 1) * width


def shard_artifact(artifact, shard: Shard):
    """The artifact as this rank sees it: its layers only, each projection a view of its own
    rows (Q, K, V, gate, up) or columns (O, down) of the mapped file. Nothing is copied."""
    w = artifact.weights
    layers = tuple(_layer_share(w.layers[i], shard) for i in range(*shard.layers))
    return dataclasses.replace(artifact, weights=dataclasses.replace(w, layers=layers))


def _layer_share(layer, shard: Shard):
    if shard.parallel is Parallel.PIPELINE:
        return layer
    q = (shard.query_heads[0] * HEAD_DIM, shard.query_heads[1] * HEAD_DIM)
    kv = (shard.kv[0] * HEAD_DIM, shard.kv[1] * HEAD_DIM)
    return dataclasses.replace(
        layer, q=_rows(layer.q, *q), k=_rows(layer.k, *kv), v=_rows(layer.v, *kv),
        o=_columns(layer.o, *q), gate=_rows(layer.gate, *shard.ffn),
        up=_rows(layer.up, *shard.ffn), down=_columns(layer.down, *shard.ffn))


def _row_view(t) -> np.ndarray:
    return t.raw.reshape(t.shape[0], t.raw.size // t.shape[0])


def _rows(t, lo: int, hi: int):
    """Rows [lo, hi) of a projection tensor: a contiguous view of the mapping."""
    return dataclasses.replace(t, shape=(hi - lo, t.shape[1]), raw=_row_view(t)[lo:hi])


def _columns(t, lo: int, hi: int):
    """Columns [lo, hi) (multiples of 32: whole quantization blocks) of every row: a strided
    view of the mapping."""
    rows = _row_view(t)
    block_bytes = rows.shape[1] * BLOCK // t.shape[1]
    part = rows[:, lo // BLOCK * block_bytes:hi // BLOCK * block_bytes]
    return dataclasses.replace(t, shape=(t.shape[0], hi - lo), raw=part)


def projection_shapes(artifact) -> tuple:
    """(format, rows, cols) of every distinct projection of an artifact (a shard's own)."""
    names = ("q", "k", "v", "o", "gate", "up", "down")
    found = {(_format(t), *t.shape) for layer in artifact.weights.layers
             for t in (getattr(layer, n) for n in names)}
    return tuple(sorted(found))


def _format(t) -> str:
    if t.ggml_type == GGML_BF16:
        return "bf16"
    if t.ggml_type == GGML_F32:
        return "f32"
    return SCHEMES_BY_GGML_TYPE[t.ggml_type].name


def shard_probes(shapes, runner=None, seed: int = 0) -> list:
    """kipp.probe Probes of the matvec and matmul kernels at each (format, rows, cols) of a
    shard's projections, against their twin: the shapes the kernels will run at on this rank.
    A probe's name is the variant's, then "@ROWSxCOLS"."""
    import mlx.core as mx

    from kipp.apple import layout, linear, probe, repack
    from kipp.formats import quant
    from kipp.probe import Probe

    rng = np.random.default_rng(seed)
    found = []
    for fmt, rows, cols in shapes:
        if fmt not in linear.FORMATS:
            continue  # no kernel takes it: the backend refuses it at load
        raw = quant.quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), fmt)
        if fmt == "bf16":
            w = layout.Linear(fmt, rows, cols, planes=(mx.array(raw.view("<u2")),))
        else:
            p = repack.to_planes(raw, fmt, cols)
            w = layout.Linear(fmt, rows, cols,
                              planes=tuple(mx.array(a) for a in (p.q, p.d, p.m) if a is not None))
        for kind, kernel in (("matvec", linear.matvec), ("matmul", linear.matmul)):
            x = mx.array(rng.standard_normal((probe.TOKENS[kind], cols)).astype(np.float32))
            found.append(Probe(f"{kind}/{fmt}@{rows}x{cols}",
                               lambda kernel=kernel, x=x, w=w: np.array(kernel(x, w, runner)),
                               lambda x=x, w=w: np.array(linear.planes_twin(x, w)), probe.BOUND))
    return found


# -- joining ----------------------------------------------------------------------------------

def join(group: Group, shard: Shard | None = None) -> Link:
    """mx.distributed.init over the ring of `group`'s hostfile (strict: no silent group of
    one). A ring that does not connect within the group's join timeout (a rank that never
    starts leaves rank 0 waiting for ever): one line naming this rank and the others'
    addresses, and the process exits (EXIT_GROUP_BROKEN)."""
    import mlx.core as mx

    group.check()
    hosts = group.hosts()
    os.environ[RANK_ENV], os.environ[HOSTFILE_ENV] = str(group.rank), str(group.hostfile)
    others = ", ".join(f"rank {i} ({_where(hosts, i)})" for i in range(len(hosts))
                       if i != group.rank)
    failed = (f"rank {group.rank} of {len(hosts)} ({_where(hosts, group.rank)}): the group did "
              f"not form within {group.join_timeout_s:g} s; waiting for {others}")
    joined = threading.Event()
    _watchdog(joined, group.join_timeout_s, failed)
    backstop = _watchdog_process(group.join_timeout_s + WATCHDOG_MARGIN_S, failed)
    try:
        world = mx.distributed.init(strict=True, backend="ring")
    except Exception as e:  # RuntimeError: a peer refused, gave up connecting, ...
        _exit(f"{failed} ({_first_line(e)})")
    joined.set()
    backstop.stdin.close()  # it stands down
    backstop.wait()
    if world.size() != len(hosts) or world.rank() != group.rank:
        _exit(f"rank {group.rank}: MLX formed a group of {world.size()} with this process as "
              f"rank {world.rank()}; the hostfile lists {len(hosts)}")
    return Link(world, group.rank, hosts, shard)


def _watchdog(done: threading.Event, timeout_s: float, line: str) -> None:
    """Exit with `line` unless `done` is set within `timeout_s` (a thread: it runs while a
    connecting rank's mx.distributed.init waits, which releases the GIL)."""
    def watch():
        if not done.wait(timeout_s):
            _exit(line)

    threading.Thread(target=watch, daemon=True, name="kipp-mlx-join").start()


# The backstop: rank 0's init waits for its peers holding the GIL, so no thread of the
# process runs; this process writes the line and kills it, unless its stdin closes first.
_WATCHDOG = """
import os, select, signal, sys
ready, _, _ = select.select([sys.stdin], [], [], float(sys.argv[2]))
if not ready:
    sys.stderr.write(sys.argv[3] + chr(10))
    sys.stderr.flush()
    os.kill(int(sys.argv[1]), signal.SIGKILL)
"""


def _watchdog_process(timeout_s: float, line: str):
    import subprocess

    return subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(timeout_s),
                             f"kipp: distributed group broken: {line}"], stdin=subprocess.PIPE)


def _where(hosts, rank: int) -> str:
    return ", ".join(hosts[rank]) if 0 <= rank < len(hosts) else "address unknown"


# -- the step channel -------------------------------------------------------------------------

class Link:
    """This rank's end of the group (module docstring). Thread-safe: the leader's keep-alive
    thread and its scheduler share it under one lock, so the ranks' collectives keep one
    order."""

    def __init__(self, world, rank: int, hosts: list[list[str]], shard: Shard | None = None):
        self.world, self.rank, self.hosts = world, rank, hosts
        self.shard = shard  # what this rank holds (plan_shard), for its backend
        self.size = len(hosts)
        self.leader = rank == 0
        self.lock = threading.RLock()
        self._last = time.monotonic()
        self._stopped = False
        self._keepalive: threading.Thread | None = None
        self._inflight: tuple[str, float] | None = None  # what the ranks are doing, since when

    # -- the leader ---------------------------------------------------------------------------

    def step(self, inputs, run: Callable[[], object]):
        """Share one round's inputs (kipp.apple.backend.RoundInputs), then `run()` it (every
        rank runs the same round), under the lock; returns what `run` returns."""
        with self.lock:
            words = encode(inputs)
            self._guard("sharing a round", lambda: self._send(Command.STEP, words), timed=True)
            result = self._guard("running a round", run, timed=True)
            self._last = time.monotonic()
            return result

    def barrier(self) -> None:
        """Every rank has its shard ready (MLXBackend's last step): so no round waits for a
        rank still loading, under the join's timeout."""
        ready = threading.Event()
        _watchdog(ready, JOIN_TIMEOUT_S, f"rank {self.rank} of {self.size}: the other ranks "
                                         f"did not load within {JOIN_TIMEOUT_S:.0f} s")
        self._guard("waiting for every rank to load", lambda: self._all_sum(np.ones(1, np.int32)))
        ready.set()

    def start_keepalive(self) -> None:
        """The leader's idle keep-alives (a daemon thread): the other ranks hear within
        KEEPALIVE_S, and a dead rank is noticed while nothing is asked."""
        if self.leader and self._keepalive is None:
            self._keepalive = threading.Thread(target=self._keep_alive, daemon=True,
                                               name="kipp-mlx-keepalive")
            self._keepalive.start()
            threading.Thread(target=self._watch_stalls, daemon=True,
                             name="kipp-mlx-stalls").start()

    def _watch_stalls(self, stall_s: float = STALL_S) -> None:
        """A collective over a dead peer mostly fails at once, but not always: one that has
        not finished within `stall_s` ends the group too."""
        while not self._stopped:
            time.sleep(min(0.5, stall_s / 4))
            inflight = self._inflight
            if inflight is not None and time.monotonic() - inflight[1] > stall_s:
                self._broken(f"{inflight[0]} (no answer within {stall_s:.0f} s)", None)

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
        """Tell the other ranks to leave their loop (they exit 0)."""
        with self.lock:
            if self._stopped:
                return
            self._stopped = True
            if self.leader:
                self._guard("stopping the group", lambda: self._send(Command.STOP))

    def _send(self, command: Command, words: np.ndarray | None = None) -> None:
        header = np.zeros(HEADER, np.int32)
        header[0], header[1] = command, 0 if words is None else len(words)
        self._all_sum(header)
        if words is not None:
            self._all_sum(words)

    def _all_sum(self, words: np.ndarray) -> np.ndarray:
        import mlx.core as mx

        total = mx.distributed.all_sum(mx.array(words), group=self.world, stream=mx.cpu)
        mx.eval(total)
        return np.array(total)

    # -- a follower -----------------------------------------------------------------------------

    def receive(self):
        """(Command, RoundInputs or None): the leader's next message (its words plus zeros)."""
        header = self._guard("waiting for rank 0",
                             lambda: self._all_sum(np.zeros(HEADER, np.int32)))
        self._last = time.monotonic()
        command = Command(int(header[0]))
        if command is not Command.STEP:
            return command, None
        words = self._guard("receiving a round",
                            lambda: self._all_sum(np.zeros(int(header[1]), np.int32)))
        return command, decode(words)

    def watch_silence(self, silence_s: float = SILENCE_S) -> None:
        """A follower's watchdog (a daemon thread): nothing from the leader for `silence_s`
        while it sends every KEEPALIVE_S means the leader is stuck: exit."""
        def watch():
            while not self._stopped:
                time.sleep(min(1.0, silence_s / 4))
                if not self._stopped and time.monotonic() - self._last > silence_s:
                    self._broken(f"hearing nothing from rank 0 for {silence_s:.0f} s", None)

        threading.Thread(target=watch, daemon=True, name="kipp-mlx-watch").start()

    # -- failures -------------------------------------------------------------------------------

    def _guard(self, what: str, action: Callable[[], object], timed: bool = False):
        """`action()`; a failure ends the group. `timed`: the leader's stall watchdog ends it
        too if the action has not finished within STALL_S (a round, not a wait)."""
        if timed:
            self._inflight = (what, time.monotonic())
        try:
            return action()
        except Exception as e:  # RuntimeError: [ring] connection to a peer was lost
            log.debug("distributed failure while %s", what, exc_info=True)
            self._broken(what, e)
        finally:
            self._inflight = None

    def _broken(self, what: str, error: Exception | None) -> None:
        _exit(f"rank {self.rank} of {self.size}: lost {self.lost()} while {what}"
              + (f": {_first_line(error)}" if error is not None else ""))

    def lost(self) -> str:
        """The peer this rank lost: the other one of two; of more, its ring neighbours (a ring
        rank talks only to them, so one of them is gone or cut off)."""
        if self.size == 2:
            other = 1 - self.rank
            return f"rank {other} ({_where(self.hosts, other)})"
        left, right = (self.rank - 1) % self.size, (self.rank + 1) % self.size
        return (f"a peer (ring neighbours rank {left} ({_where(self.hosts, left)}) and rank "
                f"{right} ({_where(self.hosts, right)}))")


def follow(backend) -> None:
    """A follower's loop: run every round the leader shares, until it says STOP."""
    link = backend.link
    link.watch_silence()
    while True:
        command, inputs = link.receive()
        if command is Command.STOP:
            link._stopped = True
            return
        if command is Command.STEP:
            link._guard("running a round", lambda: backend.run(inputs))


# -- a round's inputs as int32 words ------------------------------------------------------------

def encode(inputs) -> np.ndarray:
    """RoundInputs as one int32 vector: T, pieces, R, table width (0: no tables), then the
    tokens, positions and slots, each piece's (first row, tokens, visible count, visible slots),
    the logit rows, and the kernels' tables and lengths."""
    if inputs.adapters:
        raise KippError("a distributed round cannot carry LoRA adapter rows")
    width = 0 if inputs.tables is None else inputs.tables.shape[1]
    parts = [[len(inputs.tokens), len(inputs.spans), len(inputs.rows), width],
             inputs.tokens, inputs.positions, inputs.slots]
    for start, n, visible in inputs.spans:
        parts += [[start, n, len(visible)], visible]
    parts.append(inputs.rows)
    if width:
        parts += [inputs.tables.reshape(-1), inputs.lengths]
    return np.concatenate([np.asarray(p, np.int64) for p in parts]).astype(np.int32)


def decode(words: np.ndarray):
    """The RoundInputs `encode` wrote."""
    from kipp.apple.backend import RoundInputs

    words = np.asarray(words, np.int64)
    t, pieces, r, width = (int(v) for v in words[:4])
    at = 4

    def take(n):
        nonlocal at
        at += n
        return words[at - n:at]

    tokens, positions, slots = take(t), take(t), take(t).astype(np.int32)
    spans = []
    for _ in range(pieces):
        start, n, count = (int(v) for v in take(3))
        spans.append((start, n, take(count).astype(np.int32)))
    inputs = RoundInputs(tokens, positions, slots, spans, take(r).astype(np.int32))
    if width:
        inputs.tables = take(pieces * width).astype(np.int32).reshape(pieces, width)
        inputs.lengths = take(pieces).astype(np.int32)
    if at != len(words):
        raise KippError(f"a round's inputs of {len(words)} words held {at}")
    return inputs


# -- one round on a rank ----------------------------------------------------------------------

def run_round(backend, r):
    """Run round `r` (kipp.apple.forward.Round) on this rank's shard, evaluated with its slab:
    the logits on rank 0, None elsewhere. Every rank of the group runs it at once."""
    import mlx.core as mx

    from kipp.apple import forward

    shard, w, ops = backend.shard, backend.weights, backend.ops
    k, v = backend.k_cache, backend.v_cache
    slabs = [*k.arrays(), *v.arrays()]
    world = None if backend.link is None else backend.link.world
    if shard.ranks > 1 and world is None:
        raise KippError(f"{shard.describe()} has no link to the other ranks")
    if shard.parallel is Parallel.TENSOR:
        reduce = None if shard.ranks == 1 else (
            lambda y: mx.distributed.all_sum(y, group=world, stream=mx.cpu))
        x = forward.layers(w, k, v, r, ops, r.x, reduce)
        if not shard.holds_head:
            mx.eval(x, *slabs)  # its all_sums are the other ranks' too
            return None
        logits = forward.head(w, x, r, ops)
        mx.eval(logits, *slabs)
        return logits
    shape = (r.slots.shape[0], backend.entry.hidden)
    x = r.x if shard.embeds else mx.distributed.recv(shape, mx.float32, shard.rank - 1,
                                                     group=world, stream=mx.cpu)
    x = forward.layers(w, k, v, r, ops, x)
    if shard.ranks > 1:  # on to the next stage; the last hands it back to rank 0
        x = mx.distributed.send(x, (shard.rank + 1) % shard.ranks, group=world, stream=mx.cpu)
    mx.eval(x, *slabs)
    if not shard.holds_head:
        return None
    if shard.ranks > 1:
        x = mx.distributed.recv(shape, mx.float32, shard.ranks - 1, group=world, stream=mx.cpu)
    logits = forward.head(w, x, r, ops)
    mx.eval(logits)
    return logits


class Emulation:
    """Every rank's shard in one process, run as the group runs them: the same shard shapes,
    the partial sums added in rank order (for two ranks, what the ring's all_sum computes),
    the pipeline's stages one after the other. `eval` as a Backend's; for checks."""

    def __init__(self, artifact, num_blocks: int, ranks: int,
                 parallel: str | Parallel = Parallel.TENSOR, **options):
        from kipp.apple.backend import MLXBackend

        shards = [plan_shard(artifact.entry, rank, ranks, parallel) for rank in range(ranks)]
        self.parallel = shards[0].parallel
        self.ranks = [MLXBackend(artifact, num_blocks, shard=s, **options) for s in shards]
        self.num_blocks = num_blocks

    def eval(self, items) -> list[np.ndarray]:
        from kipp.engine.rounds import plan_rounds
        from kipp.formats.registry import VOCAB_SIZE

        lead = self.ranks[0]
        lead.check(items)
        outputs = [np.empty((item.logits_rows, VOCAB_SIZE), np.float32) for item in items]
        for pieces in plan_rounds(items, lead.max_round_tokens):
            inputs, dests = lead._plan(items, pieces)
            host = np.asarray(self._run(inputs))
            for row, (item, index) in enumerate(dests):
                outputs[item][index] = host[row]
        return outputs

    def _run(self, inputs):
        import mlx.core as mx

        from kipp.apple import forward

        rounds = [rank._round(inputs) for rank in self.ranks]
        x = rounds[0].x
        if self.parallel is Parallel.PIPELINE:
            for rank, r in zip(self.ranks, rounds):
                x = forward.layers(rank.weights, rank.k_cache, rank.v_cache, r, rank.ops, x)
                mx.eval(x, *_slabs(rank))
        else:
            for index in range(len(self.ranks[0].weights.layers)):
                x = x + _in_rank_order([forward.attention_out(
                    index, rank.weights.layers[index], x, rank.k_cache, rank.v_cache, r, rank.ops)
                    for rank, r in zip(self.ranks, rounds)])
                x = x + _in_rank_order([forward.ffn_out(rank.weights.layers[index], x, r,
                                                        rank.ops)
                                        for rank, r in zip(self.ranks, rounds)])
        lead = self.ranks[0]
        logits = forward.head(lead.weights, x, rounds[0], lead.ops)
        mx.eval(logits, *(a for rank in self.ranks for a in _slabs(rank)))
        return logits


def _in_rank_order(parts):
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _slabs(backend) -> list:
    return [*backend.k_cache.arrays(), *backend.v_cache.arrays()]


# -- failures -----------------------------------------------------------------------------------

def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _exit(line: str) -> None:
    """The group cannot go on (every round needs every rank): one line on stderr, then exit
    at once."""
    sys.stderr.write(f"kipp: distributed group broken: {line}\n")
    sys.stderr.flush()  # not logging.shutdown: it waits for a handler lock another thread may hold
    os._exit(EXIT_GROUP_BROKEN)


# -- a group's self-check: python -m kipp.apple.distributed ARTIFACT --dump OUT.npz ------------

def check_steps(backend, prompt_len: int = 20, decode_steps: int = 3, repeat: int = 0,
                ready: Path | None = None) -> dict:
    """Two sequences prefilled in one round (every prompt row's logits), then decoded greedily
    together `decode_steps` times: {"step0": logits, ..., "tokens": [steps, 2]}. Then `ready`
    is touched and the first sequence's last position is evaluated `repeat` more times (a run
    long enough to kill a rank in)."""
    from kipp.backend import EvalItem, blocks_needed

    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(0, 151_643, n)) for n in (prompt_len, 7)]
    per = blocks_needed(prompt_len + decode_steps + 1)
    tables = [tuple(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    logits = backend.eval([EvalItem(p, 0, t, logits_rows=len(p)) for p, t in zip(prompts, tables)])
    out, chosen = {"step0": np.concatenate(logits)}, []
    lengths = [len(p) for p in prompts]
    for step in range(1, decode_steps + 1):
        tokens = [int(np.argmax(rows[-1])) for rows in logits]
        chosen.append(tokens)
        logits = backend.eval([EvalItem((token,), n, t)
                               for token, n, t in zip(tokens, lengths, tables)])
        out[f"step{step}"] = np.concatenate(logits)
        lengths = [n + 1 for n in lengths]
    out["tokens"] = np.asarray(chosen, np.int64)
    if ready is not None:
        ready.touch()
    for _ in range(repeat):
        backend.eval([EvalItem((chosen[-1][0],), lengths[0] - 1, tables[0])])
    return out


def shard_facts(backend) -> dict:
    """What a rank holds: its layers, its first layer's Q/K/V rows, its slab's KV heads, its
    weight and KV bytes, and this process's peak RSS."""
    import resource

    layer = backend.weights.layers[0]
    rows = layer["qkv"].rows if "qkv" in layer else sum(layer[n].rows for n in ("q", "k", "v"))
    rss_unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, else KiB
    return {"layers": len(backend.weights.layers), "qkv_rows": rows,
            "kv_heads": backend.ops.kv_heads, "head": backend.weights.head is not None,
            "weight_bytes": backend.weight_bytes,
            "kv_bytes": backend.k_cache.nbytes + backend.v_cache.nbytes,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * rss_unit}


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kipp.apple.distributed",
        description="One rank of an MLX group's self-check (the rank and hostfile from "
                    "MLX_RANK and MLX_HOSTFILE, as mlx.launch sets them): rank 0 runs two "
                    "sequences' prefill and greedy decode and writes their logits to --dump; "
                    "every rank writes what it holds beside it.")
    parser.add_argument("artifact")
    parser.add_argument("--dump", required=True, help="rank 0's .npz (rank i: OUT.rank<i>.npz)")
    parser.add_argument("--parallel", choices=[p.value for p in Parallel], default="tensor")
    parser.add_argument("--kv-tokens", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=20)
    parser.add_argument("--decode-steps", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=0, help="decode steps more, unrecorded")
    parser.add_argument("--join-timeout", type=float, default=JOIN_TIMEOUT_S)
    args = parser.parse_args(argv)
    backend = _open_rank(args.artifact, args.parallel, args.kv_tokens, args.join_timeout)
    dump = Path(args.dump)
    link = backend.link
    if link.leader:
        try:
            out = check_steps(backend, args.prompt_len, args.decode_steps, args.repeat,
                              ready=dump.with_suffix(".ready"))
        finally:
            link.stop()
        np.savez(dump, **out, **shard_facts(backend))
    else:
        dump.with_suffix(f".rank{link.rank}.ready").touch()
        follow(backend)
        np.savez(dump.with_suffix(f".rank{link.rank}.npz"), **shard_facts(backend))
    return 0


def _open_rank(path: str, parallel: str, kv_tokens: int, join_timeout_s: float):
    """This rank's MLXBackend, as kipp.load(..., backend="mlx", distributed=True) opens it."""
    from kipp.apple.backend import MLXBackend
    from kipp.backend import blocks_needed
    from kipp.formats.artifact import open_artifact

    group = Group.resolve(join_timeout_s=join_timeout_s)
    artifact = open_artifact(path)
    shard = plan_shard(artifact.entry, group.rank, group.size, parallel)
    link = join(group, shard)
    backend = MLXBackend(artifact, blocks_needed(kv_tokens), shard=shard, link=link)
    link.start_keepalive()
    return backend


if __name__ == "__main__":
    # run as kipp.apple.distributed, not as a second copy named __main__ (whose Parallel and
    # Command enums would not be the ones the backend compares with)
    from kipp.apple.distributed import main as _main

    sys.exit(_main())
