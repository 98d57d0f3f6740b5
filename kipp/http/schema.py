"""OpenAI request bodies -> validated Kipp calls, or an APIError naming the offending field.

Every field a body may carry is listed here, per endpoint. A field that is not listed, or that
asks for something Kipp does not do (suffix, best_of != n), is a 400 naming it: never a silent
ignore. `response_format` (both endpoints) and `tools` / `tool_choice` / `parallel_tool_calls`
(chat) become a kipp.text.grammar constraint on the request; a schema or tool that cannot be
enforced is a 400 naming the field.

Ranges follow OpenAI's (temperature 0..2, penalties -2..2, logit_bias -100..100, n <= 8, legacy
logprobs 0..5, top_logprobs 0..20, at most 4 stop strings); top_k, min_p and
repetition_penalty are Kipp's (llama.cpp-style) extensions. A stop string is at most
MAX_STOP_CHARS characters. /v1/completions takes a batch of prompts (a list of strings or of
token-id lists: one scheduler request each, choices indexed i*n + j) and `echo` (the prompt's
tokens first, with their logprobs when asked; max_tokens 0 only scores the prompt), as
evaluation harnesses use them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kipp.engine.scheduler import MAX_CHOICES, Request
from kipp.http.fields import (
    SAMPLING_FIELDS,
    APIError,
    bad,
    boolean,
    check_fields,
    check_model,
    check_user,
    integer,
    is_int,
    sampling,
    stop_strings,
    stream_flags,
)
from kipp.text.sampling import SamplingParams

MAX_LEGACY_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


_COMMON_FIELDS = {"model", "max_tokens", "n", "stream", "stream_options", "stop", "user"} | \
    SAMPLING_FIELDS
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo", "suffix", "best_of",
                                      "response_format"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                "chat_template_kwargs", "response_format", "tools", "tool_choice",
                                "parallel_tool_calls", "reasoning_format", "reasoning_effort",
                                "max_reasoning_tokens"}


@dataclass(frozen=True)
class Call:
    """A parsed request: what the scheduler runs plus how the answer is shaped."""

    endpoint: str  # "completions", "chat", "responses" or "messages"
    request: Request
    stream: bool
    include_usage: bool
    logprobs: bool  # whether choices carry logprobs (the count is request.logprobs)
    tools: bool = False  # chat: parse <tool_call> blocks into tool_calls
    batch: tuple[Request, ...] = ()  # a batch of prompts: every request, `request` first
    # The body's names for what the scheduler calls "prompt" and "max_tokens", for errors.
    prompt_param: str = "prompt"
    max_tokens_param: str = "max_tokens"

    @property
    def requests(self) -> tuple[Request, ...]:
        """One scheduler request per prompt."""
        return self.batch or (self.request,)


def _prompts(body: dict, tokenizer) -> list[list[int]]:
    """The prompt, or a batch of prompts, as token ids."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return [_text_prompt(prompt, "prompt", tokenizer)]
    if isinstance(prompt, list) and prompt:
        if all(is_int(t) for t in prompt):
            return [_token_prompt(prompt, "prompt", tokenizer)]
        if all(isinstance(p, str) for p in prompt):
            return [_text_prompt(p, f"prompt[{i}]", tokenizer) for i, p in enumerate(prompt)]
        if all(isinstance(p, list) for p in prompt):
            return [_token_prompt(p, f"prompt[{i}]", tokenizer) for i, p in enumerate(prompt)]
        odd = _first_odd_item(prompt)
        raise bad(f"'prompt[{odd}]' is a {type(prompt[odd]).__name__}: 'prompt' must be a "
                  f"string, a list of token ids, a list of strings or a list of token-id "
                  f"lists", "prompt")
    raise bad("'prompt' must be a non-empty string, a list of token ids, a list of strings or "
              "a list of token-id lists", "prompt")


def _first_odd_item(items: list) -> int:
    """The index of the first item that breaks the list's kind (token id, string or list)."""
    kinds = (is_int, lambda p: isinstance(p, str), lambda p: isinstance(p, list))
    same = next((k for k in kinds if k(items[0])), None)
    if same is None:
        return 0
    return next(i for i, p in enumerate(items) if not same(p))


def _text_prompt(text: str, name: str, tokenizer) -> list[int]:
    if not text:
        raise bad(f"'{name}' is empty", "prompt")
    return tokenizer.encode(text)


def _token_prompt(ids: list, name: str, tokenizer) -> list[int]:
    if not ids:
        raise bad(f"'{name}' is empty", "prompt")
    for t in ids:
        if not is_int(t):
            raise bad(f"'{name}' holds a {type(t).__name__}; token ids are integers", "prompt")
        if not 0 <= t < tokenizer.vocab_size:
            raise bad(f"'{name}' token id {t} is outside the vocabulary "
                      f"0..{tokenizer.vocab_size - 1}", "prompt")
    return list(ids)


def parse_completion(body: Any, served, tokenizer) -> Call:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    check_model(body, served)
    echo = boolean(body, "echo", False)
    if body.get("suffix") is not None:
        raise bad("'suffix' is not supported", "suffix", "unsupported_value")
    n = integer(body, "n", 1, MAX_CHOICES, 1)
    best_of = integer(body, "best_of", 1, MAX_CHOICES, n)
    if best_of != n:
        raise bad("'best_of' other than n is not supported", "best_of", "unsupported_value")
    logprobs = integer(body, "logprobs", 0, MAX_LEGACY_LOGPROBS, None)
    stream, include_usage = stream_flags(body)
    check_user(body)
    if is_int(body.get("max_tokens")) and body["max_tokens"] == 0 and not echo:
        raise bad("'max_tokens' 0 is only allowed with echo: true (to score the prompt)",
                  "max_tokens")
    max_tokens = integer(body, "max_tokens", 0, None, DEFAULT_COMPLETION_TOKENS)
    params, stop = sampling(body), stop_strings(body)
    grammar = _response_format(body)
    requests = tuple(Request(prompt=tuple(ids), max_tokens=max_tokens, n=n, sampling=params,
                             stop=stop, logprobs=logprobs, echo=echo, grammar=grammar)
                     for ids in _prompts(body, tokenizer))
    return Call("completions", requests[0], stream, include_usage, logprobs is not None,
                batch=requests if len(requests) > 1 else ())


def _response_format(body: dict):
    from kipp.text.grammar import GrammarError, response_format_grammar

    try:
        return response_format_grammar(body.get("response_format"))
    except GrammarError as e:
        raise bad(str(e), "response_format") from None


@dataclass(frozen=True)
class ChatContext:
    """What every chat translator needs of the served model and the server's settings."""

    served: tuple[str, ...]  # the names a body's "model" may give
    tokenizer: object
    template: str | APIError  # the model's chat template, or the error chat requests get
    # (prompt_tokens, n, asked or None) -> max_tokens: the default when None is asked, else
    # `asked`, or with `clamp` the room left when `asked` is more (kipp.http.app).
    max_tokens: Callable[..., int]
    reasoning_format: str = "auto"  # the server's default (--reasoning-format)
    stops: tuple[str, ...] = ()  # the server's stop strings (--stop), added to every reply's


@dataclass(frozen=True)
class ChatTurn:
    """One assistant reply to build, whichever API asked for it: OpenAI-shaped messages and
    tools (the translators convert theirs), the constraint, reasoning and sampling."""

    messages: list
    tools: list | None = None  # OpenAI function tools, shown to the model
    parse_tools: bool = False  # split <tool_call> blocks out of the reply
    grammar: object = None  # kipp.text.grammar.Grammar (a forced call, a response format)
    enable_thinking: bool = True
    reasoning_format: str | None = None  # None: the server's
    reasoning_budget: int | None = None
    n: int = 1
    max_tokens: int | None = None
    clamp: bool = False  # a max_tokens beyond the room left is a ceiling, not an error
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    # the body's names, for errors
    messages_param: str = "messages"
    max_tokens_param: str = "max_tokens"
    reasoning_param: str = "reasoning_format"


def chat_request(turn: ChatTurn, ctx: ChatContext) -> Request:
    """The scheduler request of a chat reply, or an APIError naming the body's field."""
    from kipp.text.chat import ChatError, reply_prompt
    from kipp.text.reasoning import reasoning_for

    if isinstance(ctx.template, APIError):
        raise ctx.template  # a base checkpoint, or a template Kipp cannot render
    try:
        reasoning = reasoning_for(turn.reasoning_format or ctx.reasoning_format,
                                  turn.reasoning_budget)
    except ValueError as e:
        raise bad(str(e), turn.reasoning_param) from None
    try:
        text = reply_prompt(turn.messages, tools=turn.tools, template=ctx.template,
                            enable_thinking=turn.enable_thinking,
                            constrained=turn.grammar is not None,
                            reasoning_budget=turn.reasoning_budget)
    except ChatError as e:
        raise bad(f"'{turn.messages_param}': {e}", turn.messages_param) from None
    prompt = ctx.tokenizer.encode(text)
    asked = turn.max_tokens
    max_tokens = ctx.max_tokens(len(prompt), turn.n, asked, clamp=turn.clamp)
    stop = turn.stop + tuple(s for s in ctx.stops if s not in turn.stop)
    return Request(prompt=tuple(prompt), max_tokens=max_tokens, n=turn.n,
                   sampling=turn.sampling, stop=stop, logprobs=turn.logprobs,
                   grammar=turn.grammar, reasoning=reasoning)


def chat_constraint(response_format, tools, tool_choice, parallel: bool, *,
                    param: str = "tools"):
    """The grammar of a chat body's response format and tool choice (kipp.text.chat
    chat_grammar), or a 400 naming the field."""
    from kipp.text.chat import chat_grammar
    from kipp.text.grammar import GrammarError

    try:
        return chat_grammar(response_format, tools, tool_choice, parallel)
    except GrammarError as e:
        fields = ("tools", "tool_choice", "response_format")
        raise bad(str(e), e.param if e.param in fields else param) from None


def parse_chat(body: Any, ctx: ChatContext) -> Call:
    from kipp.text.reasoning import effort_budget

    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    check_model(body, ctx.served)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of messages", "messages")
    thinking = True
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        unknown = sorted(set(kwargs) - {"enable_thinking"})
        if unknown:
            raise bad(f"unsupported chat template argument '{unknown[0]}'",
                      "chat_template_kwargs")
        thinking = boolean(kwargs, "enable_thinking", True)
    tools, choice = body.get("tools"), body.get("tool_choice")
    grammar = chat_constraint(body.get("response_format"), tools, choice,
                              boolean(body, "parallel_tool_calls", True))
    n = integer(body, "n", 1, MAX_CHOICES, 1)
    want = boolean(body, "logprobs", False)
    top = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, None)
    if top is not None and not want:
        raise bad("'top_logprobs' requires logprobs: true", "top_logprobs")
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise bad("give either 'max_tokens' or 'max_completion_tokens', not both",
                  "max_completion_tokens")
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    budget = integer(body, "max_reasoning_tokens", 0, None, None)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if budget is not None:
            raise bad("give either 'max_reasoning_tokens' or 'reasoning_effort', not both",
                      "reasoning_effort")
        try:
            budget = effort_budget(effort) if isinstance(effort, str) else effort_budget("?")
        except ValueError as e:
            raise bad(f"'reasoning_effort': {e}", "reasoning_effort") from None
    fmt = body.get("reasoning_format")
    if fmt is not None and not isinstance(fmt, str):
        raise bad("'reasoning_format' must be a string", "reasoning_format")
    stream, include_usage = stream_flags(body)
    check_user(body)
    turn = ChatTurn(messages, tools=tools, parse_tools=tools is not None and choice != "none",
                    grammar=grammar, enable_thinking=thinking, reasoning_format=fmt,
                    reasoning_budget=budget, n=n, max_tokens=integer(body, name, 1, None, None),
                    sampling=sampling(body), stop=stop_strings(body),
                    logprobs=(top or 0) if want else None, max_tokens_param=name)
    request = chat_request(turn, ctx)
    return Call("chat", request, stream, include_usage, want, tools=turn.parse_tools,
                prompt_param="messages", max_tokens_param=name)
