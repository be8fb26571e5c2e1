"""Prompt tokens an engine found in its cache reach the client as usage.prompt_tokens_details.cached_tokens."""

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from frontend_gateway.http_app import GatewayApp
from frontend_gateway.models.pipeline import ModelRegistry, TokenModel
from frontend_gateway.models.remote_engines import merge_engine_outputs
from runtime.engine import RequestContext
from runtime.models.card import ModelCard
from runtime.models.loading import load_model_card
from runtime.protocol import EngineOutput, PreprocessedRequest
from tests.frontend_gateway.asgi import TokenScript, call


class CachingScript(TokenScript):
    """Says on its first output that ``cached`` prompt tokens were cache hits (None: says nothing)."""

    def __init__(self, tokens: list[int], cached: int | None) -> None:
        super().__init__(tokens)
        self.cached = cached

    async def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        first = True
        async for output in super().generate(request, context):
            if first and self.cached is not None:
                output.cached_tokens = self.cached
            first = False
            yield output


@pytest.fixture(scope="module")
def card(smollm2: Path) -> ModelCard:
    return load_model_card(smollm2)


def app_with(card: ModelCard, cached: int | None) -> GatewayApp:
    registry = ModelRegistry()
    registry.add(TokenModel(card, CachingScript([11, 12, 13], cached)))
    return GatewayApp(registry)


def body(card: ModelCard, **fields: Any) -> dict[str, Any]:
    return {"model": card.name, "messages": [{"role": "user", "content": "hi"}], **fields}


async def test_a_whole_answer_reports_the_cached_prompt_tokens(card: ModelCard) -> None:
    client = await call(app_with(card, 7), "/v1/chat/completions", body(card))
    usage = msgspec.json.decode(client.content)["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 7}
    assert usage["completion_tokens"] == 3


async def test_a_stream_reports_them_in_its_usage_chunk(card: ModelCard) -> None:
    request = {"model": card.name, "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
    client = await call(app_with(card, 0), "/v1/completions", request)
    usages = [event["usage"] for event in client.events()[:-1] if event.get("usage")]
    assert len(usages) == 1
    assert usages[0]["completion_tokens"] == 3
    assert usages[0]["prompt_tokens_details"] == {"cached_tokens": 0}  # zero hits is still said


async def test_an_engine_that_does_not_say_adds_no_details(card: ModelCard) -> None:
    client = await call(app_with(card, None), "/v1/chat/completions", body(card))
    assert "prompt_tokens_details" not in msgspec.json.decode(client.content)["usage"]


def test_outputs_merged_from_one_frame_keep_the_cached_token_count() -> None:
    merged = merge_engine_outputs([EngineOutput([1], cached_tokens=32), EngineOutput([2]), EngineOutput([3], "stop")])
    assert merged == EngineOutput([1, 2, 3], "stop", cached_tokens=32)
