"""Which model a key's request is charged to in its usage: the model it asked for whenever the fleet knows that
name, refused or not (out of the key's models, not ready, bad parameters), and "(unknown model)" only for
names nothing serves, so that made-up names cannot fill the usage tables. Through the gateway's HTTP app,
its meter on a real redis-server."""

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from frontend_gateway.access.api_keys import KeyTable
from frontend_gateway.access.quotas import UNKNOWN_MODEL, USAGE_PREFIX, Meter
from frontend_gateway.http_app import GatewayApp
from frontend_gateway.models.pipeline import ModelRegistry, TokenModel
from frontend_gateway.models.served_names import ServedNames
from runtime.cluster.discovery import WatchEvent
from runtime.fleet_contract.api_keys import KeyRecord, etcd_key, key_hash, new_key, sign
from runtime.fleet_contract.served_names import SERVED_NAMES_PREFIX
from runtime.models.loading import load_model_card
from tests.frontend_gateway.asgi import Client, TokenScript
from tests.infra import RedisServer

SECRET = b"s" * 64
# 2027-01-15 08:00:00 UTC: the usage hash of that day.
NOW = 1_800_000_000.0
DAY = f"{USAGE_PREFIX}2027-01-15"


class Gateway:
    """An ingress process serving one model, with a stopped pipeline's name known, keys and a meter."""

    def __init__(self, smollm2: Path, redis: aioredis.Redis) -> None:
        self.card = load_model_card(smollm2).prepare()
        models = ModelRegistry()
        models.add(TokenModel(self.card, TokenScript([11])))
        served = ServedNames()
        served.apply(WatchEvent("put", f"{SERVED_NAMES_PREFIX}stopped-chat", b'{"state":"stopped"}'))
        self.keys = KeyTable(SECRET)
        self.meter = Meter(redis, clock=lambda: NOW)
        self.app = GatewayApp(models, api_keys=self.keys, meter=self.meter, served_names=served)

    def key(self, key_id: int, **fields: Any) -> str:
        key, record = new_key(), KeyRecord(key_id=key_id, name=f"app-{key_id}", owner="alice", **fields)
        self.keys.apply(WatchEvent("put", etcd_key(key_hash(key)), sign(record, key_hash(key), SECRET)))
        return key

    async def post(self, key: str, body: dict[str, Any]) -> int:
        client = Client(msgspec.json.encode(body))
        headers = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {key}".encode())]
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
        await self.app(scope, client.receive, client.send)
        return client.status

    async def usage(self, redis: aioredis.Redis) -> dict[str, int]:
        await self.meter.flush()
        return {name.decode(): int(count) for name, count in (await redis.hgetall(DAY)).items()}


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
async def gateway(smollm2: Path, redis: aioredis.Redis) -> AsyncIterator[Gateway]:
    gateway = Gateway(smollm2, redis)
    yield gateway
    await gateway.meter.close()


def chat(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


async def test_a_request_refused_for_a_served_model_is_charged_to_that_model(
    gateway: Gateway, redis: aioredis.Redis
) -> None:
    name = gateway.card.name
    other_models_only, any_model = gateway.key(1, models=["other"]), gateway.key(2)

    assert await gateway.post(other_models_only, chat(name)) == 403  # out of the key's models
    assert await gateway.post(any_model, chat(name, stream_options={"include_usage": True})) == 400
    assert await gateway.post(any_model, chat("stopped-chat")) == 503  # its pipeline is stopped

    assert await gateway.usage(redis) == {
        f"1\t{name}\trequests": 1,
        f"1\t{name}\terrors": 1,
        f"2\t{name}\trequests": 1,
        f"2\t{name}\terrors": 1,
        "2\tstopped-chat\trequests": 1,
        "2\tstopped-chat\terrors": 1,
    }


async def test_a_name_nothing_serves_is_counted_under_unknown_model(gateway: Gateway, redis: aioredis.Redis) -> None:
    assert await gateway.post(gateway.key(1), chat("made-up")) == 404
    assert await gateway.usage(redis) == {f"1\t{UNKNOWN_MODEL}\trequests": 1, f"1\t{UNKNOWN_MODEL}\terrors": 1}
