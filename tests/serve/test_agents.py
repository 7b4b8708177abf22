"""``hfaccel serve`` for agents and evaluations, as a real process driven by the clients people point at it: the
``openai`` client (tools, reasoning, echo, the Responses API), LangChain's ``ChatOpenAI``, instructor and the
OpenAI Agents SDK.

Two tiny random Llamas over SmolLM2's real tokenizer (tests/serve/agent_models.py): one with SmolLM2's own chat
template, which knows nothing of tools — ``required`` and named tool choices must still return calls that match
their schemas — and one with a Qwen3-style template (Hermes ``<tool_call>`` calls, ``<think>`` blocks). A random
model writes nothing a parser would find, so what ``tool_choice="auto"`` and the reasoning split read is forced with
vLLM's ``structured_outputs`` regex: the raw text is then exactly what a model of that family writes.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
import torch
import transformers
from pydantic import BaseModel, Field

import hfaccel
from hfaccel.serve.server import ServerConfig, create_app
from tests.serve.agent_models import save_served, smollm2_tokenizer, tiny_model_over
from tests.helpers import Server

CITY = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}
WEATHER = {
    "type": "object",
    "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
THINKING = {"chat_template_kwargs": {"enable_thinking": True}}


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """A server with SmolLM2's own template (no tools in it)."""
    running = Server(save_served(tmp_path_factory.mktemp("smol")))
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A server with the Qwen3-style template: the Hermes parser and the reasoning split found in it."""
    running = Server(save_served(tmp_path_factory.mktemp("qwen"), qwen_style=True))
    yield running
    assert running.stop() == 0


def _greedy(**kwargs) -> dict:
    return {"model": "tiny", "temperature": 0, **kwargs}


def _literal(text: str) -> str:
    """A regex matching exactly ``text`` (only regex syntax escaped: xgrammar takes spaces and newlines as they
    are)."""
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", text)


def _forced(text: str) -> dict:
    """The request fields that make the model write ``text`` (the whole output, reasoning included)."""
    return {"structured_outputs": {"regex": _literal(text), "reasoning": None}}


def _calls(message) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, the arguments checked against the function's schema."""
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    return calls


def _rebuilt(chunks) -> tuple[dict, str | None]:
    """(the message a client rebuilds from chat stream chunks, the finish reason)."""
    content, reasoning, calls, finish = "", "", [], None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for call in delta.tool_calls or []:
            if call.id:
                calls.append([call.function.name, call.function.arguments or ""])
            else:
                calls[call.index][1] += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content, "reasoning": reasoning, "calls": [(n, json.loads(a)) for n, a in calls]}, finish


# ------------------------------------------------------------------------------------------------ tool calls
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_choices_return_calls_that_match_the_schema(smol, choice):
    """SmolLM2's template shows the model no tools: the constraint alone makes the calls, streamed and not."""
    client = smol.client()
    full = client.chat.completions.create(
        messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=60, **_greedy()
    )
    assert full.choices[0].finish_reason == "tool_calls", full.choices[0].message
    calls = _calls(full.choices[0].message)
    assert len(calls) == 1 and full.choices[0].message.content is None
    assert choice == "required" or calls[0][0] == "get_time"
    assert full.choices[0].message.tool_calls[0].id.startswith("call_")
    streamed, finish = _rebuilt(
        client.chat.completions.create(
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=60,
            stream=True,
            **_greedy(),
        )
    )
    assert finish == "tool_calls" and streamed["calls"] == calls and streamed["content"] == ""


def test_auto_reads_the_models_calls_and_leaves_other_text_as_content(qwen):
    client = qwen.client()
    raw = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    )
    body = {**NO_THINKING, **_forced(raw)}
    full = client.chat.completions.create(messages=ASK, tools=TOOLS, max_tokens=400, extra_body=body, **_greedy())
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    assert _calls(message) == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]
    streamed, finish = _rebuilt(
        client.chat.completions.create(
            messages=ASK, tools=TOOLS, max_tokens=400, stream=True, extra_body=body, **_greedy()
        )
    )
    assert finish == "tool_calls" and streamed["content"] == "Let me check." and streamed["calls"] == _calls(message)
    # text that is no call stays content; tool_choice="none" reads no calls at all
    plain = client.chat.completions.create(
        messages=ASK,
        tools=TOOLS,
        max_tokens=100,
        **_greedy(),
        extra_body={**NO_THINKING, **_forced("It is sunny <tool_call> maybe")},
    )
    message = plain.choices[0].message
    assert message.content == "It is sunny <tool_call> maybe" and not message.tool_calls
    assert plain.choices[0].finish_reason == "stop"
    none = client.chat.completions.create(
        messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=400, extra_body=body, **_greedy()
    )
    assert none.choices[0].message.content == raw and none.choices[0].finish_reason == "stop"


def test_a_multi_turn_history_with_tool_results_reaches_the_template(qwen):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
        {"role": "user", "content": "And the time?"},
    ]
    tokens = httpx.post(f"{qwen.url}/tokenize", json={"messages": history, "tools": TOOLS, **NO_THINKING}).json()
    prompt = httpx.post(f"{qwen.url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in prompt
        and '<tool_response>\n{"sky": "clear"}\n</tool_response>' in prompt
        and '"name": "get_time"' in prompt
    )
    full = qwen.client().chat.completions.create(
        messages=history,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        extra_body=NO_THINKING,
        **_greedy(),
    )
    assert len(_calls(full.choices[0].message)) == 1
    assert full.usage.prompt_tokens == tokens["count"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0]"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        (
            {
                "messages": ASK
                + [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": "{not json"},
                            }
                        ],
                    }
                ]
            },
            "messages",
        ),
        ({"messages": ASK + [{"role": "tool", "content": "sunny"}]}, "messages"),
        ({"chat_template_kwargs": {"tools": []}}, "messages"),
        ({"audio": {"voice": "alloy"}}, "audio"),
    ],
)
def test_bad_tools_and_histories_are_400s_naming_the_field_and_the_server_goes_on(qwen, body, param):
    response = httpx.post(
        f"{qwen.url}/v1/chat/completions", json={"model": "tiny", "messages": ASK, **body}, timeout=60
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()
    ok = qwen.client().chat.completions.create(messages=ASK, max_tokens=3, logit_bias={}, **_greedy())
    assert ok.usage.completion_tokens == 3
    assert qwen.wait_idle()["blocks_used"] == 0


# ------------------------------------------------------------------------------------------------ client libraries
class Weather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=5)


def test_langchain_bind_tools_and_with_structured_output(smol):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool(args_schema=Weather)
    def get_weather(city: str, days: int) -> str:
        """The weather in a city."""
        return f"{city}: sunny for {days} days"

    llm = ChatOpenAI(
        model="tiny", base_url=f"{smol.url}/v1", api_key="none", temperature=0, max_tokens=60, max_retries=0
    )
    message = llm.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=False).invoke("Weather in Rome?")
    assert len(message.tool_calls) == 1 and message.tool_calls[0]["name"] == "get_weather"
    Weather.model_validate(message.tool_calls[0]["args"])
    assert get_weather.invoke(message.tool_calls[0]["args"]).endswith("days")
    for method in ("function_calling", "json_schema"):  # LangChain's two ways: a tool call, response_format
        answer = llm.with_structured_output(Weather, method=method).invoke("Weather in Oslo?")
        assert isinstance(answer, Weather), (method, answer)


def test_instructor_returns_a_validated_object(smol):
    import instructor

    client = instructor.from_openai(smol.client(), mode=instructor.Mode.TOOLS)
    answer = client.chat.completions.create(
        response_model=Weather, messages=ASK, max_tokens=60, max_retries=0, **_greedy()
    )
    assert isinstance(answer, Weather)


def test_openai_agents_sdk_runs_an_agent_with_function_tools(qwen):
    """The SDK's default model (the Responses API): a forced first call runs the tool; its output goes back as an
    input item, and the next turn (tool choice reset to auto) answers in text — run and streamed."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)  # no export to OpenAI's servers
    called = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        called.append(city)
        return f"{city}: sunny"

    # a random model never ends a text answer by itself (and the SDK fails an incomplete response): after three
    # tokens its EOS is pushed; a call ends where its grammar does anyway
    eos = smollm2_tokenizer().eos_token_id
    settings = ModelSettings(
        tool_choice="required",
        temperature=0,
        max_tokens=60,
        extra_body={**NO_THINKING, "min_tokens": 3, "logit_bias": {str(eos): 100}},
    )

    def agent() -> Agent:  # a client per event loop
        client = openai.AsyncOpenAI(base_url=f"{qwen.url}/v1", api_key="none", max_retries=0)
        return Agent(
            name="weather",
            instructions="Answer with the weather.",
            tools=[get_weather],
            model=OpenAIResponsesModel("tiny", client),
            model_settings=settings,
        )

    result = Runner.run_sync(agent(), "What is the weather in Paris?")
    kinds = [type(item) for item in result.new_items]
    assert kinds[:2] == [ToolCallItem, ToolCallOutputItem] and kinds[-1] is MessageOutputItem, kinds
    assert called and called[0] in ("Paris", "Rome", "Oslo") and result.new_items[1].output == f"{called[0]}: sunny"
    assert isinstance(result.final_output, str) and result.final_output

    async def streamed() -> list[str]:
        run = Runner.run_streamed(agent(), "What is the weather in Oslo?")
        async for _ in run.stream_events():
            pass
        return [type(item).__name__ for item in run.new_items]

    assert asyncio.run(streamed())[:2] == ["ToolCallItem", "ToolCallOutputItem"]
    assert len(called) == 2


# ------------------------------------------------------------------------------------------------ Responses API
def test_responses_api_with_the_openai_client(qwen):
    client = qwen.client()
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    called = client.responses.create(
        model="tiny",
        input="Weather in Rome?",
        instructions="Be brief.",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=60,
        extra_body=NO_THINKING,
    )
    assert called.status == "completed" and [item.type for item in called.output] == ["function_call"]
    call = called.output[0]
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert call.name == "get_weather" and call.call_id.startswith("call_") and called.usage.output_tokens > 0
    # the call's result continues the stored conversation
    answer = client.responses.create(
        model="tiny",
        previous_response_id=called.id,
        temperature=0,
        max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        extra_body=NO_THINKING,
    )
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.output[0].type == "message" and answer.output_text
    conversation = [
        {"role": "user", "content": "Weather in Rome?"},  # instructions are per request: not carried
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    rendered = httpx.post(f"{qwen.url}/tokenize", json={"messages": conversation, **NO_THINKING}).json()
    assert answer.usage.input_tokens == rendered["count"]
    assert client.responses.retrieve(answer.id).output_text == answer.output_text
    # text.format: a JSON schema, streamed as the Responses events
    text = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}}
    whole = client.responses.create(
        model="tiny", input="Weather?", text=text, temperature=0, max_output_tokens=60, extra_body=NO_THINKING
    )
    jsonschema.validate(json.loads(whole.output_text), WEATHER)
    events = list(
        client.responses.create(
            model="tiny",
            input="Weather?",
            text=text,
            temperature=0,
            max_output_tokens=60,
            stream=True,
            extra_body=NO_THINKING,
        )
    )
    assert [e.type for e in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert [e.type for e in events[-4:]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    # a streamed call: its arguments as deltas
    events = list(
        client.responses.create(
            model="tiny",
            input="Time?",
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_output_tokens=60,
            stream=True,
            extra_body=NO_THINKING,
        )
    )
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["function_call"]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == done[0].arguments
    jsonschema.validate(json.loads(done[0].arguments), SCHEMAS[done[0].name])
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    assert error.value.body["param"] == "previous_response_id"


def test_responses_without_a_store_refuse_previous_response_id():
    """In-process: ``max_stored_responses=0`` keeps nothing, and says so."""
    tokenizer = smollm2_tokenizer()
    model = hfaccel.accelerate(tiny_model_over(tokenizer), attention="torch")
    engine = hfaccel.AsyncEngine(hfaccel.Engine(model, tokenizer, max_num_seqs=2, num_blocks=64))
    app = create_app(engine, ServerConfig(model_name="tiny", max_stored_responses=0))

    async def post(body: dict) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post(
                "/v1/responses", json={"model": "tiny", "max_output_tokens": 2, **body}, timeout=60
            )

    try:
        first = asyncio.run(post({"input": "hi"}))
        assert first.status_code == 200 and first.json()["status"] == "incomplete"
        refused = asyncio.run(post({"input": "more", "previous_response_id": first.json()["id"]}))
        assert refused.status_code == 400 and "--max-stored-responses 0" in refused.json()["error"]["message"]
    finally:
        engine.shutdown()


# ------------------------------------------------------------------------------------------------ reasoning
def test_reasoning_is_split_out_with_thinking_on_and_absent_with_it_off(qwen):
    client = qwen.client()
    thought = {**THINKING, **_forced("I check the map.</think>Paris is sunny.")}
    full = client.chat.completions.create(messages=ASK, max_tokens=40, extra_body=thought, **_greedy())
    message = full.choices[0].message
    assert message.content == "Paris is sunny." and message.model_extra["reasoning_content"] == "I check the map."
    assert message.model_extra["reasoning"] == "I check the map."
    streamed, finish = _rebuilt(
        client.chat.completions.create(messages=ASK, max_tokens=40, stream=True, extra_body=thought, **_greedy())
    )
    assert (streamed["reasoning"], streamed["content"], finish) == ("I check the map.", "Paris is sunny.", "stop")
    off = client.chat.completions.create(
        messages=ASK, max_tokens=40, **_greedy(), extra_body={**NO_THINKING, **_forced("Paris is sunny.")}
    )
    message = off.choices[0].message
    assert message.content == "Paris is sunny." and "reasoning_content" not in message.model_extra
    response = client.responses.create(
        model="tiny", input="Weather?", temperature=0, max_output_tokens=40, extra_body=thought
    )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "I check the map." and response.output_text == "Paris is sunny."
    assert response.usage.output_tokens_details.reasoning_tokens > 0


def test_tool_calls_are_constrained_after_the_reasoning(qwen):
    """With thinking on the prompt opens a <think> block: the model reasons freely (here: closes it at once, pushed
    by logit_bias), and the call after it matches the schema."""
    close = str(smollm2_tokenizer(qwen_style=True).convert_tokens_to_ids("</think>"))
    full = qwen.client().chat.completions.create(
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        logit_bias={close: 100},
        extra_body=THINKING,
        **_greedy(),
    )
    message = full.choices[0].message
    assert message.model_extra["reasoning_content"] == "" and full.choices[0].finish_reason == "tool_calls"
    assert _calls(message)[0][0] == "get_weather"


# ------------------------------------------------------------------------------------------------ evaluations
def test_echo_logprobs_equal_transformers_log_softmax(smol):
    """lm-evaluation-harness's loglikelihood request (``echo``, ``logprobs=1``, ``max_tokens=1``): the prompt's
    tokens and logprobs (the first null) equal transformers' own log-softmax of the same prompt, in fp32; vLLM's
    ``prompt_logprobs`` field gives the same numbers."""
    prompt = "The capital of France is Paris, and the capital of Italy is"
    tokenizer = smollm2_tokenizer()
    ids = tokenizer(prompt).input_ids
    reference = transformers.AutoModelForCausalLM.from_pretrained(smol.model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0].float()  # [L, V]
    expected = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    out = smol.client().completions.create(prompt=prompt, echo=True, logprobs=1, max_tokens=1, **_greedy())
    logprobs = out.choices[0].logprobs
    assert out.choices[0].text.startswith(prompt) and len(logprobs.tokens) == len(ids) + 1
    assert logprobs.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1 : len(ids)] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert all(len(top) >= 1 for top in logprobs.top_logprobs[1:])
    vllm = httpx.post(
        f"{smol.url}/v1/completions",
        json={**_greedy(), "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0},
        timeout=60,
    ).json()
    entries = vllm["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    assert [entries[i][str(t)]["logprob"] for i, t in enumerate(ids) if i] == pytest.approx(
        expected, rel=1e-4, abs=1e-4
    )
    streamed = list(
        smol.client().completions.create(prompt=prompt, echo=True, logprobs=1, max_tokens=3, stream=True, **_greedy())
    )
    assert "".join(c.choices[0].text for c in streamed).startswith(prompt)


def test_logit_bias_ignore_eos_min_tokens_and_stop_token_ids_do_what_they_say(smol):
    client = smol.client()
    tokenizer = smollm2_tokenizer()
    the, eos = tokenizer.encode(" the")[0], tokenizer.eos_token_id

    def complete(**body) -> tuple[list[str], str, int]:
        out = client.completions.create(prompt="Say:", max_tokens=5, logprobs=0, **_greedy(), **body)
        return out.choices[0].logprobs.tokens, out.choices[0].finish_reason, out.usage.completion_tokens

    pushed = {"logit_bias": {str(the): 100}}
    assert complete(**pushed) == ([" the"] * 5, "length", 5)
    assert complete(**pushed, extra_body={"stop_token_ids": [the]})[1:] == ("stop", 1)
    tokens, finish, count = complete(**pushed, extra_body={"stop_token_ids": [the], "min_tokens": 3})
    assert (finish, count) == ("stop", 4) and " the" not in tokens[:3]
    ended = {"logit_bias": {str(eos): 100}}
    assert complete(**ended)[1:] == ("stop", 1)
    assert complete(**ended, extra_body={"ignore_eos": True})[1:] == ("length", 5)
    assert complete(**ended, extra_body={"min_tokens": 2})[1:] == ("stop", 3)
    banned = complete()[0][0]
    assert (
        complete(logit_bias={str(tokenizer.convert_tokens_to_ids(tokenizer.tokenize(banned))[0]): -100})[0][0] != banned
    )


# ------------------------------------------------------------------------------------------------ the rest
def test_tokenize_detokenize_version_and_request_ids(qwen):
    tokenizer = smollm2_tokenizer(qwen_style=True)
    tokens = httpx.post(f"{qwen.url}/tokenize", json={"model": "tiny", "prompt": "Hello there"}).json()
    assert tokens["tokens"] == tokenizer("Hello there").input_ids and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 1024
    rendered = httpx.post(f"{qwen.url}/tokenize", json={"messages": ASK}).json()
    assert (
        rendered["tokens"]
        == tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    )
    assert httpx.post(f"{qwen.url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello there"}
    bad = httpx.post(f"{qwen.url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{qwen.url}/tokenize", json={}).status_code == 400
    assert httpx.get(f"{qwen.url}/version").json() == {"version": hfaccel.__version__}
    for method, path, body, status in [
        ("POST", "/v1/chat/completions", {**_greedy(), "messages": ASK, "max_tokens": 1}, 200),
        ("POST", "/v1/completions", {"model": "nope", "prompt": "x"}, 404),
        ("GET", "/v1/nothing", None, 404),
    ]:
        given = httpx.request(method, f"{qwen.url}{path}", json=body, headers={"X-Request-Id": "trace-7"})
        assert given.status_code == status and given.headers["x-request-id"] == "trace-7"
        made = httpx.request(method, f"{qwen.url}{path}", json=body)
        assert made.status_code == status and len(made.headers["x-request-id"]) == 32


def test_cors_for_allowed_origins_only():
    """In-process: a browser's preflight from an allowed origin is answered (before the API key is asked for), one
    from another origin is not; answers carry the origin's header."""
    tokenizer = smollm2_tokenizer()
    engine = hfaccel.AsyncEngine(
        hfaccel.Engine(
            hfaccel.accelerate(tiny_model_over(tokenizer), attention="torch"), tokenizer, max_num_seqs=2, num_blocks=64
        )
    )
    app = create_app(engine, ServerConfig(model_name="tiny", api_key="k", allowed_origins=("https://app.example",)))

    async def send(method: str, origin: str, **kwargs) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            headers = {"Origin": origin, "Access-Control-Request-Method": "POST", **kwargs.pop("headers", {})}
            return await client.request(method, "/v1/models", headers=headers, **kwargs)

    try:
        allowed = asyncio.run(send("OPTIONS", "https://app.example"))
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
        assert asyncio.run(send("OPTIONS", "https://evil.example")).status_code == 400
        answered = asyncio.run(send("GET", "https://app.example", headers={"Authorization": "Bearer k"}))
        assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == "https://app.example"
        assert "x-request-id" in answered.headers["access-control-expose-headers"].lower()
    finally:
        engine.shutdown()
