"""frontend_gateway/access/quotas.py on a real redis-server: two ingress processes' meters share one limit per
key, minutes slide, monthly budgets hold, reservations reach the other processes, usage adds up per key,
model and day, a Redis outage loses no count, and a flush whose reply is lost is not counted twice."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from frontend_gateway.access.quotas import USAGE_PREFIX, Meter, QuotaExhausted, RateLimited
from runtime.fleet_contract.api_keys import KeyRecord
from tests.infra import RedisServer
from tests.servers import free_port

# 2027-01-15 08:00:00 UTC, the start of a minute.
START = 1_800_000_000.0 - 1_800_000_000.0 % 60


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


def key(**limits: object) -> KeyRecord:
    return KeyRecord(**{"key_id": 7, "name": "chat-app", "owner": "alice", **limits})  # type: ignore[arg-type]


def admitted(meter: Meter, record: KeyRecord, count: int) -> int:
    """How many of ``count`` requests ``meter`` admits."""
    passed = 0
    for _ in range(count):
        try:
            meter.charge(record)
        except RateLimited:
            continue
        passed += 1
    return passed


async def test_two_processes_share_one_requests_per_minute_limit(redis: aioredis.Redis, clock: Clock) -> None:
    first, second = Meter(redis, clock=clock), Meter(redis, clock=clock)
    limited = key(requests_per_minute=10)
    assert admitted(first, limited, 6) == 6
    await first.flush()
    # A process that meets a key learns the fleet's count for it at its next flush (0.1 s later).
    assert admitted(second, limited, 1) == 1
    await second.flush()
    assert admitted(second, limited, 10) == 3
    await second.flush()
    await first.flush()
    with pytest.raises(RateLimited, match="10 requests per minute") as refused:
        first.charge(limited)
    error = refused.value
    # This minute's 10 go on counting in the next, fading: one more fits 6 s into it (10 x 0.9 = 9).
    assert (error.status, error.code, error.retry_after) == (429, "rate_limit_exceeded", 66)
    headers = dict(error.headers)
    assert headers[b"x-ratelimit-limit-requests"] == b"10" and headers[b"x-ratelimit-remaining-requests"] == b"0"
    assert headers[b"x-ratelimit-reset-requests"] == b"66s"  # the same reading as Retry-After


async def test_the_minute_slides_the_previous_one_counting_for_the_part_still_in_the_last_60_s(
    redis: aioredis.Redis, clock: Clock
) -> None:
    meter = Meter(redis, clock=clock)
    limited = key(requests_per_minute=10)
    assert admitted(meter, limited, 10) == 10
    await meter.flush()
    clock.now = START + 60 + 30  # half-way into the next minute: the 10 count as 5
    await meter.flush()
    assert admitted(meter, limited, 10) == 5
    with pytest.raises(RateLimited) as refused:
        meter.charge(limited)
    # 5 of this minute and 10 x 0.5 of the last: one more fits once the last counts for 4 (at 36 s).
    assert refused.value.retry_after == 6


async def test_tokens_per_minute_refuse_once_the_finished_requests_reached_them(
    redis: aioredis.Redis, clock: Clock
) -> None:
    meter = Meter(redis, clock=clock)
    limited = key(tokens_per_minute=1000)
    meter.charge(limited)
    meter.finished(limited, "smol", prompt_tokens=700, completion_tokens=299)
    meter.charge(limited)  # 999: under the limit, so served (its own tokens are not known yet)
    meter.finished(limited, "smol", prompt_tokens=1, completion_tokens=10)
    with pytest.raises(RateLimited, match="1000 tokens per minute") as refused:
        meter.charge(limited)
    assert dict(refused.value.headers)[b"x-ratelimit-remaining-tokens"] == b"0"


async def test_a_monthly_budget_is_the_fleets_and_refused_with_insufficient_quota(
    redis: aioredis.Redis, clock: Clock
) -> None:
    first, second = Meter(redis, clock=clock), Meter(redis, clock=clock)
    budgeted = key(monthly_token_budget=5000)
    first.charge(budgeted)
    first.finished(budgeted, "smol", prompt_tokens=3000, completion_tokens=2000)
    await first.flush()
    second.charge(budgeted)  # this process has not read the fleet's month yet: its first flush does
    await second.flush()
    with pytest.raises(QuotaExhausted, match="monthly budget of 5000 tokens") as refused:
        second.charge(budgeted)
    assert (refused.value.status, refused.value.code) == (429, "insufficient_quota")
    assert refused.value.retry_after == 17 * 86400 - 8 * 3600  # until 2027-02-01 00:00 UTC


async def test_usage_adds_up_per_key_model_and_day_in_redis(redis: aioredis.Redis, clock: Clock) -> None:
    first, second = Meter(redis, clock=clock), Meter(redis, clock=clock)
    record = key()
    first.finished(record, "smol", prompt_tokens=10, cached_tokens=4, completion_tokens=5)
    second.finished(record, "smol", prompt_tokens=20, completion_tokens=1)
    second.finished(record, "big", error=True)
    await first.flush()
    await second.flush()
    usage = {k.decode(): int(v) for k, v in (await redis.hgetall(f"{USAGE_PREFIX}2027-01-15")).items()}
    assert usage == {
        "7\tsmol\trequests": 2,
        "7\tsmol\tprompt_tokens": 30,
        "7\tsmol\tcached_tokens": 4,
        "7\tsmol\tcompletion_tokens": 6,
        "7\tbig\trequests": 1,
        "7\tbig\terrors": 1,
    }


async def test_counts_made_while_redis_is_down_are_kept_and_sent_when_it_answers(
    redis_server: RedisServer, clock: Clock
) -> None:
    redis_server.stop()
    meter = Meter(aioredis.Redis.from_url(redis_server.url, socket_connect_timeout=0.5), clock=clock)
    limited = key(requests_per_minute=3)
    assert admitted(meter, limited, 5) == 3  # still enforced, on what this process saw
    meter.finished(limited, "smol", prompt_tokens=8, completion_tokens=2)
    assert not await meter.flush()

    redis_server.start()  # Redis is back, on the same port
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        assert await meter.flush()
        usage = await client.hgetall(f"{USAGE_PREFIX}2027-01-15")
        assert int(usage[b"7\tsmol\tprompt_tokens"]) == 8
        assert int(await client.get(f"flotilla:rate:7:{int(START // 60)}:r")) == 3
    finally:
        await client.aclose()
        await meter.close()


def test_without_redis_each_process_enforces_its_limits_alone(clock: Clock) -> None:
    meter = Meter(None, clock=clock)
    assert admitted(meter, key(requests_per_minute=4), 9) == 4
    unlimited: Callable[[], None] = lambda: meter.charge(key())  # noqa: E731
    for _ in range(100):
        unlimited()


def test_a_429s_retry_after_and_its_reset_headers_are_one_reading_of_the_sliding_minute(clock: Clock) -> None:
    """Once they were 5 s against 47 s (the fixed minute's end): a client that waited for the reset was
    refused again, or one that read it waited ten times too long."""
    meter = Meter(None, clock=clock)
    limited = key(requests_per_minute=10, tokens_per_minute=1000)
    assert admitted(meter, limited, 10) == 10
    clock.now = START + 60 + 13.5  # 13.5 s into the next minute: the 10 count as 7.75
    assert admitted(meter, limited, 3) == 2
    with pytest.raises(RateLimited, match="10 requests per minute") as refused:
        meter.charge(limited)
    # 2 of this minute and 10 x (1 - 0.3) of the last fit under 10 at 18 s into it: in 4.5 s.
    assert refused.value.retry_after == 5
    assert dict(refused.value.headers)[b"x-ratelimit-reset-requests"] == b"5s"
    assert dict(meter.limit_headers(limited))[b"x-ratelimit-reset-requests"] == b"5s"


def test_a_refused_reservations_reset_header_says_when_its_own_tokens_fit(clock: Clock) -> None:
    meter = Meter(None, clock=clock)
    limited = key(tokens_per_minute=1000)
    meter.charge(limited)
    meter.finished(limited, "smol", prompt_tokens=900)
    clock.now = START + 60 + 30  # half-way into the next minute: the 900 count as 450
    meter.charge(limited)
    with pytest.raises(RateLimited, match="this request may use 600") as refused:
        meter.reserve(limited, 600)
    # 600 fit once the 900 count for at most 400: at 33.3 s into the minute, in 3.3 s.
    assert refused.value.retry_after == 4
    headers = dict(refused.value.headers)
    assert headers[b"x-ratelimit-reset-tokens"] == b"4s" and headers[b"x-ratelimit-remaining-tokens"] == b"550"
    assert dict(meter.limit_headers(limited))[b"x-ratelimit-reset-tokens"] == b"0s"  # one more token fits now


async def test_a_reservation_reaches_the_other_processes_at_the_next_flush_and_its_end_corrects_its_minute(
    redis: aioredis.Redis, clock: Clock
) -> None:
    first, second = Meter(redis, clock=clock), Meter(redis, clock=clock)
    limited = key(tokens_per_minute=1000)
    await second.load(limited)  # it knows the key already (as after a request of it)
    reservation = first.reserve(limited, 800)
    await first.flush()
    await second.flush()
    with pytest.raises(RateLimited, match="1000 tokens per minute, of which 800 are used or reserved"):
        second.reserve(limited, 300)

    clock.now = START + 70  # the request ends in the next minute, having used 100 tokens
    first.settle(reservation, 100)
    first.settle(reservation, 100)  # settled once
    await first.flush()
    assert int(await redis.get(f"flotilla:rate:7:{int(START // 60)}:t")) == 100  # the minute it was admitted in
    await second.flush()
    # 100 of the last minute, 5/6 of it still counting, and 800 more fit in 1000.
    assert second.reserve(limited, 800) is not None


class ReplyDropper:
    """A TCP relay to redis-server that can lose the next reply on its way back (Redis has applied the
    command), resetting the client's connection as a network fault would."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.dropped = asyncio.Event()
        self._drop = False
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def close(self) -> None:
        for writer in self._writers:
            writer.transport.abort()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def drop_next_reply(self) -> None:
        self._drop = True

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._writers |= {writer, up_writer}

        async def requests() -> None:
            with contextlib.suppress(OSError):
                while data := await reader.read(65536):
                    up_writer.write(data)
                    await up_writer.drain()
            up_writer.transport.abort()

        async def replies() -> None:
            with contextlib.suppress(OSError):
                while data := await up_reader.read(65536):
                    if self._drop:
                        self._drop = False
                        self.dropped.set()
                        break
                    writer.write(data)
                    await writer.drain()
            writer.transport.abort()
            up_writer.transport.abort()

        await asyncio.gather(requests(), replies())


async def test_a_flush_whose_reply_is_lost_after_redis_applied_it_is_counted_once(
    redis_server: RedisServer, redis: aioredis.Redis, clock: Clock
) -> None:
    relay = ReplyDropper(redis_server.port)
    await relay.start()
    meter = Meter(aioredis.Redis.from_url(relay.url, socket_timeout=5), clock=clock)
    limited = key(requests_per_minute=100, monthly_token_budget=10_000)
    try:
        meter.charge(limited)
        meter.finished(limited, "smol", prompt_tokens=10, completion_tokens=5)
        assert await meter.flush()
        meter.charge(limited)
        meter.finished(limited, "smol", prompt_tokens=20, completion_tokens=3)
        relay.drop_next_reply()
        # Redis applies this flush and its reply is lost: redis-py may send it again at once on a new
        # connection, or the flush fails and the next one sends it again.
        applied = await meter.flush()
        assert relay.dropped.is_set()
        assert applied or await meter.flush()

        usage = {k.decode(): int(v) for k, v in (await redis.hgetall(f"{USAGE_PREFIX}2027-01-15")).items()}
        fields = ("requests", "prompt_tokens", "completion_tokens")
        assert [usage[f"7\tsmol\t{name}"] for name in fields] == [2, 30, 8]
        assert int(await redis.get(f"flotilla:rate:7:{int(START // 60)}:r")) == 2
        assert int(await redis.get("flotilla:budget:7:2027-01")) == 38
    finally:
        await meter.close()
        await relay.close()
