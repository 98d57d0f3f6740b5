"""The public engine: `kipp.load` and the Model it returns.

    model = kipp.load("kipp-synthetic/qwen3-tiny", backend="reference")
    print(model.generate("Hello", max_tokens=16, temperature=0))
    for piece in model.generate("Hello", max_tokens=16, stream=True):
        print(piece, end="")
    with model.session(capacity=256) as s:
        logits = s.eval(model.tokenizer.encode("Hello"))      # [1, 151936] float32

A model owns one backend (with its KV slab) and the block pool over that slab. Generation runs
on the model's own scheduler (`engine`, kipp.generation), the one the server runs too; sessions,
generation and batched eval all go through `eval_batch`, the one place that turns sessions into
backend items.
"""

from __future__ import annotations

import numbers
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from kipp.backend import KV_BLOCK, blocks_needed
from kipp.chooser import (
    BACKENDS,  # noqa: F401  (the API's list of backends)
    choose_backend,
    group_runtime,
    jax_group_mesh,
    open_backend,
)
from kipp.display import count, html_view, text_view
from kipp.engine.blocks import BlockPool
from kipp.engine.draft import MODEL_GATE, spec_config
from kipp.engine.session import Session, SessionError
from kipp.engine.spec import EvalClock, SpecConfig
from kipp.errors import KippError, require
from kipp.formats.artifact import Artifact, open_artifact, with_head_rows
from kipp.formats.registry import KV_HEADS, VOCAB_SIZE
from kipp.generation import (  # noqa: F401  (GenerationError, GenerationStats: API)
    ChatReply,
    Generation,
    GenerationError,
    GenerationStats,
    constraint,
    request_for,
)
from kipp.memory import check_weight_memory
from kipp.text.sampling import SamplingParams
from kipp.text.tokenizer import Tokenizer

KV_SCHEMES = ("bf16", "q8_0")  # the KV slab's storage format (see kipp.formats.kvquant for q8_0)
JAX_DEFAULT_KV_TOKENS = 8192
PARALLEL = ("tensor", "pipeline")  # how a distributed group splits the model
# draft_vocab's unit: the vocabulary itself is 1,187 x 128 rows, so a head cut to whole 128s
# keeps the row tiles every backend's head kernels divide it into (Pallas's are 32 or 64)
HEAD_ROWS = 128
DRAFT_VOCAB_RANGE = f"a multiple of {HEAD_ROWS} in {HEAD_ROWS}..{VOCAB_SIZE}"


def load(checkpoint: str | Path, backend: str = "auto", scheme: str = "bf16",
         kv_tokens: int | None = None, progress: bool = True,
         kv_scheme: str = "bf16", kv_mib: float | None = None,
         weight_memory: str = "auto", draft: "str | Path | Model | None" = None,
         draft_tokens: int | None = None, draft_vocab: int | None = None,
         kv_cache_dir: str | Path | None = None,
         kv_disk_mib: float | None = None, adapters: dict | None = None, distributed=None,
         parallel: str = "tensor", *, _head_rows: int | None = None) -> "Model":
    """Open a checkpoint: a registry id (downloaded or synthesized and converted when missing,
    with progress output) or a local .gguf artifact path. `backend` "auto" picks the fastest
    installed (kipp.chooser) and prints why. `kv_tokens` sizes the KV slab
    (default: the checkpoint's context length; the reference backend pages it in lazily).
    `kv_scheme` "q8_0" stores K and V as Q8_0 blocks (~1.9x fewer bytes than "bf16").
    `kv_mib` sizes the slab in memory instead of tokens: the same MiB hold ~1.9x more tokens
    with q8_0 KV (give kv_tokens or kv_mib, not both). `weight_memory` ("auto", "stored",
    "float32") says how the jax and mlx backends hold their weights (kipp.memory).
    `draft` (a checkpoint as above, or a loaded Model on the same backend) is a small model of
    the family that drafts for `speculative=True`, greedy or sampled (kipp.engine.draft); it
    must share the tokenizer exactly. `draft_tokens` caps its draft length (default: the
    adaptive gate's longest, 15). `draft_vocab` N gives the draft model a head over the first N
    token ids only (a multiple of 128): a small draft's eval is mostly its head over the
    151,936-token vocabulary, and Qwen's ids follow BPE merge order, so the first ids are the
    common pieces. The draft then never proposes a rarer token; the output is unchanged.
    `kv_cache_dir` keeps published KV blocks on disk there too (kipp.engine.kv_disk), up to
    `kv_disk_mib` MiB (default: a quarter of the free disk); a later process reuses them.
    `adapters` {"name": folder} loads LoRA adapters (PEFT or mlx-lm, kipp.lora.adapter) trained
    on this checkpoint; `generate(..., adapter="name")` and `session(adapter="name")` use one.
    `distributed` (backend "jax": True, the group from JAX's or SLURM's environment, or a
    kipp.cuda.distributed.Group; backend "mlx": True, the rank and hostfile from MLX_RANK and
    MLX_HOSTFILE, or a kipp.apple.distributed.Group) joins a group of processes that hold the
    model together (docs/distributed.md): process 0's Model serves; on every other process hand
    the Model to the backend's `follow` (kipp.cuda.distributed, kipp.apple.distributed), which
    returns when process 0 stops the group. `parallel` "tensor" splits every layer over every
    device; "pipeline" gives each process a range of the layers (on JAX tensor parallel over
    its own devices), for hosts joined by a slow link.
    Every argument is checked before any download, conversion or allocation."""
    _check_load_arguments(backend, scheme, kv_tokens, kv_scheme, kv_mib)
    if parallel not in PARALLEL:
        raise KippError(f"unknown parallel {parallel!r}; choose from {', '.join(PARALLEL)}")
    # JAX's group is joined before JAX's first call; MLX's once its shard is known to fit
    link = _join_group(distributed, backend, draft, kv_cache_dir, adapters)
    _check_disk_arguments(kv_cache_dir, kv_disk_mib)
    _check_adapter_arguments(adapters)
    check_weight_memory(weight_memory)
    sizes = _draft_sizes(draft, draft_tokens)
    _check_draft_vocab(draft, draft_vocab)
    choice = choose_backend(backend)
    artifact = _open_checkpoint(checkpoint, scheme, progress)
    if _head_rows is not None:  # a draft's head (draft_vocab)
        artifact = with_head_rows(artifact, _head_rows)
    if kv_mib is not None:
        kv_tokens = kv_tokens_for(artifact.entry, kv_scheme, kv_mib)
    options = {} if kv_scheme == "bf16" else {"kv_scheme": kv_scheme}
    if link is not None and choice.name == "mlx":
        link = _join_mlx_group(link, artifact, parallel)
        options.update(shard=link.shard, link=link)
    elif link is not None:
        options.update(mesh=jax_group_mesh(parallel), link=link)
    if weight_memory != "auto":
        options["weight_memory"] = weight_memory
    # the tokenizer first: building its tables takes ~40 MiB of scratch at Qwen3's vocabulary,
    # freed again before the weights are resident
    tokenizer = Tokenizer(artifact.tokenizer_data())
    loaded = _load_adapters(adapters or {}, artifact.entry)  # validated before the weights
    backend = open_backend(choice.name, artifact, _num_blocks(artifact, choice.name, kv_tokens),
                           **options)
    if choice.name == "jax":
        backend.progress = progress  # a progress line for each first-call compile
    if progress:
        print(f"kipp: backend {backend.describe()} ({choice.reason})", file=sys.stderr)
    model = Model(artifact, backend, tokenizer)
    for adapter in loaded:
        model.backend.add_adapter(adapter)
    if link is not None and link.leader:
        link.start_keepalive()
    if draft is not None:
        if not isinstance(draft, Model):
            draft = load(draft, choice.name, scheme, kv_tokens, progress, kv_scheme, kv_mib,
                         weight_memory, _head_rows=draft_vocab)
        model.set_draft(draft, sizes)
    if kv_cache_dir is not None:
        model.attach_kv_disk(kv_cache_dir, kv_disk_mib)
    return model


def _join_group(distributed, backend: str, draft, kv_cache_dir, adapters):
    """JAX's distributed group's link (joined), MLX's Group (checked; joined by
    _join_mlx_group), or None when `distributed` is not asked."""
    if distributed is None or distributed is False:
        return None
    if backend not in ("jax", "mlx"):
        raise KippError(f"distributed needs backend='jax' or backend='mlx' (got {backend!r})")
    if draft is not None or kv_cache_dir is not None or adapters:
        raise KippError("distributed does not take a draft model, kv_cache_dir or adapters yet")
    runtime = group_runtime(backend)
    if backend == "mlx":
        group = runtime.Group.resolve() if distributed is True else distributed
        if not isinstance(group, runtime.Group):
            raise KippError("with backend='mlx', distributed must be True or a "
                            f"kipp.apple.distributed.Group, not {distributed!r}")
        group.check()
        return group
    group = runtime.Group.resolve() if distributed is True else distributed
    if not isinstance(group, runtime.Group):
        raise KippError("distributed must be True or a kipp.cuda.distributed.Group, "
                        f"not {distributed!r}")
    group.check()
    return runtime.join(group)


def _join_mlx_group(group, artifact: Artifact, parallel: str):
    """MLX's group joined, once this rank's shard of the checkpoint is planned (a model that
    does not split that way is refused before any rank waits for another)."""
    runtime = group_runtime("mlx")
    shard = runtime.plan_shard(artifact.entry, group.rank, group.size, parallel)
    return runtime.join(group, shard)


def _check_draft_vocab(draft, draft_vocab) -> None:
    if draft_vocab is None:
        return
    if draft is None:
        raise KippError("draft_vocab needs a draft model (draft=...)")
    if isinstance(draft, Model):
        raise KippError("draft_vocab cuts the head of a draft that load opens: give draft "
                        "as a checkpoint, not a loaded Model")
    if not draft_vocab_fits(draft_vocab):
        raise KippError(f"draft_vocab must be {DRAFT_VOCAB_RANGE}, got {draft_vocab!r}")


def draft_vocab_fits(n) -> bool:
    """Whether `n` can be a draft's head rows (load's draft_vocab, the CLI's --draft-vocab)."""
    return (not isinstance(n, bool) and isinstance(n, numbers.Integral)
            and HEAD_ROWS <= n <= VOCAB_SIZE and n % HEAD_ROWS == 0)


def _draft_sizes(draft, draft_tokens) -> tuple[int, ...] | None:
    """The gate's draft sizes for draft_tokens: the defaults up to it, and it."""
    if draft_tokens is None:
        return None
    if draft is None:
        raise KippError("draft_tokens needs a draft model (draft=...)")
    if (isinstance(draft_tokens, bool) or not isinstance(draft_tokens, numbers.Integral)
            or not 1 <= draft_tokens <= 64):
        raise KippError(f"draft_tokens must be an integer in 1..64, got {draft_tokens!r}")
    return tuple(k for k in MODEL_GATE["sizes"] if k < draft_tokens) + (int(draft_tokens),)


def _check_adapter_arguments(adapters) -> None:
    if adapters is None:
        return
    if not isinstance(adapters, dict) or not all(
            isinstance(k, str) and k and isinstance(v, (str, Path)) for k, v in adapters.items()):
        raise KippError(f"adapters must be a dict of name -> adapter folder, got {adapters!r}")


def _load_adapters(adapters: dict, entry) -> list:
    from kipp.lora.adapter import load_adapter

    return [load_adapter(path, entry, name) for name, path in adapters.items()]


def _check_disk_arguments(folder, mib) -> None:
    if mib is not None and (isinstance(mib, bool) or not isinstance(mib, numbers.Real)
                            or not 0 <= mib < float("inf")):
        raise KippError(f"kv_disk_mib must be a number of MiB >= 0, got {mib!r}")
    if folder is not None and Path(folder).exists() and not Path(folder).is_dir():
        raise KippError(f"kv_cache_dir {folder} is a file, not a folder")


def _check_load_arguments(backend, scheme, kv_tokens, kv_scheme, kv_mib) -> None:
    from kipp.formats.quant import scheme as weight_scheme

    if backend not in BACKENDS + ("auto",):
        raise KippError(f"unknown backend {backend!r}; choose from auto, {', '.join(BACKENDS)}")
    weight_scheme(scheme)  # QuantError naming the valid schemes
    if kv_scheme not in KV_SCHEMES:
        raise KippError(f"unknown kv_scheme {kv_scheme!r}; choose from {', '.join(KV_SCHEMES)}")
    if kv_tokens is not None and kv_mib is not None:
        raise KippError("give kv_tokens or kv_mib, not both")
    if kv_tokens is not None and (isinstance(kv_tokens, bool)
                                  or not isinstance(kv_tokens, numbers.Integral)
                                  or kv_tokens < KV_BLOCK):
        raise KippError(f"kv_tokens must be an integer of at least one {KV_BLOCK}-token "
                        f"block, got {kv_tokens!r}")
    if kv_mib is not None and (isinstance(kv_mib, bool) or not isinstance(kv_mib, numbers.Real)
                               or not 0 < kv_mib < float("inf")):
        raise KippError(f"kv_mib must be a positive number of MiB, got {kv_mib!r}")
    if backend == "jax":
        require("jax", "the jax backend")
    elif backend == "mlx":
        require("mlx", "the mlx backend")


def _open_checkpoint(checkpoint: str | Path, scheme: str, progress: bool) -> Artifact:
    """A local .gguf artifact, or a registry id's artifact (made first when missing)."""
    path = Path(checkpoint)
    reject_folder(path, scheme)
    if path.suffix == ".gguf" or path.is_file():
        return open_artifact(path)
    from kipp.formats import registry
    from kipp.formats.store import ensure_artifact

    registry.get(str(checkpoint))  # RegistryError listing the supported ids
    return open_artifact(ensure_artifact(str(checkpoint), scheme, progress=progress))


def reject_folder(path: Path, scheme: str = "bf16") -> None:
    """A clear error for a folder given where an artifact belongs (a hint for an HF folder)."""
    if not path.is_dir():
        return
    if (path / "config.json").is_file():
        raise KippError(f"{path} is a Hugging Face folder, not a Kipp artifact: convert it "
                        f"first (kipp convert --checkpoint ID --source {path} --scheme {scheme} "
                        f"--out FILE.gguf), or load its registry id")
    raise KippError(f"{path} is a directory, not a .gguf artifact or a registry id")


def kv_tokens_for(entry, kv_scheme: str, mib: float) -> int:
    """Tokens of KV (whole 32-token blocks) that fit in `mib` MiB with `kv_scheme`."""
    from kipp.formats.kvquant import row_bytes

    per_token = entry.layers * 2 * KV_HEADS * row_bytes(kv_scheme)
    tokens = int(mib * 2**20) // per_token // KV_BLOCK * KV_BLOCK
    if tokens < KV_BLOCK:
        raise KippError(f"kv_mib {mib} holds less than one {KV_BLOCK}-token block "
                        f"({KV_BLOCK * per_token} bytes with {kv_scheme} KV)")
    return tokens


def _num_blocks(artifact: Artifact, backend: str, kv_tokens: int | None) -> int:
    context = artifact.entry.context_length
    # The reference pages its slab in lazily; the JAX and MLX slabs are allocated up front, so
    # they get a smaller default (4.7 GB at 0.6B for the whole 40,960-token context).
    default = context if backend == "reference" else min(context, JAX_DEFAULT_KV_TOKENS)
    tokens = default if kv_tokens is None else kv_tokens
    if tokens < KV_BLOCK:
        raise KippError(f"kv_tokens {tokens} is below one {KV_BLOCK}-token block")
    return blocks_needed(tokens)


class Model:
    """A loaded checkpoint on one backend. Not thread-safe: one caller (or engine thread)."""

    def __init__(self, artifact: Artifact, backend, tokenizer: Tokenizer | None = None):
        self.artifact = artifact
        self.entry = artifact.entry
        self.backend = backend
        self.pool = BlockPool(backend.num_blocks)
        self.tokenizer = Tokenizer(artifact.tokenizer_data()) if tokenizer is None else tokenizer
        self._engine = None
        self.draft: Model | None = None  # the draft model speculative=True drafts with
        self.draft_spec: SpecConfig | None = None
        self.kv_disk = None  # kipp.engine.kv_disk.KVDisk once attach_kv_disk is called
        self.clock = EvalClock()  # its decode rounds as schedulers time them (spec gates)
        # the ids its head scores (a draft's may stop short of the vocabulary: draft_vocab)
        self.head_rows = artifact.weights.output.shape[0]

    def set_draft(self, draft: "Model | None", sizes: tuple[int, ...] | None = None) -> None:
        """Draft with `draft` (None: prompt lookup again) for speculative=True; SpecError if it
        cannot draft for this model (another tokenizer or backend)."""
        if draft is None:
            self.draft = self.draft_spec = None
            return
        gate = {} if sizes is None else {"sizes": sizes}
        self.draft_spec = spec_config(draft, self, **gate)
        self.draft = draft

    def attach_kv_disk(self, folder: str | Path, mib: float | None = None):
        """Keep published KV blocks in `folder` too, up to `mib` MiB (default: a quarter of
        the free disk): kipp.engine.kv_disk. Returns the KVDisk."""
        from kipp.engine import kv_disk, kv_files

        _check_disk_arguments(folder, mib)
        backend = self.backend
        if not backend.supports_kv_io:
            raise KippError(f"the {backend.name} backend cannot keep KV blocks on disk "
                            f"(--kv-cache-dir)")
        folder = Path(folder)
        limit = kv_files.default_limit(folder) if mib is None else int(mib * 2**20)
        memo = folder / "artifacts.json"
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # a read-only place: the tier serves what is there, and counts its errors
        checksum = kv_files.artifact_checksum(self.artifact.path, memo)
        kv_scheme = getattr(backend, "kv_scheme", "bf16")
        space = kv_files.namespace(checksum, kv_scheme, backend.kv_identity())
        label = f"{self.entry.id} {self.artifact.scheme.name} ({checksum[:12]}), " \
                f"{kv_scheme} KV, {backend.name}"
        tier = kv_files.DiskTier(folder, space, backend.kv_block_bytes, limit, label)
        self.kv_disk = kv_disk.KVDisk(tier, backend, self.pool)
        return self.kv_disk

    def cache_prompt(self, prompt: str | Sequence[int]) -> int:
        """Evaluate `prompt` (text or token ids) and publish its KV blocks now, so a later
        request (in this process, or after a restart with the disk tier) starting with it
        skips their prefill. Returns the prompt's tokens whose KV is now cached (all of them: the
        full blocks, and the partial last block for a later prompt that continues it)."""
        ids = self.prompt_ids(prompt)
        with self.session(len(ids)) as s:
            s.match_prefix(ids)
            if s.length < len(ids):
                s.eval(ids[s.length:])
        if self.kv_disk is not None:
            self.kv_disk.tier.flush()
        return len(ids)

    def _display_rows(self) -> list[tuple[str, str]]:
        pool = self.pool
        return [
            ("checkpoint", f"{self.entry.id} @ {self.entry.revision} ({self.entry.variant})"),
            ("weights", f"{self.artifact.scheme.name}, {self.artifact.path}"),
            ("backend", self.backend.describe()),
            ("context", f"{self.entry.context_length:,} tokens"),
            ("KV pool", f"{pool.num_in_use:,} of {count(pool.num_blocks, 'block')} in use "
                        f"({KV_BLOCK} tokens each), {pool.num_evictable:,} cached for reuse"),
            ("KV disk", "off" if self.kv_disk is None else self.kv_disk.describe()),
        ]

    def __repr__(self) -> str:
        return text_view(f"kipp.Model {self.entry.id}", self._display_rows())

    def _repr_html_(self) -> str:
        return html_view(f"kipp.Model {self.entry.id}", self._display_rows())

    def session(self, capacity: int | None = None, reservation=None,
                adapter: str | None = None) -> Session:
        """A new empty session of `capacity` tokens (default: the context length). With a
        `reservation` (BlockPool.reserve) its blocks come out of the blocks promised to it.
        `adapter`: a loaded LoRA adapter's name; every eval of the session runs under it."""
        return Session(self, capacity, reservation, adapter)

    @property
    def adapters(self) -> dict:
        """The loaded LoRA adapters, name -> kipp.lora.adapter.LoraAdapter."""
        return dict(self.backend.adapters)

    def add_adapter(self, name: str, path: str | Path):
        """Load the LoRA adapter in folder `path` (PEFT or mlx-lm) under `name`; AdapterError
        if it is malformed or was trained on another checkpoint. Returns the LoraAdapter."""
        from kipp.lora.adapter import load_adapter

        adapter = load_adapter(path, self.entry, name)
        self.backend.add_adapter(adapter)
        return adapter

    def remove_adapter(self, name: str) -> None:
        """Unload adapter `name`. Its published KV blocks stay keyed by its digest: a later
        adapter of the same name but other weights never adopts them."""
        self.backend.remove_adapter(name)

    def adapter_salt(self, adapter: str | None) -> bytes:
        """The prefix-cache salt of `adapter` (b"" for the base weights): its digest."""
        if adapter is None:
            return b""
        loaded = self.backend.adapters.get(adapter) if isinstance(adapter, str) else None
        if loaded is None:
            raise SessionError(f"adapter {adapter!r} is not loaded (loaded: "
                               f"{', '.join(sorted(self.backend.adapters)) or 'none'})")
        return loaded.digest

    def check_tokens(self, tokens: Sequence[int]) -> list[int]:
        """Token ids as a list of ints, or a clear error naming the first bad one."""
        try:
            ids = [int(t) for t in tokens]
        except (TypeError, ValueError):
            raise SessionError("tokens must be a sequence of integer ids") from None
        if not ids:
            raise SessionError("at least one token is needed")
        bad = [t for t in ids if not 0 <= t < VOCAB_SIZE]
        if bad:
            raise SessionError(f"token id {bad[0]} is outside the vocabulary 0..{VOCAB_SIZE - 1}")
        return ids

    def eval_batch(self, requests: Sequence[tuple[Session, Sequence[int], int]]
                   ) -> list[np.ndarray]:
        """Evaluate (session, tokens, logits_rows) triples in one backend call.

        Each session appends its tokens. If anything fails, every session is left as it was.
        """
        sessions = [request[0] for request in requests]
        if len({id(s) for s in sessions}) != len(sessions):
            raise SessionError("a session may appear only once in a batch")
        items = []
        try:
            for session, tokens, rows in requests:
                items.append(session.item(tokens, rows))
            results = self.backend.eval(items)
        except BaseException:
            for session in sessions[: len(items) + 1]:
                if not session.closed:
                    session.abandon()
            raise
        for session, item in zip(sessions, items):
            session.commit(item)
        if self.head_rows < VOCAB_SIZE:  # ids past a cut head are never picked
            results = [_widen(logits) for logits in results]
        return results

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise GenerationError("the prompt is empty")
            return self.tokenizer.encode(prompt)
        try:
            return self.check_tokens(prompt)
        except SessionError as e:
            raise GenerationError(f"prompt: {e}") from None

    @property
    def engine(self):
        """The model's own thread-less scheduler, which generate() and chat() pump on the
        caller's thread (kipp.generation)."""
        if self._engine is None:
            from kipp.engine.scheduler import Scheduler

            self._engine = Scheduler(self, max_queue=1 << 16)
        return self._engine

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, *,
                 stream: bool = False, stop: Sequence[str] | str | None = None,
                 speculative: bool | SpecConfig = False, session: Session | None = None,
                 json_schema=None, regex: str | None = None, grammar=None,
                 logprobs: int | None = None, adapter: str | None = None,
                 **sampling) -> "str | Generation":
        """Continue `prompt` (text or token ids). Returns the text, or with stream=True a
        Generation: an iterator of text pieces (sync `for` or `async for`) whose `.stats` fill
        in as it runs. Sampling keywords are those of SamplingParams (temperature, top_p,
        top_k, min_p, penalties, logit_bias, seed). `speculative=True` emits the same tokens
        in fewer evals (kipp.engine.spec): prompt lookup, greedy only, or with a draft model
        (load(..., draft=...)) greedy or sampled, distributed exactly as without; a SpecConfig
        picks the drafter and gate. `.stats.spec` counts its drafts. `logprobs=k`
        records each token's logprob and the top k in `.stats.logprobs`. `adapter` names a
        loaded LoRA adapter to generate under (a `session`'s own adapter when it has one).
        `session` continues an open Session (a conversation): it keeps the longest prefix its
        tokens share with the prompt (cut back where they differ), evaluates only the rest,
        and stays open holding the prompt and the generated tokens for the next call.

        Constrained decoding (kipp.text.grammar), at most one of: `json_schema` (a dict, JSON
        text or pydantic model class: the output is one JSON value valid against it), `regex`
        (the output matches it in full), `grammar` (Lark or GBNF text, or a Grammar).
        Generation ends ("stop") as soon as the grammar is complete."""
        generation = self._generation(prompt, max_tokens, stop=stop, speculative=speculative,
                                      session=session, json_schema=json_schema, regex=regex,
                                      grammar=grammar, logprobs=logprobs, adapter=adapter,
                                      **sampling)
        return generation if stream else "".join(generation)

    def _generation(self, prompt, max_tokens: int, *, stop=None, speculative=False,
                    session=None, json_schema=None, regex=None, grammar=None, logprobs=None,
                    reasoning=None, adapter=None, **sampling) -> Generation:
        if adapter is None and session is not None:
            adapter = getattr(session, "adapter", None)
        request = request_for(self, self.prompt_ids(prompt), max_tokens, stop,
                              SamplingParams(**sampling), speculative=speculative,
                              session=session, grammar=constraint(json_schema, regex, grammar),
                              logprobs=logprobs, reasoning=reasoning, adapter=adapter)
        return Generation(self, request, session)

    def chat(self, messages, max_tokens: int = 256, *, enable_thinking: bool = True,
             stream: bool = False, response_format=None, tools=None, tool_choice=None,
             parallel_tool_calls: bool = True, reasoning_format: str = "auto",
             max_reasoning_tokens: int | None = None, reasoning_effort: str | None = None,
             **kwargs) -> "ChatReply | Generation":
        """Generate the assistant's reply to `messages` (instruct checkpoints only): a
        ChatReply with the answer (`content`, also its str()), the `reasoning` before it and
        the `tool_calls`. Keywords are generate's; pass the same `session` every turn to keep
        the conversation's KV. With stream=True, a Generation whose pieces say their `part`
        ("reasoning" or "content").

        Reasoning: the reply's think block is split off (`reasoning_format="none"` keeps it
        inline in the content, tags and all). `max_reasoning_tokens` bounds the block (the
        closing Kipp writes when it runs out included; 0: no thinking); `reasoning_effort`
        ("none", "minimal", "low", "medium", "high", "xhigh") picks a bound by name
        (kipp.text.reasoning.EFFORT_BUDGETS). `enable_thinking=False` asks the hybrid template
        for an answer without a block.

        `response_format`: OpenAI's ({"type": "json_object"}, {"type": "json_schema",
        "json_schema": {"name", "schema"}}), a pydantic model class or a JSON Schema dict; the
        reply is then JSON text that validates. `tools` (OpenAI function tools) are shown to
        the model and its <tool_call> blocks parsed into `tool_calls`. `tool_choice`: "auto"
        (default), "none", "required" (one or more calls; exactly one unless
        `parallel_tool_calls`) or {"type": "function", "function": {"name": ...}}; required and
        named calls are constrained to valid calls whose arguments match the function's
        schema. A constrained reply starts after an empty think block."""
        from kipp.text.chat import chat_grammar, reply_prompt
        from kipp.text.reasoning import effort_budget, reasoning_for

        if not self.entry.has_chat_template:
            raise GenerationError(f"{self.entry.id} is a base checkpoint: it has no chat "
                                  f"template; use generate()")
        if max_reasoning_tokens is not None and reasoning_effort is not None:
            raise GenerationError("give max_reasoning_tokens or reasoning_effort, not both")
        try:
            budget = (max_reasoning_tokens if reasoning_effort is None
                      else effort_budget(reasoning_effort))
            reasoning = reasoning_for(reasoning_format, budget)
        except ValueError as e:
            raise GenerationError(str(e)) from None
        grammar = chat_grammar(response_format, tools, tool_choice, parallel_tool_calls,
                               bare_schema=True)
        text = reply_prompt(messages, tools=tools, template=self.chat_template,
                            enable_thinking=enable_thinking, constrained=grammar is not None,
                            reasoning_budget=budget)
        generation = self._generation(text, max_tokens, grammar=grammar, reasoning=reasoning,
                                      **kwargs)
        if stream:
            return generation
        for _ in generation:
            pass
        return ChatReply.parse(generation, tools is not None and tool_choice != "none")

    @property
    def chat_template(self) -> str:
        """The name of the chat template this checkpoint renders with (kipp.text.chat.TEMPLATES):
        the artifact's template text must be the one its registry entry ships upstream."""
        from kipp.text.chat import ChatError, entry_template, template_name

        name = template_name(self.tokenizer.data.chat_template)
        expected = entry_template(self.entry.id)
        if name != expected:
            raise ChatError(f"{self.entry.id} ships the {expected} chat template upstream, but "
                            f"this artifact carries the {name} one")
        return name


def _widen(logits: np.ndarray) -> np.ndarray:
    """Logits [rows, head rows] of a cut head as [rows, vocabulary]: -inf past the head."""
    out = np.full((logits.shape[0], VOCAB_SIZE), -np.inf, np.float32)
    out[:, :logits.shape[1]] = logits
    return out
