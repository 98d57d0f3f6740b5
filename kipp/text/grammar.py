"""Constrained decoding: JSON Schema, regex and Lark grammars as a token mask per choice.

    grammar = json_schema_grammar({"type": "object", "properties": {...}})   # or a pydantic model
    matcher = Matcher(grammar_tokenizer(model.tokenizer, model.entry.stop_token_ids), grammar)
    token = sampler.sample(logits, history, allowed=matcher.allowed())
    matcher.consume(token)        # then prefetch([matcher]): the next mask, on a worker thread

The engine is llguidance (as in llama.cpp, vLLM and SGLang: Rust, numpy bitmasks, no torch). It
compiles JSON Schema, regular expressions and Lark grammars (JSON Schema embedded as `%json
{...}` builds the tool-call grammar) against the token trie, and each step says which ids may
come next. The sampler applies that mask on the host after logit bias and penalties, so
batching, n > 1, prefix reuse and logprobs work unchanged on every backend. The mask drops the
GIL: where the backend evaluates off the host CPU (`masks_ahead`: a GPU, Metal) the next masks
are computed on a worker thread during the eval; on a CPU backend, when the sampler asks.

JSON whitespace is bounded: at most one space between JSON tokens (`JSON_WHITESPACE`), which
admits both compact JSON and Python's json.dumps style (the style Qwen3's tool calls are
written in) but never lets a weak model fill max_tokens with blanks.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from kipp.errors import KippError

JSON_WHITESPACE = "[ ]?"  # between JSON tokens: nothing or one space, never more
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
ANY_JSON_OBJECT = {"type": "object"}
_FUNCTION_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class GrammarError(KippError, ValueError):
    """A schema, regex or grammar that cannot be enforced; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("constrained decoding needs the llguidance package: "
                           "pip install 'kipp[structured]'") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A constraint in llguidance's serialized form, and what it was made from.

    kind: "json_schema", "regex", "lark" or "tool_calls". `param` is the request field it came
    from, so a grammar that fails to compile is reported against that field.
    """

    kind: str
    source: str  # llguidance's grammar text (what LLMatcher reads)
    param: str


def schema_dict(schema: Any, param: str = "json_schema") -> dict:
    """A JSON Schema as a dict, from a dict, a JSON string or a pydantic model class (anything
    with model_json_schema()); checked against its metaschema (jsonschema). A pydantic model's
    objects are closed (additionalProperties: false unless it says otherwise), as the openai
    package's parse() does: the model ignores extra keys, so they are only room to wander."""
    if hasattr(schema, "model_json_schema"):
        schema = _closed(schema.model_json_schema())
    elif isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"{param} is not valid JSON: {e}", param) from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, Mapping):
        raise GrammarError(f"{param} must be a JSON Schema object (a dict or a pydantic model), "
                           f"not {type(schema).__name__}", param)
    schema = dict(schema)
    _check_schema(schema, param)
    return schema


def _closed(schema):
    """The schema with every object that allows any extra key closed to extra keys."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _closed(value) for key, value in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _check_schema(schema: dict, param: str) -> None:
    try:
        import jsonschema
    except ImportError:
        raise GrammarError("checking JSON schemas needs the jsonschema package: "
                           "pip install 'kipp[structured]'") from None
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise GrammarError(f"{param} is not a valid JSON Schema: {e.message}"
                           + (f" (at {where})" if where else ""), param) from None


def json_schema_grammar(schema: Any, param: str = "json_schema") -> Grammar:
    """Output that is one JSON value valid against `schema` (dict, JSON text or pydantic model)."""
    llg = _llguidance()
    schema = schema_dict(schema, param)
    source = llg.LLMatcher.grammar_from_json_schema(schema, defaults=dict(JSON_OPTIONS))
    return _checked(Grammar("json_schema", source, param))


def json_object_grammar(param: str = "response_format") -> Grammar:
    """Any JSON object (OpenAI's JSON mode)."""
    return json_schema_grammar(ANY_JSON_OBJECT, param)


def regex_grammar(pattern: str, param: str = "regex") -> Grammar:
    """Output that matches `pattern` in full (Rust regex syntax, as llguidance reads it)."""
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError(f"{param} must be a non-empty regular expression string", param)
    return _checked(Grammar("regex", _llguidance().LLMatcher.grammar_from_regex(pattern), param))


def lark_grammar(text: str, param: str = "grammar") -> Grammar:
    """Output derived from a Lark grammar (llguidance's dialect; GBNF is converted)."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(f"{param} must be a non-empty Lark or GBNF grammar string", param)
    try:
        source = _llguidance().grammar_from("grammar", text)
    except ValueError as e:
        raise GrammarError(f"{param}: {e}", param) from None
    return _checked(Grammar("lark", source, param))


@dataclass(frozen=True)
class FunctionTool:
    """One OpenAI function tool: its name and its parameters' JSON Schema."""

    name: str
    parameters: dict


def function_tools(tools: Any, param: str = "tools") -> list[FunctionTool]:
    """OpenAI `tools` ([{"type": "function", "function": {"name", "parameters", ...}}]) checked
    and reduced to (name, parameters schema); pydantic models are accepted as parameters."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)) or not tools:
        raise GrammarError(f"'{param}' must be a non-empty list of function tools", param)
    out: list[FunctionTool] = []
    for k, tool in enumerate(tools):
        where = f"{param}[{k}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise GrammarError(f"{where} must be {{\"type\": \"function\", \"function\": ...}}",
                               param)
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise GrammarError(f"{where}.function must be an object", param)
        name = function.get("name")
        if not isinstance(name, str) or not name or not set(name) <= _FUNCTION_NAME_CHARS \
                or len(name) > 64:
            raise GrammarError(f"{where}.function.name must be 1-64 of a-z, A-Z, 0-9, _, -, .; "
                               f"got {name!r}", param)
        if any(t.name == name for t in out):
            raise GrammarError(f"{where}: two tools are named {name!r}", param)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        out.append(FunctionTool(name, schema_dict(parameters, f"{where}.function.parameters")))
    return out


def tool_call_grammar(tools: Sequence[FunctionTool], *, name: str | None = None,
                      parallel: bool = True, param: str = "tool_choice") -> Grammar:
    """Output that is Qwen3 tool calls and nothing else: one `<tool_call>` block (or, with
    `parallel`, one or more separated by newlines), each holding
    {"name": ..., "arguments": ...} whose arguments match that function's schema. `name`
    restricts the calls to one function (tool_choice naming a function: exactly one call)."""
    chosen = [t for t in tools if name is None or t.name == name]
    if not chosen:
        raise GrammarError(f"tool_choice names function {name!r}, which is not in tools", param)
    calls = [_call_schema(t) for t in chosen]
    body = calls[0] if len(calls) == 1 else {"anyOf": calls}
    body["x-guidance"] = dict(JSON_OPTIONS)
    repeat = ' ("\\n" call)*' if parallel and name is None else ""
    lark = (f"start: call{repeat}\n"
            f'call: "<tool_call>\\n" %json {json.dumps(body)} "\\n</tool_call>"\n')
    return _checked(Grammar("tool_calls", _llguidance().LLMatcher.grammar_from_lark(lark), param))


def response_format_grammar(value: Any, param: str = "response_format", *,
                            bare_schema: bool = False) -> Grammar | None:
    """OpenAI's response_format as a grammar: {"type": "text"} -> None, {"type": "json_object"}
    -> any JSON object, {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    -> that schema (enforced whether strict or not). With `bare_schema` (the Python API) a
    pydantic model class or a plain JSON Schema dict is accepted too."""
    if value is None:
        return None
    if hasattr(value, "model_json_schema"):
        if bare_schema:
            return json_schema_grammar(value, param)
    elif isinstance(value, Mapping):
        kind = value.get("type")
        if kind == "text" and set(value) == {"type"}:
            return None
        if kind == "json_object" and set(value) == {"type"}:
            return json_object_grammar(param)
        if kind == "json_schema" and set(value) == {"type", "json_schema"}:
            return _json_schema_format(value["json_schema"], param)
        if bare_schema and kind not in ("text", "json_object", "json_schema"):
            return json_schema_grammar(value, param)
    raise GrammarError(f"{param} must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or "
                       f"{{\"type\": \"json_schema\", \"json_schema\": {{\"name\": ..., "
                       f"\"schema\": ...}}}}" + (", a pydantic model or a JSON Schema dict"
                                                  if bare_schema else ""), param)


def _json_schema_format(spec: Any, param: str) -> Grammar:
    where = f"{param}.json_schema"
    if not isinstance(spec, Mapping):
        raise GrammarError(f"{where} must be an object with a name and a schema", param)
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise GrammarError(f"{where}: unsupported field {unknown[0]!r}", param)
    name = spec.get("name")
    if not isinstance(name, str) or not name or not set(name) <= _FUNCTION_NAME_CHARS:
        raise GrammarError(f"{where}.name must be a non-empty name of a-z, A-Z, 0-9, _, -; "
                           f"got {name!r}", param)
    if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
        raise GrammarError(f"{where}.strict must be a boolean", param)
    if "schema" not in spec:
        raise GrammarError(f"{where}.schema is required", param)
    try:
        return json_schema_grammar(spec["schema"], f"{where}.schema")
    except GrammarError as e:
        raise GrammarError(str(e), param) from None


def tool_choice_grammar(tools: Sequence[FunctionTool] | None, tool_choice: Any,
                        parallel: bool = True, param: str = "tool_choice") -> Grammar | None:
    """OpenAI's tool_choice as a grammar: "auto" (or None) and "none" constrain nothing;
    "required" forces one or more calls (exactly one when not `parallel`); {"type": "function",
    "function": {"name": ...}} forces exactly one call of that function."""
    if tool_choice in (None, "auto", "none"):
        return None
    if not tools:
        raise GrammarError(f"{param} {tool_choice!r} needs tools", param)
    if tool_choice == "required":
        return tool_call_grammar(tools, parallel=parallel, param=param)
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), Mapping) \
            and isinstance(tool_choice["function"].get("name"), str):
        return tool_call_grammar(tools, name=tool_choice["function"]["name"], param=param)
    raise GrammarError(f"{param} must be \"auto\", \"none\", \"required\" or {{\"type\": "
                       f"\"function\", \"function\": {{\"name\": ...}}}}, got {tool_choice!r}",
                       param)


def _call_schema(tool: FunctionTool) -> dict:
    # Properties in this order: Qwen3's template writes the name before the arguments.
    return {"type": "object", "properties": {"name": {"const": tool.name},
                                             "arguments": tool.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _checked(grammar: Grammar) -> Grammar:
    """The grammar, if llguidance can compile it; else a GrammarError naming its field."""
    llg = _llguidance()
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar.source)
    if is_error:
        message = messages[0] if messages else "unknown error"
        raise GrammarError(f"{grammar.param}: cannot enforce this {grammar.kind.replace('_', ' ')}"
                           f": {message}", grammar.param)
    return grammar


class _TokenizerView:
    """What llguidance's TokenizerWrapper reads from a tokenizer: every id's bytes, the special
    (control) ids, and an encode function (used to tokenize text a grammar forces)."""

    def __init__(self, tokenizer, eos: int):
        from kipp.text.vocab import TOKEN_CONTROL

        self.eos_token_id, self.bos_token_id = eos, None
        self.tokens = [tokenizer.decode_bytes([i]) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = [i for i, kind in enumerate(tokenizer.data.token_types)
                                  if kind == TOKEN_CONTROL]
        self._tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)


_tokenizers: dict = {}


def grammar_tokenizer(tokenizer, stop_ids: Sequence[int]):
    """llguidance's view of Kipp's tokenizer, built once per distinct vocabulary (~2 s for the
    token trie; models loaded from the same artifact share it). `stop_ids` are the ids that end
    a sequence: a grammar admits them once it is complete."""
    data = tokenizer.data
    key = (data.tokens, data.token_types, data.merges, tuple(int(t) for t in stop_ids))
    if key not in _tokenizers:
        llg = _llguidance()
        view = _TokenizerView(tokenizer, key[3][0])
        if len(_tokenizers) >= 2:  # the family shares one vocabulary (base and instruct stops)
            _tokenizers.pop(next(iter(_tokenizers)))
        _tokenizers[key] = llg.LLTokenizer(llg.TokenizerWrapper(view),
                                           n_vocab=tokenizer.vocab_size, eos_token=list(key[3]))
    return _tokenizers[key]


_worker: ThreadPoolExecutor | None = None


def _mask_worker() -> ThreadPoolExecutor:
    """One thread computes masks ahead (llguidance drops the GIL while it does)."""
    global _worker
    if _worker is None:
        _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kipp-grammar")
    return _worker


def masks_ahead(backend) -> bool:
    """Whether to compute the next masks while `backend` evaluates: yes where its eval runs off
    the host CPU (a GPU through JAX, Metal through MLX). A CPU backend's eval already keeps every
    core busy, so a mask computed beside it only slows both; there the mask is computed when the
    sampler asks for it (bench/grammar_bench.py measures both ways)."""
    mesh = getattr(backend, "mesh", None)
    device = mesh.devices.flat[0] if mesh is not None else getattr(backend, "device", None)
    return getattr(device, "platform", device) in ("gpu", "cuda", "rocm", "tpu")


def prefetch(matchers: Sequence["Matcher"]) -> None:
    """Start computing the next mask of each matcher, all in one worker task (one hand-off of
    the GIL per step, however many sequences are constrained)."""
    todo = [m for m in matchers if m._future is None and not m._fresh]
    if todo:
        future = _mask_worker().submit(_compute_all, todo)
        for m in todo:
            m._future = future


def _compute_all(matchers: Sequence["Matcher"]) -> None:
    for m in matchers:
        m._compute_bits()


class Matcher:
    """The grammar state of one sequence: which ids may come next, and the ids so far.

    Only emitted tokens are consumed, so speculation needs no rollback: a draft is checked
    with `valid_prefix` and every verified row is sampled under the mask of its own position.
    Not thread-safe, except that `prefetch` hands the matcher to the mask worker until the
    next call takes it back (every method waits for it first).
    """

    def __init__(self, tokenizer, grammar: Grammar, *, _matcher=None):
        llg = _llguidance()
        self.grammar = grammar
        self._tokenizer = tokenizer
        self._matcher = _matcher if _matcher is not None else llg.LLMatcher(
            tokenizer, grammar.source, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(f"{grammar.param}: {self._matcher.get_error()}", grammar.param)
        self.vocab_size = tokenizer.vocab_size
        self._bits = np.zeros(-(-self.vocab_size // 32), dtype=np.int32)
        self._fresh = False  # _bits hold the mask of the current state
        self._allowed: np.ndarray | None = None
        self._future: Future | None = None

    def copy(self) -> "Matcher":
        """An independent matcher in the same state (for the other choices of a request)."""
        self.wait()
        return Matcher(self._tokenizer, self.grammar, _matcher=self._matcher.deep_copy())

    def allowed(self) -> np.ndarray:
        """Bool mask [vocab]: the ids the grammar admits next (stop ids once it is complete)."""
        self.wait()
        if self._allowed is None:
            if not self._fresh:
                self._compute_bits()
            bits = np.unpackbits(self._bits.view(np.uint8), count=self.vocab_size,
                                 bitorder="little")
            self._allowed = bits.view(np.bool_)
        if not self._allowed.any():
            raise GrammarError(f"{self.grammar.param}: the grammar admits no token here: "
                               f"{self._matcher.get_error() or 'dead end'}", self.grammar.param)
        return self._allowed

    def prefetch(self) -> None:
        """Start computing the next mask on the worker thread (after `consume`)."""
        prefetch([self])

    def wait(self) -> None:
        if self._future is not None:
            future, self._future = self._future, None
            future.result()

    def _compute_bits(self) -> None:
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._fresh = True

    def consume(self, token: int) -> None:
        """Advance past an emitted token (one the mask allowed)."""
        self.wait()
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"{self.grammar.param}: token {token} breaks the grammar: "
                               f"{self._matcher.get_error()}", self.grammar.param)
        self._fresh, self._allowed = False, None

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (a draft) the grammar would accept from here."""
        self.wait()
        return int(self._matcher.validate_tokens([int(t) for t in tokens])) if tokens else 0

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and admits nothing more: only a stop id may follow."""
        self.wait()
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        self.wait()
        return self._matcher.get_error() if self._matcher.is_error() else None
