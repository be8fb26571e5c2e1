"""The Responses API (POST /v1/responses) through the official openai client: text in and out, whole
and as its stream of events, with reasoning and function calls as output items.

The gateway runs in this process over echo_full (it answers with the last message's text), served with
the qwen3 reasoning parser and the hermes tool-call parser.
"""

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import openai
import pytest

from engines.echo import EchoCoreEngine, EchoFullEngine
from frontend_gateway.http_app import GatewayApp
from frontend_gateway.models.pipeline import ModelRegistry, TextModel, TokenModel
from frontend_gateway.openai_api.chat_output import Delta
from frontend_gateway.openai_api.responses_api import ResponseBuilder, decoder
from frontend_gateway.parsers.tool_calls import tool_call_parser
from runtime.models.loading import load_model_card

WEATHER_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    registry = ModelRegistry()
    registry.add(TextModel("echo", EchoFullEngine(0.0), reasoning_parser="qwen3", tool_call_parser="hermes"))
    registry.add(TextModel("plain", EchoFullEngine(0.0), 64))
    transport = httpx2.ASGITransport(app=GatewayApp(registry))
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0)


async def test_text_in_text_out(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(model="plain", input="Hello there", instructions="Be brief.")
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "completed"
    assert response.output_text == "Hello there"
    [item] = response.output
    assert item.type == "message" and item.role == "assistant"
    assert response.instructions == "Be brief."
    assert response.usage is not None
    assert (response.usage.output_tokens, response.usage.total_tokens) == (11, 22)


async def test_input_items_become_the_conversation(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(
        model="plain",
        input=[
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": [{"type": "input_text", "text": "Bonjour"}]},
        ],
    )
    assert response.output_text == "Bonjour"  # echo answers with the last message


async def test_max_output_tokens_makes_the_response_incomplete(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(model="plain", input="abcdefghij", max_output_tokens=4)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "abcd"


async def test_the_stream_is_openais_sequence_of_events(client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(model="plain", input="Hi you", stream=True)
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == "Hi you" and len(deltas) == 6
    assert [event.sequence_number for event in events] == list(range(len(events)))
    completed: Any = events[-1]
    assert completed.response.output_text == "Hi you" and completed.response.status == "completed"


async def test_the_sdks_stream_helper_assembles_the_response(client: openai.AsyncOpenAI) -> None:
    async with client.responses.stream(model="plain", input="Assembled") as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    assert final.output_text == "Assembled"


async def test_reasoning_and_a_function_call_are_output_items(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(
        model="echo", input=f"<think>Need the weather.</think>{CALL}", tools=[WEATHER_TOOL]
    )
    reasoning, call = response.output
    assert response.usage is not None  # echo: a token per character, the reasoning's up to its closing tag
    assert response.usage.output_tokens_details.reasoning_tokens == len("<think>Need the weather.</think>")
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == "Need the weather."
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")


async def test_a_streamed_function_call_arrives_as_its_item_events(client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(model="echo", input=f"Checking. {CALL}", tools=[WEATHER_TOOL], stream=True)
    events = [event async for event in stream]
    done: Any = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert [json.loads(event.arguments) for event in done] == [{"city": "Paris"}]
    # The arguments arrive as the model writes them (a character at a time here), and add up to the call's.
    deltas: Any = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == done[0].arguments
    completed: Any = events[-1]
    assert [item.type for item in completed.response.output] == ["message", "function_call"]
    assert completed.response.output[0].content[0].text == "Checking. "


async def test_function_call_outputs_are_sent_back_as_tool_messages(client: openai.AsyncOpenAI) -> None:
    response = await client.responses.create(
        model="echo",
        tools=[WEATHER_TOOL],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
        ],
    )
    assert response.output_text == "Sunny, 21 C"  # the tool's output is the last message


@pytest.mark.parametrize(
    ("fields", "param", "contains"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "this gateway has none"),
        ({"conversation": "conv_1"}, "conversation", "conversation objects are not supported"),
        ({"background": True}, "background", "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "only named functions"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]", "image_url"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0]", "input_file"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://127.0.0.1:9/a"}]}]},
            "messages[0].content[0]",
            "takes text only",
        ),
        ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role", "wizard"),
        ({"text": {"format": {"type": "json_object"}}}, "response_format", "cannot constrain"),
        ({"tools": [WEATHER_TOOL], "model": "plain"}, "tools", "tool-call parser"),
    ],
)
async def test_what_cannot_be_honoured_is_a_bad_request(
    client: openai.AsyncOpenAI, fields: dict[str, Any], param: str, contains: str
) -> None:
    body: dict[str, Any] = {"model": "echo", "input": "hi", **fields}
    with pytest.raises(openai.BadRequestError, match=contains) as caught:
        await client.responses.create(**body)
    assert caught.value.param == param


async def test_an_unknown_model_is_not_found(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="gpt-9", input="hi")


# A template that shows each message's role, reasoning, text and calls: echo_core answers with it.
TURNS_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}|{{ m.reasoning_content or '' }}|{{ m.content or '' }}|"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}]"
    "{% endfor %}"
)


@pytest.fixture
async def turns_client(smollm2: Path) -> AsyncIterator[openai.AsyncOpenAI]:
    """``echo`` (qwen3 and hermes parsers) to make turn 1, and ``turns``, whose answer is how its chat
    template saw the conversation."""
    card = msgspec.structs.replace(load_model_card(smollm2), chat_template=TURNS_TEMPLATE, tool_call_parser="hermes")
    registry = ModelRegistry()
    registry.add(TextModel("echo", EchoFullEngine(0.0), reasoning_parser="qwen3", tool_call_parser="hermes"))
    registry.add(TokenModel(msgspec.structs.replace(card, name="turns"), EchoCoreEngine(0.0)))
    transport = httpx2.ASGITransport(app=GatewayApp(registry))
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0)


async def test_a_tool_loop_sends_the_responses_own_output_back_as_input(turns_client: openai.AsyncOpenAI) -> None:
    question: Any = [{"role": "user", "content": f"<think>Need the weather.</think>Checking.{CALL}"}]
    first = await turns_client.responses.create(model="echo", input=question, tools=[WEATHER_TOOL])
    assert [item.type for item in first.output] == ["reasoning", "message", "function_call"]
    call: Any = first.output[-1]
    result = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": [{"type": "input_text", "text": "Sunny, "}, {"type": "input_text", "text": "21 C"}],
    }
    second = await turns_client.responses.create(
        model="turns", input=[*question, *first.output, result], tools=[WEATHER_TOOL]
    )
    # One assistant turn: its reasoning, its text and its call; then the tool's output, its parts joined.
    assert second.output_text.endswith(
        '[assistant|Need the weather.|Checking.|get_weather{"city": "Paris"}][tool||Sunny, 21 C|]'
    )


async def test_a_function_call_output_with_other_than_text_parts_is_refused(client: openai.AsyncOpenAI) -> None:
    output: Any = [{"type": "input_image", "image_url": "https://example.com/x.png"}]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(
            model="echo",
            input=[
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": output},
            ],
        )
    assert caught.value.param == "input[1].output"


async def test_text_after_a_call_in_the_same_piece_keeps_the_calls_arguments_whole() -> None:
    # One piece ends a call's arguments and then has text: the arguments go to the call, the text after it.
    builder = ResponseBuilder(decoder.decode(b'{"model": "echo", "input": "hi"}'), response_id="r", model="echo")
    parser = tool_call_parser("hermes")
    frames = b""
    for piece in ['<tool_call>{"name": "f", "arguments": {"a', '": 1}}</tool_call> After.']:
        content, calls = parser.feed(piece)
        frames += builder.delta(Delta(content=content, tool_calls=calls))
    assert [item["type"] for item in builder.output] == ["function_call", "message"]
    assert builder.output[0]["arguments"] == '{"a": 1}' and builder.output[1]["content"][0]["text"] == "After."
    assert frames.index(b"function_call_arguments.done") < frames.index(b"output_text.delta")
