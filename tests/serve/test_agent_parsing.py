"""The text side of the agent features, without a model: each family's tool-call format read back (what the model
wrote: calls, content before them, text that only looks like a call), ``<think>`` reasoning split out, and — for
any way a stream cuts the text into deltas (hypothesis) — the streamed message equal to the whole one, and the
Responses items built from the deltas equal to those built at once."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hfaccel.serve.chat import ChatShape
from hfaccel.serve.reasoning import reasoning_mode, split_reasoning
from hfaccel.serve.responses import OutputItems, input_messages
from hfaccel.serve.tools import (
    PARSERS,
    Tool,
    ToolError,
    constrained_calls,
    constrained_schema,
    detect_parser,
    parse_tool_choice,
    parse_tools,
)

WEATHER = Tool("get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}}})
CALLS = {
    "hermes": (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        "Let me look.",
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "CET"}}',
        "",
    ),
    "mistral": (
        'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        "Let me look.",
    ),
}
NOT_CALLS = {
    "hermes": "Use <tool_call> tags to call, like <tool_call> this </tool_call>.",
    "llama3_json": "The answer is {not json}",
    "mistral": "No call here, only [TOOL_CALLS] broken {",
}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_each_format_reads_its_calls_and_leaves_other_text_as_content(name):
    text, content = CALLS[name]
    found_content, calls = PARSERS[name]().parse(text)
    assert found_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == 2
    assert PARSERS[name]().parse(NOT_CALLS[name]) == (NOT_CALLS[name], [])


def test_mistral_v11_calls_and_template_detection():
    content, calls = PARSERS["mistral"]().parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Rome"}')]
    assert detect_parser("... <tool_call> ...") == "hermes" and detect_parser("[TOOL_CALLS]") == "mistral"
    assert detect_parser("<|python_tag|>") == "llama3_json" and detect_parser("{{ messages }}") is None


def _chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def _streamed(shape: ChatShape, text: str, cuts: list[int]) -> tuple[dict, list[dict]]:
    """The message a client rebuilds from the stream's deltas, and the deltas."""
    stream, deltas = shape.stream(), []
    for piece in _chunked(text, cuts):
        deltas += stream.feed(piece)
    deltas += stream.finish()
    message = {"role": "assistant", "content": "".join(d.get("content", "") for d in deltas) or None}
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    if calls:
        message["tool_calls"] = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls if c.get("id")
        ]
        for c in calls:
            if not c.get("id"):
                message["tool_calls"][-1]["arguments"] += c["function"]["arguments"]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    if reasoning or shape.reasoning == "open":
        message["reasoning_content"] = reasoning
    return message, deltas


def _whole(shape: ChatShape, text: str) -> dict:
    message, _ = shape.message(text)
    message = {**message, "content": message["content"] or None}
    message.pop("reasoning", None)
    if "tool_calls" in message:
        message["tool_calls"] = [c["function"] for c in message["tool_calls"]]
    if message.get("reasoning_content") == "" and shape.reasoning != "open":
        message.pop("reasoning_content")
    return message


SHAPES = [
    (ChatShape("auto", PARSERS["hermes"]), CALLS["hermes"][0]),
    (ChatShape("auto", PARSERS["hermes"]), NOT_CALLS["hermes"]),
    (ChatShape("auto", PARSERS["llama3_json"]), CALLS["llama3_json"][0]),
    (ChatShape("auto", PARSERS["llama3_json"]), NOT_CALLS["llama3_json"]),
    (ChatShape("auto", PARSERS["mistral"]), CALLS["mistral"][0]),
    (ChatShape("auto", PARSERS["hermes"], reasoning="open"), "I should call.</think>\n\n" + CALLS["hermes"][0]),
    (ChatShape("auto", PARSERS["hermes"], reasoning="optional"), "<think>Hmm <thin</think>Plain answer."),
    (ChatShape("none", None, reasoning="optional"), "No reasoning, <think> in the middle stays."),
    (ChatShape("none", None, reasoning="open"), "cut short while reasoning"),
    (ChatShape(WEATHER, None, constrained=True), '{"city": "Paris"}'),
    (
        ChatShape("required", None, constrained=True),
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]',
    ),
    (
        ChatShape("required", None, reasoning="open", constrained=True),
        'plan</think>[{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
    ),
    (ChatShape("required", None, constrained=True), '[{"name": "get_weather", "param'),  # cut short: content
]


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=12))
@pytest.mark.parametrize("shape,text", SHAPES)
def test_a_streamed_message_equals_the_whole_one(shape, text, cuts):
    message, _ = _streamed(shape, text, cuts)
    assert message == _whole(shape, text)
    streamed, stream, events = OutputItems(), shape.stream(), []
    for piece in _chunked(text, cuts):
        events += streamed.feed(stream.feed(piece))
    events += streamed.feed(stream.finish()) + streamed.finish()
    one = shape.stream()
    whole = OutputItems()
    whole.feed(one.feed(text) + one.finish())
    whole.finish()
    assert _without_ids(streamed.items) == _without_ids(whole.items)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert _without_ids(done) == _without_ids(streamed.items)  # each item is done once, as the response has it


def _without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_reasoning_modes_of_rendered_prompts():
    assert reasoning_mode("<|im_start|>assistant\n<think>\n") == "open"
    assert reasoning_mode("<|im_start|>assistant\n<think>\n\n</think>\n\n") is None
    assert reasoning_mode("<|im_start|>assistant\n") == "optional"
    assert split_reasoning("a</think>\n\nb", opened=True) == ("a", "b")
    assert split_reasoning("  <think>a</think>b", opened=False) == ("a", "b")
    assert split_reasoning("b <think>", opened=False) == (None, "b <think>")


def test_tools_and_tool_choice_are_checked_naming_the_field():
    tools = parse_tools([{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}])
    assert tools == [Tool("get_weather", None, WEATHER.parameters)]
    assert parse_tools([{"type": "function", "name": "f"}], flat=True)[0].parameters["type"] == "object"
    for bad, where in [
        ([{"type": "retrieval"}], "tools[0]"),
        ([{"type": "function", "function": {"name": "a b"}}], "tools[0]"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tools[0]"),
        ([{"type": "function", "function": {"name": "f"}}] * 2, "tools"),
        ({"f": 1}, "tools"),
    ]:
        with pytest.raises(ToolError) as error:
            parse_tools(bad)
        assert error.value.param == where
    assert parse_tool_choice(None, tools) == "auto" and parse_tool_choice(None, []) == "none"
    assert parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools) == tools[0]
    assert parse_tool_choice({"type": "function", "name": "get_weather"}, tools, flat=True) == tools[0]
    for bad, message in [
        ("required", None),
        ({"type": "function", "function": {"name": "nope"}}, "not among"),
        ("sometimes", "must be 'none'"),
    ]:
        with pytest.raises(ToolError, match=message or "needs tools") as error:
            parse_tool_choice(bad, tools if bad != "required" else [])
        assert error.value.param == "tool_choice"


def test_constrained_schemas_and_their_calls():
    assert constrained_schema(WEATHER, [WEATHER], True) == WEATHER.parameters
    assert constrained_schema("auto", [WEATHER], True) is None
    single = constrained_schema("required", [WEATHER], parallel=False)
    assert single["maxItems"] == 1 and single["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    assert "maxItems" not in constrained_schema("required", [WEATHER], parallel=True)
    calls = constrained_calls("required", '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]
    assert constrained_calls("required", '[{"name": "get_w') == []
    assert constrained_calls(WEATHER, '{"city": "Os')[0].arguments == '{"city": "Os'  # as far as it came


def test_responses_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
    ]
    assert input_messages(items) == [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon", "name": "get_time"},
    ]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    for bad, match in [
        ([{"type": "item_reference", "id": "x"}], r"input\[0\]: items of type 'item_reference'"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "only text"),
        ([{"type": "function_call", "name": "f"}], "call_id"),
        ([{"type": "function_call_output", "output": "x"}], "names its call"),
    ]:
        with pytest.raises(ValueError, match=match):
            input_messages(bad)
