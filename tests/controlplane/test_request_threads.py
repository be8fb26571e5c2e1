"""Requests run on a bounded set of reused threads (controlplane/request_threads.py)."""

import asyncio
import threading

import pytest
from asgiref.sync import sync_to_async

from controlplane.request_threads import on_request_threads


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


async def test_waiting_people_get_a_thread_before_waiting_agents() -> None:
    order: list[str] = []
    release_first = threading.Event()
    first_holds_the_thread = asyncio.Event()
    loop = asyncio.get_running_loop()

    @sync_to_async
    def view(path: str) -> None:
        order.append(path)
        if path == "/first/":
            loop.call_soon_threadsafe(first_holds_the_thread.set)
            release_first.wait(5)

    async def app(scope, receive, send) -> None:
        await view(scope["path"])

    pooled = on_request_threads(app, threads=1)
    first = asyncio.create_task(pooled({"type": "http", "path": "/first/"}, _noop, _noop))
    await first_holds_the_thread.wait()
    agent = asyncio.create_task(pooled({"type": "http", "path": "/api/v1/agent/heartbeat/"}, _noop, _noop))
    person = asyncio.create_task(pooled({"type": "http", "path": "/api/v1/nodes/"}, _noop, _noop))
    await asyncio.sleep(0.01)  # both are now waiting for the thread
    release_first.set()
    await asyncio.gather(first, agent, person)

    assert order == ["/first/", "/api/v1/nodes/", "/api/v1/agent/heartbeat/"]


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
