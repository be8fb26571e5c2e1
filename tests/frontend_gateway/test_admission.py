"""Admission control: past the in-flight limit requests queue, and what cannot queue is refused fast with
429 or 503 and Retry-After, while the admitted ones complete."""

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from frontend_gateway.admission import Admission, AdmissionLimits
from frontend_gateway.errors import Overloaded, QueueTimeout
from frontend_gateway.http_app import GatewayApp
from frontend_gateway.metrics import GatewayMetrics
from frontend_gateway.models.pipeline import ModelRegistry, TokenModel
from runtime.models.loading import load_model_card
from tests.frontend_gateway.asgi import Client, TokenScript, call
from tests.frontend_gateway.test_health_and_metrics import metric_value
from tests.servers import Server, start_server


def admission(max_inflight: int, max_queued: int, queue_timeout_s: float = 60.0) -> Admission:
    limits = AdmissionLimits(max_inflight=max_inflight, max_queued=max_queued, queue_timeout_s=queue_timeout_s)
    return Admission(limits, GatewayMetrics())


async def test_slots_up_to_the_limit_are_taken_without_waiting() -> None:
    gate = admission(2, 0)
    await gate.acquire()
    await gate.acquire()
    assert (gate.inflight, gate.queued) == (2, 0)
    gate.release()
    assert gate.inflight == 1


async def test_a_full_queue_refuses_at_once_with_429_and_retry_after() -> None:
    gate = admission(1, 1)
    await gate.acquire()
    waiting = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)  # let it enter the queue
    with pytest.raises(Overloaded) as refused:
        await gate.acquire()
    assert (int(refused.value.status), refused.value.retry_after) == (429, 1)
    gate.release()
    await waiting
    assert (gate.inflight, gate.queued) == (1, 0)


async def test_a_freed_slot_goes_to_the_oldest_waiter() -> None:
    gate = admission(1, 10)
    await gate.acquire()
    order: list[int] = []

    async def wait(number: int) -> None:
        await gate.acquire()
        order.append(number)

    waiters = [asyncio.create_task(wait(number)) for number in range(3)]
    await asyncio.sleep(0)
    for _ in range(3):
        gate.release()
        await asyncio.sleep(0)
    await asyncio.gather(*waiters)
    assert order == [0, 1, 2]
    assert gate.inflight == 1


async def test_a_wait_past_the_timeout_is_refused_with_503_and_retry_after() -> None:
    gate = admission(1, 1, queue_timeout_s=0.01)
    await gate.acquire()
    with pytest.raises(QueueTimeout) as refused:
        await gate.acquire()
    assert int(refused.value.status) == 503
    assert refused.value.retry_after is not None
    assert gate.queued == 0
    gate.release()
    assert gate.inflight == 0  # the timed-out waiter got nothing and holds nothing


async def test_a_cancelled_waiter_holds_no_slot() -> None:
    gate = admission(1, 1)
    await gate.acquire()
    waiting = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    gate.release()
    assert (gate.inflight, gate.queued) == (0, 0)


async def test_a_waiter_cancelled_after_being_handed_a_slot_passes_it_on() -> None:
    gate = admission(1, 2)
    await gate.acquire()
    first = asyncio.create_task(gate.acquire())
    second = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    gate.release()  # handed to `first`, which has not resumed yet
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await second
    assert (gate.inflight, gate.queued) == (1, 0)


async def test_a_new_arrival_takes_a_free_slot_even_while_a_handed_waiter_resumes() -> None:
    gate = admission(2, 5)
    await gate.acquire()
    await gate.acquire()
    waiter = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    gate.release()  # to the waiter
    gate.release()  # no one waits any more: back to the pool
    await gate.acquire()  # must not queue behind the waiter that already has its slot
    await waiter
    assert (gate.inflight, gate.queued) == (2, 0)


async def test_a_client_that_leaves_while_queued_gives_its_place_up_at_once(smollm2: Path) -> None:
    card = load_model_card(smollm2)
    registry = ModelRegistry()
    registry.add(TokenModel(card, TokenScript([11, 12], endless=True)))
    app = GatewayApp(registry, limits=AdmissionLimits(max_inflight=1, max_queued=1, queue_timeout_s=60))
    body = {"model": card.name, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    streaming, never = asyncio.Event(), asyncio.Event()

    class Holder(Client):  # reads its headers, then stops reading: it keeps its slot
        async def send(self, message: dict[str, object]) -> None:
            await super().send(message)
            streaming.set()
            await never.wait()

    holder, quitter = Holder(msgspec.json.encode(body)), Client(msgspec.json.encode(body))
    holding = asyncio.create_task(call(app, "/v1/chat/completions", None, holder))
    await streaming.wait()  # it holds the one slot now
    queued = asyncio.create_task(call(app, "/v1/chat/completions", None, quitter))
    await asyncio.sleep(0.1)  # nothing to await: the second request enters the queue within a few loop turns
    assert app.admission.queued == 1
    quitter.left.set()
    async with asyncio.timeout(5):  # far below the 60 s queue timeout
        await queued
    assert (app.admission.queued, app.admission.inflight) == (0, 1)
    assert quitter.sent == []  # nothing is written to a client that left
    holder.left.set()
    await holding
    assert app.admission.inflight == 0
    exposition = app.metrics.exposition().decode()
    assert metric_value(exposition, "flotilla_frontend_queued_requests") == 0


# --- through a real server --------------------------------------------------------------------

LONG = "x" * 150  # echoed one character per 20 ms: about 3 s, far beyond the 0.5 s queue timeout


@pytest.fixture(scope="module")
def one_slot_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("one_slot") / "server.log"
    args = ["out=echo_full", "--model-name", "echo", "--max-inflight", "1", "--max-queued", "1"]
    server = start_server([*args, "--queue-timeout", "0.5"], log, env={"FLOTILLA_TOKEN_ECHO_DELAY_MS": "20"})
    yield server
    server.stop()


def chat(content: str, stream: bool = False) -> dict[str, object]:
    return {"model": "echo", "messages": [{"role": "user", "content": content}], "stream": stream}


async def test_past_its_limits_the_server_refuses_fast_while_the_admitted_stream_completes(
    one_slot_server: Server,
) -> None:
    url = one_slot_server.base_url
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        before = (await client.get("/metrics")).text
        async with client.stream("POST", "/v1/chat/completions", json=chat(LONG, stream=True)) as admitted:
            assert admitted.status_code == 200
            lines = admitted.aiter_lines()
            first = await anext(lines)  # it holds the one slot now

            queued = asyncio.create_task(client.post("/v1/chat/completions", json=chat("short")))
            for _ in range(250):  # polling another process's metrics: no event to await
                if metric_value((await client.get("/metrics")).text, "flotilla_frontend_queued_requests") >= 1:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the second request never queued")

            beyond = await client.post("/v1/chat/completions", json=chat("short"))
            assert beyond.status_code == 429
            assert beyond.headers["retry-after"] == "1"
            assert beyond.json()["error"]["code"] == "rate_limit_exceeded"

            timed_out = await queued
            assert timed_out.status_code == 503
            assert int(timed_out.headers["retry-after"]) >= 1
            assert timed_out.json()["error"]["code"] == "queue_timeout"

            events = [first, *[line async for line in lines if line]]
        assert events[-1] == "data: [DONE]"
        chunks = [msgspec.json.decode(event.removeprefix("data: ")) for event in events[:-1]]
        assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks) == LONG
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

        after_admitted = await client.post("/v1/chat/completions", json=chat("again"))
        assert after_admitted.status_code == 200
        after = (await client.get("/metrics")).text

    def grew(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert grew("flotilla_frontend_admission_rejected_total", reason="queue_full") == 1
    assert grew("flotilla_frontend_admission_rejected_total", reason="queue_timeout") == 1
    assert grew("flotilla_frontend_errors_total", status_code="429") == 1
    assert grew("flotilla_frontend_errors_total", status_code="503") == 1


def test_the_health_routes_are_not_subject_to_admission(one_slot_server: Server) -> None:
    with httpx.stream(
        "POST", one_slot_server.base_url + "/v1/chat/completions", json=chat(LONG, stream=True), timeout=30
    ) as admitted:
        next(admitted.iter_lines())
        for path in ("/health", "/live", "/metrics", "/v1/models"):
            assert httpx.get(one_slot_server.base_url + path, timeout=5).status_code == 200
