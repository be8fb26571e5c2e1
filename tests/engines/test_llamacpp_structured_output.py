"""response_format json_object and json_schema on llama.cpp: the answer is held to the JSON (schema) by
a grammar, through the official openai client; a schema llama.cpp cannot express is a 400."""

import json
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel

from tests.servers import Server, llama_cpp_available

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed (`make install`)"),
]

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PARIS: Any = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
CITY_SCHEMA: Any = {
    "type": "json_schema",
    "json_schema": {
        "name": "capital",
        "schema": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "London", "Berlin"]}, "sure": {"type": "boolean"}},
            "required": ["city", "sure"],
        },
    },
}


@pytest.fixture
def client(llamacpp_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=llamacpp_server.api_url, api_key="unused", max_retries=0)


def test_a_json_schema_answer_follows_the_schema(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=40, response_format=CITY_SCHEMA
    )
    answer = json.loads(reply.choices[0].message.content or "")
    assert set(answer) == {"city", "sure"}
    assert answer["city"] in ("Paris", "London", "Berlin") and isinstance(answer["sure"], bool)
    assert reply.choices[0].finish_reason == "stop"  # the grammar ended the answer with the JSON


def test_a_streamed_json_schema_answer_is_the_same_json(client: openai.OpenAI) -> None:
    unary = client.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=40, response_format=CITY_SCHEMA
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=40, response_format=CITY_SCHEMA, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == unary.choices[0].message.content


def test_json_object_makes_the_answer_open_a_json_object(client: openai.OpenAI) -> None:
    question: Any = [{"role": "user", "content": "What is the capital of France?"}]
    free = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=12)
    held = client.chat.completions.create(
        model=MODEL, messages=question, temperature=0, max_tokens=12, response_format={"type": "json_object"}
    )
    assert not (free.choices[0].message.content or "").lstrip().startswith("{")  # what it says when free
    assert (held.choices[0].message.content or "").lstrip().startswith("{")


def test_completions_take_a_response_format_too(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL,
        prompt="The capital of France, as JSON:",
        temperature=0,
        max_tokens=40,
        extra_body={"response_format": CITY_SCHEMA},
    )
    assert json.loads(reply.choices[0].text)["city"] in ("Paris", "London", "Berlin")


@pytest.mark.parametrize(
    ("response_format", "param", "contains"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}},
            None,
            "cannot turn this JSON schema into a grammar",
        ),
        ({"type": "json_schema"}, "response_format.json_schema", "needs json_schema"),
        ({"type": "xml"}, "response_format.type", "Invalid enum value 'xml'"),
    ],
)
def test_a_response_format_that_cannot_be_honoured_is_a_bad_request(
    client: openai.OpenAI, response_format: Any, param: str | None, contains: str
) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match=contains) as caught:
            client.chat.completions.create(
                model=MODEL, messages=PARIS, max_tokens=5, response_format=response_format, stream=stream
            )
        assert caught.value.param == param


# --- forced tool calls: the answer held to the call's JSON schema --------------------------------

WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "London"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME_TOOL: Any = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["CET"]}}}},
}
WEATHER: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_named_function_is_called_with_arguments_that_follow_its_parameters(client: openai.OpenAI) -> None:
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=MODEL, messages=WEATHER, temperature=0, max_tokens=40, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice
    )
    assert reply.choices[0].finish_reason == "stop"  # forced by tool_choice: "stop", as OpenAI's and vLLM's
    assert reply.choices[0].message.content is None
    [call] = reply.choices[0].message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "London") and arguments["unit"] in ("celsius", "fahrenheit")


def test_required_makes_a_model_without_a_tool_call_parser_call_an_offered_tool(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER,
        temperature=0,
        max_tokens=80,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    [call] = reply.choices[0].message.tool_calls or []  # parallel_tool_calls false: one at most
    assert call.type == "function" and call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)
    assert reply.choices[0].finish_reason == "stop"


def test_a_streamed_forced_call_arrives_whole_in_one_delta(client: openai.OpenAI) -> None:
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER,
        temperature=0,
        max_tokens=40,
        tools=[WEATHER_TOOL],
        tool_choice=choice,
        stream=True,
    )
    chunks = [chunk for chunk in stream if chunk.choices]
    calls = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()]
    assert [(call.index, call.function.name if call.function else None) for call in calls] == [(0, "get_weather")]
    assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_auto_still_needs_a_tool_call_parser(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="tool-call parser"):
        client.chat.completions.create(model=MODEL, messages=WEATHER, max_tokens=5, tools=[WEATHER_TOOL])


def test_a_forced_call_and_a_response_format_are_refused_together(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="cannot be combined") as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=WEATHER,
            max_tokens=5,
            tools=[WEATHER_TOOL],
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    assert caught.value.param == "response_format"


def test_a_forced_call_cut_off_by_max_tokens_says_so(client: openai.OpenAI) -> None:
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    with pytest.raises(openai.UnprocessableEntityError, match="raise max_tokens") as caught:
        client.chat.completions.create(
            model=MODEL, messages=WEATHER, max_tokens=3, tools=[WEATHER_TOOL], tool_choice=choice
        )
    assert caught.value.code == "tool_call_missing"


class Capital(BaseModel):
    city: Literal["Paris", "London", "Berlin"]
    population_millions: float


def test_the_sdks_parse_helper_gets_an_instance_of_its_pydantic_model(client: openai.OpenAI) -> None:
    reply = client.chat.completions.parse(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=60, response_format=Capital
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Capital) and parsed.city in ("Paris", "London", "Berlin")
