"""The Flask app: thin handlers over the scheduler, one translator per API.

A handler parses the body into a Call (kipp.http.schema for OpenAI's chat and completions,
kipp.http.responses for the Responses API, kipp.http.messages for Anthropic's Messages API),
submits its Requests to the scheduler (one per prompt, as a TicketGroup) and turns the events
into a JSON response or a server-sent event stream through the API's Shape (kipp.http.shape).
Every API answers its errors in its own shape (error_shape_for). Handlers never touch the
model: the tokenizer (pure) is the one model attribute they read, for prompts and for the text
of logprob tokens. A client that goes away cancels its own request, streamed or not: a
waiting handler polls waitress's `client_disconnected` (the server runs with a request
lookahead so that it sees the connection close), and for a stream the WSGI server also closes
the response iterator, whose `finally` cancels the tickets.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import re
import time

from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from kipp.engine.scheduler import (
    SHUTDOWN_MESSAGE,
    Done,
    Failed,
    QueueFull,
    SchedulerError,
    ShuttingDown,
    Ticket,
)
from kipp.http.access import KEY_ERRORS, Access  # noqa: F401  (Access: API)
from kipp.http.fields import MAX_JSON_DEPTH, json_body  # noqa: F401  (MAX_JSON_DEPTH: API)
from kipp.http.metrics import Metrics
from kipp.http.schema import APIError, Call, ChatContext, parse_chat, parse_completion
from kipp.http.shape import Shape, TokenText, error_shape, shape_for

log = logging.getLogger("kipp.http")

MAX_BODY_BYTES = 32 << 20  # agents send tens of thousands of tokens of tools and history
DEFAULT_CHAT_MAX_TOKENS = 1024
# How often a waiting handler checks that the engine is alive and the client still there.
EVENT_POLL_SECONDS = 0.25


class Server:
    """The app's shared state: the model, the scheduler, the served names, and `answer`, the one
    path from a parsed Call to its response that every API's handler takes."""

    def __init__(self, model, scheduler, served: tuple[str, ...], chat_max_tokens: int,
                 reasoning_format: str = "auto", max_output_tokens: int | None = None,
                 stops: tuple[str, ...] = ()):
        self.model, self.scheduler = model, scheduler
        self.base_names = served  # the base weights' names; the first is the one reported
        # a request's "model" may also name a loaded LoRA adapter (as vLLM's --lora-modules)
        self.adapters = tuple(getattr(model.backend, "adapters", {}))
        clash = sorted(set(self.adapters) & set(served))
        if clash:
            raise ValueError(f"adapter name {clash[0]!r} is also a served model name")
        self.tokenizer = model.tokenizer
        self.token_text = TokenText(model.tokenizer)
        self.metrics = Metrics(scheduler)
        self.chat_max_tokens = chat_max_tokens
        self.reasoning_format = reasoning_format
        self.max_output_tokens = max_output_tokens  # a ceiling on every chat-family reply
        self.stops = stops  # stop strings every chat-family reply also ends at
        self.template = _chat_template(model, served[0])

    @property
    def name(self) -> str:
        return self.served[0]

    @property
    def served(self) -> tuple[str, ...]:
        """Every name a body's "model" may give: the base's, then the adapters'."""
        return self.base_names + self.adapters

    def _under_adapter(self, call: Call) -> Call:
        """The call's requests under the adapter the body's "model" names (checked already
        against `served` by the parser), else unchanged: the base weights."""
        body = g.get("json_body")
        name = body.get("model") if isinstance(body, dict) else None
        if name not in self.adapters:
            return call
        return dataclasses.replace(
            call, request=dataclasses.replace(call.request, adapter=name),
            batch=tuple(dataclasses.replace(r, adapter=name) for r in call.batch))

    def chat_context(self) -> ChatContext:
        """What a chat translator needs (kipp.http.schema.chat_request)."""
        return ChatContext(self.served, self.tokenizer, self.template, self.max_tokens,
                           self.reasoning_format, self.stops)

    def max_tokens(self, prompt_tokens: int, n: int, asked: int | None, *,
                   clamp: bool = False) -> int:
        """A chat reply's max_tokens: the server's default when none is asked; with `clamp`,
        what is asked cut to the room the context and the pool leave; never more than the
        server's --max-output-tokens."""
        ceiling = self.max_output_tokens
        if asked is None:
            preferred = self.chat_max_tokens if ceiling is None else min(self.chat_max_tokens,
                                                                         ceiling)
            return self.scheduler.default_max_tokens(prompt_tokens, n, preferred)
        if ceiling is not None:
            asked = min(asked, ceiling)
        if clamp:
            return self.scheduler.default_max_tokens(prompt_tokens, n, asked)
        return asked

    def answer(self, call: Call, shape: Shape, endpoint: str):
        """Submit the call and answer: an SSE stream, or the whole response once it is done."""
        call = self._under_adapter(call)
        ticket = _submit(self.scheduler, call)
        gone = request.environ.get("waitress.client_disconnected")
        if call.stream:
            return Response(_sse(ticket, shape, self, endpoint, gone),
                            content_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                     **shape.headers()})
        try:
            events = list(_events(ticket, self.scheduler, gone))
        finally:
            if not ticket.ended:
                ticket.cancel()
        last = events[-1]
        if isinstance(last, Failed):
            raise _failure(last)
        self.metrics.observe(ticket, endpoint)
        response = json_response(shape.response(events))
        response.headers.update(shape.headers())
        return response


def create_app(model, scheduler, *, model_name: str | None = None,
               served_names: tuple[str, ...] = (),
               chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS, reasoning_format: str = "auto",
               max_output_tokens: int | None = None, stops: tuple[str, ...] = (),
               access: Access | None = None, runtime_lora: bool = False) -> Flask:
    """The app over a started Scheduler of `model`: OpenAI's chat and completions, the
    Responses API, Anthropic's Messages API, tokenize/detokenize, health and metrics.
    `served_names`: the model names requests may give (the first is reported; default the
    checkpoint id, or `model_name`). `runtime_lora`: POST /v1/load_lora_adapter and
    /v1/unload_lora_adapter load and unload LoRA adapters from server-side folders."""
    from kipp.http import messages, responses

    app = Flask("kipp")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    names = tuple(served_names) or (model_name or model.entry.id,)
    server = Server(model, scheduler, names, chat_max_tokens, reasoning_format,
                    max_output_tokens, tuple(stops))
    access = access or Access()
    _error_handlers(app, server.metrics)
    _access(app, access)
    _info_routes(app, server)
    _generation_routes(app, server)
    _token_routes(app, server)
    responses.register(app, server)
    messages.register(app, server)
    if runtime_lora:
        _lora_routes(app, server)
    return app


def _lora_routes(app: Flask, server: Server) -> None:
    """Loading and unloading LoRA adapters at run time (vLLM's endpoint names and fields):
    validated in the handler, registered with the backend on the engine thread between steps."""
    from kipp.http.fields import bad, check_fields
    from kipp.lora.adapter import AdapterError, load_adapter

    def name_of(body: dict, endpoint: str, fields: set[str]) -> str:
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        check_fields(body, fields, endpoint)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise bad("'lora_name' must be a non-empty string", "lora_name")
        return name

    @app.post("/v1/load_lora_adapter")
    def load_lora():
        body = json_body()
        name = name_of(body, "/v1/load_lora_adapter", {"lora_name", "lora_path"})
        if name in server.served:
            raise bad(f"'{name}' is served already", "lora_name")
        if not isinstance(body.get("lora_path"), str):
            raise bad("'lora_path' must be a string (an adapter folder on the server)",
                      "lora_path")
        try:
            adapter = load_adapter(body["lora_path"], server.model.entry, name)
        except AdapterError as e:
            raise bad(str(e), "lora_path") from None
        server.scheduler.call_on_engine(lambda: server.model.backend.add_adapter(adapter))
        server.adapters = tuple(server.model.backend.adapters)
        return {"object": "lora_adapter", "id": name, "loaded": True}

    @app.post("/v1/unload_lora_adapter")
    def unload_lora():
        name = name_of(json_body(), "/v1/unload_lora_adapter", {"lora_name"})
        if name not in server.adapters:
            raise APIError(404, f"no adapter '{name}' is loaded", "lora_name", "model_not_found")

        def unload():
            if server.scheduler.uses_adapter(name):
                raise APIError(409, f"adapter '{name}' has requests queued or running",
                               "lora_name", "adapter_in_use")
            server.model.backend.remove_adapter(name)
        server.scheduler.call_on_engine(unload)
        server.adapters = tuple(server.model.backend.adapters)
        return {"object": "lora_adapter", "id": name, "loaded": False}


def error_response(e: APIError, path: str | None = None) -> Response:
    """An APIError as a JSON response in the shape of the API `path` belongs to."""
    path = request.path if path is None else path
    response = json_response(error_shape(path).body(e), e.status)
    for key, value in e.headers.items():
        response.headers[key] = value
    return response


def json_response(payload, status: int = 200) -> Response:
    return Response(json.dumps(payload), status=status, content_type="application/json")


def _error_handlers(app: Flask, metrics: Metrics) -> None:
    """Every error in its API's shape, and each response counted by route and status."""

    @app.errorhandler(APIError)
    def api_error(e: APIError):
        return error_response(e)

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        kinds = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        message = e.description or e.name
        if e.code == 413:
            message = f"the request body is larger than {MAX_BODY_BYTES} bytes"
        return error_response(APIError(e.code or 500, message, code=kinds.get(e.code)))

    @app.errorhandler(Exception)
    def internal_error(e: Exception):
        log.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(e).__name__}",
                                       type="server_error"))

    @app.after_request
    def count(response):
        # The route's pattern, not the path: /v1/models/<anything> is one label value.
        metrics.responses.labels(request.url_rule.rule if request.url_rule else "other",
                                 str(response.status_code)).inc()
        return response


def _access(app: Flask, access: Access) -> None:
    """The API key check and CORS (kipp.http.access), before any handler runs."""

    @app.before_request
    def check_key():
        if request.method == "OPTIONS" and access.cors_origins:
            return Response(status=204, headers=access.preflight_headers(
                request.headers.get("Origin"),
                request.headers.get("Access-Control-Request-Headers")))
        code = access.key_error(request.path, request.headers.get)
        if code is not None:
            return error_response(APIError(401, KEY_ERRORS[code], code=code,
                                           type="authentication_error"))
        return None

    @app.after_request
    def cors(response):
        origin = access.allowed_origin(request.headers.get("Origin"))
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"
        return response


def _info_routes(app: Flask, server: Server) -> None:
    """/health, /metrics and /v1/models."""
    created = int(time.time())
    model, scheduler = server.model, server.scheduler

    @app.get("/health")
    def health():
        if not scheduler.alive:
            return error_response(APIError(503, "the engine thread is not running",
                                           type="server_error"))
        if scheduler.draining:
            return error_response(APIError(503, SHUTDOWN_MESSAGE, code="shutting_down",
                                           type="server_error"))
        # which backend path runs, and which kernels fell back to their twins (kipp.probe)
        return {"status": "ok", "model": server.name, "served": list(server.served),
                "backend": model.backend.describe(),
                "kernels": model.backend.kernel_report().to_json()}

    @app.get("/metrics")
    def prometheus():
        body, content_type = server.metrics.render()
        return Response(body, content_type=content_type)

    @app.get("/v1/models")
    def models():
        return {"object": "list",
                "data": [_card(server, name, created) for name in server.served]}

    @app.get("/v1/models/<path:name>")
    def one_model(name: str):
        if name not in server.served:
            names = ", ".join(f"'{n}'" for n in server.served)
            raise APIError(404, f"model '{name}' is not served here; this server serves "
                                f"{names}", "model", "model_not_found")
        return _card(server, name, created)


def _generation_routes(app: Flask, server: Server) -> None:
    """/v1/completions and /v1/chat/completions: parse, submit, answer."""

    @app.post("/v1/completions")
    def completions():
        call = parse_completion(json_body(), server.served, server.tokenizer)
        return server.answer(call, shape_for(call, server.name, server.token_text),
                             "completions")

    @app.post("/v1/chat/completions")
    def chat_completions():
        call = parse_chat(json_body(), server.chat_context())
        return server.answer(call, shape_for(call, server.name, server.token_text), "chat")


def _token_routes(app: Flask, server: Server) -> None:
    """POST /tokenize and /detokenize (llama.cpp's and vLLM's shapes), for agents that count
    or trim their context: text or chat messages to ids, ids to text."""
    from kipp.http.fields import bad, boolean, check_fields, check_model, is_int

    @app.post("/tokenize")
    def tokenize():
        body = json_body()
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        check_fields(body, {"model", "content", "prompt", "messages", "add_generation_prompt",
                            "chat_template_kwargs", "tools", "with_pieces"}, "/tokenize")
        if body.get("model") is not None:
            check_model(body, server.served)
        text = _tokenize_text(server, body)
        ids = server.tokenizer.encode(text)
        out = {"tokens": ids, "count": len(ids), "max_model_len":
               server.model.entry.context_length}
        if boolean(body, "with_pieces", False):
            out["pieces"] = [server.token_text.text(t) for t in ids]
        return out

    @app.post("/detokenize")
    def detokenize():
        body = json_body()
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        check_fields(body, {"model", "tokens"}, "/detokenize")
        if body.get("model") is not None:
            check_model(body, server.served)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
            raise bad("'tokens' must be a list of token ids", "tokens")
        vocab = server.tokenizer.vocab_size
        for t in tokens:
            if not 0 <= t < vocab:
                raise bad(f"'tokens' holds {t}, outside the vocabulary 0..{vocab - 1}",
                          "tokens")
        return {"content": server.tokenizer.decode(tokens), "prompt":
                server.tokenizer.decode(tokens)}


def _tokenize_text(server: Server, body: dict) -> str:
    """The text /tokenize encodes: `content` or `prompt` as given, or `messages` rendered with
    the chat template (with the generation prompt unless add_generation_prompt is false)."""
    from kipp.http.fields import bad, boolean
    from kipp.text.chat import ChatError, render

    given = [k for k in ("content", "prompt", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise bad("give exactly one of 'content', 'prompt' and 'messages'",
                  given[1] if len(given) > 1 else "content")
    if given[0] != "messages":
        text = body[given[0]]
        if not isinstance(text, str):
            raise bad(f"'{given[0]}' must be a string", given[0])
        return text
    if isinstance(server.template, APIError):
        raise server.template
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"}:
        raise bad("'chat_template_kwargs' may hold only enable_thinking", "chat_template_kwargs")
    try:
        return render(body["messages"], boolean(body, "add_generation_prompt", True),
                      boolean(kwargs, "enable_thinking", True), tools=body.get("tools"),
                      template=server.template)
    except ChatError as e:
        raise bad(f"'messages': {e}", "messages") from None


def _chat_template(model, name: str):
    """The model's chat template name, or the APIError chat requests get: a base checkpoint
    has no template, and one Kipp cannot render is refused (kipp.http.schema.chat_request)."""
    from kipp.text.chat import ChatError

    if not model.entry.has_chat_template:
        return APIError(400, f"'{name}' is a base checkpoint: it has no chat template; use "
                             f"/v1/completions", "model", "no_chat_template")
    try:
        return model.chat_template
    except ChatError as e:
        return APIError(400, str(e), "model", "unsupported_chat_template")


def _submit(scheduler, call: Call):
    """Queue the call's requests as one TicketGroup, or raise the APIError that says why not."""
    try:
        return scheduler.submit_many(call.requests)
    except QueueFull as e:
        raise APIError(503, str(e), code="queue_full", type="server_overloaded",
                       headers={"Retry-After": "1"}) from None
    except ShuttingDown as e:
        raise APIError(503, str(e), code="shutting_down", type="server_error",
                       headers={"Connection": "close"}) from None
    except SchedulerError as e:
        raise _scheduler_error(call, e) from None


def _scheduler_error(call: Call, e: SchedulerError) -> APIError:
    """A 400 naming the body's own field: the scheduler says "prompt" and "max_tokens"."""
    names = {"prompt": call.prompt_param, "max_tokens": call.max_tokens_param}
    message = str(e)
    if call.max_tokens_param != "max_tokens":
        message = re.sub(r"\bmax_tokens\b", call.max_tokens_param, message)
    return APIError(400, message, names.get(e.param, e.param), e.code)


def _events(ticket: Ticket, scheduler, gone=None):
    """The ticket's events; a dead engine thread ends the stream with Failed. `gone`
    (waitress's client_disconnected) is checked before every wait: a client that left
    cancels its request within a step or an EVENT_POLL_SECONDS."""
    while True:
        if gone is not None and not ticket.cancelled and gone():
            ticket.cancel()  # the Failed(cancelled) it brings ends this loop
        try:
            event = ticket.get(timeout=EVENT_POLL_SECONDS)
        except queue.Empty:
            if not scheduler.alive:
                ticket.ended = True
                yield Failed("the engine thread stopped")
                return
            continue
        yield event
        if ticket.ended:
            return


def _sse(ticket: Ticket, shape: Shape, server: Server, endpoint: str, gone=None):
    """Server-sent events in the shape's framing; closing this generator early (client gone)
    cancels the request."""
    try:
        for payload in shape.first_chunks():
            yield shape.frame(payload)
        for event in _events(ticket, server.scheduler, gone):
            if isinstance(event, Failed):
                for frame in shape.error_frames(_failure(event)):
                    yield frame
                return
            if isinstance(event, Done):
                server.metrics.observe(ticket, endpoint)
            for payload in shape.chunks(event):
                yield shape.frame(payload)
        for frame in shape.closing_frames():
            yield frame
    finally:
        if not ticket.ended:
            ticket.cancel()


def _failure(event: Failed) -> APIError:
    """A request that ended without finishing: 503 when the server is shutting down, 499 (as
    nginx logs it) when its client went away."""
    if event.cancelled:
        return APIError(499, "the client closed the request", code="client_closed_request")
    if event.message == SHUTDOWN_MESSAGE:
        return APIError(503, f"the request was ended: {event.message}", code="shutting_down",
                        type="server_error")
    return APIError(500, f"the request failed: {event.message}", type="server_error")


def _card(server: Server, name: str, created: int) -> dict:
    """A served name's card; an adapter's names its base (`parent`, as vLLM lists LoRAs)."""
    card = _model_card(server.model, name, created)
    if name in server.adapters:
        adapter = server.model.backend.adapters[name]
        card["parent"] = server.name
        card["kipp"]["adapter"] = {"base": adapter.base, "format": adapter.format,
                                   "rank": adapter.rank, "scale": adapter.scale,
                                   "targets": list(adapter.targets)}
    return card


def _model_card(model, served: str, created: int) -> dict:
    entry = model.entry
    return {"id": served, "object": "model", "created": created, "owned_by": "kipp",
            "kipp": {"checkpoint": entry.id, "revision": entry.revision,
                     "scheme": model.artifact.scheme.name, "backend": model.backend.describe(),
                     "context_length": entry.context_length, "variant": entry.variant}}
