"""Streaming a chat completion through an ingress while something happens to the worker serving it."""

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.distributed.cluster import Cluster, Worker
from tests.servers import Server, start_server

MODEL = "alpha"
# About 60 tokens once templated: at 40 ms a token the echo takes ~2.4 s, time enough to act mid-stream.
PROMPT = " ".join(f"w{i}" for i in range(20))


@dataclass
class StreamResult:
    text: str = ""
    usage: dict[str, object] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    #: The longest wait between two content chunks, in seconds: the pause the client saw.
    longest_gap: float = 0.0


def start_ingress(cluster: Cluster, *args: str, silence_s: float = 5) -> Server:
    """An ingress with its own silence timeout (the cluster's default is 1 s)."""
    log_path = Path(cluster.directory) / f"ingress-{len(cluster.servers)}.log"
    server = start_server(["out=dyn", *args], log_path, env=cluster.env(FLOTILLA_STREAM_SILENCE_S=str(silence_s)))
    cluster.servers.append(server)
    return server


def stream_chat(base_url: str, on_chunk: Callable[[int], None] | None = None) -> StreamResult:
    """Stream a chat completion of PROMPT; ``on_chunk(n)`` is called after the n-th content chunk."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = StreamResult()
    pieces: list[str] = []
    last: float | None = None
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                result.errors.append(event["error"]["message"])
            elif event.get("usage"):
                result.usage = event["usage"]
            elif event["choices"] and (content := event["choices"][0]["delta"].get("content")):
                now = time.monotonic()
                if last is not None:
                    result.longest_gap = max(result.longest_gap, now - last)
                last = now
                pieces.append(content)
                if on_chunk is not None:
                    on_chunk(len(pieces))
    result.text = "".join(pieces)
    return result


def next_worker(cluster: Cluster, base_url: str) -> Worker:
    """The worker that answers the next request (round-robin over two: ask once, the next one is the other)."""
    first = httpx.post(
        base_url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    ).headers["x-flotilla-instance"]
    return next(worker for worker in cluster.workers if worker.instance_id != first)


def while_streaming(cluster: Cluster, base_url: str, action: Callable[[Worker], None]) -> tuple[StreamResult, Worker]:
    """Stream a chat and, after its fifth chunk, do ``action`` to the worker serving it (on another thread)."""
    victim = next_worker(cluster, base_url)
    started = threading.Event()
    actor = threading.Thread(target=lambda: (started.wait(30), action(victim)))
    actor.start()
    result = stream_chat(base_url, on_chunk=lambda n: n == 5 and started.set())
    actor.join()
    return result, victim
