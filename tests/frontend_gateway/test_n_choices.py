"""n > 1: several choices, each its own generation, numbered as vLLM numbers them, usage summed."""

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.servers import Server, start_server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
HELLO = [19556, 905]  # "Hello world": echo_core answers with it
HOW = [1073, 359, 346, 47]  # " How are you?"


@pytest.fixture(scope="module")
def client(echo_core_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=echo_core_server.api_url, api_key="unused", max_retries=0)


def test_n_completions_of_one_prompt_are_n_choices_with_usage_summed(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt=HELLO, n=3)
    assert [(choice.index, choice.text) for choice in reply.choices] == [(i, "Hello world") for i in range(3)]
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (3 * len(HELLO), 3 * len(HELLO))


def test_choices_of_several_prompts_are_numbered_prompt_times_n_plus_j(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt=[HELLO, HOW], n=2)
    texts = [(choice.index, choice.text) for choice in reply.choices]
    assert texts == [(0, "Hello world"), (1, "Hello world"), (2, " How are you?"), (3, " How are you?")]


def test_streamed_choices_interleave_each_with_its_index_and_finish(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL, prompt=HOW, n=2, stream=True, stream_options={"include_usage": True}
    )
    texts = {0: "", 1: ""}
    finished = {}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert texts == {0: " How are you?", 1: " How are you?"}
    assert finished == {0: "stop", 1: "stop"}
    assert usage is not None and usage.completion_tokens == 2 * len(HOW)


def test_too_many_choices_are_refused_naming_n(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=[HELLO, HOW, HELLO], n=100)
    assert raised.value.body["param"] == "n"  # type: ignore[index]


def test_n_chat_choices_are_n_messages_with_usage_summed(client: openai.OpenAI) -> None:
    one = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert [choice.index for choice in reply.choices] == [0, 1]
    assert {choice.message.content for choice in reply.choices} == {one.choices[0].message.content}
    assert {choice.finish_reason for choice in reply.choices} == {"stop"}
    assert reply.usage is not None and one.usage is not None
    assert reply.usage.completion_tokens == 2 * one.usage.completion_tokens


def test_streamed_chat_choices_each_announce_their_role_and_end_with_a_finish(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, stream=True)
    texts = {0: "", 1: ""}
    roles: dict[int, list[str]] = {0: [], 1: []}
    finished = {}
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role is not None:
                roles[choice.index].append(choice.delta.role)
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert texts[0] == texts[1] and texts[0].endswith("<|im_start|>assistant\n")
    assert roles == {0: ["assistant"], 1: ["assistant"]}
    assert finished == {0: "stop", 1: "stop"}


@pytest.fixture(scope="module")
def parsing_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """echo_full with Qwen3's reasoning parser and the hermes tool-call parser."""
    log = tmp_path_factory.mktemp("parsing") / "server.log"
    args = ["out=echo_full", "--model-name", "qwen", "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes"]
    server = start_server(args, log, env={"FLOTILLA_TOKEN_ECHO_DELAY_MS": "0"})
    yield server
    server.stop()


THOUGHT_AND_CALL = (
    '<think>weather</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
WEATHER_TOOL: Any = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def test_each_chat_choice_goes_through_its_own_parsers(parsing_server: Server) -> None:
    client = openai.OpenAI(base_url=parsing_server.api_url, api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": THOUGHT_AND_CALL}]
    reply: Any = client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER_TOOL], n=2)
    for choice in reply.choices:
        assert choice.message.reasoning_content == "weather"
        assert choice.message.tool_calls[0].function.name == "get_weather"
        assert choice.finish_reason == "tool_calls"
    stream: Any = client.chat.completions.create(
        model="qwen", messages=messages, tools=[WEATHER_TOOL], n=2, stream=True
    )
    calls: dict[int, list[Any]] = {0: [], 1: []}
    for chunk in stream:
        for choice in chunk.choices:
            calls[choice.index] += choice.delta.tool_calls or []
    # Each choice numbers its own calls: one call each, announced once, its arguments in later deltas.
    assert [{call.index for call in calls[index]} for index in (0, 1)] == [{0}, {0}]
    assert [sum(1 for call in calls[index] if call.id) for index in (0, 1)] == [1, 1]
