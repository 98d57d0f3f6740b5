"""Admission arithmetic: whether a request can ever run, and what it reserves when it starts.

A request is reserved its worst case when admitted: the blocks of prompt + max_tokens for each
choice, less the blocks its first choice already holds (kept from a borrowed session, or
adopted from the pool's published prefix). Reservations are held until the request ends, so
pool pressure delays admission and never takes a block from a running sequence. A request that
could never fit is refused at submit, naming the field at fault.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from kipp.backend import KV_BLOCK, blocks_needed
from kipp.engine.blocks import PoolExhausted, Reservation
from kipp.engine.requests import Request
from kipp.errors import KippError

if TYPE_CHECKING:
    from kipp.engine.session import Session

MAX_CHOICES = 8
# A request without max_tokens gets its share of the pool, but at least this many tokens while
# the pool holds it at all (kipp.http's chat default; see default_max_tokens).
MIN_DEFAULT_TOKENS = 256


class SchedulerError(KippError, ValueError):
    """A request the scheduler can never run (names the limit it breaks). `param` is the
    request field at fault and `code` a machine-readable reason, when there is one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def check_request(model, request: Request, max_batch: int, session: Session | None) -> None:
    """Raise SchedulerError, naming the field (`param`), for a request that can never run."""
    limit = min(MAX_CHOICES, max_batch)
    if not 1 <= request.n <= limit:
        raise SchedulerError(f"n must be in 1..{limit}, got {request.n}", param="n")
    if not request.prompt:
        raise SchedulerError("the prompt is empty", param="prompt")
    model.check_tokens(request.prompt)
    low = 0 if request.echo else 1
    if not isinstance(request.max_tokens, int) or request.max_tokens < low:
        raise SchedulerError(f"max_tokens must be an integer >= {low}, got "
                             f"{request.max_tokens!r}", param="max_tokens")
    if session is None:
        check_room(len(request.prompt), request.max_tokens, model.entry.context_length,
                   "the context length")
    else:
        if request.n != 1 or request.echo:
            raise SchedulerError("a borrowed session runs one choice without echo", param="n")
        check_room(len(request.prompt), request.max_tokens, session.capacity,
                   "the session's capacity")
    check_pool(model.pool.num_blocks, request)


def check_room(prompt: int, max_tokens: int, limit: int, what: str) -> None:
    """The prompt and max_tokens must fit `limit` tokens (the context or a session)."""
    if prompt > limit or (prompt == limit and max_tokens):
        room = "is longer than" if prompt > limit else "leaves no room to generate in"
        raise SchedulerError(f"the prompt ({prompt} tokens) {room} {what} {limit}",
                             param="prompt", code="context_length_exceeded")
    total = prompt + max_tokens
    if total > limit:
        raise SchedulerError(f"prompt ({prompt} tokens) + max_tokens ({max_tokens}) = {total} "
                             f"exceeds {what} {limit}", param="max_tokens",
                             code="context_length_exceeded")


def check_pool(pool: int, request: Request) -> None:
    """Every choice's worst case must fit the pool at once."""
    n, prompt = request.n, len(request.prompt)
    worst = n * blocks_needed(prompt + request.max_tokens)
    if worst <= pool:
        return
    least = blocks_needed(prompt + min(request.max_tokens, 1))  # the prompt, one token
    param = "max_tokens" if n * least <= pool else "prompt" if least > pool else "n"
    raise SchedulerError(f"the request needs up to {worst} KV blocks ({n} x (prompt {prompt} "
                         f"+ max_tokens {request.max_tokens} tokens)); the KV pool has "
                         f"{pool} blocks of {KV_BLOCK} tokens", param=param,
                         code="kv_capacity_exceeded")


def default_max_tokens(model, max_batch: int, prompt_tokens: int, n: int,
                       preferred: int) -> int:
    """max_tokens for a request that gives none: `preferred`, cut to the context, to the pool
    (its n choices must fit at once) and to a fair share of the pool, so that `max_batch` such
    sequences run together: num_blocks // max_batch blocks per choice for prompt and
    completion, or at least MIN_DEFAULT_TOKENS of completion beyond a share. At least 1 (a
    prompt that leaves no room then fails check_request, naming the prompt)."""
    blocks = model.pool.num_blocks
    share = blocks // max_batch * KV_BLOCK - prompt_tokens
    fit = blocks // n * KV_BLOCK - prompt_tokens
    room = model.entry.context_length - prompt_tokens
    return max(1, min(preferred, room, fit, max(share, MIN_DEFAULT_TOKENS)))


def keep_prefix(session: Session, prompt: Sequence[int], adopt: bool) -> int:
    """Prompt tokens whose KV a starting session keeps: a borrowed session's common prefix with
    the prompt (the rest of its timeline is cut), else, with `adopt`, published blocks."""
    if session.tokens:
        shared = 0
        for have, want in zip(session.tokens, prompt):
            if have != want:
                break
            shared += 1
        keep = min(shared, len(prompt) - 1)  # the last prompt token gives the logits
        session.truncate(keep)
        if keep or not adopt:
            return keep
    return session.match_prefix(prompt) if adopt else 0


def reserve(model, request: Request, leader: Session) -> Reservation | None:
    """The request's worst-case blocks beyond what its first choice holds, or None while the
    pool cannot promise them. Followers adopt the leader's prompt blocks once it has evaluated
    them, but one may find fewer (evicted, or a live duplicate), so each is reserved in full."""
    capacity = len(request.prompt) + request.max_tokens
    try:
        return model.pool.reserve(request.n * blocks_needed(capacity) - len(leader.block_table))
    except PoolExhausted:
        return None
