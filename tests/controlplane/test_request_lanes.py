"""The API on a real uvicorn server keeps serving heartbeats and people while clients are slow: bodies are
read before a request takes a thread, agents and log tails have threads of their own
(controlplane/body_limit.py, controlplane/request_threads.py, controlplane/asgi.py)."""

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from asgiref.sync import sync_to_async
from django.db import connections

from controlplane.accounts.models import Role
from controlplane.deployments import log_tail
from controlplane.deployments.dispatch import NodeDidNotAnswer
from controlplane.deployments.models import Instance
from runtime.fleet_contract.tasks import LogTailRequest
from tests.controlplane.factories import agent_token, make_node, make_user, person_token, placed_instance
from tests.servers import free_port, read_until_closed

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgresql]  # the server's threads see the rows

ANSWER_S = 3.0  # far below the body deadline and the hold times below: a request served at once
HEARTBEAT = {
    "address": "127.0.0.1",
    "cpu_count": 8,
    "memory_total_bytes": 64 << 30,
    "memory_available_bytes": 60 << 30,
    "gpus": [{"index": 0, "name": "Simulated GPU", "memory_total_bytes": 80 << 30}],
}


class Arrivals:
    """Wraps the control plane's app: holds requests to ``/slow/`` on their thread until ``released``.
    ``counted`` wraps the whole stack, to count requests as they arrive, before their body is read."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.arrived: list[str] = []
        self.released = threading.Event()
        self.slow_running = threading.Semaphore(0)

    def counted(self, stack: Any) -> Any:
        async def counting(scope: Any, receive: Any, send: Any) -> None:
            self.arrived.append(scope.get("path", ""))
            await stack(scope, receive, send)

        return counting

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["path"].startswith("/slow/"):
            await sync_to_async(self._slow_view)()  # on the request's thread, as Django's views run
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.app(scope, receive, send)
        # On the request's thread, which outlives the test: a connection kept there would stop the test
        # database from being dropped on PostgreSQL.
        await sync_to_async(connections.close_all)()

    def _slow_view(self) -> None:
        self.slow_running.release()
        self.released.wait(30)

    def wait_slow_running(self, count: int) -> None:
        for _ in range(count):
            assert self.slow_running.acquire(timeout=10), "the slow requests did not start"


@contextmanager
def serving(app: Any) -> Iterator[tuple[str, int]]:
    """``app`` on a real uvicorn server in a thread; yields its base URL and port."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}", port
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def control_plane(settings: Any) -> Iterator[tuple[str, int, Arrivals]]:
    """The control plane's HTTP stack as asgi.py builds it (2 threads for people, 1 for agents, 2 for log
    tails, a 1.5 s body deadline) around Django, served by uvicorn."""
    from controlplane.asgi import http_application, http_stack  # importing it sets Django up and reads the database

    settings.API_REQUEST_THREADS = 2
    settings.API_AGENT_THREADS = 1
    settings.API_LOG_TAIL_THREADS = 2
    settings.API_BODY_TIMEOUT_S = 1.5
    arrivals = Arrivals(http_application)
    with serving(arrivals.counted(http_stack(arrivals))) as (url, port):
        yield url, port, arrivals
        arrivals.released.set()


@pytest.fixture
def tokens() -> tuple[str, str]:
    """Node gpu-a registered; (its agent's header, a read-only person's header)."""
    make_node("gpu-a", (80,))
    person = person_token(make_user("reader", Role.READ_ONLY))
    return f"Bearer {agent_token('gpu-a')}", f"Bearer {person}"


def stalled_post(port: int, path: str, *, sent: bytes = b"") -> socket.socket:
    """A client that sends a POST's headers (a 100-byte JSON body announced) and ``sent`` of its body, then
    nothing more."""
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    client.sendall(head.encode() + sent)
    return client


def wait_for(what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_two_stalled_unauthenticated_posts_delay_neither_a_heartbeat_nor_a_persons_get(
    control_plane: tuple[str, int, Arrivals], tokens: tuple[str, str]
) -> None:
    url, port, arrivals = control_plane
    agent, person = tokens
    with ExitStack() as stack:
        for sent in (b"", b'{"na'):  # one sends nothing of its body, the other a few bytes
            stack.enter_context(stalled_post(port, "/api/v1/models/", sent=sent))
        wait_for("both stalled POSTs to arrive", lambda: arrivals.arrived.count("/api/v1/models/") == 2)

        started = time.monotonic()
        beat = httpx.post(f"{url}/api/v1/agent/heartbeat/", json=HEARTBEAT, headers={"authorization": agent})
        nodes = httpx.get(f"{url}/api/v1/nodes/", headers={"authorization": person}, timeout=ANSWER_S)
        took = time.monotonic() - started

    assert beat.status_code == 200, beat.text
    assert nodes.status_code == 200, nodes.text
    assert took < ANSWER_S


def test_a_stalled_body_is_a_408_once_the_deadline_passes(control_plane: tuple[str, int, Arrivals]) -> None:
    _, port, _ = control_plane
    with stalled_post(port, "/api/v1/models/", sent=b'{"name": ') as client:
        started = time.monotonic()
        answer = read_until_closed(client)
        waited = time.monotonic() - started

    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer
    assert json.loads(body) == {"detail": "the request body did not arrive within 1.5 s"}
    assert 1.2 < waited < 1.5 + ANSWER_S


def test_heartbeats_are_served_while_both_people_threads_are_busy(
    control_plane: tuple[str, int, Arrivals], tokens: tuple[str, str]
) -> None:
    url, _, arrivals = control_plane
    agent, person = tokens
    with ThreadPoolExecutor(2) as clients:
        slow = [clients.submit(httpx.get, f"{url}/slow/{n}/", timeout=30) for n in range(2)]
        arrivals.wait_slow_running(2)

        beat = httpx.post(f"{url}/api/v1/agent/heartbeat/", json=HEARTBEAT, headers={"authorization": agent})

        assert beat.status_code == 200, beat.text
        assert not any(request.done() for request in slow)  # both threads of people were busy throughout
        arrivals.released.set()
        assert [request.result().status_code for request in slow] == [204, 204]
    # People get their threads back once the slow requests end.
    assert httpx.get(f"{url}/api/v1/nodes/", headers={"authorization": person}).status_code == 200


class SilentAgent:
    """A dispatcher whose agent answers a log tail only when released; counts the tails it is holding."""

    def __init__(self) -> None:
        self.asked = threading.Semaphore(0)
        self.released = threading.Event()

    def log_tail(self, node: str, request: LogTailRequest, *, timeout_s: float) -> str:
        self.asked.release()
        if not self.released.wait(30):
            raise NodeDidNotAnswer(f"node {node} did not answer in {timeout_s:g} s")
        return f"the last {request.lines} lines"


def test_log_tails_waiting_on_a_silent_agent_hold_no_thread_of_people_or_agents_and_are_capped(
    control_plane: tuple[str, int, Arrivals], monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    url, _, _ = control_plane
    silent = SilentAgent()
    monkeypatch.setattr(log_tail, "agent_dispatcher", lambda: silent)
    instance: Instance = placed_instance()
    person = f"Bearer {person_token(make_user('reader', Role.READ_ONLY))}"
    agent = f"Bearer {agent_token('gpu-a')}"
    tail_url = f"{url}/api/v1/instances/{instance.pk}/log/"
    with ThreadPoolExecutor(2) as clients:
        tails: list[Future[httpx.Response]] = [
            clients.submit(httpx.get, tail_url, headers={"authorization": person}, timeout=30) for _ in range(2)
        ]
        for _ in range(2):
            assert silent.asked.acquire(timeout=10), "the log tails did not reach the agent"

        nodes = httpx.get(f"{url}/api/v1/nodes/", headers={"authorization": person}, timeout=ANSWER_S)
        beat = httpx.post(
            f"{url}/api/v1/agent/heartbeat/", json=HEARTBEAT, headers={"authorization": agent}, timeout=ANSWER_S
        )
        third = httpx.get(tail_url, headers={"authorization": person}, timeout=ANSWER_S)

        assert nodes.status_code == 200, nodes.text
        assert beat.status_code == 200, beat.text
        assert third.status_code == 503
        assert third.headers["retry-after"] == "5"  # FLOTILLA_LOG_TAIL_TIMEOUT_S: by then a tail has ended
        assert "2 log tails are being read already" in third.json()["detail"]
        silent.released.set()
        assert [tail.result().json()["text"] for tail in tails] == ["the last 100 lines"] * 2
