"""API keys' usage: counted by ingress meters in a real redis-server, drained into the database once and
only once, and read per key, model and day over the REST API, as rows or CSV."""

import asyncio
from collections.abc import Callable, Iterator

import pytest
import redis
import redis.asyncio as aioredis
from rest_framework.test import APIClient

from controlplane.accounts.models import Role, User
from controlplane.apikeys import actions
from controlplane.apikeys.models import ApiKey, KeyUsage
from controlplane.apikeys.tasks import drain_usage
from controlplane.apikeys.usage import CLAIMED_PREFIX, drain
from controlplane.audit.records import Actor
from frontend_gateway.access.quotas import Meter
from runtime.fleet_contract.api_keys import KeyRecord
from tests.infra import RedisServer
from tests.servers import free_port

pytestmark = pytest.mark.django_db

DAY = 1_800_000_000.0  # 2027-01-15 08:00 UTC


@pytest.fixture
def sync_redis(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[redis.Redis]:
    monkeypatch.setenv("FLOTILLA_QUOTA_REDIS_URL", redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def make_key(owner: User, name: str = "chat-app") -> ApiKey:
    return actions.create_key(Actor.person(owner), owner, name)[0]


def count(redis_url: str, key: ApiKey, model: str, **tokens: int) -> None:
    """One finished request of ``key`` on ``model``, counted by an ingress's meter and flushed to Redis."""

    async def flush() -> None:
        client = aioredis.Redis.from_url(redis_url)
        meter = Meter(client, clock=lambda: DAY)
        meter.finished(KeyRecord(key_id=key.pk, name=key.name, owner="x"), model, **tokens)  # type: ignore[arg-type]
        await meter.close()

    asyncio.run(flush())


@pytest.fixture
def alice(client_for: Callable[[Role | None], APIClient]) -> tuple[APIClient, User]:
    client = client_for(Role.OPERATOR)
    return client, User.objects.get(role=Role.OPERATOR)


def test_the_ingresses_counts_become_rows_per_key_model_and_day(
    sync_redis: redis.Redis, redis_server: RedisServer, alice: tuple[APIClient, User]
) -> None:
    _, owner = alice
    key = make_key(owner)
    count(redis_server.url, key, "smol", prompt_tokens=10, cached_tokens=4, completion_tokens=5)
    count(redis_server.url, key, "smol", prompt_tokens=20, completion_tokens=1)
    count(redis_server.url, key, "big", error=True)
    count(redis_server.url, key, "smol")  # a request that used no tokens (cut off before its prompt was read)
    sync_redis.hincrby("flotilla:usage:2027-01-15", "999\tsmol\trequests", 3)  # a key the database does not have

    report = drain(sync_redis)
    assert (report.batches, report.rows, report.skipped) == (1, 2, 1)
    rows = {row.model: row for row in KeyUsage.objects.all()}
    smol = rows["smol"]
    assert (smol.requests, smol.prompt_tokens, smol.cached_tokens, smol.completion_tokens, smol.errors) == (
        3,
        30,
        4,
        6,
        0,
    )
    assert (rows["big"].requests, rows["big"].errors, str(rows["big"].day)) == (1, 1, "2027-01-15")
    assert sync_redis.keys("flotilla:usage*") == []

    count(redis_server.url, key, "smol", prompt_tokens=1)
    drain(sync_redis)
    assert KeyUsage.objects.get(model="smol").prompt_tokens == 31  # added to the day's row


def test_a_batch_whose_deletion_failed_is_added_once(sync_redis: redis.Redis, alice: tuple[APIClient, User]) -> None:
    key = make_key(alice[1])
    # A drain claimed this batch and added it, then died before deleting it: the next drain must not add it again.
    claimed = f"{CLAIMED_PREFIX}2027-01-15:dead0001"
    sync_redis.hset(claimed, f"{key.pk}\tsmol\trequests", 5)
    drain(sync_redis)
    sync_redis.hset(claimed, f"{key.pk}\tsmol\trequests", 5)
    drain(sync_redis)
    assert KeyUsage.objects.get().requests == 5


def test_with_redis_down_the_drain_says_so_and_nothing_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_QUOTA_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    assert drain_usage() is None
    assert not KeyUsage.objects.exists()


def test_people_read_their_keys_usage_filtered_and_as_csv(
    sync_redis: redis.Redis, redis_server: RedisServer, client_for: Callable[[Role | None], APIClient]
) -> None:
    alice_client, bob_client, admin = client_for(Role.OPERATOR), client_for(Role.OPERATOR), client_for(Role.ADMIN)
    alice, bob = User.objects.filter(role=Role.OPERATOR).order_by("id")
    alices, bobs = make_key(alice), make_key(bob, "bob-app")
    count(redis_server.url, alices, "smol", prompt_tokens=7, completion_tokens=3)
    count(redis_server.url, alices, "big", prompt_tokens=1)
    count(redis_server.url, bobs, "smol", prompt_tokens=100)
    drain(sync_redis)

    rows = alice_client.get("/api/v1/usage/", {"model": "smol", "since": "2027-01-15"}).json()["results"]
    assert [(row["key_name"], row["model"], row["prompt_tokens"], row["completion_tokens"]) for row in rows] == [
        ("chat-app", "smol", 7, 3)
    ]
    assert alice_client.get("/api/v1/usage/", {"since": "2027-01-16"}).json()["results"] == []
    assert len(admin.get("/api/v1/usage/").json()["results"]) == 3
    assert [row["owner"] for row in bob_client.get("/api/v1/usage/").json()["results"]] == [bob.username]
    assert alice_client.get("/api/v1/usage/", {"since": "not a day"}).status_code == 400

    exported = alice_client.get("/api/v1/usage/export/", {"key": alices.pk})
    assert exported.status_code == 200 and exported["Content-Type"].startswith("text/csv")
    lines = exported.content.decode().splitlines()
    assert lines[0] == "day,key,key_name,owner,model,requests,prompt_tokens,cached_tokens,completion_tokens,errors"
    assert lines[1:] == [
        f"2027-01-15,{alices.pk},chat-app,{alice.username},big,1,1,0,0,0",
        f"2027-01-15,{alices.pk},chat-app,{alice.username},smol,1,7,0,3,0",
    ]
