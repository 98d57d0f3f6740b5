"""The fields every API body shares, validated: numbers and ranges, sampling, stop strings,
stream flags, and the APIError that names a bad field (kipp.http.schema, .responses and
.messages build their calls from these)."""

from __future__ import annotations

import json
import math
import re

from flask import g, request

from kipp.text.sampling import VOCAB_SIZE, SamplingError, SamplingParams

MAX_STOP_STRINGS = 4
# The longest stop string accepted. Matching costs the same per token whatever the length
# (kipp.text.stops), but compiling one is linear in it and its table is held per request.
MAX_STOP_CHARS = 131_072
MAX_JSON_DEPTH = 128  # nesting of arrays and objects in a body; deeper is a 400
SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                   "presence_penalty", "repetition_penalty", "logit_bias", "seed"}


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


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def integer(body: dict, name: str, low: int, high: int | None, default):
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value):
        raise bad(f"'{name}' must be an integer, got {type(value).__name__}", name)
    if value < low or (high is not None and value > high):
        limit = f"{low}..{high}" if high is not None else f">= {low}"
        raise bad(f"'{name}' must be {limit}, got {value}", name)
    return value


def number(body: dict, name: str, low: float, high: float | None, default, *,
            low_open: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if not is_number(value):
        raise bad(f"'{name}' must be a number, got {type(value).__name__}", name)
    if value < low or (low_open and value == low) or (high is not None and value > high):
        left = "(" if low_open else "["
        right = f"{high}]" if high is not None else "inf)"
        raise bad(f"'{name}' must be in {left}{low}, {right}, got {value}", name)
    return float(value)


def boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be a boolean, got {type(value).__name__}", name)
    return value


def check_fields(body: dict, allowed: set[str], endpoint: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"unsupported field '{unknown[0]}' for {endpoint}; Kipp accepts: "
                  f"{', '.join(sorted(allowed))}", unknown[0], "unsupported_field")


def check_model(body: dict, served) -> None:
    """The body's "model" must be one of the `served` names (a str or a tuple of them)."""
    names = (served,) if isinstance(served, str) else tuple(served)
    model = body.get("model")
    if model is None:
        raise bad("'model' is required", "model")
    if not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    if model not in names:
        listed = ", ".join(f"'{n}'" for n in names)
        raise APIError(404, f"model '{model}' is not served here; this server serves {listed}",
                       "model", "model_not_found")


def logit_bias(body: dict) -> dict[int, float]:
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
        if not is_number(value) or not -100 <= value <= 100:
            raise bad(f"'logit_bias[{key}]' must be a number in [-100, 100]", "logit_bias")
        pairs[token] = float(value)
    return pairs


def sampling_param(message: str) -> str | None:
    """The field a SamplingError message is about (it starts with the parameter's name)."""
    found = re.match(r"[a-z_]+", message)
    return found.group(0) if found and found.group(0) in SAMPLING_FIELDS else None


def sampling(body: dict) -> SamplingParams:
    pairs = logit_bias(body)
    seed = body.get("seed")
    if seed is not None and not is_int(seed):
        raise bad("'seed' must be an integer", "seed")
    try:
        return SamplingParams(
            temperature=number(body, "temperature", 0.0, 2.0, 1.0),
            top_p=number(body, "top_p", 0.0, 1.0, 1.0, low_open=True),
            top_k=integer(body, "top_k", 0, None, 0),
            min_p=number(body, "min_p", 0.0, 1.0, 0.0),
            frequency_penalty=number(body, "frequency_penalty", -2.0, 2.0, 0.0),
            presence_penalty=number(body, "presence_penalty", -2.0, 2.0, 0.0),
            repetition_penalty=number(body, "repetition_penalty", 0.0, None, 1.0,
                                       low_open=True),
            logit_bias=pairs,
            seed=None if seed is None else seed % 2**64,
        )
    except SamplingError as e:
        raise bad(str(e), sampling_param(str(e))) from None


def stop_strings(body: dict) -> tuple[str, ...]:
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


def stream_flags(body: dict) -> tuple[bool, bool]:
    stream = boolean(body, "stream", False)
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
    return stream, boolean(options, "include_usage", False)


def check_user(body: dict) -> None:
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("'user' must be a string", "user")


def json_body():
    raw = request.get_data(cache=False)
    if not raw:
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}",
                       code="invalid_json") from None
    except RecursionError:  # the parser recursed past Python's limit: nested far too deep
        raise _too_deep() from None
    if _depth_exceeds(body, MAX_JSON_DEPTH):
        raise _too_deep()
    g.json_body = body  # the body, read once (cache=False), for Server.answer's "model"
    return body


def _too_deep() -> APIError:
    return APIError(400, f"the request body nests arrays and objects more than "
                         f"{MAX_JSON_DEPTH} deep", code="invalid_json")


def _depth_exceeds(value, limit: int) -> bool:
    """Whether arrays and objects nest deeper than `limit` (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(
            item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False
