"""The Flask app: thin handlers over the scheduler, OpenAI's response and chunk shapes.

A handler parses the body into a Call (kipp.http.schema), submits its Requests to the scheduler
(one per prompt, as a TicketGroup) and turns the events into a JSON response or a server-sent
event stream (kipp.http.shape). Handlers never touch the model: the tokenizer (pure) is the one
model attribute they read, for prompts and for the text of logprob tokens. A client that goes
away cancels its own request, streamed or not: a waiting handler polls waitress's
`client_disconnected` (the server runs with a request lookahead so that it sees the connection
close), and for a stream the WSGI server also closes the response iterator, whose `finally`
cancels the tickets.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import time

from flask import Flask, Response, request
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
from kipp.http.metrics import Metrics
from kipp.http.schema import APIError, Call, parse_chat, parse_completion
from kipp.http.shape import Shape, TokenText, shape_for

log = logging.getLogger("kipp.http")

MAX_BODY_BYTES = 4 << 20
MAX_JSON_DEPTH = 128  # nesting of arrays and objects in a body; deeper is a 400
DEFAULT_CHAT_MAX_TOKENS = 1024
# How often a waiting handler checks that the engine is alive and the client still there.
EVENT_POLL_SECONDS = 0.25


def create_app(model, scheduler, *, model_name: str | None = None,
               chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS) -> Flask:
    """The OpenAI-compatible app over a started Scheduler of `model`."""
    app = Flask("kipp")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    served = model_name or model.entry.id
    metrics = Metrics(scheduler)
    _error_handlers(app, metrics)
    _info_routes(app, model, scheduler, metrics, served)
    _generation_routes(app, model, scheduler, metrics, served, chat_max_tokens)
    return app


def _error_handlers(app: Flask, metrics: Metrics) -> None:
    """Every error in OpenAI's error shape, and each response counted by route and status."""

    @app.errorhandler(APIError)
    def api_error(e: APIError):
        return _error_response(e)

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        kinds = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        message = e.description or e.name
        if e.code == 413:
            message = f"the request body is larger than {MAX_BODY_BYTES} bytes"
        return _error_response(APIError(e.code or 500, message, code=kinds.get(e.code)))

    @app.errorhandler(Exception)
    def internal_error(e: Exception):
        log.exception("unhandled error")
        return _error_response(APIError(500, f"internal error: {type(e).__name__}",
                                        type="server_error"))

    @app.after_request
    def count(response):
        # The route's pattern, not the path: /v1/models/<anything> is one label value.
        metrics.responses.labels(request.url_rule.rule if request.url_rule else "other",
                                 str(response.status_code)).inc()
        return response


def _info_routes(app: Flask, model, scheduler, metrics: Metrics, served: str) -> None:
    """/health, /metrics and /v1/models."""
    created = int(time.time())

    @app.get("/health")
    def health():
        if not scheduler.alive:
            return _error_response(APIError(503, "the engine thread is not running",
                                            type="server_error"))
        if scheduler.draining:
            return _error_response(APIError(503, SHUTDOWN_MESSAGE, code="shutting_down",
                                            type="server_error"))
        # which backend path runs, and which kernels fell back to their twins (kipp.probe)
        return {"status": "ok", "model": served, "backend": model.backend.describe(),
                "kernels": model.backend.kernel_report().to_json()}

    @app.get("/metrics")
    def prometheus():
        body, content_type = metrics.render()
        return Response(body, content_type=content_type)

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [_model_card(model, served, created)]}

    @app.get("/v1/models/<path:name>")
    def one_model(name: str):
        if name != served:
            raise APIError(404, f"model '{name}' is not served here", "model",
                           "model_not_found")
        return _model_card(model, served, created)


def _generation_routes(app: Flask, model, scheduler, metrics: Metrics, served: str,
                       chat_max_tokens: int) -> None:
    """/v1/completions and /v1/chat/completions: parse, submit, answer."""
    tokenizer = model.tokenizer
    token_text = TokenText(tokenizer)
    template = _chat_template(model)

    @app.post("/v1/completions")
    def completions():
        call = parse_completion(_json_body(), served, tokenizer)
        return _answer(call, scheduler, metrics, shape_for(call, served, token_text))

    @app.post("/v1/chat/completions")
    def chat_completions():
        body = _json_body()
        if isinstance(template, APIError):
            raise template

        def default_max_tokens(prompt_tokens: int, n: int) -> int:
            return scheduler.default_max_tokens(prompt_tokens, n, chat_max_tokens)

        call = parse_chat(body, served, tokenizer, model.entry.has_chat_template,
                          model.entry.context_length, default_max_tokens, template=template)
        return _answer(call, scheduler, metrics, shape_for(call, served, token_text))


def _answer(call: Call, scheduler, metrics: Metrics, shape: Shape):
    """Submit the call and answer: an SSE stream, or the whole response once it is done."""
    ticket = _submit(scheduler, call)
    gone = request.environ.get("waitress.client_disconnected")
    if call.stream:
        return Response(_sse(ticket, shape, metrics, scheduler, gone),
                        content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        events = list(_events(ticket, scheduler, gone))
    finally:
        if not ticket.ended:
            ticket.cancel()
    last = events[-1]
    if isinstance(last, Failed):
        raise _failure(last)
    metrics.observe(ticket)
    return shape.response(events)


def _chat_template(model):
    """The model's chat template name, an APIError to answer chat requests with when Kipp
    cannot render its template, or "qwen3" for base checkpoints (parse_chat refuses them)."""
    from kipp.text.chat import ChatError

    if not model.entry.has_chat_template:
        return "qwen3"
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


def _sse(ticket: Ticket, shape: Shape, metrics: Metrics, scheduler, gone=None):
    """Server-sent events; closing this generator early (client gone) cancels the request."""
    try:
        for chunk in shape.first_chunks():
            yield _data(chunk)
        for event in _events(ticket, scheduler, gone):
            if isinstance(event, Failed):
                yield _data(_failure(event).body())
                break
            if isinstance(event, Done):
                metrics.observe(ticket)
            for chunk in shape.chunks(event):
                yield _data(chunk)
        yield "data: [DONE]\n\n"
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


def _data(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _json_body():
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


def _error_response(e: APIError) -> Response:
    response = Response(json.dumps(e.body()), status=e.status, content_type="application/json")
    for key, value in e.headers.items():
        response.headers[key] = value
    return response


def _model_card(model, served: str, created: int) -> dict:
    entry = model.entry
    return {"id": served, "object": "model", "created": created, "owned_by": "kipp",
            "kipp": {"checkpoint": entry.id, "revision": entry.revision,
                     "scheme": model.artifact.scheme.name, "backend": model.backend.describe(),
                     "context_length": entry.context_length, "variant": entry.variant}}
