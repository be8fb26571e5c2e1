"""A stream always ends properly: a failure after the headers becomes an error event and [DONE], is
counted as an error, and a client that leaves (even while a send is blocked) closes the engine's stream
at once, not when the garbage collector gets to it."""

import asyncio
import gc
from pathlib import Path
from typing import Any

import msgspec
import pytest

from frontend_gateway.http_app import GatewayApp
from frontend_gateway.models import pipeline
from frontend_gateway.models.pipeline import ModelRegistry, TokenModel
from runtime.models.card import ModelCard
from runtime.models.loading import load_model_card
from tests.frontend_gateway.asgi import Client, TokenScript, call
from tests.frontend_gateway.test_health_and_metrics import metric_value

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def card(smollm2: Path) -> ModelCard:
    return load_model_card(smollm2)


def app_with(card: ModelCard, engine: TokenScript) -> GatewayApp:
    registry = ModelRegistry()
    registry.add(TokenModel(card, engine))
    return GatewayApp(registry)


def body(card: ModelCard, **fields: Any) -> dict[str, Any]:
    return {"model": card.name, "messages": [{"role": "user", "content": "hi"}], **fields}


def tokens(card: ModelCard, text: str) -> list[int]:
    ids: list[int] = card.tokenizer.encode(text, add_special_tokens=False).ids
    return ids


def assert_ends_with_an_error_event(client: Client, message: str) -> dict[str, Any]:
    assert client.status == 200
    events = client.events()
    assert events[-1] == "[DONE]"
    error: dict[str, Any] = events[-2]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"]
    # The answer did not finish: no chunk may claim it did.
    assert all(event["choices"][0]["finish_reason"] is None for event in events[:-2])
    assert client.sent[-1].get("more_body", False) is False
    return error


async def test_a_plain_exception_after_the_headers_ends_the_stream_with_an_error_event(card: ModelCard) -> None:
    engine = TokenScript(tokens(card, "one two three"), error=Exception("the engine tripped over itself"))
    app = app_with(card, engine)

    client = await call(app, CHAT, body(card, stream=True, stream_options={"include_usage": True}))

    error = assert_ends_with_an_error_event(client, "internal error while generating")
    assert error["type"] == "internal_server_error"
    texts = [event["choices"][0]["delta"].get("content") for event in client.events()[:-2]]
    assert "".join(text for text in texts if text) == "one two three"
    exposition = app.metrics.exposition().decode()
    labels = {"endpoint": "chat_completions", "request_type": "stream"}
    assert metric_value(exposition, "flotilla_frontend_requests_total", status="error", **labels) == 1
    assert metric_value(exposition, "flotilla_frontend_requests_total", status="success", **labels) == 0
    assert metric_value(exposition, "flotilla_frontend_errors_total", status_code="500") == 1


class _FailingDecodeStream:
    """Stands in for tokenizers' DecodeStream, which raises a plain Exception on an invalid prefix."""

    def __init__(self, skip_special_tokens: bool) -> None:
        self.steps = 0

    def step(self, tokenizer: object, token_id: int) -> str | None:
        self.steps += 1
        if self.steps == 3:
            raise Exception("Invalid prefix encountered")
        return f"<{token_id}>"


@pytest.fixture
def failing_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline, "DecodeStream", _FailingDecodeStream)


async def test_a_detokenizer_failure_mid_stream_is_an_engine_error_event(
    card: ModelCard, failing_decoder: None
) -> None:
    engine = TokenScript([11, 12, 13, 14])
    app = app_with(card, engine)

    client = await call(app, CHAT, body(card, stream=True))

    assert_ends_with_an_error_event(client, "could not be detokenized: Invalid prefix encountered")
    assert engine.closed.is_set()
    assert engine.contexts[0].stopped


async def test_a_detokenizer_failure_before_any_text_is_a_500_envelope(card: ModelCard, failing_decoder: None) -> None:
    engine = TokenScript([11, 12, 13, 14])

    client = await call(app_with(card, engine), CHAT, body(card))

    assert client.status == 500
    assert b"could not be detokenized" in client.content


async def test_a_client_leaving_while_a_send_is_blocked_closes_the_engine_stream_at_once(card: ModelCard) -> None:
    engine = TokenScript(tokens(card, "again and"), endless=True)
    app = app_with(card, engine)
    blocked = asyncio.Event()
    never = asyncio.Event()

    class SlowReader(Client):
        async def send(self, message: dict[str, Any]) -> None:
            await super().send(message)
            if len(self.sent) == 5:  # the client stops reading: the send waits, as uvicorn's drain does
                blocked.set()
                await never.wait()

    client = SlowReader(msgspec.json.encode(body(card, stream=True)))
    gc.disable()  # the point: nothing may rely on the collector finalizing the generators
    try:
        served = asyncio.create_task(call(app, CHAT, None, client))
        await blocked.wait()
        client.left.set()  # the disconnect arrives while the send is stuck
        await served
        assert engine.closed.is_set(), "the engine's stream was left open after the client left"
    finally:
        gc.enable()
    assert engine.contexts[0].stopped
    exposition = app.metrics.exposition().decode()
    assert metric_value(exposition, "flotilla_frontend_requests_total", status="cancelled") == 1
    assert metric_value(exposition, "flotilla_frontend_inflight_requests") == 0


@pytest.mark.parametrize("stream", [True, False])
async def test_a_finished_request_leaves_no_garbage_cycle(card: ModelCard, stream: bool) -> None:
    """Everything a request allocated is freed by reference counting when it ends. A cancelled helper
    task that stored its CancelledError once held each request's whole graph in a cycle, so that the
    ingress spent long collections (up to 126 ms under load) freeing them."""
    app = app_with(card, TokenScript(tokens(card, "one two three")))
    await call(app, CHAT, body(card, stream=stream))  # the first request fills caches: not garbage
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        client = Client(msgspec.json.encode(body(card, stream=stream)))
        await call(app, CHAT, None, client)
        await asyncio.sleep(0)  # the helper task's cancellation runs
        assert client.status == 200
        gc.collect()
        left = [type(thing).__name__ for thing in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == [], f"a finished request left cycles for the collector: {sorted(set(left))}"
