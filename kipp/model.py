"""The public engine: `kipp.load` and the Model it returns.

    model = kipp.load("kipp-synthetic/qwen3-tiny", backend="reference")
    print(model.generate("Hello", max_tokens=16, temperature=0))
    for piece in model.generate("Hello", max_tokens=16, stream=True):
        print(piece, end="")
    with model.session(capacity=256) as s:
        logits = s.eval(model.tokenizer.encode("Hello"))      # [1, 151936] float32

A model owns one backend (with its KV slab) and the block pool over that slab; sessions,
generation and batched eval all go through `eval_batch`, the one place that turns sessions into
backend items.
"""

from __future__ import annotations

import asyncio
import contextlib
import numbers
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from kipp.backend import KV_BLOCK, blocks_needed
from kipp.chooser import BACKENDS, choose_backend, open_backend  # noqa: F401  (BACKENDS: API)
from kipp.display import count, html_view, preview, text_view
from kipp.engine.blocks import BlockPool
from kipp.engine.session import Session, SessionError
from kipp.engine.spec import SpecConfig, SpecStats, SpeculativeDecoder
from kipp.errors import KippError, require
from kipp.formats.artifact import Artifact, open_artifact
from kipp.formats.registry import KV_HEADS, VOCAB_SIZE
from kipp.memory import check_weight_memory
from kipp.text import stops
from kipp.text.sampling import Sampler, SamplingParams
from kipp.text.tokenizer import StreamingDetokenizer, Tokenizer

KV_SCHEMES = ("bf16", "q8_0")  # the KV slab's storage format (see kipp.formats.kvquant for q8_0)
JAX_DEFAULT_KV_TOKENS = 8192


class GenerationError(KippError, ValueError):
    """Bad arguments to generate or chat; nothing was evaluated."""


def load(checkpoint: str | Path, backend: str = "auto", scheme: str = "bf16",
         kv_tokens: int | None = None, progress: bool = True,
         kv_scheme: str = "bf16", kv_mib: float | None = None,
         weight_memory: str = "auto") -> "Model":
    """Open a checkpoint: a registry id (downloaded or synthesized and converted when missing,
    with progress output) or a local .gguf artifact path. `backend` "auto" picks the fastest
    installed (kipp.chooser) and prints why. `kv_tokens` sizes the KV slab
    (default: the checkpoint's context length; the reference backend pages it in lazily).
    `kv_scheme` "q8_0" stores K and V as Q8_0 blocks (~1.9x fewer bytes than "bf16").
    `kv_mib` sizes the slab in memory instead of tokens: the same MiB hold ~1.9x more tokens
    with q8_0 KV (give kv_tokens or kv_mib, not both). `weight_memory` ("auto", "stored",
    "float32") says how the jax and mlx backends hold their weights (kipp.memory). Every
    argument is checked before any download, conversion or allocation."""
    _check_load_arguments(backend, scheme, kv_tokens, kv_scheme, kv_mib)
    check_weight_memory(weight_memory)
    choice = choose_backend(backend)
    artifact = _open_checkpoint(checkpoint, scheme, progress)
    if kv_mib is not None:
        kv_tokens = kv_tokens_for(artifact.entry, kv_scheme, kv_mib)
    options = {} if kv_scheme == "bf16" else {"kv_scheme": kv_scheme}
    if weight_memory != "auto":
        options["weight_memory"] = weight_memory
    # the tokenizer first: building its tables takes ~40 MiB of scratch at Qwen3's vocabulary,
    # freed again before the weights are resident
    tokenizer = Tokenizer(artifact.tokenizer_data())
    backend = open_backend(choice.name, artifact, _num_blocks(artifact, choice.name, kv_tokens),
                           **options)
    if choice.name == "jax":
        backend.progress = progress  # a progress line for each first-call compile
    if progress:
        print(f"kipp: backend {backend.describe()} ({choice.reason})", file=sys.stderr)
    return Model(artifact, backend, tokenizer)


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


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose KV was adopted from the block pool
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # time in decode evals (one token, or a speculative verify)
    decode_evals: int = 0
    decode_tokens: int = 0  # tokens picked from decode-eval logits (== decode_evals unless spec)
    finish_reason: str | None = None  # "stop" or "length"
    tokens: list[int] = field(default_factory=list)
    spec: SpecStats | None = None  # drafted, accepted, evals: with speculative=True only

    @property
    def prefill_tokens_per_second(self) -> float:
        evaluated = self.prompt_tokens - self.reused_tokens
        return evaluated / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Model:
    """A loaded checkpoint on one backend. Not thread-safe: one caller (or engine thread)."""

    def __init__(self, artifact: Artifact, backend, tokenizer: Tokenizer | None = None):
        self.artifact = artifact
        self.entry = artifact.entry
        self.backend = backend
        self.pool = BlockPool(backend.num_blocks)
        self.tokenizer = Tokenizer(artifact.tokenizer_data()) if tokenizer is None else tokenizer

    def _display_rows(self) -> list[tuple[str, str]]:
        pool = self.pool
        return [
            ("checkpoint", f"{self.entry.id} @ {self.entry.revision} ({self.entry.variant})"),
            ("weights", f"{self.artifact.scheme.name}, {self.artifact.path}"),
            ("backend", self.backend.describe()),
            ("context", f"{self.entry.context_length:,} tokens"),
            ("KV pool", f"{pool.num_in_use:,} of {count(pool.num_blocks, 'block')} in use "
                        f"({KV_BLOCK} tokens each), {pool.num_evictable:,} cached for reuse"),
        ]

    def __repr__(self) -> str:
        return text_view(f"kipp.Model {self.entry.id}", self._display_rows())

    def _repr_html_(self) -> str:
        return html_view(f"kipp.Model {self.entry.id}", self._display_rows())

    def session(self, capacity: int | None = None, reservation=None) -> Session:
        """A new empty session of `capacity` tokens (default: the context length). With a
        `reservation` (BlockPool.reserve) its blocks come out of the blocks promised to it."""
        return Session(self, capacity, reservation)

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

    def eval_batch(self, requests: Sequence[tuple[Session, Sequence[int], int]]) -> list[np.ndarray]:
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

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, *,
                 stream: bool = False, stop: Sequence[str] | str | None = None,
                 speculative: bool | SpecConfig = False, session: Session | None = None,
                 json_schema=None, regex: str | None = None, grammar=None,
                 **sampling) -> "str | Generation":
        """Continue `prompt` (text or token ids). Returns the text, or with stream=True a
        Generation: an iterator of text pieces (sync `for` or `async for`) whose `.stats` fill
        in as it runs. Sampling keywords are those of SamplingParams (temperature, top_p,
        top_k, min_p, penalties, logit_bias, seed). `speculative=True` (greedy only:
        temperature=0 or top_k=1) emits the same tokens in fewer evals (kipp.engine.spec; a
        SpecConfig picks the drafter and gate); `.stats.spec` counts its drafts.
        `session` continues an open Session (a conversation): it keeps the longest prefix its
        tokens share with the prompt (cut back where they differ), evaluates only the rest,
        and stays open holding the prompt and the generated tokens for the next call.

        Constrained decoding (kipp.text.grammar), at most one of: `json_schema` (a dict, JSON text
        or pydantic model class: the output is one JSON value valid against it), `regex` (the
        output matches it in full), `grammar` (Lark or GBNF text, or a kipp.text.grammar.Grammar).
        Generation ends ("stop") as soon as the grammar is complete."""
        generation = Generation(self, self.prompt_ids(prompt), max_tokens, stop,
                                SamplingParams(**sampling), speculative=speculative,
                                session=session,
                                grammar=constraint(json_schema, regex, grammar))
        return generation if stream else "".join(generation)

    def chat(self, messages, max_tokens: int = 256, *, enable_thinking: bool = True,
             stream: bool = False, response_format=None, tools=None, tool_choice=None,
             parallel_tool_calls: bool = True, **kwargs) -> "str | ChatReply | Generation":
        """Generate the assistant's reply to `messages` (instruct checkpoints only). Keywords
        are generate's; pass the same `session` every turn to keep the conversation's KV.

        `response_format`: OpenAI's ({"type": "json_object"}, {"type": "json_schema",
        "json_schema": {"name", "schema"}}), a pydantic model class or a JSON Schema dict; the
        reply is then JSON text that validates. `tools` (OpenAI function tools) are shown to
        the model and its <tool_call> blocks parsed: the result is a ChatReply with `content`
        and `tool_calls`. `tool_choice`: "auto" (default), "none", "required" (one or more
        calls; exactly one unless `parallel_tool_calls`) or {"type": "function", "function":
        {"name": ...}}; required and named calls are constrained to valid calls whose arguments
        match the function's schema. A constrained reply starts after an empty think block.
        With stream=True the text pieces come as they are made (kipp.text.chat.parse_tool_calls
        splits the whole text afterwards)."""
        from kipp.text.chat import close_reasoning, render

        if not self.entry.has_chat_template:
            raise GenerationError(f"{self.entry.id} is a base checkpoint: it has no chat "
                                  f"template; use generate()")
        grammar = chat_constraint(response_format, tools, tool_choice, parallel_tool_calls)
        template = self.chat_template
        text = render(messages, add_generation_prompt=True, enable_thinking=enable_thinking,
                      tools=tools, template=template)
        if grammar is not None:
            text = close_reasoning(text, template)
        generation = self.generate(text, max_tokens, stream=True, grammar=grammar, **kwargs)
        if stream:
            return generation
        reply = "".join(generation)
        if not tools or tool_choice == "none":
            return reply
        return ChatReply.parse(reply, generation.stats.finish_reason)

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


def constraint(json_schema=None, regex=None, grammar=None):
    """generate()'s constraint keywords as one kipp.text.grammar.Grammar (None: unconstrained)."""
    from kipp.text import grammar as g

    given = [k for k, v in (("json_schema", json_schema), ("regex", regex),
                            ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise GenerationError(f"give at most one of json_schema, regex and grammar, not "
                              f"{' and '.join(given)}")
    if json_schema is not None:
        return g.json_schema_grammar(json_schema)
    if regex is not None:
        return g.regex_grammar(regex)
    if isinstance(grammar, g.Grammar) or grammar is None:
        return grammar
    return g.lark_grammar(grammar)


def chat_constraint(response_format, tools, tool_choice, parallel_tool_calls=True):
    """chat()'s (and the server's) response_format / tool_choice as one Grammar, or None."""
    from kipp.text import grammar as g

    functions = g.function_tools(tools) if tools is not None else None
    forced = g.tool_choice_grammar(functions, tool_choice, parallel_tool_calls)
    formatted = g.response_format_grammar(response_format, bare_schema=True)
    if forced is not None and formatted is not None:
        raise GenerationError("tool_choice forces a tool call, so response_format cannot "
                              "also constrain the reply; give one of them")
    return forced or formatted


@dataclass
class ChatReply:
    """A chat() reply when tools were offered: the text and the calls the model made."""

    content: str | None
    tool_calls: list
    finish_reason: str | None

    @classmethod
    def parse(cls, text: str, finish_reason: str | None) -> "ChatReply":
        from kipp.text.chat import parse_tool_calls

        content, calls = parse_tool_calls(text)
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return cls(content, calls, finish_reason)

    @property
    def message(self) -> dict:
        """The assistant message to append to the conversation (OpenAI's shape)."""
        message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.openai() for call in self.tool_calls]
        return message

    def __str__(self) -> str:
        return self.content or ""


class Generation:
    """One streaming generation: iterate for text pieces (`for`, or `async for` in async code);
    `text` holds what has been produced so far and `stats` the counts and timings."""

    def __init__(self, model: Model, prompt: list[int], max_tokens: int, stop, params,
                 speculative: bool | SpecConfig = False, session: Session | None = None,
                 grammar=None):
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise GenerationError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        limit, what = model.entry.context_length, "the context length"
        if session is not None:
            _check_session(model, session)
            limit, what = session.capacity, "the session's capacity"
        if max_tokens > limit - len(prompt):
            raise GenerationError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) "
                                  f"exceeds {what} {limit}")
        if not isinstance(speculative, (bool, SpecConfig)):
            raise GenerationError(f"speculative must be True, False or a kipp.engine.spec.SpecConfig, "
                                  f"got {speculative!r}")
        if speculative and not params.is_greedy:
            raise GenerationError("speculative decoding is greedy only: set temperature=0 (or "
                                  "top_k=1); a sampled token cannot be verified against a draft")
        self.model = model
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.stops = StopStrings([stop] if isinstance(stop, str) else list(stop or []))
        self.sampler = Sampler(params)
        self.matcher = None
        if grammar is not None:
            from kipp.text.grammar import Matcher, grammar_tokenizer, masks_ahead

            self.matcher = Matcher(grammar_tokenizer(model.tokenizer,
                                                     model.entry.stop_token_ids), grammar)
            self._masks_ahead = masks_ahead(model.backend)
        self._grammar_done = False
        self.speculative = SpecConfig() if speculative is True else speculative or None
        self.stats = GenerationStats(prompt_tokens=len(prompt),
                                     spec=SpecStats() if speculative else None)
        self.session = session  # borrowed: left open, holding prompt + reply, for the next call
        self.text = ""
        self.state = "not started"  # then "running"; "finished", "stopped" (close) or "failed"
        self._iterator = self._run()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self.state == "stopped":
            raise StopIteration
        self.state = "running"
        try:
            piece = next(self._iterator)
        except StopIteration:
            self.state = "finished"
            raise
        except BaseException:
            self.state = "failed"
            raise
        self.text += piece
        return piece

    def close(self) -> None:
        """Stop early. An owned session publishes its full blocks and frees them at once; a
        borrowed session stays open, holding what was evaluated so far."""
        self._iterator.close()
        if self.state != "finished":
            self.state = "stopped"

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> str:
        """The next piece, from async code. Each step runs on the calling thread (the model is
        not thread-safe, and MLX streams are per thread), so the event loop waits for one
        token at a time and serves its other tasks between tokens."""
        await asyncio.sleep(0)
        try:
            return next(self)
        except StopIteration:
            raise StopAsyncIteration from None

    def _display_rows(self) -> list[tuple[str, str]]:
        s = self.stats
        state = self.state + (f" ({s.finish_reason})" if s.finish_reason else "")
        rows = [("state", state),
                ("tokens", f"{s.prompt_tokens:,} prompt ({s.reused_tokens:,} reused), "
                           f"{s.completion_tokens:,} generated of at most {self.max_tokens:,}"),
                ("speed", f"prefill {s.prefill_tokens_per_second:.1f} tok/s, decode "
                          f"{s.decode_tokens_per_second:.1f} tok/s")]
        if s.spec is not None:
            rows.append(("speculative", f"{s.spec.accepted}/{s.spec.drafted} drafted tokens "
                                        f"accepted in {s.spec.evals} evals"))
        return rows

    def __repr__(self) -> str:
        rows = self._display_rows() + [("text", repr(preview(self.text)))]
        return text_view("kipp.Generation", rows)

    def _repr_html_(self) -> str:
        return html_view("kipp.Generation", self._display_rows(), text=self.text)

    def _open_session(self):
        if self.session is not None:
            return contextlib.nullcontext(self.session)
        return self.model.session(len(self.prompt) + self.max_tokens)

    def _reuse(self, session: Session) -> int:
        """Prompt tokens whose KV is kept: the borrowed session's common prefix with the prompt
        (the rest of its timeline is cut), else published blocks adopted from the pool."""
        if session.tokens:
            shared = 0
            for have, want in zip(session.tokens, self.prompt):
                if have != want:
                    break
                shared += 1
            keep = min(shared, len(self.prompt) - 1)  # the last prompt token gives the logits
            session.truncate(keep)
            if keep:
                return keep
        return session.match_prefix(self.prompt)

    def _run(self) -> Iterator[str]:
        model, stats = self.model, self.stats
        detok = StreamingDetokenizer(model.tokenizer)
        with self._open_session() as session:
            start = time.perf_counter()
            stats.reused_tokens = self._reuse(session)
            logits = session.eval(self.prompt[stats.reused_tokens:])[0]
            stats.prefill_seconds = time.perf_counter() - start
            for received, token in enumerate(self._tokens(session, logits)):
                stats.decode_tokens = received  # every token after the first: decode logits
                if token in model.entry.stop_token_ids:
                    stats.finish_reason = "stop"
                    break
                stats.tokens.append(token)
                stats.completion_tokens += 1
                text, stopped = self.stops.feed(detok.push(token))
                if text:
                    yield text
                if stopped:
                    stats.finish_reason = "stop"
                    break
                if stats.completion_tokens == self.max_tokens:
                    stats.finish_reason = "length"
                    break
        if not self.stops.stopped:
            tail = self.stops.flush(detok.flush())
            if tail:
                yield tail

    def _tokens(self, session: Session, logits: np.ndarray) -> Iterator[int]:
        """The picked tokens, one at a time; the caller stops consuming when generation ends."""
        evaluate = self._timed(session)
        if self.speculative:
            config = self.speculative
            decoder = SpeculativeDecoder(session, self._pick, drafter=config.drafter(),
                                         gate=config.gate(), evaluate=evaluate,
                                         history_matters=self.sampler.params.has_penalties)
            decoder.stats = self.stats.spec
            yield from decoder.tokens(logits, session.tokens, self.max_tokens)
            return
        while True:
            token = self._pick(logits, session.tokens)
            yield token
            if self._grammar_done:  # only a stop token can follow: emit it without an eval
                yield self.model.entry.stop_token_ids[0]
                return
            logits = evaluate([token], 1)[0]

    def _pick(self, logits: np.ndarray, history) -> int:
        """The next token; under a grammar, from its mask, and the grammar advanced past it
        (every picked token is emitted, so it is consumed at once: a speculative draft the
        grammar bars is rejected by the mask, and nothing needs rolling back)."""
        matcher = self.matcher
        if matcher is None:
            return self.sampler.sample(logits, history)
        token = self.sampler.sample(logits, history, matcher.allowed())
        if token not in self.model.entry.stop_token_ids:
            matcher.consume(token)
            self._grammar_done = matcher.complete
            if not self._grammar_done and self._masks_ahead:
                matcher.prefetch()  # the next mask, while the backend evaluates this token
        return token

    def _timed(self, session: Session):
        def evaluate(tokens: list[int], rows: int) -> np.ndarray:
            start = time.perf_counter()
            logits = session.eval(tokens, rows)
            self.stats.decode_seconds += time.perf_counter() - start
            self.stats.decode_evals += 1
            return logits

        return evaluate


def _check_session(model: Model, session: Session) -> None:
    if not isinstance(session, Session):
        raise GenerationError(f"session must be a kipp Session (model.session()), "
                              f"got {type(session).__name__}")
    if session.model is not model:
        raise GenerationError("the session belongs to another model")
    if session.closed:
        raise GenerationError("the session is closed")


class StopStrings(stops.StopStrings):
    """Holds back streamed text while it could still become a stop string (kipp.text.stops)."""

    def __init__(self, strings):
        try:
            super().__init__(strings)
        except stops.StopError as e:
            raise GenerationError(str(e)) from None
