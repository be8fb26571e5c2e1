"""chat_template_kwargs and reasoning_effort reach the chat template, as in vLLM's server.

echo_core answers with the templated prompt's tokens, so the answer shows what the template was given.
"""

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import openai
import pytest

from engines.echo import EchoCoreEngine
from frontend_gateway.http_app import GatewayApp
from frontend_gateway.models.pipeline import ModelRegistry, TokenModel
from runtime.models.card import ModelCard
from runtime.models.loading import load_model_card

MODEL = "SmolLM2-135M-Instruct.Q4_1"
# Qwen3's switch and gpt-oss's effort, each shown when the template is given it.
TEMPLATE = (
    "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    "{% if reasoning_effort is defined %}<effort={{ reasoning_effort }}>{% endif %}"
    "{% for message in messages %}{{ message.content }}{% endfor %}"
)


@pytest.fixture(scope="module")
def card(smollm2: Path) -> ModelCard:
    return msgspec.structs.replace(load_model_card(smollm2), chat_template=TEMPLATE)


@pytest.fixture
async def client(card: ModelCard) -> AsyncIterator[openai.AsyncOpenAI]:
    registry = ModelRegistry()
    registry.add(TokenModel(card, EchoCoreEngine(0.0)))
    transport = httpx2.ASGITransport(app=GatewayApp(registry))
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0)


async def ask(client: openai.AsyncOpenAI, **fields: Any) -> str | None:
    reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], **fields)
    return reply.choices[0].message.content


async def test_without_either_field_the_template_sees_neither(client: openai.AsyncOpenAI) -> None:
    assert await ask(client) == "hi"


async def test_chat_template_kwargs_become_template_variables(client: openai.AsyncOpenAI) -> None:
    assert await ask(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == "<no-think>hi"


async def test_reasoning_effort_becomes_a_template_variable(client: openai.AsyncOpenAI) -> None:
    assert await ask(client, reasoning_effort="low") == "<effort=low>hi"


async def test_reasoning_effort_wins_over_the_same_name_in_the_kwargs(client: openai.AsyncOpenAI) -> None:
    fields = {"chat_template_kwargs": {"reasoning_effort": "high", "enable_thinking": False}}
    assert await ask(client, reasoning_effort="minimal", extra_body=fields) == "<no-think><effort=minimal>hi"


async def test_kwargs_that_would_replace_the_messages_are_refused(client: openai.AsyncOpenAI) -> None:
    fields = {"chat_template_kwargs": {"messages": [{"role": "user", "content": "other"}]}}
    with pytest.raises(openai.BadRequestError, match="may not set messages") as raised:
        await ask(client, extra_body=fields)
    assert raised.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]


async def test_an_unknown_reasoning_effort_is_refused_naming_the_field(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await ask(client, extra_body={"reasoning_effort": "extreme"})
    assert raised.value.body["param"] == "reasoning_effort"  # type: ignore[index]


async def test_kwargs_that_are_not_an_object_are_refused_naming_the_field(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await ask(client, extra_body={"chat_template_kwargs": ["enable_thinking"]})
    assert raised.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]


async def test_tokenize_counts_messages_as_chat_renders_them_with_the_same_variables(
    client: openai.AsyncOpenAI,
) -> None:
    """/tokenize with messages takes chat's template variables, so its count is what that chat request is
    charged (vLLM's TokenizeChatRequest takes them too)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}
    fields = {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"}
    plain = await client.post("/tokenize", cast_to=httpx2.Response, body=body)
    varied = await client.post("/tokenize", cast_to=httpx2.Response, body=body | fields)
    shown = "".join(varied.json()["token_strs"]).replace("Ġ", " ")
    assert shown.startswith("<no-think><effort=low>") and varied.json()["count"] > plain.json()["count"]
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        reasoning_effort="low",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == varied.json()["count"]
