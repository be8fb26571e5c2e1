"""Reasoning output and tool calls through the official openai client, whole and streamed.

The engines are real ones: ``echo_full`` answers with the last message's text (so a message holding
``<think>`` or ``<tool_call>`` text stands for a model writing it, one character per stream chunk,
tags split over many chunks), and ``echo_core`` answers with the templated prompt's tokens (so the
answer shows what the chat template made of ``tools``).
"""

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import msgspec
import openai
import pytest

from engines.echo import EchoCoreEngine
from frontend_gateway.http_app import GatewayApp
from frontend_gateway.models.pipeline import ModelRegistry, TokenModel
from runtime.models.card import ModelCard
from runtime.models.loading import load_model_card
from tests.frontend_gateway.test_health_and_metrics import metric_value
from tests.servers import Server, start_server

WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL: Any = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def parsing_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """echo_full served with a reasoning parser and a tool-call parser, as a Qwen3 model would be."""
    log = tmp_path_factory.mktemp("parsing") / "server.log"
    args = ["out=echo_full", "--model-name", "qwen", "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"]
    server = start_server(args, log, env={"FLOTILLA_TOKEN_ECHO_DELAY_MS": "0"})
    yield server
    server.stop()


@pytest.fixture
def client(parsing_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=parsing_server.api_url, api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, text: str, **fields: Any) -> Any:
    return client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": text}], **fields)


# --- reasoning ---------------------------------------------------------------------------------


def test_reasoning_comes_back_as_reasoning_content(client: openai.OpenAI) -> None:
    reply = ask(client, "<think>The user wants a greeting.</think>\n\nHello!")
    message = reply.choices[0].message
    assert message.content == "Hello!"
    assert message.model_extra["reasoning_content"] == "The user wants a greeting."
    assert reply.choices[0].finish_reason == "stop"


def test_an_answer_without_thinking_is_all_content(client: openai.OpenAI) -> None:
    message = ask(client, "Just the answer.").choices[0].message
    assert message.content == "Just the answer."
    assert message.model_extra["reasoning_content"] is None


def test_streamed_reasoning_arrives_as_reasoning_content_deltas(client: openai.OpenAI) -> None:
    chunks = list(ask(client, "<think>Step 1. Step 2.</think>\n\nDone.", stream=True))
    reasoning = "".join((chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for chunk in chunks)
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert (reasoning, content) == ("Step 1. Step 2.", "Done.")
    # One character per chunk: the tags were split over many, and none of them leaked.
    assert sum(1 for chunk in chunks if (chunk.choices[0].delta.model_extra or {}).get("reasoning_content")) > 10
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_reasoning_tokens_count_the_answer_up_to_the_end_of_its_reasoning(client: openai.OpenAI) -> None:
    text = "<think>Step.</think>\n\nDone."
    reasoning = len("<think>Step.</think>")  # echo_full: a token per character
    whole: Any = ask(client, text).usage
    assert (whole.completion_tokens, whole.completion_tokens_details.reasoning_tokens) == (len(text), reasoning)
    chunks = list(ask(client, text, stream=True, stream_options={"include_usage": True}))
    streamed: Any = chunks[-1].usage
    assert streamed.completion_tokens_details.reasoning_tokens == reasoning
    both: Any = ask(client, text, n=2).usage
    assert both.completion_tokens_details.reasoning_tokens == 2 * reasoning
    none: Any = ask(client, "No thinking.").usage
    assert none.completion_tokens_details.reasoning_tokens == 0


def test_a_model_without_a_reasoning_parser_returns_the_tags_as_content(echo_full_server: Server) -> None:
    plain = openai.OpenAI(base_url=echo_full_server.api_url, api_key="unused", max_retries=0)
    reply = plain.chat.completions.create(model="echo", messages=[{"role": "user", "content": "<think>x</think>y"}])
    assert reply.choices[0].message.content == "<think>x</think>y"
    assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})


# --- tool calls --------------------------------------------------------------------------------


def test_a_tool_call_comes_back_as_tool_calls_with_finish_reason_tool_calls(client: openai.OpenAI) -> None:
    reply = ask(client, HERMES_CALL, tools=[WEATHER_TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_thinking_then_two_calls_then_text_are_each_in_their_place(client: openai.OpenAI) -> None:
    text = (
        "<think>Two lookups.</think>Looking up.<tool_call>"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n<tool_call>'
        '{"name": "get_time", "arguments": {}}</tool_call>'
    )
    message = ask(client, text, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="auto").choices[0].message
    assert message.model_extra["reasoning_content"] == "Two lookups."
    assert message.content == "Looking up."
    assert [call.function.name for call in message.tool_calls] == ["get_weather", "get_time"]


def test_streamed_tool_calls_arrive_as_deltas_the_client_can_assemble(client: openai.OpenAI) -> None:
    text = f"Let me check. {HERMES_CALL}<tool_call>" + '{"name": "get_time", "arguments": {}}</tool_call>'
    chunks = list(ask(client, text, tools=[WEATHER_TOOL, TIME_TOOL], stream=True))
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or "" if delta.function else ""
            call["arguments"] += delta.function.arguments or "" if delta.function else ""
    assert content == "Let me check. "
    assert [(call["name"], json.loads(call["arguments"])) for call in calls.values()] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert all(call["id"].startswith("call_") for call in calls.values())
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_clients_stream_helper_assembles_the_calls_of_the_whole_answer(client: openai.OpenAI) -> None:
    text = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}</tool_call>'
    text += '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    messages: Any = [{"role": "user", "content": text}]
    whole = client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER_TOOL, TIME_TOOL])
    with client.chat.completions.stream(model="qwen", messages=messages, tools=[WEATHER_TOOL, TIME_TOOL]) as stream:
        fragments = [event.arguments_delta for event in stream if event.type == "tool_calls.function.arguments.delta"]
        streamed = stream.get_final_completion()
    expected = [(call.function.name, call.function.arguments) for call in whole.choices[0].message.tool_calls or ()]
    got = [(call.function.name, call.function.arguments) for call in streamed.choices[0].message.tool_calls or ()]
    assert got == expected == [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", "{}")]
    assert streamed.choices[0].message.content == whole.choices[0].message.content == "Checking."
    assert streamed.choices[0].finish_reason == "tool_calls"
    # echo_full writes a character at a time: the arguments came as the model wrote them, not whole.
    assert len(fragments) > 10 and "".join(fragments) == expected[0][1] + expected[1][1]


def test_parallel_tool_calls_false_returns_the_first_call_only(client: openai.OpenAI) -> None:
    text = HERMES_CALL + '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    for stream in (False, True):
        reply = ask(client, text, tools=[WEATHER_TOOL, TIME_TOOL], parallel_tool_calls=False, stream=stream)
        if stream:
            calls = [c for chunk in reply for c in chunk.choices[0].delta.tool_calls or ()]
            names = [c.function.name for c in calls if c.id]  # a call's first delta names it
        else:
            names = [call.function.name for call in reply.choices[0].message.tool_calls]
        assert names == ["get_weather"]


def test_without_tools_the_call_text_is_just_content(client: openai.OpenAI) -> None:
    message = ask(client, HERMES_CALL).choices[0].message
    assert message.content == HERMES_CALL
    assert message.tool_calls is None


def test_tool_choice_none_leaves_the_call_text_as_content(client: openai.OpenAI) -> None:
    reply = ask(client, HERMES_CALL, tools=[WEATHER_TOOL], tool_choice="none")
    assert reply.choices[0].message.content == HERMES_CALL
    assert reply.choices[0].finish_reason == "stop"


def test_required_is_served_when_the_model_calls_a_tool(client: openai.OpenAI) -> None:
    reply = ask(client, HERMES_CALL, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required")
    assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert reply.choices[0].finish_reason == "stop"  # a forced call ends with "stop", as OpenAI's and vLLM's


def test_a_named_function_is_served_when_the_model_calls_it(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = ask(client, HERMES_CALL, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice)
    assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert reply.choices[0].finish_reason == "stop"


def test_required_without_a_call_is_an_error_not_a_plain_answer(client: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        ask(client, "I will not call anything.", tools=[WEATHER_TOOL], tool_choice="required")
    assert caught.value.code == "tool_call_missing"


def test_a_missing_forced_call_is_a_422_the_client_does_not_retry_and_is_charged_once(
    parsing_server: Server, client: openai.OpenAI
) -> None:
    text = "I will not call anything."
    plain = ask(client, text).usage
    assert plain is not None
    before = httpx.get(parsing_server.base_url + "/metrics").text
    retrying = openai.OpenAI(base_url=parsing_server.api_url, api_key="unused")  # the default: 2 retries
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        ask(retrying, text, tools=[WEATHER_TOOL], tool_choice="required")
    assert caught.value.status_code == 422 and caught.value.code == "tool_call_missing"
    after = httpx.get(parsing_server.base_url + "/metrics").text
    failed = {"model": "qwen", "endpoint": "chat_completions", "status": "error"}
    # One generation, not three: the client did not retry, and its tokens count once.
    assert (
        metric_value(after, "flotilla_frontend_requests_total", **failed)
        - metric_value(before, "flotilla_frontend_requests_total", **failed)
        == 1
    )
    assert (
        metric_value(after, "flotilla_frontend_output_tokens_total", model="qwen")
        - metric_value(before, "flotilla_frontend_output_tokens_total", model="qwen")
        == plain.completion_tokens
    )


def test_a_call_to_another_function_than_the_named_one_is_an_error(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        ask(client, HERMES_CALL, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice)
    assert "get_weather" in str(caught.value) and caught.value.code == "tool_call_missing"


def test_a_streamed_answer_without_the_required_call_ends_with_an_error_event(client: openai.OpenAI) -> None:
    stream = ask(client, "No call.", tools=[WEATHER_TOOL], tool_choice="required", stream=True)
    with pytest.raises(openai.APIError, match="without calling a tool"):
        list(stream)


def test_a_model_without_a_tool_call_parser_refuses_tools(echo_full_server: Server) -> None:
    plain = openai.OpenAI(base_url=echo_full_server.api_url, api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": HERMES_CALL}]
    for choice in (None, "auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        fields: dict[str, Any] = {} if choice is None else {"tool_choice": choice}
        with pytest.raises(openai.BadRequestError, match="tool-call parser") as caught:
            plain.chat.completions.create(model="echo", messages=messages, tools=[WEATHER_TOOL], **fields)
        assert caught.value.param == ("tools" if choice is None else "tool_choice")
    # tool_choice "none" asks for nothing it cannot do.
    reply = plain.chat.completions.create(model="echo", messages=messages, tools=[WEATHER_TOOL], tool_choice="none")
    assert reply.choices[0].message.content == HERMES_CALL


# --- what the chat template is given ------------------------------------------------------------

# A template that shows the tools it is given, then the messages: echo_core answers with it.
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for message in messages %}{{ message.content }}{% endfor %}"
)


@pytest.fixture(scope="module")
def tools_card(smollm2: Path) -> ModelCard:
    """SmolLM2's tokenizer with TOOLS_TEMPLATE, and the hermes tool-call parser."""
    return msgspec.structs.replace(load_model_card(smollm2), chat_template=TOOLS_TEMPLATE, tool_call_parser="hermes")


@pytest.fixture
async def tools_client(tools_card: ModelCard) -> AsyncIterator[openai.AsyncOpenAI]:
    """The openai client talking to a gateway in this process that serves tools_card with echo_core."""
    registry = ModelRegistry()
    registry.add(TokenModel(tools_card, EchoCoreEngine(0.0)))
    transport = httpx2.ASGITransport(app=GatewayApp(registry))
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0)


async def templated(client: openai.AsyncOpenAI, text: str, **fields: Any) -> Any:
    return await client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": text}], **fields
    )


async def test_the_chat_template_is_given_the_tools(tools_client: openai.AsyncOpenAI) -> None:
    reply = await templated(tools_client, "hi", tools=[WEATHER_TOOL, TIME_TOOL])
    assert reply.choices[0].message.content == "<tools>get_weather;get_time;</tools>hi"


async def test_a_named_function_is_the_only_tool_the_template_shows(tools_client: openai.AsyncOpenAI) -> None:
    choice: Any = {"type": "function", "function": {"name": "get_time"}}
    with pytest.raises(openai.UnprocessableEntityError):  # echo does not call it, but shows what it was offered
        await templated(tools_client, "hi", tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice)
    reply = await templated(tools_client, "hi", tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="auto")
    assert "get_weather" in reply.choices[0].message.content
    named: Any = await tools_client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=[{"role": "user", "content": '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=choice,
    )
    # The echoed prompt: the offered tools (only get_time) are content, the call a call.
    assert named.choices[0].message.content == "<tools>get_time;</tools>"
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"


async def test_tool_choice_none_shows_the_template_no_tools(tools_client: openai.AsyncOpenAI) -> None:
    reply = await templated(tools_client, "hi", tools=[WEATHER_TOOL], tool_choice="none")
    assert reply.choices[0].message.content == "hi"


async def test_a_token_model_streams_tool_calls_from_detokenized_text(tools_client: openai.AsyncOpenAI) -> None:
    stream = await templated(tools_client, HERMES_CALL, tools=[WEATHER_TOOL], stream=True)
    names = [
        call.function.name
        async for chunk in stream
        if chunk.choices
        for call in chunk.choices[0].delta.tool_calls or ()
        if call.id
    ]
    assert names == ["get_weather"]
