"""MLXBackend: Kipp's backend on MLX. Metal kernels on Apple silicon, MLX-op twins elsewhere.

    backend = MLXBackend(open_artifact("tiny.gguf"), num_blocks=64)  # or kipp.load(..., "mlx")
    backend.describe()  # 'mlx (MLX-op twins on cpu: no Metal device (...); f32 weights from
                        #  the bf16 artifact (auto: the ... float32 copy fits the budget ...),
                        #  2 CPU streams)'
    [logits] = backend.eval([EvalItem((9707, 11, 1879), 0, (5, 2))])

At load the path is chosen once (kipp.apple.select; an injected `kernel_runner`,
kipp.apple.metal, means the kernel path). There every Metal kernel variant the checkpoint uses
is probed against its twin, run by that same runner (kipp.apple.probe); one that fails is
replaced by its twin with a warning (fallback=False or KIPP_KERNEL_FALLBACK=0 raise instead).
The weights are prepared once in the path's layout (kipp.apple.layout) and the KV slab
allocated once (kipp.apple.kvcache). `eval` splits the items into rounds (kipp.engine.rounds),
builds one lazy MLX graph per round, and evaluates the requested logits with the slab.
With a `shard` (kipp.apple.distributed.Shard) the backend holds one rank's share of the
model, prepared from views of the artifact's shard rows and columns; its `link` shares each
round's inputs with the other ranks, which run the same round.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kipp import memory, probe
from kipp.apple import select
from kipp.backend import KV_BLOCK, Backend, EvalItem, blocks_needed
from kipp.engine.rounds import Piece, plan_rounds
from kipp.errors import KippError
from kipp.formats.artifact import Artifact
from kipp.formats.registry import KV_HEADS
from kipp.rope import rope_tables

try:  # kipp.model imports make_backend on any machine; MLX itself may be missing
    import mlx.core as mx

    from kipp.apple import forward, layout
    from kipp.apple.kvcache import KVSlab
except ImportError as e:
    _MLX_MISSING: ImportError | None = e
else:
    _MLX_MISSING = None

log = logging.getLogger("kipp.apple")

MAX_ROUND_TOKENS = 512  # bounds a round's activations and attention scores
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
NORMS = ("attn_norm", "q_norm", "k_norm", "ffn_norm")


class MLXBackend(Backend):
    """Qwen3 on MLX (see module docstring). Not thread-safe: one caller at a time."""

    name = "mlx"
    supports_adapters = True  # LoRA: kipp.apple.linear.low_rank beside every projection

    def __init__(self, artifact: Artifact, num_blocks: int, *, path: str = "auto",
                 kv_scheme: str = "bf16", max_round_tokens: int = MAX_ROUND_TOKENS,
                 weight_memory: str = "auto", fallback: bool | None = None,
                 kernel_runner=None, shard=None, link=None):
        entry = artifact.entry
        super().__init__(num_blocks, entry.context_length)
        if max_round_tokens < 1:
            raise KippError(f"max_round_tokens must be positive, got {max_round_tokens}")
        if link is not None and shard is None:
            raise KippError("a distributed MLXBackend needs its shard")
        self.entry, self.scheme, self.artifact = entry, artifact.scheme, artifact
        self.head_rows = artifact.weights.output.shape[0]  # the ids its logits score
        self.shard, self.link = shard, link  # kipp.apple.distributed: one rank of a group
        # this process's share of the weights: views of the mapped artifact, never copies
        own = artifact if shard is None else shard.view(artifact)
        kv_heads = KV_HEADS if shard is None else shard.kv_heads
        self.choice = _choose(path, kernel_runner)
        gpu = mx.default_device() == mx.gpu
        self.device = "gpu" if gpu else "cpu"
        self.max_round_tokens = max_round_tokens
        self.kv_scheme = kv_scheme
        self._adapter_slots: dict[str, int] = {}
        self._ranks: dict[int, int] = {}  # stacked LoRA slot -> its adapter's rank
        fallback = probe.fallback_enabled(fallback)
        # The kernels read the stored format, and so do the twins that replace them (a GPU)
        self.memory = memory.choose_weight_memory(
            weight_memory, gpu=gpu or self.choice.kernels, float32_bytes=_float32_bytes(own))
        self.kernels = (self._probe(fallback, kernel_runner, own) if self.choice.kernels
                        else probe.KernelReport())
        # a probe at a shard's shape ("matvec/q8_0@1024x1024") that fails: the variant's twin
        twins = {name.split("@")[0] for name in self.kernels.fell_back}
        self.ops = forward.Ops(self.choice.kernels, select.cpu_streams(gpu), kernel_runner,
                               frozenset(twins), kv_heads)
        start = time.perf_counter()
        self.weights = _prepare(own, self.choice.kernels, len(self.ops.streams),
                                self.memory.mode == "stored",
                                head=shard is None or shard.holds_head)
        slots = num_blocks * KV_BLOCK
        self.k_cache = KVSlab(len(own.weights.layers), slots, kv_scheme, kv_heads)
        self.v_cache = KVSlab(len(own.weights.layers), slots, kv_scheme, kv_heads)
        mx.clear_cache()  # the packing's scratch buffers, freed: back to the OS
        memory.trim_heap()
        if link is not None:
            link.barrier()  # every rank's shard is ready before rank 0 shares a round
        log.info("%s (weights prepared in %.1f s)", self.describe(), time.perf_counter() - start)

    def _probe(self, fallback: bool, runner, own: Artifact) -> probe.KernelReport:
        """Every kernel variant this checkpoint uses, against its twin (kipp.apple.probe), run
        by `runner` (kipp.apple.metal; None: MLX on Metal), which is part of the cache key.
        A shard's projections are probed at the shard's own shapes too, and decode attention
        at its heads."""
        from kipp.apple import probe as probes

        heads = (self.entry.query_heads, KV_HEADS) if self.shard is None else (
            self.shard.query_heads[1] - self.shard.query_heads[0], self.shard.kv_heads)
        checks = probes.probes(self.scheme.name, self.kv_scheme, heads[0], runner=runner,
                               kv_heads=heads[1])
        shapes = ()
        if self.shard is not None:
            shapes, shaped = self.shard.probes(own, runner)
            checks += shaped
        # the runner and the kernels' sources are part of the key: a test that plants a fault
        # in a source, or runs the kernels another way, meets kernels not probed yet
        key = ("mlx", str(mx.default_device()), runner, probes.sources(self.scheme.name,
                                                                       self.kv_scheme), shapes,
               heads)
        report = probe.run_probes(checks, key, fallback, log)
        log.info("kernel probes: %s (%.2f s)", report.summary(), report.seconds)
        return report

    def describe(self) -> str:
        if self.choice.kernels:
            layout = f"{self.scheme.name} weights as stored; {self.kernels.summary()}"
        else:
            layout = f"{_twin_layout(self.scheme.name, self.memory.mode)} ({self.memory.reason})"
        streams = len(self.ops.streams)
        where = f", {streams} CPU streams" if self.device == "cpu" and streams > 1 else ""
        kv = "" if self.kv_scheme == "bf16" else f", {self.kv_scheme} KV"
        rank = "" if self.shard is None else f"; {self.shard.describe()}"
        return (f"mlx ({self.choice.label} on {self.device}: {self.choice.reason}; "
                f"{layout}{where}{kv}{rank})")

    def kernel_report(self) -> probe.KernelReport:
        return self.kernels

    supports_kv_io = True

    def kv_identity(self) -> str:
        return (f"mlx {mx.__version__} {self.device} {self.choice.label} "
                f"{self.scheme.name} {self.memory.mode} streams={len(self.ops.streams)} "
                f"kernels={sorted(self.kernels.running)} twins={sorted(self.kernels.fell_back)}")

    @property
    def kv_block_bytes(self) -> int:
        return KV_BLOCK * (self.k_cache.nbytes + self.v_cache.nbytes) // (
            self.num_blocks * KV_BLOCK)

    def read_blocks(self, block_ids: Sequence[int]):
        return self._read_split_blocks(self.k_cache, self.v_cache, block_ids)

    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        self._write_split_blocks(self.k_cache, self.v_cache, block_ids, payloads)

    @property
    def weight_bytes(self) -> int:
        """Bytes of prepared weights (projections, head, norms)."""
        return sum(a.nbytes for a in _arrays(self.weights))

    def eval(self, items: Sequence[EvalItem]) -> list[np.ndarray]:
        self.check(items)
        outputs = [np.empty((item.logits_rows, self.head_rows), np.float32) for item in items]
        for pieces in plan_rounds(items, self.max_round_tokens):
            inputs, dests = self._plan(items, pieces)
            if self.link is not None:  # the other ranks run the same round on the same inputs
                logits = self.link.step(inputs, lambda: self.run(inputs))
            else:
                logits = self.run(inputs)
            if dests:
                host = np.asarray(logits)
                for row, (item, index) in enumerate(dests):
                    outputs[item][index] = host[row]
        return outputs

    def run(self, inputs: "RoundInputs") -> "mx.array | None":
        """One round, evaluated with the slab: its logits (None on a rank without the head)."""
        r = self._round(inputs)
        if self.shard is not None:
            return self.shard.run(self, r)
        logits = forward.step(self.weights, self.k_cache, self.v_cache, r, self.ops)
        mx.eval(logits, *self.k_cache.arrays(), *self.v_cache.arrays())
        return logits

    def _adapters_changed(self) -> None:
        """The loaded adapters stacked per layer (kipp.lora.apply.stack_adapters) as MLX
        arrays in Weights.lora, float32."""
        from kipp.lora.apply import stack_adapters

        self._adapter_slots, stacked = stack_adapters(self.adapters, self.entry)
        self._ranks = {s: self.adapters[n].rank for n, s in self._adapter_slots.items()}
        if not stacked:
            self.weights.lora = None
            return
        self.weights.lora = [{proj: (mx.array(a[layer]), mx.array(b[layer]))
                              for proj, (a, b) in stacked.items()}
                             for layer in range(self.entry.layers)]
        mx.eval([x for layer in self.weights.lora for pair in layer.values() for x in pair])

    def _round_adapters(self, items, pieces) -> dict:
        """Round's LoRA fields: adapter_rows [T, N] one-hot index of each token row into
        adapter_active (the N stacked slots the round reads, kipp.lora.apply.round_adapters)
        and adapter_rank (the ranks it reads); none when no piece runs under an adapter."""
        from kipp.lora.apply import round_adapters

        names = [items[p.item].adapter for p in pieces]
        active, rank = round_adapters(names, self._adapter_slots, self._ranks)
        if not active:
            return {}
        index = {slot: i for i, slot in enumerate(active)}
        rows = []
        for p, name in zip(pieces, names):
            rows += [index[self._adapter_slots[name]] if name is not None else -1] * (
                p.stop - p.start)
        hot = np.asarray(rows)[:, None] == np.arange(len(active))[None, :]
        return dict(adapter_rows=mx.array(hot.astype(np.float32)),
                    adapter_active=forward.as_int32(active), adapter_rank=rank)

    def _plan(self, items: Sequence[EvalItem], pieces: Sequence[Piece]):
        """The one place items become a round's inputs: (RoundInputs, [(item, output row)] per
        logits row)."""
        tokens, positions, slots, spans, rows, dests = [], [], [], [], [], []
        row = 0
        for p in pieces:
            item = items[p.item]
            n = p.stop - p.start
            pos = np.arange(item.start_position + p.start, item.start_position + p.stop)
            visible = item.slots(0, item.start_position + p.stop)
            tokens.append(np.asarray(item.tokens[p.start:p.stop], np.int64))
            positions.append(pos)
            slots.append(visible[pos])
            spans.append((row, n, np.asarray(visible, np.int32)))
            first = len(item.tokens) - item.logits_rows
            for t in range(max(p.start, first), p.stop):
                rows.append(row + t - p.start)
                dests.append((p.item, t - first))
            row += n
        inputs = RoundInputs(np.concatenate(tokens), np.concatenate(positions),
                             np.concatenate(slots).astype(np.int32), spans,
                             np.asarray(rows if rows else [0], np.int32),
                             adapters=self._round_adapters(items, pieces))
        if inputs.decode_only and self.choice.kernels:
            blocks = [blocks_needed(len(v)) for _, _, v in spans]
            tables = np.zeros((len(pieces), max(blocks)), np.int32)  # 0-padded: never read
            for s, (p, used) in enumerate(zip(pieces, blocks)):
                tables[s, :used] = items[p.item].block_table[:used]
            inputs.tables = tables
            inputs.lengths = np.asarray([len(v) for _, _, v in spans], np.int32)
        return inputs, dests

    def _pack(self, items: Sequence[EvalItem], pieces: Sequence[Piece]):
        """(Round, [(item, output row)] per logits row): _plan's inputs as MLX arrays."""
        inputs, dests = self._plan(items, pieces)
        return self._round(inputs), dests

    def _round(self, inputs: "RoundInputs") -> forward.Round:
        """A round's inputs as MLX arrays. A pipeline stage after the first gets its hidden
        state from the stage before it, so it looks up no embedding."""
        embeds = self.shard is None or self.shard.embeds
        x = (self.artifact.weights.token_embd.bf16()[inputs.tokens].astype(np.float32)
             if embeds else None)
        cos, sin = rope_tables(inputs.positions, self.entry.rope_theta)
        r = forward.Round(
            x=None if x is None else mx.array(x), cos=mx.array(cos), sin=mx.array(sin),
            slots=forward.as_int32(inputs.slots),
            pieces=[(start, n, forward.as_int32(v)) for start, n, v in inputs.spans],
            logit_rows=forward.as_int32(inputs.rows), decode_only=inputs.decode_only,
            **inputs.adapters)
        if inputs.tables is not None:
            r.tables, r.lengths = mx.array(inputs.tables), mx.array(inputs.lengths)
        return r


@dataclass
class RoundInputs:
    """One round's inputs as host arrays: what rank 0 shares with the other ranks."""

    tokens: np.ndarray  # [T] token ids
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T] int32 slab rows this round's K/V go to
    spans: list  # (first token row, tokens, visible slots int32 [P]) per piece
    rows: np.ndarray  # [R] int32 token rows whose logits are returned
    tables: np.ndarray | None = None  # [S, B] int32, kernel decode rounds only
    lengths: np.ndarray | None = None  # [S] int32, kernel decode rounds only
    adapters: dict = field(default_factory=dict)  # Round's LoRA fields (never distributed)

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for _, n, _ in self.spans)


def _choose(path: str, kernel_runner) -> "select.Choice":
    """select.choose_path, except that an injected kernel runner (kipp.apple.metal: the Metal
    emulator, a test's failing kernel) means the kernel path, Metal or not."""
    if kernel_runner is None:
        return select.choose_path(path)
    if path == "twins":
        raise KippError("a kernel runner was given with path='twins'")
    return select.Choice(True, f"kernels run by {getattr(kernel_runner, 'label', kernel_runner)}")



def _twin_layout(scheme: str, mode: str) -> str:
    head = "f32" if mode == "float32" else "bf16 as stored"
    if scheme == "bf16":
        return "f32 weights from the bf16 artifact" if mode == "float32" else \
            "bf16 weights as stored"
    return f"{scheme} weights as MLX affine group-32, {head} head"


def _float32_bytes(artifact: Artifact) -> int:
    """What the float32 twins would hold: BF16 projections and the head widened (quantized
    projections stay in MLX's affine repack either way)."""
    w = artifact.weights
    count = w.output.shape[0] * w.output.shape[1]
    if artifact.scheme.name == "bf16":
        count += sum(getattr(layer, name).shape[0] * getattr(layer, name).shape[1]
                     for layer in w.layers for name in PROJECTIONS)
    return 4 * count


def _prepare(artifact: Artifact, kernels: bool, n_shards: int, stored: bool,
             head: bool = True) -> forward.Weights:
    """Kernels: the seven projections as stored ("q" ... "down"). Twins: "qkv" stacked, "o",
    and "ffn" split tensor-parallel over the streams (kipp.apple.linear), float32 or `stored`.
    Each tensor's mapped pages are released once copied: file and copies are never both
    resident (peak RSS). `head` False: no output head (a rank whose logits nobody reads)."""
    w = artifact.weights
    layers = []
    for layer in w.layers:
        if kernels:
            params = {name: layout.prepare(getattr(layer, name), True) for name in PROJECTIONS}
        else:
            params = {"qkv": layout.prepare_twin([layer.q, layer.k, layer.v], n_shards, stored),
                      "o": layout.prepare_twin([layer.o], n_shards, stored),
                      "ffn": layout.prepare_ffn_twin(layer.gate, layer.up, layer.down, n_shards,
                                                     stored)}
        params.update({name: mx.array(getattr(layer, name).f32()) for name in NORMS})
        mx.eval([a for value in params.values()
                 for a in ([value] if isinstance(value, mx.array) else value.arrays())])
        artifact.release(*(getattr(layer, name) for name in PROJECTIONS))
        layers.append(params)
    # the head is the largest tensor (the 0.6B's: 297 MiB): its rows' pages go as copied
    if not head:
        output = None
    elif kernels:
        output = layout.prepare(w.output, True)
    else:
        output = layout.prepare_twin([w.output], n_shards, stored, artifact.release_view)
    weights = forward.Weights(layers, mx.array(w.output_norm.f32()), output)
    mx.eval(_arrays(weights))
    if head:
        artifact.release(w.output)
    return weights


def _arrays(w: forward.Weights) -> list[mx.array]:
    out = [w.output_norm] + ([] if w.head is None else w.head.arrays())
    for params in w.layers:
        for value in params.values():
            out += [value] if isinstance(value, mx.array) else value.arrays()
    return out


def make_backend(artifact: Artifact, num_blocks: int, **options) -> MLXBackend:
    """The constructor kipp.model uses; raises KippError when MLX is unusable."""
    if _MLX_MISSING is not None:
        raise KippError(f"the MLX backend needs the mlx package (pip install 'kipp[apple]', or "
                        f"'mlx[cpu]' off Apple silicon): {_MLX_MISSING}") from _MLX_MISSING
    try:
        return MLXBackend(artifact, num_blocks, **options)
    except RuntimeError as e:
        raise KippError(f"the MLX backend could not start: {e}") from e
