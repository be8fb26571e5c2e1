"""Requests run on a bounded set of reused threads, in lanes for people, agents and log tails
(controlplane/request_threads.py)."""

import asyncio
import json
import threading
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from controlplane.request_threads import AGENTS, LOG_TAILS, PEOPLE, lane_of, on_request_threads


def _thread_recording_app(seen: list[str], running: list[int], peak: list[int]):
    @sync_to_async  # thread_sensitive, as Django's handler calls views
    def view() -> None:
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        seen.append(threading.current_thread().name)
        threading.Event().wait(0.01)  # hold the thread so that requests overlap
        running[0] -= 1

    async def app(scope, receive, send) -> None:
        await view()

    return app


async def _noop(*_args):
    return {}


async def test_requests_share_a_bounded_set_of_reused_threads() -> None:
    seen: list[str] = []
    running, peak = [0], [0]
    app = on_request_threads(_thread_recording_app(seen, running, peak), threads=2)

    await asyncio.gather(*(app({"type": "http"}, _noop, _noop) for _ in range(12)))

    assert len(seen) == 12
    assert set(seen) == {"request-0_0", "request-1_0"}
    assert peak[0] == 2  # never more than two at once, and both were used together


async def test_other_scopes_pass_through_on_the_default_executor() -> None:
    seen: list[str] = []
    app = on_request_threads(_thread_recording_app(seen, [0], [0]), threads=1)

    await app({"type": "websocket"}, _noop, _noop)

    assert seen and not seen[0].startswith("request-")


def test_at_least_one_thread() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        on_request_threads(_thread_recording_app([], [0], [0]), threads=0)


class Holding:
    """An app whose requests to a path under ``/hold`` keep their thread until ``release``; the others
    record their path and thread and return at once."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.holding = 0
        self.held = asyncio.Condition()
        self.done: list[tuple[str, str]] = []
        self.sent: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        loop = asyncio.get_running_loop()
        held = asyncio.Event()

        @sync_to_async
        def view(path: str) -> None:
            if "/hold" in path:
                loop.call_soon_threadsafe(held.set)
                self.released.wait(5)
            self.done.append((path, threading.current_thread().name))

        task = asyncio.ensure_future(view(scope["path"]))
        if "/hold" in scope["path"]:
            await held.wait()
            async with self.held:
                self.holding += 1
                self.held.notify_all()
        await task

    async def until_holding(self, count: int) -> None:
        async with asyncio.timeout(5), self.held:
            await self.held.wait_for(lambda: self.holding == count)

    async def send(self, message: Any) -> None:
        self.sent.append(message)

    def request(self, app: Any, path: str) -> "asyncio.Task[None]":
        return asyncio.ensure_future(app({"type": "http", "path": path}, _noop, self.send))


def test_each_path_has_its_lane() -> None:
    assert lane_of({"path": "/api/v1/agent/heartbeat/"}) == AGENTS
    assert lane_of({"path": "/api/v1/agent/instances/7/state/"}) == AGENTS
    assert lane_of({"path": "/api/v1/instances/7/log/"}) == LOG_TAILS
    assert lane_of({"path": "/instances/7/log/"}) == LOG_TAILS  # the dashboard's log pane
    assert lane_of({"path": "/api/v1/instances/7/"}) == PEOPLE
    assert lane_of({"path": "/api/v1/nodes/"}) == PEOPLE


async def test_agents_are_served_while_people_hold_every_thread_of_theirs() -> None:
    held = Holding()
    app = on_request_threads(held, threads=2, agent_threads=1)
    people = [held.request(app, f"/hold/{n}/") for n in range(2)]
    await held.until_holding(2)

    await asyncio.wait_for(held.request(app, "/api/v1/agent/heartbeat/"), 2)

    assert held.done == [("/api/v1/agent/heartbeat/", "agent-request-0_0")]
    held.released.set()
    await asyncio.gather(*people)


async def test_people_are_served_while_agents_hold_every_thread_of_theirs() -> None:
    held = Holding()
    app = on_request_threads(held, threads=1, agent_threads=2)
    agents = [held.request(app, f"/api/v1/agent/hold/{n}/") for n in range(2)]
    await held.until_holding(2)

    await asyncio.wait_for(held.request(app, "/api/v1/nodes/"), 2)

    assert held.done == [("/api/v1/nodes/", "request-0_0")]
    held.released.set()
    await asyncio.gather(*agents)


async def test_a_log_tail_beyond_its_lanes_threads_is_refused_at_once_with_retry_after() -> None:
    held = Holding()
    app = on_request_threads(held, threads=1, log_tail_threads=2, log_tail_retry_after_s=4.2)
    tails = [held.request(app, f"/api/v1/instances/hold{n}/log/") for n in range(2)]
    await held.until_holding(2)

    await asyncio.wait_for(held.request(app, "/instances/3/log/"), 2)
    await asyncio.wait_for(held.request(app, "/api/v1/nodes/"), 2)  # people's thread is free all along

    start, body = held.sent
    assert start["status"] == 503
    assert (b"retry-after", b"5") in start["headers"]
    assert json.loads(body["body"]) == {
        "detail": "2 log tails are being read already; try again in 5 s (FLOTILLA_API_LOG_TAIL_THREADS)"
    }
    assert held.done == [("/api/v1/nodes/", "request-0_0")]
    held.released.set()
    await asyncio.gather(*tails)
    await asyncio.wait_for(held.request(app, "/instances/3/log/"), 2)  # the lane's threads came back
    path, thread = held.done[-1]
    assert path == "/instances/3/log/" and thread.startswith("log-tail-")


async def test_waiting_requests_get_a_thread_in_order_of_arrival() -> None:
    held = Holding()
    app = on_request_threads(held, threads=1)
    first = held.request(app, "/hold/")
    await held.until_holding(1)
    waiting = [held.request(app, f"/{n}/") for n in range(3)]
    await asyncio.sleep(0.01)  # all three are now waiting for the thread
    held.released.set()
    await asyncio.gather(first, *waiting)

    assert [path for path, _ in held.done] == ["/hold/", "/0/", "/1/", "/2/"]


async def test_a_request_cancelled_while_waiting_does_not_lose_the_thread() -> None:
    release_first = threading.Event()
    done: list[str] = []

    @sync_to_async
    def view(path: str) -> None:
        if path == "/first/":
            release_first.wait(5)
        done.append(path)

    async def app(scope, receive, send) -> None:
        await view(scope["path"])

    pooled = on_request_threads(app, threads=1)
    first = asyncio.create_task(pooled({"type": "http", "path": "/first/"}, _noop, _noop))
    await asyncio.sleep(0.01)
    gone = asyncio.create_task(pooled({"type": "http", "path": "/gone/"}, _noop, _noop))
    await asyncio.sleep(0.01)
    gone.cancel()
    release_first.set()
    await first
    await asyncio.wait_for(pooled({"type": "http", "path": "/after/"}, _noop, _noop), 5)

    assert done == ["/first/", "/after/"]
