"""The official openai client works unchanged against `flotilla run in=http`."""

import httpx2
import openai
import pytest

from engines.echo import EchoFullEngine
from frontend_gateway.http_app import GatewayApp
from frontend_gateway.models.pipeline import ModelRegistry, TextModel
from tests.servers import Server


@pytest.fixture
def client(echo_full_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=echo_full_server.api_url, api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [model.id for model in models.data] == ["echo"]
    assert models.data[0].owned_by == "flotilla"


def test_chat_completion_echoes_the_last_message_with_usage(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="echo",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
    )
    assert reply.object == "chat.completion"
    assert reply.id.startswith("chatcmpl-")
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == "hello"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (5, 5, 10)


def test_streamed_chat_completion_arrives_in_pieces_with_usage_last(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="echo",
        messages=[{"role": "user", "content": "héllo 🌍"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == "héllo 🌍"
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len("héllo 🌍")


def test_streamed_chat_without_include_usage_sends_no_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}], stream=True)
    )
    assert all(chunk.usage is None for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_cuts_the_answer_with_finish_reason_length(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "abcdefgh"}], max_completion_tokens=3
    )
    assert reply.choices[0].message.content == "abc"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 3


def test_stop_string_across_pieces_ends_the_answer_and_is_not_shown(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "one two STOP three"}], stop=["STOP"]
    )
    assert reply.choices[0].message.content == "one two "
    assert reply.choices[0].finish_reason == "stop"


def test_streamed_stop_string_is_held_back_then_dropped(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "abc<END>xyz"}], stop="<END>", stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == "abc"


def test_completion_echoes_the_prompt(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="echo", prompt="The quick brown fox")
    assert reply.object == "text_completion"
    assert reply.choices[0].text == "The quick brown fox"
    assert reply.choices[0].finish_reason == "stop"


def test_streamed_completion_arrives_in_pieces(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="echo", prompt="stream me", stream=True, max_tokens=6)
    chunks = list(stream)
    assert "".join(chunk.choices[0].text for chunk in chunks) == "stream"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_unknown_model_is_a_not_found_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert "nope" in str(caught.value)
    assert caught.value.code == "model_not_found"


def test_a_message_with_an_unknown_role_is_a_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="echo", messages=[{"role": "wizard", "content": "hi"}])  # type: ignore[misc,list-item]
    assert "wizard" in str(caught.value)
    assert caught.value.param == "messages[0].role"


def test_models_retrieve_describes_a_served_model(client: openai.OpenAI) -> None:
    model = client.models.retrieve("echo")
    assert (model.id, model.object, model.owned_by) == ("echo", "model", "flotilla")
    assert model.created > 0


def test_models_retrieve_of_an_unknown_id_is_not_found_in_openais_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-9")
    assert caught.value.code == "model_not_found"
    assert caught.value.param == "model"
    assert "gpt-9" in str(caught.value)


async def test_models_retrieve_takes_an_id_with_a_slash() -> None:
    registry = ModelRegistry()
    registry.add(TextModel("org/name", EchoFullEngine(0.0)))
    transport = httpx2.ASGITransport(app=GatewayApp(registry))
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
        client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0)
        assert (await client.models.retrieve("org/name")).id == "org/name"
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("org/other")
