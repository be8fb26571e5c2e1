"""Keys' token limits through the gateway's HTTP app, its meter on a real redis-server: a request reserves its
prompt and max_tokens at admission, so concurrent requests cannot pass a limit together (one process: not at
all; two: by at most the limit on each), a request's end puts back what it did not use, embeddings are
charged before they are computed, and a key met for the first time (or again after it was idle) is judged on
the fleet's totals, not on this process's counts alone."""

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from frontend_gateway.access.api_keys import KeyTable
from frontend_gateway.access.quotas import Meter
from frontend_gateway.http_app import GatewayApp
from frontend_gateway.models.pipeline import ModelRegistry, TokenModel
from runtime.cluster.discovery import WatchEvent
from runtime.errors import EngineError
from runtime.fleet_contract.api_keys import KeyRecord, etcd_key, key_hash, new_key, sign
from runtime.models.card import ModelCard
from runtime.models.loading import load_model_card
from tests.frontend_gateway.asgi import Client, TokenScript
from tests.infra import RedisServer

SECRET = b"s" * 64
MAX_TOKENS = 16
WORDS = [28120, 905]  # "hello world" in SmolLM2's vocabulary: pieces of text a stream sends
# 2027-01-15 08:00:00 UTC, the start of a minute: the limits' minutes and months follow this clock.
START = 1_800_000_000.0 - 1_800_000_000.0 % 60


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


class Gateway:
    """One ingress process: the HTTP app with its keys and its meter, on a shared Redis."""

    def __init__(self, models: ModelRegistry, redis_url: str, clock: Clock) -> None:
        self.keys = KeyTable(SECRET)
        self.meter = Meter(aioredis.Redis.from_url(redis_url, socket_timeout=5), clock=clock)
        self.app = GatewayApp(models, api_keys=self.keys, meter=self.meter)

    def publish(self, key: str, **limits: int) -> None:
        record = KeyRecord(key_id=7, name="chat-app", owner="alice", **limits)  # type: ignore[arg-type]
        hashed = key_hash(key)
        self.keys.apply(WatchEvent("put", etcd_key(hashed), sign(record, hashed, SECRET)))

    async def post(
        self, key: str, body: dict[str, Any], *, path: str = "/v1/chat/completions", client: Client | None = None
    ) -> Client:
        return await post(self.app, body, path=path, key=key, client=client)


async def post(
    app: GatewayApp,
    body: dict[str, Any],
    *,
    path: str = "/v1/chat/completions",
    key: str | None = None,
    client: Client | None = None,
) -> Client:
    """Run one request through ``app`` to its end (with ``key`` as its bearer); the client shows what came."""
    client = client or Client(msgspec.json.encode(body))
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    await app({"type": "http", "method": "POST", "path": path, "headers": headers}, client.receive, client.send)
    return client


Start = Callable[..., Gateway]


@pytest.fixture
def card(smollm2: Path) -> ModelCard:
    return load_model_card(smollm2).prepare()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def start(redis_server: RedisServer, clock: Clock) -> AsyncIterator[Start]:
    """``start(*models)``: an ingress process serving them, its meter on ``redis_server`` (closed at the end)."""
    started: list[Gateway] = []

    def make(*models: TokenModel) -> Gateway:
        registry = ModelRegistry()
        for model in models:
            registry.add(model)
        started.append(Gateway(registry, redis_server.url, clock))
        return started[-1]

    yield make
    for gateway in started:
        await gateway.meter.close()


def chat(card: ModelCard, **fields: Any) -> dict[str, Any]:
    return {"model": card.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS, **fields}


async def bound_of(card: ModelCard) -> int:
    """The most tokens ``chat(card)`` may use: its prompt's (as a served answer counts them) and max_tokens."""
    registry = ModelRegistry()
    registry.add(TokenModel(card, TokenScript([11])))
    answer = await post(GatewayApp(registry), chat(card))
    return int(msgspec.json.decode(answer.content)["usage"]["prompt_tokens"]) + MAX_TOKENS


def error_of(client: Client) -> dict[str, Any]:
    error: dict[str, Any] = msgspec.json.decode(client.content)["error"]
    return error


async def test_fifty_requests_at_once_on_a_key_with_room_for_two_admit_two_and_refuse_the_rest(
    card: ModelCard, start: Start
) -> None:
    bound = await bound_of(card)
    gateway = start(TokenModel(card, TokenScript([11], endless=True)))  # each answer takes all of max_tokens
    key = new_key()
    gateway.publish(key, tokens_per_minute=2 * bound)

    answers = await asyncio.gather(*(gateway.post(key, chat(card)) for _ in range(50)))

    assert sorted(answer.status for answer in answers) == [200] * 2 + [429] * 48
    refused = next(answer for answer in answers if answer.status == 429)
    assert error_of(refused)["code"] == "rate_limit_exceeded"
    assert f"{2 * bound} tokens per minute" in error_of(refused)["message"]
    assert int(refused.headers[b"retry-after"]) >= 1


async def test_two_processes_admit_at_most_the_limit_each_and_then_both_refuse(card: ModelCard, start: Start) -> None:
    bound = await bound_of(card)
    engine = TokenScript([11], endless=True)
    first, second = start(TokenModel(card, engine)), start(TokenModel(card, engine))
    key = new_key()
    for gateway in (first, second):
        gateway.publish(key, tokens_per_minute=2 * bound)

    # Within one flush neither sees the other's reservations: each admits what fits the limit on its own.
    answers = await asyncio.gather(*(gateway.post(key, chat(card)) for gateway in (first, second) * 25))
    admitted = sum(answer.status == 200 for answer in answers)
    assert 2 <= admitted <= 2 * 2
    assert all(answer.status in (200, 429) for answer in answers)

    assert await first.meter.flush() and await second.meter.flush() and await first.meter.flush()
    for gateway in (first, second):
        assert (await gateway.post(key, chat(card))).status == 429


class Holder(Client):
    """A streaming client that takes the status line, then stops reading until ``go`` (or it leaves)."""

    def __init__(self, body: bytes) -> None:
        super().__init__(body)
        self.streaming = asyncio.Event()
        self.go = asyncio.Event()

    async def send(self, message: dict[str, Any]) -> None:
        await super().send(message)
        self.streaming.set()
        await self.go.wait()


@pytest.mark.parametrize("ending", ["the client leaves", "the engine fails"])
async def test_a_request_holds_its_reservation_while_it_runs_and_gives_back_what_it_did_not_use(
    card: ModelCard, start: Start, ending: str
) -> None:
    bound = await bound_of(card)
    prompt = bound - MAX_TOKENS
    failing = TokenModel(card, TokenScript(WORDS, error=EngineError("the engine's process died")))
    steady = TokenModel(msgspec.structs.replace(card, name="steady"), TokenScript([11]))
    gateway = start(failing, steady)
    key = new_key()
    # Room for one request's reservation, plus the few tokens another one uses (its prompt, a token or two).
    gateway.publish(key, tokens_per_minute=bound + prompt + 4)

    holder = Holder(msgspec.json.encode(chat(card, stream=True)))
    held = asyncio.create_task(gateway.post(key, {}, client=holder))
    await holder.streaming.wait()
    refused = await gateway.post(key, chat(card))
    assert refused.status == 429, "a second request was admitted into the first one's reservation"

    if ending == "the client leaves":
        holder.left.set()
    else:
        holder.go.set()
    await held
    if ending == "the engine fails":
        assert b"the engine's process died" in holder.content
    # It used its prompt and at most two tokens: the rest of its reservation is free again.
    assert (await gateway.post(key, chat(card, model="steady"))).status == 200


async def test_a_request_that_could_never_fit_is_refused_saying_to_lower_max_tokens(
    card: ModelCard, start: Start
) -> None:
    gateway = start(TokenModel(card, TokenScript([11])))
    key = new_key()
    gateway.publish(key, tokens_per_minute=1000)

    # No max_tokens: the answer may fill the model's context (8,192 tokens), which is what is reserved.
    refused = await gateway.post(key, {"model": card.name, "messages": [{"role": "user", "content": "hi"}]})

    assert refused.status == 429 and b"retry-after" not in refused.headers  # waiting would not help
    assert "over the limit of 1000 tokens per minute; lower max_tokens" in error_of(refused)["message"]
    assert (await gateway.post(key, chat(card))).status == 200


class Embedding(TokenScript):
    """A token engine that embeds; its first call waits for ``go``."""

    def __init__(self) -> None:
        super().__init__([11])
        self.calls = 0
        self.called = asyncio.Event()
        self.go = asyncio.Event()

    async def embed(self, texts: list[str]) -> tuple[list[list[float]], int]:
        self.calls += 1
        self.called.set()
        if self.calls == 1:
            await self.go.wait()
        return [[1.0, 0.0] for _ in texts], 3 * len(texts)


async def test_embeddings_reserve_their_tokens_before_the_engine_embeds(card: ModelCard, start: Start) -> None:
    engine = Embedding()
    gateway = start(TokenModel(msgspec.structs.replace(card, embeddings=True).prepare(), engine))
    key = new_key()
    texts = ["the quick brown fox jumps over the lazy dog"] * 4
    tokens = sum(len(card.tokenizer.encode(text, add_special_tokens=True).ids) for text in texts)
    gateway.publish(key, tokens_per_minute=tokens + tokens // 2)  # one request's tokens fit, two's do not

    first = asyncio.create_task(gateway.post(key, {"model": card.name, "input": texts}, path="/v1/embeddings"))
    await engine.called.wait()
    second = await gateway.post(key, {"model": card.name, "input": texts}, path="/v1/embeddings")
    assert second.status == 429 and engine.calls == 1  # refused before any embedding
    assert f"this request may use {tokens} (its inputs' tokens)" in error_of(second)["message"]
    engine.go.set()
    assert (await first).status == 200


async def test_a_used_up_budget_is_refused_by_a_process_meeting_the_key_first_and_after_it_was_idle(
    card: ModelCard, start: Start, clock: Clock
) -> None:
    gateway = start(TokenModel(card, TokenScript([11])))
    other = start(TokenModel(card, TokenScript([11])))
    key = new_key()
    for each in (gateway, other):
        each.publish(key, monthly_token_budget=1000)
    record = other.keys.check(f"Bearer {key}".encode())
    other.meter.finished(record, card.name, prompt_tokens=900, completion_tokens=100)  # another process used it
    assert await other.meter.flush()

    first = await gateway.post(key, chat(card))  # no flush of this process's has read the key yet
    assert first.status == 429 and error_of(first)["code"] == "insufficient_quota"

    clock.now += 3 * 60  # idle: this process forgets the key at its next flush
    assert await gateway.meter.flush()
    again = await gateway.post(key, chat(card))
    assert again.status == 429 and error_of(again)["code"] == "insufficient_quota"


async def test_a_key_met_while_redis_is_frozen_is_judged_on_this_process_counts_after_the_load_timeout(
    card: ModelCard, start: Start, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = start(TokenModel(card, TokenScript([11])))
    key = new_key()
    gateway.publish(key, requests_per_minute=1)
    assert redis_server.process is not None
    os.kill(redis_server.process.pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING, "frontend_gateway.access.quotas"):
            assert (await gateway.post(key, chat(card))).status == 200
            assert (await gateway.post(key, chat(card))).status == 429  # this process's own count still holds
    finally:
        os.kill(redis_server.process.pid, signal.SIGCONT)
    assert "Redis did not give the fleet's totals of key 7 within 0.5 s" in caplog.text


async def test_every_answer_of_a_key_with_limits_says_what_is_left_of_them(card: ModelCard, start: Start) -> None:
    """As OpenAI's answers do, not only its 429s: a client can pace itself before it is refused."""
    gateway = start(TokenModel(card, TokenScript(WORDS)))
    key, unlimited = new_key(), new_key()
    gateway.publish(key, requests_per_minute=5, tokens_per_minute=10_000)

    first, second = await gateway.post(key, chat(card)), await gateway.post(key, chat(card))

    assert (first.status, second.status) == (200, 200)
    assert first.headers[b"x-ratelimit-limit-requests"] == b"5"
    assert (first.headers[b"x-ratelimit-remaining-requests"], second.headers[b"x-ratelimit-remaining-requests"]) == (
        b"4",
        b"3",
    )
    assert first.headers[b"x-ratelimit-limit-tokens"] == b"10000"
    assert int(first.headers[b"x-ratelimit-remaining-tokens"]) < 10_000  # its reservation or its use counted
    assert first.headers[b"x-ratelimit-reset-requests"].endswith(b"s")
    tokenized = await gateway.post(key, {"model": card.name, "prompt": "hi"}, path="/v1/tokenize")
    assert tokenized.status == 200 and tokenized.headers[b"x-ratelimit-remaining-requests"] == b"2"
    # A key without limits gets none of these headers.
    gateway.keys.apply(
        WatchEvent(
            "put",
            etcd_key(key_hash(unlimited)),
            sign(KeyRecord(key_id=8, name="free", owner="bob"), key_hash(unlimited), SECRET),
        )
    )
    free = await gateway.post(unlimited, chat(card))
    assert free.status == 200 and not any(name.startswith(b"x-ratelimit") for name in free.headers)
