"""The numpy oracle backend: Qwen3's forward pass read top to bottom, FP32 accumulation.

Per layer, in order: (1) RMSNorm; (2) Q, K, V projections; (3) per-head RMSNorm on Q and K;
(4) RoPE; (5) causal grouped-query attention over the paged KV; (6) output projection and
residual; (7) RMSNorm; (8) down(SiLU(gate(x)) * up(x)); (9) residual. Then the final RMSNorm and
the output head (the embedding when tied) give 151,936 FP32 logits.

With `activations` naming the dots of Kipp's stored CPU matmul ("int8", "bf16", "int8+bf16"),
each projection's input is first rounded as that dot rounds it: to int8 per 32-block for a
quantized projection (ops.int8_rows), to bf16 for a BF16 one and the output head
(ops.bf16_rows): the oracle for a JAX backend that runs those dots (kipp.gates.
gate_vs_reference builds it so).

K and V are rounded to BF16 when stored, exactly as the KV storage contract says (or, with
kv_scheme="q8_0", quantized to Q8_0 head-rows by kipp.formats.kvquant and dequantized on read), and
attention always reads them back from the slab, for prompt and decode tokens alike, so a
token's logits do not depend on whether its prefix was evaluated in this call, an earlier one,
or another sequence whose blocks it adopted. Items of a batch share each weight chunk's
conversion; every row's arithmetic is independent of the others (see ops.linear), so batched
equals isolated bitwise.
"""

from __future__ import annotations

from typing import Sequence

import ml_dtypes
import numpy as np

from kipp.backend import KV_BLOCK, Backend, EvalItem
from kipp.errors import KippError
from kipp.formats import kvquant
from kipp.formats.artifact import Artifact, LayerWeights
from kipp.formats.quant import GGML_BF16, GGML_F32
from kipp.formats.registry import HEAD_DIM, KV_HEADS
from kipp.lora import apply as lora
from kipp.reference import ops


class ReferenceBackend(Backend):
    """The numpy oracle. Weights stay in the mapped artifact; KV is one BF16 (or Q8_0) slab."""

    name = "reference"
    batch_invariant = True  # every row's arithmetic is independent of the others (ops.linear)
    supports_adapters = True  # LoRA: kipp.lora.apply, row by row

    def __init__(self, artifact: Artifact, num_blocks: int, kv_dtype=ml_dtypes.bfloat16,
                 kv_scheme: str = "bf16", activations: str = "f32"):
        """`kv_scheme` "q8_0" stores K/V as Q8_0 head-rows (kipp.formats.kvquant). `kv_dtype`
        float32 is a diagnostic only: with K/V unrounded the reference should match an FP32
        oracle to rounding noise, which shows the BF16 KV is the only gap.
        `activations`: "f32", or the stored CPU matmul's dots whose rounding of a
        projection's input the reference repeats, joined by "+" (module docstring)."""
        entry = artifact.entry
        super().__init__(num_blocks, entry.context_length)
        kvquant.row_bytes(kv_scheme)  # rejects an unknown scheme
        if kv_scheme != "bf16" and kv_dtype != ml_dtypes.bfloat16:
            raise KippError("kv_dtype is a diagnostic of the bf16 KV scheme, not of q8_0")
        self.entry = entry
        self.weights = artifact.weights
        self.scheme = artifact.scheme
        self.kv_scheme = kv_scheme
        self.activations = activations
        slots = num_blocks * KV_BLOCK
        self.k_cache = KVSlab(entry.layers, slots, kv_scheme, kv_dtype)
        self.v_cache = KVSlab(entry.layers, slots, kv_scheme, kv_dtype)
        self._norms = [
            {name: getattr(layer, name).f32() for name in ("attn_norm", "q_norm", "k_norm",
                                                             "ffn_norm")}
            for layer in self.weights.layers
        ]
        self._output_norm = self.weights.output_norm.f32()

    @property
    def activations(self) -> str:
        return self._activations

    @activations.setter
    def activations(self, dots: str) -> None:
        # the rounding of x per weight kind, looked up once here rather than per projection
        self._rounding = ops.activation_rounding(dots)  # rejects an unknown dot
        self._activations = dots

    def describe(self) -> str:
        kv = "" if self.kv_scheme == "bf16" else f", {self.kv_scheme} KV"
        x = f", {self.activations} activations" if self.activations != "f32" else ""
        return f"reference (numpy, {self.scheme.name} weights{x}{kv})"

    @property
    def kv_bytes_per_token(self) -> int:
        """KV slab bytes one token takes (all layers, K and V): 136 vs 256 per head-row."""
        return self.entry.layers * 2 * KV_HEADS * self.k_cache.row_bytes

    supports_kv_io = True

    def kv_identity(self) -> str:
        return f"reference numpy {np.__version__} kv {np.dtype(self.k_cache.dtype).name}"

    @property
    def kv_block_bytes(self) -> int:
        return KV_BLOCK * self.kv_bytes_per_token

    def read_blocks(self, block_ids: Sequence[int]):
        return self._read_split_blocks(self.k_cache, self.v_cache, block_ids)

    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        self._write_split_blocks(self.k_cache, self.v_cache, block_ids, payloads)

    def eval(self, items: Sequence[EvalItem]) -> list[np.ndarray]:
        self.check(items)
        tokens = np.concatenate([np.asarray(item.tokens, np.int64) for item in items])
        x = self.weights.token_embd.bf16()[tokens].astype(np.float32)  # [T, hidden]
        positions = np.concatenate([np.arange(item.start_position, item.end_position)
                                    for item in items])
        cos, sin = ops.rope_tables(positions, self.entry.rope_theta)
        slots = np.concatenate([item.slots(0, item.end_position) for item in items])
        groups = lora.row_groups(items, self.adapters)  # LoRA adapters' token rows
        for index, layer in enumerate(self.weights.layers):
            x = self._layer(index, layer, x, items, cos, sin, slots, groups)
        return self._logits(x, items)

    def _layer(self, index, layer: LayerWeights, x, items, cos, sin, slots, groups=()):
        norms = self._norms[index]
        t = x.shape[0]

        def linear(x, name):  # W x, plus s * B (A x) on the rows of each adapter's items
            return lora.add_low_rank(self._linear(x, getattr(layer, name)), x, groups, index,
                                     name)

        h = ops.rms_norm(x, norms["attn_norm"])                            # (1)
        q = linear(h, "q").reshape(t, -1, HEAD_DIM)                         # (2) [T, H, 128]
        k = linear(h, "k").reshape(t, KV_HEADS, HEAD_DIM)                   #     [T, 8, 128]
        v = linear(h, "v").reshape(t, KV_HEADS, HEAD_DIM)
        q = ops.rms_norm(q, norms["q_norm"])                                # (3)
        k = ops.rms_norm(k, norms["k_norm"])
        q = ops.apply_rope(q, cos, sin)                                     # (4)
        k = ops.apply_rope(k, cos, sin)
        attn = self._attention(index, q, k, v, items, slots)                # (5) [T, H * 128]
        x = x + linear(attn, "o")                                           # (6)
        h = ops.rms_norm(x, norms["ffn_norm"])                              # (7)
        with np.errstate(over="ignore"):  # exp overflow in SiLU of very negative x gives -0
            ffn = ops.silu(linear(h, "gate")) * linear(h, "up")
        return x + linear(ffn, "down")                                      # (8), (9)

    def _attention(self, index, q, k, v, items, slots):
        """Store this call's K/V (BF16 or Q8_0), then attend every token over its visible
        positions."""
        out = np.empty((q.shape[0], q.shape[1] * HEAD_DIM), np.float32)
        row = 0
        for item in items:
            n = len(item.tokens)
            new = item.slots(item.start_position, item.end_position)
            self.k_cache.store(index, new, k[row:row + n])
            self.v_cache.store(index, new, v[row:row + n])
            visible = item.slots(0, item.end_position)
            keys = self.k_cache.load(index, visible)  # [positions, 8, 128] float32
            values = self.v_cache.load(index, visible)
            grouped = q[row:row + n].reshape(n, KV_HEADS, -1, HEAD_DIM)  # [n, 8, group, 128]
            for i in range(n):
                p = item.start_position + i
                out[row + i] = ops.attend(grouped[i], keys[:p + 1], values[:p + 1])
            row += n
        return out

    def _linear(self, x, w) -> np.ndarray:
        """W x, with x rounded first where `activations` names the dot for W's format."""
        kind = "bf16" if w.ggml_type == GGML_BF16 else None if w.ggml_type == GGML_F32 else "q"
        round_rows = self._rounding.get(kind)
        return ops.linear(round_rows(x) if round_rows else x, w)

    def _logits(self, x, items) -> list[np.ndarray]:
        """Final RMSNorm and output head for each item's last logits_rows tokens."""
        ends = np.cumsum([len(item.tokens) for item in items])
        rows = np.concatenate([np.arange(end - item.logits_rows, end)
                               for end, item in zip(ends, items)])
        h = ops.rms_norm(x[rows], self._output_norm)
        logits = self._linear(h, self.weights.output)
        splits = np.cumsum([item.logits_rows for item in items])[:-1]
        return [np.ascontiguousarray(part) for part in np.split(logits, splits)]


class KVSlab:
    """K (or V) of every layer, `[layer, block * 32 + offset, kv head, 128]`, in the slab's
    storage: `values` (BF16), or for q8_0 the planes `q` (int8) and `d` (fp16, [..., 4]).
    np.zeros pages in lazily."""

    def __init__(self, layers: int, slots: int, scheme: str, dtype=ml_dtypes.bfloat16):
        self.scheme = scheme
        shape = (layers, slots, KV_HEADS, HEAD_DIM)
        if scheme == "q8_0":
            self.q = np.zeros(shape, np.int8)
            self.d = np.zeros(shape[:-1] + (kvquant.ROW_BLOCKS,), np.float16)
        else:
            self.values = np.zeros(shape, dtype)

    @property
    def dtype(self):
        return np.int8 if self.scheme == "q8_0" else self.values.dtype

    def planes(self) -> list[np.ndarray]:
        return [self.q, self.d] if self.scheme == "q8_0" else [self.values]

    def block_bytes(self, block: int) -> bytes:
        """Block `block`'s rows of every layer, each plane in turn (a copy)."""
        rows = slice(block * KV_BLOCK, (block + 1) * KV_BLOCK)
        return b"".join(plane[:, rows].tobytes() for plane in self.planes())

    def set_block(self, block: int, data: bytes) -> None:
        """The inverse of block_bytes."""
        rows, at = slice(block * KV_BLOCK, (block + 1) * KV_BLOCK), 0
        for plane in self.planes():
            shape = (plane.shape[0], KV_BLOCK) + plane.shape[2:]
            size = int(np.prod(shape)) * plane.itemsize
            plane[:, rows] = np.frombuffer(data, plane.dtype, size // plane.itemsize,
                                           at).reshape(shape)
            at += size

    @property
    def row_bytes(self) -> int:
        """Bytes of one (token, KV head) row: 136 for q8_0, 256 for BF16."""
        if self.scheme == "q8_0":
            return kvquant.row_bytes("q8_0")
        return HEAD_DIM * self.values.dtype.itemsize

    def store(self, layer: int, slots: np.ndarray, rows: np.ndarray) -> None:
        """Write float32 rows [n, 8, 128] at `slots`, rounded to the slab's format."""
        if self.scheme == "q8_0":
            self.q[layer, slots], self.d[layer, slots] = kvquant.quantize(rows)
        else:
            self.values[layer, slots] = rows.astype(self.values.dtype)

    def load(self, layer: int, slots: np.ndarray) -> np.ndarray:
        """The rows at `slots` as float32 [n, 8, 128]."""
        if self.scheme == "q8_0":
            return kvquant.dequantize(self.q[layer, slots], self.d[layer, slots])
        return self.values[layer, slots].astype(np.float32)



def make_backend(artifact: Artifact, num_blocks: int, *, weight_memory: str = "auto",
                 fallback: bool | None = None, **options) -> ReferenceBackend:
    """The constructor kipp.chooser uses. The reference reads the mapped artifact in place
    (weight_memory is always "stored") and runs no kernels (nothing to fall back from)."""
    from kipp.memory import check_weight_memory

    if check_weight_memory(weight_memory) == "float32":
        raise KippError("the reference backend reads the artifact in place: weight_memory="
                        "'float32' applies to the jax and mlx backends")
    return ReferenceBackend(artifact, num_blocks, **options)
