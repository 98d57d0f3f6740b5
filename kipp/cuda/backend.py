"""JaxBackend: Kipp's backend on JAX. Pallas kernels on a GPU, jax.numpy twins on XLA elsewhere.

    backend = JaxBackend(open_artifact("tiny.gguf"), num_blocks=64)
    backend.describe()  # 'jax (jax.numpy twins on cpu: JAX platform is cpu, no GPU for the
                        #  kernels; f32 panel weights, Kipp CPU matmul, ..., bf16 artifact
                        #  (auto: the ... float32 copy fits the budget ...))'
    [logits] = backend.eval([EvalItem((9707, 11, 1879), 0, (5, 2))])

At load the platform's flags are planned once (kipp.cuda.plan), the weights placed tensor by
tensor in the planned layout (kipp.cuda.layout) and the KV slab allocated once
(kipp.cuda.kvcache, BF16 or q8_0). `eval` splits the items into rounds (kipp.cuda.rounds) and
runs one compiled step per shape bucket with the slab donated (updated in place). A Pallas
kernel that fails its probe, or the first step, is replaced by its twin with one warning
(kipp.probe; fallback=False or KIPP_KERNEL_FALLBACK=0 raise instead). `mesh`: tensor parallel
over a one-axis ("tp") jax.sharding.Mesh (kipp.cuda.sharding), on the twins; `link`: that mesh
spans several processes (kipp.cuda.distributed): process 0 broadcasts each step to the others.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Sequence

import jax
import numpy as np

from kipp import memory, probe
from kipp.backend import KV_BLOCK, Backend, EvalError, EvalItem
from kipp.cuda import forward, kvcache, layout, plan, rounds
from kipp.cuda.cpu import stored_matmul as cpu_stored
from kipp.display import step_bar
from kipp.errors import KippError
from kipp.formats import kvquant
from kipp.formats.artifact import Artifact
from kipp.rope import rope_tables

log = logging.getLogger("kipp.cuda")

MAX_ROUND_TOKENS = 512  # tokens per round: bounds the token bucket and activation memory

# Stored weights on a CPU are the choice for memory, so their steps compile with XLA's older CPU
# fusion code generator: a fraction of the compiler's scratch at its peak, decode as fast, the
# logits bitwise the same (tests/test_weight_memory.py). A jaxlib without the option compiles
# as usual (_compile_with).
LEAN_CPU_COMPILE = {"xla_cpu_use_fusion_emitters": False}
_UNKNOWN_OPTIONS: set[str] = set()  # compiler options this process's jaxlib rejected

# Compiled steps, shared by every backend whose parameters, slab and path have the same shapes,
# dtypes and placements (e.g. a checkpoint's schemes in the CPU's float32 layout).
_PROGRAMS: dict[tuple, object] = {}


class JaxBackend(Backend):
    """Qwen3 on JAX (see module docstring). Not thread-safe: one caller at a time."""

    name = "jax"
    supports_adapters = True  # LoRA: forward.low_rank beside every targeted projection
    progress = False  # kipp.load(progress=True) sets it: a progress line per first-call compile

    def __init__(self, artifact: Artifact, num_blocks: int, *, path: str = "auto",
                 weight_memory: str = "auto", weight_layout: str | None = None, mesh=None,
                 device=None, max_round_tokens: int = MAX_ROUND_TOKENS,
                 kv_scheme: str = "bf16", fallback: bool | None = None, link=None,
                 cpu_dot: str | None = None):
        """`cpu_dot`: the dots of Kipp's stored CPU matmul (a $KIPP_JAX_CPU_DOT value, which
        is the default; kipp.cuda.cpu.stored_matmul.dots)."""
        entry = artifact.entry
        super().__init__(num_blocks, entry.context_length)
        kvquant.row_bytes(kv_scheme)  # rejects an unknown scheme
        self.entry, self.scheme, self.kv_scheme = entry, artifact.scheme, kv_scheme
        self.head_rows = artifact.weights.output.shape[0]  # the ids its logits score
        self.device = device or (None if mesh is not None else jax.devices()[0])
        self.mesh = mesh
        self.link = link  # kipp.cuda.distributed.Link: the mesh spans processes
        if link is not None:
            if mesh is None:
                raise ValueError("a distributed JaxBackend needs a mesh over every process")
            self.supports_kv_io = False  # the slab's blocks live in several processes
        from kipp.cuda import sharding

        self.pipelined = sharding.pipelined(mesh)  # mesh axis "pp": layer ranges in stages
        if self.pipelined:
            self.supports_kv_io = False  # the slab's layers live on several devices
            if entry.layers % mesh.shape[sharding.PIPELINE]:
                raise ValueError(f"{entry.layers} layers do not split into "
                                 f"{mesh.shape[sharding.PIPELINE]} equal pipeline stages")
        facts = plan.gather(self.device, mesh)
        chosen = None if plan.explicit_layout(weight_layout) else memory.choose_weight_memory(
            weight_memory, gpu=facts.gpu, float32_bytes=layout.float32_bytes(artifact),
            stored_kernel=plan.stored_kernel(facts, path))
        self.plan = plan.make_plan(facts, scheme=self.scheme.name, path=path,
                                   weight_memory=chosen, weight_layout=weight_layout,
                                   kv_scheme=kv_scheme)
        for warning in self.plan.warnings:
            _warn_once(warning)
        # the plan's flags the rest of Kipp and the tests read off the backend
        self.choice, self.memory, self.layout = (self.plan.choice, self.plan.memory,
                                                 self.plan.layout)
        self.cpu_attention, self.stacked = self.plan.cpu_attention, self.plan.stacked
        # Kipp's CPU attention reads only the positions a query sees: one table width serves
        # every context (rounds.fixed_table_width)
        self._table_width = (rounds.fixed_table_width(num_blocks) if self.cpu_attention
                             else None)
        # $KIPP_JAX_CPU_DOT at load unless named: part of the program key
        self._dot = cpu_stored.dot_mode(cpu_dot)
        # the dots that meet this artifact's weights (its projections' scheme, the BF16 head):
        # what describe() names and what picks the gates' bounds (kipp.gates.bounds)
        self.cpu_dot = (cpu_stored.running(self._dot, (self.scheme.name, "bf16"))
                        if self.plan.cpu_stored else cpu_stored.Dot.F32.value)
        self.stacked = self.stacked or self.pipelined  # the stages split the stacked layers
        self.compiler_options = dict(LEAN_CPU_COMPILE) if self.plan.lean_compile else {}
        self.fallback = probe.fallback_enabled(fallback)
        self.max_round_tokens = rounds.bucket_size(max_round_tokens)
        self.compile_log: list[tuple[rounds.Bucket, float]] = []
        # (bucket, LoRA adapters read, their ranks read) -> the compiled step
        self._programs: dict[tuple[rounds.Bucket, int, int], object] = {}
        start = time.perf_counter()
        self.kernels = self._probe() if self.choice.kernels else probe.KernelReport()
        self._load(artifact)
        if self.plan.first_step and self.kernels.running:
            self._first_step()
        log.info("%s (loaded in %.1f s)", self.describe(), time.perf_counter() - start)

    def _probe(self) -> probe.KernelReport:
        """Every kernel variant the step will run, against its twin (kipp.cuda.probe)."""
        from kipp.cuda import probe as probes

        device = self.device if self.device is not None else jax.devices()[0]
        checks = probes.probes(self.plan.probe_formats, self.kv_scheme, self.entry.query_heads,
                               interpret=self.choice.interpret, device=device)
        key = ("jax", device.platform, getattr(device, "device_kind", ""), self.choice.interpret)
        report = probe.run_probes(checks, key, self.fallback, log)
        log.info("kernel probes: %s (%.2f s)", report.summary(), report.seconds)
        return report

    def _load(self, artifact: Artifact) -> None:
        # positions a sequence reaches: every one holds a slot of the slab (the whole context's
        # table is 40 MiB; Backend.check keeps positions inside the slab)
        self.rope_positions = min(self.entry.context_length, self.num_blocks * KV_BLOCK)
        cos, sin = rope_tables(np.arange(self.rope_positions), self.entry.rope_theta)
        if self.mesh is not None:
            from kipp.cuda import sharding

            mesh = self.mesh
            replicated = sharding.replicated(mesh)
            if self.pipelined:  # stacked layers and slab split by layer ranges over stages
                per_layer = set(layout.PROJECTIONS + layout.NORMS)

                def place(name, value):  # each process places only its own shards
                    return sharding.put(value, sharding.stage_leaf_sharding(name, value, mesh)
                                        if name in per_layer else replicated)
                kv_sharding = sharding.stage_kv_sharding(mesh)
            elif self.link is not None:  # each process places only its own shards
                def place(name, value):
                    return sharding.put(value, sharding.leaf_sharding(name, value, mesh))
                kv_sharding = sharding.kv_sharding(mesh)
            else:
                def place(name, value):
                    return layout.to_device(
                        value, shardings=sharding.leaf_sharding(name, value, mesh))
                kv_sharding = sharding.kv_sharding(mesh)
            self.params = layout.place_weights(artifact, self.layout, place, self.plan.bits,
                                               self.pipelined)
        else:
            self.params = layout.place_weights(artifact, self.layout, lambda name, value: (
                layout.to_device(value, self.device)), self.plan.bits, self.stacked)
            kv_sharding = replicated = self.device
        self._adapter_slots: dict[str, int] = {}
        self._ranks: dict[int, int] = {}  # stacked LoRA slot -> its adapter's rank
        self._kv_zeros = kvcache.slab_maker(self.entry.layers, self.num_blocks, self.kv_scheme,
                                            self.plan.platform, self.stacked, kv_sharding)
        self.kv = self._kv_zeros()
        self.rope = self._put((cos, sin), replicated)
        self._replicated = replicated
        self._signature = (self._ops(), _signature(self.params), _signature(self.kv),
                           _signature(self.rope), tuple(sorted(self.compiler_options.items())))
        memory.trim_heap()  # the host copies and the packing's scratch, freed: back to the OS

    def describe(self) -> str:
        where = "mesh of %d" % self.mesh.size if self.mesh is not None else self.device.platform
        if self.pipelined:
            where = f"pipeline of {self.mesh.size} stages"
        if self.link is not None:
            where += f" over {self.link.processes} processes"
        kv = "" if self.kv_scheme == "bf16" else f", {self.kv_scheme} KV"
        kernels = f"; {self.kernels.summary()}" if self.choice.kernels else ""
        weights = ("f32 panel weights, Kipp CPU matmul" if self.layout == "panels"
                   else f"{self.layout} weights")
        if self.plan.cpu_stored:
            weights += ", Kipp CPU stored matmul"
            if self.cpu_dot != cpu_stored.Dot.F32.value:
                weights += f" ({self.cpu_dot} dot)"
        if self.cpu_attention:
            weights += ", Kipp CPU attention"
        return (f"jax ({self.choice.label} on {where}: {self.choice.reason}; "
                f"{weights}, {self.scheme.name} artifact ({self.memory.reason})"
                f"{kv}{kernels})")

    def kernel_report(self) -> probe.KernelReport:
        return self.kernels

    @property
    def kv_bytes_per_token(self) -> int:
        """KV slab bytes one token takes (all layers, K and V): 136 vs 256 per head-row."""
        return kvquant.bytes_per_token(self.entry.layers, self.kv_scheme)

    @property
    def buckets(self) -> list[rounds.Bucket]:
        """The step shapes this backend has run (compiled programs; LoRA widths aside)."""
        return sorted({bucket for bucket, _, _ in self._programs})

    @property
    def weight_bytes(self) -> int:
        """Bytes of prepared weights on the device (what a decode step streams, plus KV)."""
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self.params))

    supports_kv_io = True

    def kv_identity(self) -> str:
        device = getattr(self.device, "device_kind", "") if self.device is not None else "mesh"
        return (f"jax {jax.__version__} {self.plan.platform} {device} {self.choice.label} "
                f"{self.layout} {self.memory.mode} stacked={self.stacked} {self._ops()!r}")

    @property
    def kv_block_bytes(self) -> int:
        return KV_BLOCK * self.kv_bytes_per_token

    def read_blocks(self, block_ids: Sequence[int]):
        gather, _ = self._block_io()
        parts = [gather(self.kv, ids) for ids in _io_chunks(block_ids)]  # dispatched, async
        axis, n = (1 if self.stacked else 0), len(block_ids)

        def fetch() -> list[bytes]:
            hosts = [[np.asarray(a) for a in jax.tree.leaves(p)] for p in parts]
            return [b"".join(np.take(h, i % kvcache.IO_BLOCKS, axis).tobytes()
                             for h in hosts[i // kvcache.IO_BLOCKS]) for i in range(n)]
        return fetch

    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        _, scatter = self._block_io()
        shapes = kvcache.block_shapes(self.kv, self.stacked)
        sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in shapes]
        if any(len(p) != sum(sizes) for p in payloads):
            raise EvalError(f"a KV block payload is not {sum(sizes)} bytes")
        for start in range(0, len(block_ids), kvcache.IO_BLOCKS):
            chunk = list(payloads[start:start + kvcache.IO_BLOCKS])
            [ids] = _io_chunks(block_ids[start:start + kvcache.IO_BLOCKS])
            chunk += [chunk[-1]] * (kvcache.IO_BLOCKS - len(chunk))  # the padding's own block
            parts, at = [], 0
            for (shape, dtype), size in zip(shapes, sizes):
                parts.append([np.frombuffer(p, dtype, size // np.dtype(dtype).itemsize, at)
                              .reshape(shape) for p in chunk])
                at += size
            self.kv = scatter(self.kv, ids, parts)

    def _block_io(self):
        if getattr(self, "_io", None) is None:
            self._io = kvcache.block_io(self.kv, self.stacked)
        return self._io

    def eval(self, items: Sequence[EvalItem]) -> list[np.ndarray]:
        self.check(items)
        outputs = [np.empty((item.logits_rows, self.head_rows), np.float32) for item in items]
        for pieces in rounds.plan_rounds(items, self.max_round_tokens):
            bucket, arrays, dests = rounds.pack_round(items, pieces, self.num_blocks,
                                                      self._adapter_slots, self._table_width)
            program = self._program(bucket, arrays)
            if self.link is not None:  # the followers run the same step on the same inputs
                logits, self.kv = self.link.step(bucket, arrays,
                                                 lambda: self._run(program, arrays))
            else:
                logits, self.kv = self._run(program, arrays)
            if dests:
                host = _to_host(logits)  # [R, vocab]; rows past len(dests) are padding
                for row, (item, index) in enumerate(dests):
                    outputs[item][index] = host[row]
        return outputs

    def _run(self, program, arrays: rounds.RoundArrays):
        """(logits, KV) of one compiled step. On a CPU the step runs to its end inside
        kipp.memory.large_blocks_returned, so XLA's temporaries (host memory there) go back to
        the OS when freed; a GPU's steps are not waited on here."""
        args = (self.params, self.kv, self.rope, self._round_inputs(arrays))
        if not self.plan.cpu_steps:
            return program(*args)
        with memory.large_blocks_returned():
            logits, kv = program(*args)
            jax.block_until_ready(logits)  # its temporaries were allocated inside
        return logits, kv

    def _round_inputs(self, arrays: rounds.RoundArrays):
        """A round's small host arrays as its step takes them. On one device, as they are:
        the compiled step's own transfer of host arrays costs less than device_put's, whose
        share of a small model's one-token step (a draft model's) is not small; a mesh's step
        takes them placed on every device."""
        if self.mesh is None:
            return arrays
        return self._put(arrays, self._replicated)

    def _program(self, bucket: rounds.Bucket, arrays: rounds.RoundArrays):
        key = (bucket, len(arrays.adapter_active), self._lora_rank(arrays.adapter_active))
        program = self._programs.get(key)
        if program is None:
            program = _PROGRAMS.get(key + self._signature)
            if program is None:
                program = self._compile_or_fall_back(bucket, arrays, key[2])
                _PROGRAMS[key + self._signature] = program  # the path actually compiled
            self._programs[key] = program
            self._precompile_decode(bucket)
        return program

    def _lora_rank(self, active: np.ndarray) -> int:
        """The stacked LoRA ranks a round under these slots reads: the largest of theirs,
        rounded up to a power of two (fewer programs), at most the stacked width."""
        if not len(active):
            return 0
        return min(rounds.bucket_size(max(self._ranks[int(s)] for s in active)),
                   max(self._ranks.values()))

    def _precompile_decode(self, bucket: rounds.Bucket) -> None:
        """A multi-token round's block width gets its one-token program at once: the first
        decode step at that context, and a cache hit that leaves only a prompt's last token to
        evaluate (kipp.engine.blocks' tails), then never wait on a compile."""
        one = rounds.Bucket(1, 1, 1, bucket.blocks, 1)
        if bucket.tokens > 1 and (one, 0, 0) not in self._programs:
            self._program(one, rounds.placeholder_arrays(one, self.num_blocks))

    def _compile_or_fall_back(self, bucket: rounds.Bucket, arrays: rounds.RoundArrays,
                              lora_rank: int):
        if not self.kernels.running or self.choice.interpret:
            return self._compile(bucket, arrays, lora_rank)
        try:
            return self._compile(bucket, arrays, lora_rank)
        except Exception as e:  # a lowering or Triton compile error of the whole step
            self._fall_back(f"the step failed to compile ({probe.one_line(e)})")
            return self._compile(bucket, arrays, lora_rank)

    def _first_step(self) -> None:
        """Compile and run one decode step on the kernels at load, storing nothing (every slot
        past the slab's end is dropped): a kernel that fails only inside the real step, at its
        real shapes, is caught while no session holds KV yet (a runtime fault may take the
        donated slab with it; a fresh one is allocated)."""
        items = [EvalItem((0,), 0, (0,))]
        bucket, arrays, _ = rounds.pack_round(items, rounds.plan_rounds(items, 1)[0],
                                              self.num_blocks, table_width=self._table_width)
        arrays = arrays._replace(slots=np.full_like(arrays.slots, self.num_blocks * KV_BLOCK))
        try:
            logits, self.kv = self._run(self._program(bucket, arrays), arrays)
            jax.block_until_ready(logits)
        except probe.KernelError:
            raise
        except Exception as e:  # a launch or runtime error of a kernel inside the step
            self._fall_back(f"the first step failed ({probe.one_line(e)})")
            self.kv = self._kv_zeros()

    def _fall_back(self, problem: str) -> None:
        """Every kernel still running is replaced by its twin (or KernelError, fallback off)."""
        running = self.kernels.running
        probe.fail(log, ", ".join(running), problem, self.fallback)
        self.kernels.fall_back(running, problem)
        self._programs.clear()
        self._signature = (self._ops(),) + self._signature[1:]

    def _compile(self, bucket: rounds.Bucket, arrays: rounds.RoundArrays, lora_rank: int = 0):
        start = time.perf_counter()
        step = jax.jit(functools.partial(forward.step, ops=self._ops(), lora_rank=lora_rank),
                       donate_argnums=(1,))
        what = f"kipp: compiling the jax step {bucket} (first call of this shape)"
        with step_bar(what, self.progress):
            program = _compile_with(step.lower(self.params, self.kv, self.rope,
                                               self._put(arrays, self._replicated)),
                                    self.compiler_options)
        seconds = time.perf_counter() - start
        memory.trim_heap()  # the compiler's scratch, freed: back to the OS
        self.compile_log.append((bucket, seconds))
        log.info("compiled step %s in %.2f s (%s)", bucket, seconds, self.choice.label)
        return program

    def add_adapter(self, adapter) -> None:
        # the pipeline's stages and the followers of a group never see the stacked adapters
        if self.link is not None or self.pipelined:
            raise EvalError("LoRA adapters are not built for a JAX backend split over "
                            "processes or pipeline stages; load the adapter on one process")
        super().add_adapter(adapter)

    def _adapters_changed(self) -> None:
        """The loaded adapters, stacked (kipp.lora.apply.stack_adapters) into params["lora"]
        beside the base weights, replicated; the step's programs are keyed by the new shapes."""
        from kipp.lora.apply import stack_adapters

        self._adapter_slots, stacked = stack_adapters(self.adapters, self.entry)
        self._ranks = {s: self.adapters[n].rank for n, s in self._adapter_slots.items()}
        self.params.pop("lora", None)
        if stacked:
            self.params["lora"] = jax.device_put(stacked, self._replicated)
        self._programs.clear()
        self._signature = (self._signature[0], _signature(self.params)) + self._signature[2:]

    def _put(self, tree, where):
        if self.link is None and not self.pipelined:
            return jax.device_put(tree, where)
        from kipp.cuda import sharding

        return sharding.put(tree, where)

    def _ops(self) -> forward.Ops:
        # no probed kernel left running: nothing runs a kernel, probed or not
        kernels = self.choice.kernels and bool(self.kernels.running)
        return forward.Ops(kernels=kernels, interpret=self.choice.interpret,
                           twins=frozenset(self.kernels.fell_back),
                           cpu_attention=self.cpu_attention, cpu_stored=self.plan.cpu_stored,
                           cpu_dot=self._dot,
                           pipeline=self.mesh if self.pipelined else None)


def _to_host(logits) -> np.ndarray:
    if logits.is_fully_addressable:
        return np.asarray(logits)
    from kipp.cuda import sharding

    return sharding.to_host(logits)


def _io_chunks(block_ids: Sequence[int]) -> list[np.ndarray]:
    """Block ids in kvcache.IO_BLOCKS-long int32 chunks, the last padded with its last id."""
    out = []
    for start in range(0, len(block_ids), kvcache.IO_BLOCKS):
        ids = list(block_ids[start:start + kvcache.IO_BLOCKS])
        out.append(np.asarray(ids + [ids[-1]] * (kvcache.IO_BLOCKS - len(ids)), np.int32))
    return out


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    log.warning(message)


def _compile_with(lowered: jax.stages.Lowered, options: dict) -> jax.stages.Compiled:
    """lowered.compile() with XLA compiler `options`; if this jaxlib rejects them as unknown
    (Kipp passes one at a time), that is logged once and remembered for the process, and the
    step compiles without them."""
    options = {k: v for k, v in options.items() if k not in _UNKNOWN_OPTIONS}
    if options:
        try:
            return lowered.compile(compiler_options=options)
        except Exception as e:  # jax raises JaxRuntimeError (XlaRuntimeError before 0.4.36)
            if "No such compile option" not in str(e):
                raise
            _UNKNOWN_OPTIONS.update(options)
            log.info("this jaxlib has no compiler option %s: steps compile without it",
                     ", ".join(sorted(options)))
    return lowered.compile()


def _signature(tree) -> tuple:
    leaves, structure = jax.tree.flatten(tree)
    return (structure,) + tuple((a.shape, a.dtype, a.sharding) for a in leaves)


def make_backend(artifact: Artifact, num_blocks: int, **options) -> JaxBackend:
    """The constructor kipp.model uses; raises KippError when JAX is unusable."""
    try:
        return JaxBackend(artifact, num_blocks, **options)
    except (ImportError, RuntimeError) as e:
        raise KippError(f"the JAX backend could not start: {e}") from e
