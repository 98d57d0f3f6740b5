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

import math
import re
from dataclasses import dataclass
from typing import Any

from kipp.engine.scheduler import MAX_CHOICES, Request
from kipp.text.sampling import VOCAB_SIZE, SamplingError, SamplingParams

MAX_STOP_STRINGS = 4
# The longest stop string accepted. Matching costs the same per token whatever the length
# (kipp.text.stops), but compiling one is linear in it and its table is held per request.
MAX_STOP_CHARS = 131_072
MAX_LEGACY_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


_SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                    "presence_penalty", "repetition_penalty", "logit_bias", "seed"}
_COMMON_FIELDS = {"model", "max_tokens", "n", "stream", "stream_options", "stop", "user"} | \
    _SAMPLING_FIELDS
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo", "suffix", "best_of",
                                      "response_format"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                "chat_template_kwargs", "response_format", "tools", "tool_choice",
                                "parallel_tool_calls"}


@dataclass(frozen=True)
class Call:
    """A parsed request: what the scheduler runs plus how the answer is shaped."""

    endpoint: str  # "completions" or "chat"
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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _integer(body: dict, name: str, low: int, high: int | None, default):
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise bad(f"'{name}' must be an integer, got {type(value).__name__}", name)
    if value < low or (high is not None and value > high):
        limit = f"{low}..{high}" if high is not None else f">= {low}"
        raise bad(f"'{name}' must be {limit}, got {value}", name)
    return value


def _number(body: dict, name: str, low: float, high: float | None, default, *,
            low_open: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise bad(f"'{name}' must be a number, got {type(value).__name__}", name)
    if value < low or (low_open and value == low) or (high is not None and value > high):
        left = "(" if low_open else "["
        right = f"{high}]" if high is not None else "inf)"
        raise bad(f"'{name}' must be in {left}{low}, {right}, got {value}", name)
    return float(value)


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be a boolean, got {type(value).__name__}", name)
    return value


def _check_fields(body: dict, allowed: set[str], endpoint: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"unsupported field '{unknown[0]}' for {endpoint}; Kipp accepts: "
                  f"{', '.join(sorted(allowed))}", unknown[0], "unsupported_field")


def _model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is None:
        raise bad("'model' is required", "model")
    if not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    if model != served:
        raise APIError(404, f"model '{model}' is not served here; this server serves "
                            f"'{served}'", "model", "model_not_found")


def _logit_bias(body: dict) -> dict[int, float]:
    bias = body.get("logit_bias")
    pairs: dict[int, float] = {}
    if bias is None:
        return pairs
    if not isinstance(bias, dict):
        raise bad("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    for key, value in bias.items():
        if not re.fullmatch(r"[0-9]+", key):
            raise bad(f"'logit_bias' key {key!r} is not a token id", "logit_bias")
        token = int(key)
        if token >= VOCAB_SIZE:
            raise bad(f"'logit_bias' token id {token} is outside the vocabulary "
                      f"0..{VOCAB_SIZE - 1}", "logit_bias")
        if token in pairs:  # "1" and "01": one token given two biases
            raise bad(f"'logit_bias' gives token id {token} twice", "logit_bias")
        if not _is_number(value) or not -100 <= value <= 100:
            raise bad(f"'logit_bias[{key}]' must be a number in [-100, 100]", "logit_bias")
        pairs[token] = float(value)
    return pairs


def _sampling_param(message: str) -> str | None:
    """The field a SamplingError message is about (it starts with the parameter's name)."""
    found = re.match(r"[a-z_]+", message)
    return found.group(0) if found and found.group(0) in _SAMPLING_FIELDS else None


def _sampling(body: dict) -> SamplingParams:
    pairs = _logit_bias(body)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad("'seed' must be an integer", "seed")
    try:
        return SamplingParams(
            temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
            top_p=_number(body, "top_p", 0.0, 1.0, 1.0, low_open=True),
            top_k=_integer(body, "top_k", 0, None, 0),
            min_p=_number(body, "min_p", 0.0, 1.0, 0.0),
            frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0, 0.0),
            presence_penalty=_number(body, "presence_penalty", -2.0, 2.0, 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 0.0, None, 1.0,
                                       low_open=True),
            logit_bias=pairs,
            seed=None if seed is None else seed % 2**64,
        )
    except SamplingError as e:
        raise bad(str(e), _sampling_param(str(e))) from None


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"'stop' allows at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise bad("'stop' strings must not be empty", "stop")
    longest = max(len(s) for s in stops)
    if longest > MAX_STOP_CHARS:
        raise bad(f"a 'stop' string is {longest} characters long; at most {MAX_STOP_CHARS} "
                  f"are allowed", "stop")
    return tuple(stops)


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad("'stream_options' is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise bad(f"unsupported field 'stream_options.{unknown[0]}'", "stream_options")
    return stream, _boolean(options, "include_usage", False)


def _user(body: dict) -> None:
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("'user' must be a string", "user")


def _prompts(body: dict, tokenizer) -> list[list[int]]:
    """The prompt, or a batch of prompts, as token ids."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return [_text_prompt(prompt, "prompt", tokenizer)]
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
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
    kinds = (_is_int, lambda p: isinstance(p, str), lambda p: isinstance(p, list))
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
        if not _is_int(t):
            raise bad(f"'{name}' holds a {type(t).__name__}; token ids are integers", "prompt")
        if not 0 <= t < tokenizer.vocab_size:
            raise bad(f"'{name}' token id {t} is outside the vocabulary "
                      f"0..{tokenizer.vocab_size - 1}", "prompt")
    return list(ids)


def parse_completion(body: Any, served: str, tokenizer) -> Call:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    _model(body, served)
    echo = _boolean(body, "echo", False)
    if body.get("suffix") is not None:
        raise bad("'suffix' is not supported", "suffix", "unsupported_value")
    n = _integer(body, "n", 1, MAX_CHOICES, 1)
    best_of = _integer(body, "best_of", 1, MAX_CHOICES, n)
    if best_of != n:
        raise bad("'best_of' other than n is not supported", "best_of", "unsupported_value")
    logprobs = _integer(body, "logprobs", 0, MAX_LEGACY_LOGPROBS, None)
    stream, include_usage = _stream(body)
    _user(body)
    if _is_int(body.get("max_tokens")) and body["max_tokens"] == 0 and not echo:
        raise bad("'max_tokens' 0 is only allowed with echo: true (to score the prompt)",
                  "max_tokens")
    max_tokens = _integer(body, "max_tokens", 0, None, DEFAULT_COMPLETION_TOKENS)
    sampling, stop = _sampling(body), _stop(body)
    grammar = _response_format(body)
    requests = tuple(Request(prompt=tuple(ids), max_tokens=max_tokens, n=n, sampling=sampling,
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


def _chat_constraint(body: dict):
    """(grammar, parse tool calls?, tools to render) of a chat body."""
    from kipp.text.chat import chat_grammar
    from kipp.text.grammar import GrammarError

    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = _boolean(body, "parallel_tool_calls", True)
    try:
        grammar = chat_grammar(body.get("response_format"), tools, choice, parallel)
    except GrammarError as e:
        fields = ("tools", "tool_choice", "response_format")
        raise bad(str(e), e.param if e.param in fields else "tools") from None
    return grammar, tools is not None and choice != "none", tools


def parse_chat(body: Any, served: str, tokenizer, has_template: bool, context_length: int,
               default_max_tokens, template: str = "qwen3") -> Call:
    from kipp.text.chat import ChatError, close_reasoning, render

    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    _model(body, served)
    if not has_template:
        raise bad(f"'{served}' is a base checkpoint: it has no chat template; use "
                  f"/v1/completions", "model", "no_chat_template")
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
        thinking = _boolean(kwargs, "enable_thinking", True)
    grammar, parse_tools, tools = _chat_constraint(body)
    try:
        text = render(messages, add_generation_prompt=True, enable_thinking=thinking,
                      tools=tools, template=template)
    except ChatError as e:
        raise bad(f"'messages': {e}", "messages") from None
    if grammar is not None:  # a constrained reply starts after an empty think block
        text = close_reasoning(text, template)
    prompt = tokenizer.encode(text)
    n = _integer(body, "n", 1, MAX_CHOICES, 1)
    want = _boolean(body, "logprobs", False)
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, None)
    if top is not None and not want:
        raise bad("'top_logprobs' requires logprobs: true", "top_logprobs")
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise bad("give either 'max_tokens' or 'max_completion_tokens', not both",
                  "max_completion_tokens")
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _integer(body, name, 1, None, None)
    if max_tokens is None:
        max_tokens = _default_max_tokens(default_max_tokens, len(prompt), n, context_length)
    stream, include_usage = _stream(body)
    _user(body)
    request = Request(prompt=tuple(prompt), max_tokens=max_tokens, n=n,
                      sampling=_sampling(body), stop=_stop(body),
                      logprobs=(top or 0) if want else None, grammar=grammar)
    return Call("chat", request, stream, include_usage, want, tools=parse_tools,
                prompt_param="messages", max_tokens_param=name)


def _default_max_tokens(default, prompt_tokens: int, n: int, context_length: int) -> int:
    """max_tokens for a chat request that gives none: `default(prompt_tokens, n)` when it is
    a function (the server derives it from its KV pool), else `default` within the context."""
    if callable(default):
        return default(prompt_tokens, n)
    return max(1, min(default, context_length - prompt_tokens))
