"""Qwen3's think block: where a reply's reasoning ends and its answer starts, and the budget that
closes the block early.

Qwen3 reasons inside `<think>` ... `</think>` before it answers; both tags are single tokens. A
chat request may have the engine split its reply there (the reasoning leaves as its own part,
without the tags and the newlines next to them; the answer after `</think>` loses its leading
newlines) and may bound the block: once the block holds `budget` tokens less the closing text,
the engine writes the closing text itself, the phrase the Qwen3 technical report uses for a
thinking budget followed by `</think>`, and the model answers. Everything between the tags,
the closing included, stays within the budget.

    think = think_tokens(tokenizer)                   # None: the vocabulary has no think tags
    tracker = ThinkTracker(Reasoning(budget=64), think, prompt)
    tracker.forced()      # the token the engine must emit next instead of sampling, or None
    tracker.see(token)    # the part the token's text belongs to (None for a tag)

Where the prompt leaves the reply decides the start: after an open `<think>` (the
Thinking-2507 template, or any prompt that opened one) the reply starts inside; after a closed
block (enable_thinking=False) it is all answer; after a bare generation prompt (the hybrid
template) the reply's first token may open a block.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
IM_START = "<|im_start|>"
# The Qwen3 technical report's words for stopping at a thinking budget, then the tag.
BUDGET_CLOSE = ("Considering the limited time by the user, I have to give the solution based on "
                "the thinking directly now.\n" + THINK_CLOSE)
# The closing phrase is used when the budget is at least this many times its length; a smaller
# budget closes with the bare tag, so that the model still has most of it to think in.
_PHRASE_SHARE = 4
# reasoning_effort (OpenAI's names) as token budgets; None is no bound.
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 256, "low": 1024,
                                         "medium": 4096, "high": 16384, "xhigh": None,
                                         "max": None}
REASONING_FORMATS = ("auto", "deepseek", "none")  # "deepseek" is llama.cpp's name for "auto"


class Part(str, Enum):
    """Which part of a chat reply a piece of text belongs to."""

    CONTENT = "content"
    REASONING = "reasoning"

    __str__ = str.__str__
    __format__ = str.__format__


class ThinkState(Enum):
    BEFORE = "before"  # the reply's first token may open a block
    INSIDE = "inside"
    AFTER = "after"  # the answer: a block closed, or the reply started without one


@dataclass(frozen=True)
class Reasoning:
    """A chat request's reasoning handling (kipp.engine.requests.Request.reasoning)."""

    split: bool = True  # reasoning leaves as Part.REASONING; False: inline, tags and all
    budget: int | None = None  # the most tokens the think block may hold, its closing included

    def __post_init__(self):
        if self.budget is not None and (isinstance(self.budget, bool)
                                        or not isinstance(self.budget, int) or self.budget < 0):
            raise ValueError(f"the reasoning budget must be a non-negative integer, "
                             f"got {self.budget!r}")


@dataclass(frozen=True)
class ThinkTokens:
    """The think tags' ids in one vocabulary and the budget's closing texts as ids."""

    open: int
    close: int
    im_start: int
    phrase_close: tuple[int, ...]  # BUDGET_CLOSE, ending with the close tag

    def closing(self, budget: int) -> tuple[int, ...]:
        """What a block bounded by `budget` is closed with when the budget runs out."""
        if budget >= _PHRASE_SHARE * len(self.phrase_close):
            return self.phrase_close
        return (self.close,)

    def start(self, prompt) -> ThinkState:
        """Where the prompt leaves the reply: the last tag after the last <|im_start|>."""
        for token in reversed(prompt):
            if token == self.open:
                return ThinkState.INSIDE
            if token == self.close:
                return ThinkState.AFTER
            if token == self.im_start:
                return ThinkState.BEFORE
        return ThinkState.BEFORE


def think_tokens(tokenizer) -> ThinkTokens | None:
    """The tags of `tokenizer`'s vocabulary, or None when it has no single-token tags."""
    ids = [tokenizer.token_to_id(tag) for tag in (THINK_OPEN, THINK_CLOSE, IM_START)]
    if any(i is None for i in ids):
        return None
    phrase = tuple(tokenizer.encode(BUDGET_CLOSE))
    if phrase[-1] != ids[1]:
        return None
    return ThinkTokens(ids[0], ids[1], ids[2], phrase)


class ThinkTracker:
    """One choice's place in its think block, and the closing the budget forces."""

    def __init__(self, reasoning: Reasoning, think: ThinkTokens, prompt):
        self.reasoning, self.think = reasoning, think
        self.state = think.start(prompt)
        self.used = 0  # tokens in the block so far (the closing tag included)
        self._forcing: list[int] = []
        budget = reasoning.budget
        self._closing = () if budget is None else think.closing(budget)

    def forced(self) -> int | None:
        """The token the reply must continue with (the budget's closing), or None."""
        if self._forcing:
            return self._forcing[0]
        free = self.free()
        if free == 0:
            self._forcing = list(self._closing)
            return self._forcing[0]
        return None

    def free(self) -> int | None:
        """Tokens the model may still think freely before the closing is forced (None: no
        bound, or not inside a block)."""
        budget = self.reasoning.budget
        if budget is None or self.state is not ThinkState.INSIDE or self._forcing:
            return None
        return max(0, budget - len(self._closing) - self.used)

    def see(self, token: int) -> Part | None:
        """Account for an emitted token; the part its text belongs to, None for a tag."""
        if self._forcing and token == self._forcing[0]:
            self._forcing.pop(0)
        if self.state is ThinkState.BEFORE:
            self.state = ThinkState.AFTER
            if token == self.think.open:
                self.state = ThinkState.INSIDE
                return None
            return Part.CONTENT
        if self.state is ThinkState.INSIDE:
            self.used += 1
            if token == self.think.close:
                self.state = ThinkState.AFTER
                self._forcing = []
                return None
            return Part.REASONING
        return Part.CONTENT


class EdgeTrim:
    """The text of one part as it streams, without the newlines at its edges: leading ones are
    dropped, trailing ones held until more text follows (`trailing` False: kept)."""

    def __init__(self, trailing: bool):
        self.trailing = trailing
        self.started = False
        self.held = ""

    def feed(self, text: str) -> str:
        if not self.started:
            text = text.lstrip("\n")
            if not text:
                return ""
            self.started = True
        if not self.trailing:
            return text
        text = self.held + text
        body = text.rstrip("\n")
        self.held = text[len(body):]
        return body


def reasoning_for(reasoning_format: str = "auto", budget: int | None = None) -> Reasoning | None:
    """The engine's reasoning handling for a chat request: None (inline text, no bound) for
    reasoning_format "none" without a budget. ValueError names a bad format or budget."""
    if reasoning_format not in REASONING_FORMATS:
        raise ValueError(f"reasoning_format {reasoning_format!r} is not one of "
                         f"{', '.join(REASONING_FORMATS)}")
    split = reasoning_format != "none"
    if not split and budget is None:
        return None
    return Reasoning(split=split, budget=budget)


def effort_budget(effort: str) -> int | None:
    """A reasoning_effort name's token budget (EFFORT_BUDGETS); ValueError for another name."""
    if effort not in EFFORT_BUDGETS:
        raise ValueError(f"reasoning effort {effort!r} is not one of "
                         f"{', '.join(EFFORT_BUDGETS)}")
    return EFFORT_BUDGETS[effort]
