"""A chat reply's think block, split and bounded (kipp.text.reasoning, kipp.engine.output).

The oracle of the split is the same request with the reasoning left inline (reasoning_format
"none": the engine's plain text path, tags and all), cut at the block by str.partition here.
Synthetic weights never open or close a block on their own, so the thinking checkpoint (whose
template opens the block in the prompt) thinks until max_tokens or its budget, and the hybrid
template's own `<think>` is written by a grammar on an engine request.
"""

import json

import pytest

from kipp.engine.requests import Delta, Finished, Request
from kipp.engine.scheduler import Scheduler
from kipp.generation import Piece
from kipp.http.app import create_app
from kipp.model import load
from kipp.text.chat import render
from kipp.text.grammar import lark_grammar
from kipp.text.reasoning import (
    BUDGET_CLOSE,
    EFFORT_BUDGETS,
    Part,
    Reasoning,
    ThinkState,
    ThinkTracker,
    think_tokens,
)

THINKING = "kipp-synthetic/qwen3-tiny-thinking"
TINY = "kipp-synthetic/qwen3-tiny"
HI = [{"role": "user", "content": "Say something long."}]
OPEN, CLOSE = 151667, 151668  # <think>, </think> in Qwen3's vocabulary


@pytest.fixture(scope="module")
def thinking(artifacts):
    # JAX on the CPU decodes the tiny model several times faster than the numpy reference;
    # every comparison here is between two requests on the same backend.
    return load(artifacts(THINKING), backend="jax", progress=False)


@pytest.fixture(scope="module")
def tiny(artifacts):
    return load(artifacts(TINY), backend="reference", progress=False)


def inline_split(text: str, opened: bool) -> tuple[str | None, str]:
    """The oracle: an inline reply cut at its think block, the newlines at the tags dropped."""
    if not opened:
        if not text.startswith("<think>"):
            return None, text
        text = text[len("<think>"):]
    reasoning, closed, content = text.partition("</think>")
    return reasoning.strip("\n") or None, content.lstrip("\n") if closed else ""


def block_tokens(tokens: list[int], opened: bool) -> int:
    """Tokens inside the think block, its closing tag included (the budget's measure)."""
    start = 0 if opened else tokens.index(OPEN) + 1
    end = tokens.index(CLOSE, start) + 1 if CLOSE in tokens[start:] else len(tokens)
    return end - start


# -- the split equals the inline text cut at the block -------------------------------------------

@pytest.mark.parametrize("budget", [None, 7, 60])
def test_thinking_template_split_equals_the_inline_text(thinking, budget):
    kwargs = dict(max_tokens=90, temperature=0, max_reasoning_tokens=budget)
    reply = thinking.chat(HI, **kwargs)
    inline = thinking.chat(HI, reasoning_format="none", **kwargs)
    assert inline.reasoning is None
    expected = inline_split(inline.content, opened=True)
    assert (reply.reasoning, reply.content) == expected
    assert reply.reasoning  # the synthetic model thinks until its budget or max_tokens
    if budget is None:
        assert reply.content == "" and reply.finish_reason == "length"
    else:
        assert reply.content  # the budget closed the block and the model answered


def test_streamed_pieces_say_their_part_and_agree_with_the_whole(thinking):
    kwargs = dict(max_tokens=120, temperature=0, max_reasoning_tokens=100)
    whole = thinking.chat(HI, **kwargs)
    generation = thinking.chat(HI, stream=True, **kwargs)
    pieces = list(generation)
    assert all(isinstance(p, Piece) for p in pieces)
    parts = [p.part for p in pieces]
    assert parts == sorted(parts, key=lambda p: p is Part.CONTENT)  # reasoning, then answer
    assert "".join(p for p in pieces if p.part is Part.REASONING) == whole.reasoning
    assert "".join(p for p in pieces if p.part is Part.CONTENT) == whole.content
    assert (generation.reasoning, generation.text) == (whole.reasoning, whole.content)


def test_n_choices_are_split_each_like_their_inline_twin(thinking):
    prompt = render(HI, template="qwen3-thinking-2507")
    ids = tuple(thinking.tokenizer.encode(prompt))
    engine = Scheduler(thinking)
    from kipp.text.sampling import SamplingParams

    params = SamplingParams(temperature=2.0, seed=11)  # the synthetic logits are peaked
    split = _texts(engine, Request(ids, 90, n=3, sampling=params,
                                   reasoning=Reasoning(budget=60)))
    inline = _texts(engine, Request(ids, 90, n=3, sampling=params,
                                    reasoning=Reasoning(split=False, budget=60)))
    assert len({s[0] for s in split}) > 1  # three different replies
    for (reasoning, content), (_, text) in zip(split, inline):
        assert (reasoning or None, content) == inline_split(text, opened=True)


def _texts(engine: Scheduler, request: Request) -> list[tuple[str, str]]:
    ticket = engine.submit(request)
    while engine.step():
        pass
    out = [["", ""] for _ in range(request.n)]
    while (event := ticket.poll()) is not None:
        if isinstance(event, Delta):
            out[event.choice][event.part is Part.CONTENT] += event.text
    return [tuple(o) for o in out]


def test_the_hybrid_template_splits_a_block_the_reply_opens(tiny):
    """The hybrid template leaves the opening to the reply: a grammar writes one here."""
    ids = tuple(tiny.tokenizer.encode(render(HI)))
    grammar = lark_grammar('start: <[151667]> "\\nweighing it\\n\\n" <[151668]> "\\n\\nan answer"')
    engine = Scheduler(tiny)
    split = _texts(engine, Request(ids, 40, grammar=grammar, reasoning=Reasoning()))
    inline = _texts(engine, Request(ids, 40, grammar=grammar))
    assert inline[0][1] == "<think>\nweighing it\n\n</think>\n\nan answer"
    assert split[0] == ("weighing it", "an answer")
    assert split[0] == inline_split(inline[0][1], opened=False)


def test_a_reply_without_a_block_is_all_answer(tiny):
    with_thinking = tiny.chat(HI, max_tokens=12, temperature=0)
    assert with_thinking.reasoning is None  # the hybrid model did not open a block
    inline = tiny.chat(HI, max_tokens=12, temperature=0, reasoning_format="none")
    assert with_thinking.content == inline.content
    closed = tiny.chat(HI, max_tokens=12, temperature=0, enable_thinking=False)
    assert closed.reasoning is None and closed.content


# -- stop strings, logprobs, constraints ---------------------------------------------------------

def test_stop_strings_apply_to_the_answer_not_the_reasoning(thinking):
    kwargs = dict(max_tokens=140, temperature=0, max_reasoning_tokens=100)
    plain = thinking.chat(HI, **kwargs)
    words = plain.reasoning.split()
    stop = next(w for w in words[len(words) // 2:] if len(w) > 2 and w not in plain.content)
    stopped = thinking.chat(HI, stop=[stop], **kwargs)
    assert stopped.reasoning == plain.reasoning  # the stop string in the reasoning is passed
    inline = thinking.chat(HI, stop=[stop], reasoning_format="none", **kwargs)
    assert stop not in inline.content and len(inline.content) < len(plain.reasoning)
    answer_stop = plain.content.split()[2]
    cut = thinking.chat(HI, stop=[answer_stop], **kwargs)
    assert cut.reasoning == plain.reasoning
    assert cut.content == plain.content[:plain.content.index(answer_stop)]
    assert cut.finish_reason == "stop"


def test_logprobs_cover_the_reasoning_and_the_answer(thinking):
    generation = thinking.chat(HI, max_tokens=60, temperature=0, max_reasoning_tokens=30,
                               logprobs=2, stream=True)
    "".join(generation)
    stats = generation.stats
    assert len(stats.logprobs) == len(stats.tokens) == stats.completion_tokens == 60
    assert [lp.token for lp in stats.logprobs] == stats.tokens


def test_a_constrained_reply_does_not_think(thinking):
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"],
              "additionalProperties": False}
    reply = thinking.chat(HI, max_tokens=40, temperature=0, response_format=schema)
    assert reply.reasoning is None and reply.finish_reason == "stop"
    assert json.loads(reply.content)["a"] in (1, 2)


# -- the budget ----------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [1, 2, 23, 91, 92])
def test_the_budget_is_never_exceeded_and_closes_the_block(thinking, budget):
    generation = thinking.chat(HI, max_tokens=budget + 20, temperature=0,
                               max_reasoning_tokens=budget, stream=True)
    for _ in generation:
        pass
    tokens = generation.stats.tokens
    assert CLOSE in tokens  # the block closed: the model, not max_tokens, went on to answer
    assert block_tokens(tokens, opened=True) == budget  # the model thinks up to the budget
    text = thinking.tokenizer.decode(tokens[:budget])
    if budget >= 4 * len(thinking.tokenizer.encode(BUDGET_CLOSE)):
        assert text.endswith(BUDGET_CLOSE)  # Qwen's closing words, then the tag
    else:
        assert text.endswith("</think>") and "Considering" not in text


def test_the_budget_holds_under_speculative_decoding(thinking):
    """Drafts stop where the closing starts: the same tokens as plain greedy decoding."""
    prompt = render(HI, template="qwen3-thinking-2507")
    kwargs = dict(max_tokens=120, temperature=0, reasoning=Reasoning(budget=100))
    plain = thinking._generation(prompt, **kwargs)
    spec = thinking._generation(prompt, speculative=True, **kwargs)
    "".join(plain), "".join(spec)
    assert spec.stats.tokens == plain.stats.tokens
    assert block_tokens(spec.stats.tokens, opened=True) == 100
    assert spec.stats.spec.drafted > 0  # speculation ran


def test_budget_zero_and_effort_names(thinking):
    none = thinking.chat(HI, max_tokens=10, temperature=0, max_reasoning_tokens=0)
    assert none.reasoning is None and none.content
    minimal = thinking.chat(HI, max_tokens=EFFORT_BUDGETS["minimal"] + 10, temperature=0,
                            reasoning_effort="minimal", stream=True)
    "".join(minimal)
    assert block_tokens(minimal.stats.tokens, opened=True) == EFFORT_BUDGETS["minimal"]
    with pytest.raises(ValueError, match="reasoning effort 'huge'"):
        thinking.chat(HI, reasoning_effort="huge")
    with pytest.raises(ValueError, match="reasoning_format 'xml'"):
        thinking.chat(HI, reasoning_format="xml")


def test_the_tracker_starts_where_the_prompt_leaves_the_reply(tiny):
    think = think_tokens(tiny.tokenizer)
    encode = tiny.tokenizer.encode
    assert think.start(encode(render(HI))) is ThinkState.BEFORE
    assert think.start(encode(render(HI, enable_thinking=False))) is ThinkState.AFTER
    assert think.start(encode(render(HI, template="qwen3-thinking-2507"))) is ThinkState.INSIDE
    # an earlier turn's closed block does not count: only what follows the last <|im_start|>
    turns = HI + [{"role": "assistant", "content": "<think>\nx\n</think>\n\ny"}] + HI
    assert think.start(encode(render(turns))) is ThinkState.BEFORE
    tracker = ThinkTracker(Reasoning(budget=3), think, encode(render(HI)))
    assert tracker.see(OPEN) is None and tracker.state is ThinkState.INSIDE
    assert tracker.forced() is None and tracker.see(11) is Part.REASONING
    assert tracker.forced() is None and tracker.see(12) is Part.REASONING
    assert tracker.forced() == CLOSE and tracker.see(CLOSE) is None
    assert tracker.state is ThinkState.AFTER and tracker.forced() is None


# -- the server's chat completions ---------------------------------------------------------------

@pytest.fixture(scope="module")
def served(thinking):
    scheduler = Scheduler(thinking).start()
    yield scheduler
    scheduler.stop()


def chat(client, **body):
    r = client.post("/v1/chat/completions", json={"model": THINKING, "messages": HI,
                                                  "temperature": 0, **body})
    return r.status_code, r


def test_chat_completions_split_reasoning_streamed_and_whole(thinking, served):
    client = create_app(thinking, served).test_client()
    body = dict(max_tokens=60, max_reasoning_tokens=40)
    status, whole = chat(client, **body)
    assert status == 200
    message = whole.json["choices"][0]["message"]
    status, inline = chat(client, reasoning_format="none", **body)
    inline_text = inline.json["choices"][0]["message"]["content"]
    assert (message["reasoning_content"], message["content"]) == inline_split(inline_text, True)
    assert message["reasoning"] == message["reasoning_content"]
    assert "reasoning_content" not in inline.json["choices"][0]["message"]
    status, stream = chat(client, stream=True, **body)
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in
              stream.data.decode().splitlines() if line.startswith("data: {")]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == "".join(d.get("reasoning", "") for d in deltas)
    assert reasoning == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any("reasoning_content" in d for d in deltas[first_content:])


def test_the_server_flag_keeps_reasoning_inline(thinking, served):
    client = create_app(thinking, served, reasoning_format="none").test_client()
    status, r = chat(client, max_tokens=30, max_reasoning_tokens=20)
    message = r.json["choices"][0]["message"]
    assert status == 200 and "reasoning_content" not in message
    assert "</think>" in message["content"]
    status, r = chat(client, max_tokens=30, max_reasoning_tokens=20, reasoning_format="auto")
    assert "</think>" not in r.json["choices"][0]["message"]["content"]


@pytest.mark.parametrize("body, param", [
    ({"reasoning_format": "xml"}, "reasoning_format"),
    ({"reasoning_format": 3}, "reasoning_format"),
    ({"max_reasoning_tokens": -1}, "max_reasoning_tokens"),
    ({"max_reasoning_tokens": "9"}, "max_reasoning_tokens"),
    ({"reasoning_effort": "huge"}, "reasoning_effort"),
    ({"reasoning_effort": "low", "max_reasoning_tokens": 9}, "reasoning_effort"),
])
def test_bad_reasoning_fields_are_400s_naming_them(thinking, served, body, param):
    client = create_app(thinking, served).test_client()
    status, r = chat(client, max_tokens=5, **body)
    assert status == 400 and r.json["error"]["param"] == param


def test_a_tool_call_after_thinking_is_parsed(thinking):
    from kipp.http.schema import Call
    from kipp.http.shape import ChatShape, TokenText

    request = Request((1, 2), 50, reasoning=Reasoning())
    call = Call("chat", request, stream=True, include_usage=False, logprobs=False, tools=True)
    shape = ChatShape(call, THINKING, TokenText(thinking.tokenizer))
    events = [Delta(0, "I should look it up", (5,), part=Part.REASONING),
              Delta(0, '<tool_call>\n{"name": "look", "arguments": {"q": "x"}}\n</tool_call>',
                    (6,)), Finished(0, "stop")]
    chunks = [c for e in events for c in shape.chunks(e)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["reasoning_content"] == "I should look it up"
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "look", "arguments": '{"q": "x"}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
