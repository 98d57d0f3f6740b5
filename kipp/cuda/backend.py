"""JaxBackend: Kipp's backend on JAX. Pallas kernels on a GPU, jax.numpy twins on XLA elsewhere.

    backend = JaxBackend(open_artifact("tiny.gguf"), num_blocks=64)
    backend.describe()  # 'jax (jax.numpy twins on cpu: JAX platform is cpu, no GPU for the
                        #  kernels; f32 weights, bf16 artifact)'
    [logits] = backend.eval([EvalItem((9707, 11, 1879), 0, (5, 2))])

At load the weights are prepared once in the device's layout (kipp.cuda.layout) and the KV slab
is allocated once. `eval` splits the items into rounds (kipp.cuda.rounds), runs one compiled
step per round with the slab donated (updated in place), and copies back only the requested
logits rows. Steps are compiled ahead of time per shape bucket and cached; each compile is
logged with its time, and `compile_log` keeps (bucket, seconds) for benchmarks and tests.
`kv_scheme="q8_0"` keeps the slab as Q8_0 head-rows (kipp.kvquant: int8 and fp16 planes,
136 bytes per row against BF16's 256), quantized in the step and dequantized in attention.
If the Pallas kernels fail to compile on a GPU (the Triton lowering is deprecated upstream and
may break on a newer JAX), the backend logs a warning, switches to the twins for good, and says
so in `describe()`.

Multi-device: pass `mesh` (a jax.sharding.Mesh with one axis, "tp") to shard the model tensor-
parallel over attention heads and the FFN (kipp.cuda.sharding); XLA's partitioner inserts the
collectives. Sharded runs use the twins.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Sequence

import jax
import numpy as np

from kipp import kvquant
from kipp.artifact import Artifact
from kipp.backend import Backend, EvalItem
from kipp.cuda import forward, layout, rounds, select
from kipp.errors import KippError
from kipp.reference import ops as reference_ops
from kipp.registry import HEAD_DIM, KV_BLOCK, KV_HEADS, VOCAB_SIZE

log = logging.getLogger("kipp.cuda")

MAX_ROUND_TOKENS = 512  # tokens per round: bounds the token bucket and activation memory

# Compiled steps, shared by every backend whose parameters, slab and path have the same shapes,
# dtypes and placements (e.g. a checkpoint's schemes in the CPU's float32 layout).
_PROGRAMS: dict[tuple, object] = {}


class JaxBackend(Backend):
    """Qwen3 on JAX (see module docstring). Not thread-safe: one caller at a time."""

    name = "jax"

    def __init__(self, artifact: Artifact, num_blocks: int, *, path: str = "auto",
                 weight_layout: str = "auto", mesh=None, device=None,
                 max_round_tokens: int = MAX_ROUND_TOKENS, kv_scheme: str = "bf16"):
        entry = artifact.entry
        super().__init__(num_blocks, entry.context_length)
        kvquant.row_bytes(kv_scheme)  # rejects an unknown scheme
        self.entry, self.scheme, self.kv_scheme = entry, artifact.scheme, kv_scheme
        self.device = device or (None if mesh is not None else jax.devices()[0])
        platform = (mesh.devices.flat[0] if mesh is not None else self.device).platform
        self.choice = select.choose_path(path, "gpu" if platform in ("gpu", "cuda") else platform)
        if mesh is not None and self.choice.kernels:
            self.choice = select.Choice(False, False, "sharded over a mesh: twins")
        self.layout = (layout.choose_layout(platform, sharded=mesh is not None)
                       if weight_layout == "auto" else weight_layout)
        self.mesh = mesh
        self.max_round_tokens = rounds.bucket_size(max_round_tokens)
        self.compile_log: list[tuple[rounds.Bucket, float]] = []
        self._programs: dict[rounds.Bucket, object] = {}
        start = time.perf_counter()
        self._load(artifact, platform)
        log.info("%s (weights prepared in %.1f s)", self.describe(),
                 time.perf_counter() - start)

    def _load(self, artifact: Artifact, platform: str) -> None:
        if self.layout == "panels":
            from kipp.cuda import cpu_matmul

            usable, why = cpu_matmul.available()
            if platform != "cpu" or self.mesh is not None or not usable:
                raise KippError(f"the panels weight layout needs Kipp's CPU matmul on one CPU "
                                f"device ({why if not usable else platform})")
        params = layout.prepare_weights(artifact, self.layout)
        cos, sin = reference_ops.rope_tables(np.arange(self.entry.context_length),
                                             self.entry.rope_theta)
        shape = (self.num_blocks, KV_BLOCK, KV_HEADS, HEAD_DIM)
        if self.mesh is not None:
            from kipp.cuda import sharding

            self.params = layout.to_device(params, shardings=sharding.param_shardings(
                params, self.mesh))
            kv_sharding, replicated = sharding.kv_sharding(self.mesh), sharding.replicated(
                self.mesh)
        else:
            self.params = layout.to_device(params, self.device)
            kv_sharding = replicated = self.device
        zeros = jax.jit(lambda: layout.kv_zeros(shape, self.kv_scheme, platform),
                        out_shardings=_as_sharding(kv_sharding))
        self.kv = tuple((zeros(), zeros()) for _ in range(self.entry.layers))
        self.rope = jax.device_put((cos, sin), replicated)
        self._replicated = replicated
        self._signature = (self._ops(), _signature(self.params), _signature(self.kv),
                           _signature(self.rope))

    def describe(self) -> str:
        where = "mesh of %d" % self.mesh.size if self.mesh is not None else self.device.platform
        kv = "" if self.kv_scheme == "bf16" else f", {self.kv_scheme} KV"
        weights = ("f32 panel weights, Kipp CPU matmul" if self.layout == "panels"
                   else f"{self.layout} weights")
        return (f"jax ({self.choice.label} on {where}: {self.choice.reason}; "
                f"{weights}, {self.scheme.name} artifact{kv})")

    @property
    def kv_bytes_per_token(self) -> int:
        """KV slab bytes one token takes (all layers, K and V): 136 vs 256 per head-row."""
        return kvquant.bytes_per_token(self.entry.layers, self.kv_scheme)

    @property
    def buckets(self) -> list[rounds.Bucket]:
        """The step shapes this backend has run (each one compiled program)."""
        return sorted(self._programs)

    @property
    def weight_bytes(self) -> int:
        """Bytes of prepared weights on the device (what a decode step streams, plus KV)."""
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self.params))

    def eval(self, items: Sequence[EvalItem]) -> list[np.ndarray]:
        self.check(items)
        outputs = [np.empty((item.logits_rows, VOCAB_SIZE), np.float32) for item in items]
        for pieces in rounds.plan_rounds(items, self.max_round_tokens):
            bucket, arrays, dests = rounds.pack_round(items, pieces, self.num_blocks)
            program = self._program(bucket, arrays)
            logits, self.kv = program(self.params, self.kv, self.rope,
                                      jax.device_put(arrays, self._replicated))
            if dests:
                host = np.asarray(logits)  # [R, vocab]; rows past len(dests) are padding
                for row, (item, index) in enumerate(dests):
                    outputs[item][index] = host[row]
        return outputs

    def _program(self, bucket: rounds.Bucket, arrays: rounds.RoundArrays):
        program = self._programs.get(bucket)
        if program is None:
            program = _PROGRAMS.get((bucket,) + self._signature)
            if program is None:
                program = self._compile_or_fall_back(bucket, arrays)
                _PROGRAMS[(bucket,) + self._signature] = program  # the path actually compiled
            self._programs[bucket] = program
            self._precompile_decode(bucket)
        return program

    def _precompile_decode(self, bucket: rounds.Bucket) -> None:
        """A multi-token round's block width gets its one-token program at once: the first
        decode step at that context, and a cache hit that leaves only a prompt's last token to
        evaluate (kipp.blocks' tails), then never wait on a compile."""
        one = rounds.Bucket(1, 1, 1, bucket.blocks, 1)
        if bucket.tokens > 1 and one not in self._programs:
            self._program(one, rounds.placeholder_arrays(one, self.num_blocks))

    def _compile_or_fall_back(self, bucket: rounds.Bucket, arrays: rounds.RoundArrays):
        if not self.choice.kernels or self.choice.interpret:
            return self._compile(bucket, arrays)
        try:
            return self._compile(bucket, arrays)
        except Exception as e:  # a lowering or Triton compile error, not a user error
            problem = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            log.warning("Pallas kernels failed to compile (%s); running the jax.numpy twins",
                        problem)
            self.choice = select.Choice(False, False, f"kernels failed to compile ({problem})")
            self._programs.clear()
            self._signature = (self._ops(),) + self._signature[1:]
            return self._compile(bucket, arrays)

    def _compile(self, bucket: rounds.Bucket, arrays: rounds.RoundArrays):
        start = time.perf_counter()
        step = jax.jit(functools.partial(forward.step, ops=self._ops()), donate_argnums=(1,))
        program = step.lower(self.params, self.kv, self.rope,
                             jax.device_put(arrays, self._replicated)).compile()
        seconds = time.perf_counter() - start
        self.compile_log.append((bucket, seconds))
        log.info("compiled step %s in %.2f s (%s)", bucket, seconds, self.choice.label)
        return program

    def _ops(self) -> forward.Ops:
        return forward.Ops(kernels=self.choice.kernels, interpret=self.choice.interpret)


def _signature(tree) -> tuple:
    leaves, structure = jax.tree.flatten(tree)
    return (structure,) + tuple((a.shape, a.dtype, a.sharding) for a in leaves)


def _as_sharding(target):
    if target is None or isinstance(target, jax.sharding.Sharding):
        return target
    return jax.sharding.SingleDeviceSharding(target)


def make_backend(artifact: Artifact, num_blocks: int, **options) -> JaxBackend:
    """The constructor kipp.model uses; raises KippError when JAX is unusable."""
    try:
        return JaxBackend(artifact, num_blocks, **options)
    except (ImportError, RuntimeError) as e:
        raise KippError(f"the JAX backend could not start: {e}") from e
