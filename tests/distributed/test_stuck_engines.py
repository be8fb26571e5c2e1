"""A worker whose engine is stuck, its event loop alive, fails its streams over after the progress deadline.

Heartbeats prove that a worker's event loop runs, not that its engine does: a stream whose engine hung
used to wait for ever, with heartbeats arriving on time. Real worker processes run a pytok engine that
stops generating after a few tokens (tests/distributed/engines/stuck.py).
"""

import json
from pathlib import Path

import httpx
import pytest

from tests.distributed.cluster import Cluster, Worker, served_models, wait_until
from tests.servers import Server, start_server

pytestmark = pytest.mark.timeout(120)

MODEL = "alpha"
STUCK = Path(__file__).parent / "engines" / "stuck.py"
DEADLINE_S = 2


def start_ingress(cluster: Cluster, *args: str, flag: bool = False) -> Server:
    """An ingress whose progress deadline is DEADLINE_S, by its flag or by its variable."""
    log_path = cluster.directory / f"ingress-{len(cluster.servers)}.log"
    if flag:
        args, env = ("--progress-deadline", str(DEADLINE_S), *args), cluster.env()
    else:
        env = cluster.env(FLOTILLA_STREAM_PROGRESS_DEADLINE_S=str(DEADLINE_S))
    server = start_server(["out=dyn", *args], log_path, env=env)
    cluster.servers.append(server)
    return server


def start_worker(cluster: Cluster, stuck_after: int = 0) -> Worker:
    env = {"STUCK_AFTER": str(stuck_after)} if stuck_after else {}
    return cluster.start_worker(f"dyn://{MODEL}", f"out=pytok:{STUCK}", "--model-name", MODEL, env=env)


def body(max_tokens: int, *, stream: bool) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me something"}],
        "max_tokens": max_tokens,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


def served_by(ingress: Server) -> str:
    """Send a short request (shorter than the stuck worker's few tokens); return who served it."""
    reply = httpx.post(ingress.base_url + "/v1/chat/completions", json=body(2, stream=False), timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.headers["x-flotilla-instance"]


def stream(ingress: Server, max_tokens: int) -> tuple[int, list[dict[str, str]], dict[str, int]]:
    """Stream a chat; return (content chunks, error events, usage)."""
    chunks, errors, usage = 0, [], {}
    with httpx.stream(
        "POST", ingress.base_url + "/v1/chat/completions", json=body(max_tokens, stream=True), timeout=60
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                errors.append(event["error"])
            elif event.get("usage"):
                usage = event["usage"]
            elif event["choices"] and event["choices"][0]["delta"].get("content"):
                chunks += 1
    return chunks, errors, usage


def test_a_stream_whose_engine_gets_stuck_moves_to_another_worker_after_the_progress_deadline(
    cluster: Cluster,
) -> None:
    ingress = start_ingress(cluster, "--migration-limit", "1", flag=True)
    stuck = start_worker(cluster, stuck_after=10)
    start_worker(cluster)
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    wait_until(lambda: len({served_by(ingress) for _ in range(4)}) == 2, 15, "the ingress does not see both workers")
    # Round-robin over two: the request after one the healthy worker served goes to the stuck one.
    while served_by(ingress) == stuck.instance_id:
        pass
    _, errors, usage = stream(ingress, 40)
    assert not errors
    assert usage["completion_tokens"] == 40
    assert f"sent no output for {DEADLINE_S} s" in ingress.log()
    assert "migrating request" in ingress.log()


def test_without_migration_a_stuck_engine_ends_a_stream_with_an_error_event_and_a_whole_answer_with_a_504(
    cluster: Cluster,
) -> None:
    ingress = start_ingress(cluster)
    start_worker(cluster, stuck_after=3)
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    chunks, errors, _ = stream(ingress, 40)
    assert chunks > 0
    assert [error["code"] for error in errors] == ["progress_deadline_exceeded"]
    assert f"no output for {DEADLINE_S} s" in errors[0]["message"]
    reply = httpx.post(ingress.base_url + "/v1/chat/completions", json=body(40, stream=False), timeout=60)
    assert reply.status_code == 504
    assert reply.json()["error"]["code"] == "progress_deadline_exceeded"
