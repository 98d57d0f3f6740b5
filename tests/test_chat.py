"""kipp.text.chat.render against transformers' apply_chat_template with the upstream Qwen3
template."""

from __future__ import annotations

import copy
import json

import pytest

from kipp.formats import registry
from kipp.text.chat import (
    TEMPLATES,
    ChatError,
    close_reasoning,
    entry_template,
    render,
    require_chat_template,
    template_name,
    thinking_2507_template,
)
from kipp.text.tokenizer import TokenizerData
from kipp.text.tokenizer_files import tokenizer_config, tokenizer_json_bytes

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
HI = {"role": "user", "content": "Hi!"}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city — in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALC_TOOL = {"name": "add", "parameters": {"a": "int", "b": "int"}}


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def tool(text):
    return {"role": "tool", "content": text}


def call(name, arguments, wrapped=True):
    function = {"name": name, "arguments": arguments}
    return {"type": "function", "function": function} if wrapped else function


CONVERSATIONS = {
    "single turn": [HI],
    "system prompt": [SYSTEM, HI],
    "multi-turn": [SYSTEM, HI, assistant("Hello."), user("What is 2+2?")],
    "unicode and whitespace": [user("  多语言 😀\n\ttabs  "), assistant("\n\nok\n"), user("ok")],
    "think before the last query is stripped": [
        HI, assistant("<think>\nThe user greets me.\n</think>\n\nHello!"), user("Bye")],
    "think after the last query is kept": [
        HI, assistant("<think>\nGreeting.\n</think>\n\nHello!")],
    "think on both sides": [
        HI, assistant("<think>first</think>A"), user("again"),
        assistant("<think>\n\nsecond\n\n</think>B")],
    "several </think> and stray <think>": [
        HI, assistant("x<think>a<think>b\n</think>\nmid</think>\n\nend")],
    "no think block after the query": [HI, assistant("Just an answer.")],
    "reasoning_content key": [
        HI, assistant("Answer one.", reasoning_content="Thinking one."), user("more"),
        assistant("Answer two.", reasoning_content="\nThinking two.\n")],
    "reasoning_content beats think tags": [
        HI, assistant("<think>ignored?</think>kept", reasoning_content="given")],
    "empty reasoning_content": [HI, assistant("A", reasoning_content=""), assistant("B")],
    "reasoning under transformers' aliases": [
        HI, assistant("A", thinking="via thinking"), assistant("B", reasoning="via reasoning")],
    "assistant after the query, not last": [
        HI, assistant("<think>r1</think>one"), assistant("two"), user("three")],
    "mid-conversation system message": [SYSTEM, HI, {"role": "system", "content": "Be kind."},
                                        user("again")],
    "ends on assistant": [SYSTEM, HI, assistant("Hello.")],
    "tool calls and results": [
        SYSTEM, user("Weather in Paris and Oslo?"),
        assistant("<think>need tools</think>Checking.", tool_calls=[
            call("get_weather", {"city": "Paris"}), call("get_weather", '{"city": "Oslo"}')]),
        tool('{"temp": 21}'), tool("ünïcode result"),
        assistant("Paris 21, Oslo ?"), user("thanks")],
    "tool call with empty content and bare function": [
        user("add 1 and 2"), assistant("", tool_calls=[call("add", {"a": 1, "b": 2}, False)]),
        tool("3")],
    "tool call after a think-only content": [
        user("add"), assistant("<think>x</think>\n\n", tool_calls=[call("add", "{}")])],
    "tool response written as a user turn": [
        user("q"), assistant("<think>t</think>calling", tool_calls=[call("add", {"a": 1})]),
        user("<tool_response>\n3\n</tool_response>")],
}


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return transformers  # imported once per module


@pytest.fixture(scope="module")
def hf_tokenizer(hf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-chat")
    (folder / "tokenizer.json").write_bytes(tokenizer_json_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config("instruct")))
    return hf.AutoTokenizer.from_pretrained(str(folder))


def upstream(hf_tokenizer, messages, **options):
    return hf_tokenizer.apply_chat_template(copy.deepcopy(messages), tokenize=False, **options)


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("thinking", [True, False])
def test_render_matches_transformers(hf_tokenizer, name, generation_prompt, thinking):
    messages = CONVERSATIONS[name]
    expected = upstream(hf_tokenizer, messages, add_generation_prompt=generation_prompt,
                        enable_thinking=thinking)
    assert render(messages, add_generation_prompt=generation_prompt,
                  enable_thinking=thinking) == expected


@pytest.mark.parametrize("name", ["single turn", "system prompt", "tool calls and results"])
@pytest.mark.parametrize("tools", [[WEATHER_TOOL], [WEATHER_TOOL, CALC_TOOL]])
def test_tools_match_transformers(hf_tokenizer, name, tools):
    messages = CONVERSATIONS[name]
    expected = upstream(hf_tokenizer, messages, tools=tools, add_generation_prompt=True)
    assert render(messages, tools=tools) == expected


def test_defaults_are_generation_prompt_with_thinking(hf_tokenizer):
    assert render([HI]) == upstream(hf_tokenizer, [HI], add_generation_prompt=True)
    assert render([HI]).endswith("<|im_start|>assistant\n")
    assert render([HI], enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_null_content_beside_tool_calls_renders_as_empty(hf_tokenizer):
    # OpenAI clients send content null with tool calls; the template itself needs a string.
    calls = [call("add", {"a": 1})]
    ours = render([HI, assistant(None, tool_calls=calls)])
    assert ours == upstream(hf_tokenizer, [HI, assistant("", tool_calls=calls)],
                            add_generation_prompt=True)


def test_render_leaves_messages_untouched():
    messages = copy.deepcopy(CONVERSATIONS["tool calls and results"])
    before = copy.deepcopy(messages)
    render(messages, tools=[WEATHER_TOOL])
    assert messages == before


@pytest.mark.parametrize("messages, match", [
    ([], "empty"),
    ("hello", "list"),
    ({"role": "user", "content": "x"}, "list"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"content": "x"}], "role None"),
    ([{"role": "developer", "content": "x"}], "role 'developer'"),
    ([{"role": "user"}], "content must be a string"),
    ([{"role": "user", "content": None}], "content must be a string"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "content must be a string"),
    ([HI, {"role": "assistant", "content": 5}], r"messages\[1\]: content must be a string"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "only assistant"),
    ([HI, assistant("a", reasoning_content=3)], "reasoning_content"),
    ([HI, assistant("a", tool_calls="add")], "tool_calls must be a list"),
    ([HI, assistant("a", tool_calls=[{"function": {"arguments": "{}"}}])], "string name"),
    ([HI, assistant("a", tool_calls=[call("f", 3)])], "arguments"),
    ([HI, assistant("a", tool_calls=[call("f", {"x": {1, 2}})])], "JSON"),
])
def test_bad_messages_are_rejected(messages, match):
    with pytest.raises(ChatError, match=match):
        render(messages)


def test_bad_options_are_rejected():
    with pytest.raises(ChatError, match="booleans"):
        render([HI], enable_thinking="no")
    with pytest.raises(ChatError, match="tools"):
        render([HI], tools={"name": "f"})
    with pytest.raises(ChatError, match=r"tools\[0\]"):
        render([HI], tools=["f"])


def test_base_checkpoints_have_no_chat():
    base = registry.get("kipp-synthetic/qwen3-tiny-base")
    with pytest.raises(ChatError, match="base checkpoint"):
        require_chat_template(base)
    require_chat_template(registry.get("kipp-synthetic/qwen3-tiny"))
    require_chat_template(registry.get("Qwen/Qwen3-0.6B"))


def test_tokenizer_data_needs_the_qwen3_template():
    template = tokenizer_config("instruct")["chat_template"]
    require_chat_template(TokenizerData(("a",), (1,), (), 0, template))
    with pytest.raises(ChatError, match="no chat template"):
        require_chat_template(TokenizerData(("a",), (1,), (), 0, None))
    with pytest.raises(ChatError, match="not one kipp.text.chat renders"):
        require_chat_template(TokenizerData(("a",), (1,), (), 0, template + " "))
    require_chat_template(TokenizerData(("a",), (1,), (), 0, thinking_2507_template()))


# -- the other templates, and tools on every conversation ---------------------------------

TOOL_SETS = {"no tools": None, "one tool": [WEATHER_TOOL], "two tools": [WEATHER_TOOL, CALC_TOOL]}


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("tools", TOOL_SETS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_every_conversation_with_tools_matches_transformers(hf_tokenizer, name, tools,
                                                            generation_prompt):
    messages, tool_list = CONVERSATIONS[name], TOOL_SETS[tools]
    expected = upstream(hf_tokenizer, messages, tools=tool_list,
                        add_generation_prompt=generation_prompt)
    assert render(messages, tools=tool_list, add_generation_prompt=generation_prompt) == expected


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("tools", TOOL_SETS)
@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("thinking", [True, False])
def test_thinking_2507_template_matches_transformers(hf_tokenizer, name, tools,
                                                     generation_prompt, thinking):
    """The Qwen3-4B-Thinking-2507 template Kipp carries, rendered by transformers' jinja, and
    kipp.text.chat's Python rendering of it (enable_thinking is ignored by both)."""
    messages, tool_list = CONVERSATIONS[name], TOOL_SETS[tools]
    expected = upstream(hf_tokenizer, messages, tools=tool_list,
                        chat_template=thinking_2507_template(),
                        add_generation_prompt=generation_prompt, enable_thinking=thinking)
    assert render(messages, tools=tool_list, add_generation_prompt=generation_prompt,
                  enable_thinking=thinking, template="qwen3-thinking-2507") == expected


def test_thinking_2507_template_file_is_the_recorded_one():
    import hashlib

    text = thinking_2507_template()
    assert len(text) == 4049
    assert hashlib.sha256(text.encode()).hexdigest() == (
        "3802169b2a02b81e6adb7ab4f64f91ff02db753c8c3a64a01c35192d3a61d8d7")
    assert text.endswith("{{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}")


def test_template_names_and_entries():
    assert template_name(tokenizer_config("instruct")["chat_template"]) == "qwen3"
    assert template_name(thinking_2507_template()) == "qwen3-thinking-2507"
    with pytest.raises(ChatError, match="no chat template"):
        template_name(None)
    with pytest.raises(ChatError, match="PROVENANCE"):
        template_name("{{ messages }}")
    assert entry_template("Qwen/Qwen3-0.6B") == "qwen3"
    assert entry_template("Qwen/Qwen3-4B-Thinking-2507") == "qwen3-thinking-2507"
    assert entry_template("Qwen/Qwen3-4B-Instruct-2507") not in TEMPLATES  # no verified text
    with pytest.raises(ChatError, match="unknown chat template"):
        render([HI], template="qwen3-instruct-2507")


def test_close_reasoning_starts_the_answer_at_once(hf_tokenizer):
    hybrid = render([HI])
    assert close_reasoning(hybrid) == upstream(hf_tokenizer, [HI], add_generation_prompt=True,
                                               enable_thinking=False)
    assert close_reasoning(render([HI], enable_thinking=False)) == render([HI],
                                                                          enable_thinking=False)
    thinking = render([HI], template="qwen3-thinking-2507")
    assert close_reasoning(thinking, "qwen3-thinking-2507").endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_model_refuses_a_template_its_entry_does_not_ship(models, monkeypatch):
    model = models("kipp-synthetic/qwen3-tiny")
    assert model.chat_template == "qwen3"
    import kipp.text.chat

    monkeypatch.setitem(kipp.text.chat.ENTRY_TEMPLATES, model.entry.id, "qwen3-thinking-2507")
    with pytest.raises(ChatError, match="ships the qwen3-thinking-2507 chat template"):
        model.chat_template
