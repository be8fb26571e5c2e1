"""out=vllm with images, on vLLM's CPU build and a tiny random-weight Idefics3: the card built for the folder says
vision, a chat request's image reaches vLLM (its tokens counted in usage), two images give two answers, and vLLM's
KV events name the blocks holding an image by the image (the router's names before it, as the gateway computes them).

One engine start (~30 s on two cores), in this module only."""

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from frontend_gateway.http_app import GatewayApp
from frontend_gateway.models.pipeline import ModelRegistry, TokenModel
from launcher.options import RunOptions
from runtime.kv.events import BlockStored, KvEvent
from runtime.kv.image_blocks import request_block_hashes
from tests.engines.image_requests import Recorded, answer, data_uri
from tests.engines.vllm_model import ENGINE_ARGS, KV_CACHE_ENV, VLLM_MARKS, tiny_vision_model

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(600)]

MODEL = "tiny-vision"
# Over one KV block (32 tokens) of text before the image: that block is named as text, the next by the image too.
LEAD = "Describe the picture below in a few plain words, please, as a careful observer would describe it. " * 2


class Sink:
    def __init__(self) -> None:
        self.heard: list[KvEvent] = []
        self.arrived = asyncio.Event()

    def publish(self, dp_rank: int, events: list[KvEvent]) -> None:
        self.heard.extend(events)
        self.arrived.set()

    def links(self) -> list[tuple[int | None, int]]:
        """(parent, block) for every block stored."""
        pairs: list[tuple[int | None, int]] = []
        for event in self.heard:
            if isinstance(event, BlockStored):
                parent = event.parent_hash
                for name in event.block_hashes:
                    pairs.append((parent, name))
                    parent = name
        return pairs

    def children(self, parent: int) -> set[int]:
        return {name for above, name in self.links() if above == parent}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served() -> AsyncIterator[tuple[GatewayApp, Recorded, Sink]]:
    from launcher.run import build_vllm_model

    os.environ.update(KV_CACHE_ENV)
    options = RunOptions(
        input="http",
        output="vllm",
        model=str(tiny_vision_model()),
        model_name=MODEL,
        context_length=2048,
        gpu_memory_utilization=0.35,
        extra_engine_args=ENGINE_ARGS,
    )
    model, engine = build_vllm_model(options)
    assert isinstance(model, TokenModel)
    await engine.start()
    sink = Sink()
    engine.attach_kv_events(sink)  # type: ignore[attr-defined]
    recorded = Recorded(engine)
    registry = ModelRegistry()
    registry.add(TokenModel(model.card, recorded))  # type: ignore[arg-type]
    yield GatewayApp(registry), recorded, sink
    await engine.close()


def chat(*colors: tuple[int, int, int]) -> dict[str, Any]:
    images = [{"type": "image_url", "image_url": {"url": data_uri(color)}} for color in colors]
    content = [{"type": "text", "text": LEAD}, *images, {"type": "text", "text": "What is it?"}]
    return {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": content}]}


@pytest.mark.asyncio(loop_scope="module")
async def test_an_image_reaches_vllm_and_its_tokens_are_counted(served: tuple[GatewayApp, Recorded, Sink]) -> None:
    app, recorded, _ = served
    result = await answer(app, chat((255, 0, 0)))
    request = recorded.requests[-1]
    assert request.images is not None and len(request.images) == 1
    # The gateway's prompt holds one placeholder; vLLM widened it to the image's tokens, and usage says so.
    assert result["usage"]["prompt_tokens"] > len(request.token_ids)


@pytest.mark.asyncio(loop_scope="module")
async def test_two_images_are_two_answers_and_two_sets_of_blocks(served: tuple[GatewayApp, Recorded, Sink]) -> None:
    app, recorded, sink = served
    red = await answer(app, chat((255, 0, 0)))
    blue = await answer(app, chat((0, 0, 255)))
    assert red["choices"][0]["message"]["content"] != blue["choices"][0]["message"]["content"]
    red_request, blue_request = recorded.requests[-2:]
    assert red_request.token_ids == blue_request.token_ids  # the same text: only the images differ
    # The router names the text blocks before the image (the gateway does not know how many tokens an Idefics3
    # image becomes): vLLM's events, renamed by the worker, hold the same names for them.
    before = request_block_hashes(red_request.token_ids, red_request.images, 32)
    assert before and before == request_block_hashes(blue_request.token_ids, blue_request.images, 32)
    async with asyncio.timeout(30):  # vLLM publishes from its engine core process, over ZMQ
        while len(sink.children(before[-1])) < 2:
            sink.arrived.clear()
            await sink.arrived.wait()
    # The block after the shared text holds the image: one name per image, though their tokens are the same.
    assert set(before) <= {name for _, name in sink.links()}
