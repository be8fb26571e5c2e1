"""Many concurrent streams through one ingress over two workers, some abandoned mid-stream."""

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field

import httpx

from tests.distributed.cluster import Cluster, Worker, served_models, wait_until
from tests.distributed.load_watch import LoadWatcher

MODEL = "alpha"
STREAMS = 48
# Every third stream is abandoned after a few chunks; its prompt is long, so that an echo nobody
# stopped would keep its worker busy (thousands of tokens at 20 ms each) far past the end of this test.
ABANDONED_WORDS = 600


@dataclass
class Outcome:
    instance: str
    text: str = ""
    usage: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def prompt(index: int) -> str:
    words = ABANDONED_WORDS if abandoned(index) else 12
    return f"stream {index}: " + " ".join(f"w{index}x{n}" for n in range(words))


def abandoned(index: int) -> bool:
    return index % 3 == 0


def chat(index: int) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt(index)}]}


async def stream(client: httpx.AsyncClient, index: int, leave: asyncio.Event | None) -> Outcome:
    """Stream a chat of ``prompt(index)``; with ``leave``, stop reading after 3 chunks and close once it is set."""
    body = {**chat(index), "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        outcome = Outcome(response.headers["x-flotilla-instance"])
        pieces: list[str] = []
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                outcome.errors.append(event["error"]["message"])
            elif event.get("usage"):
                outcome.usage = event["usage"]
            elif event["choices"] and (content := event["choices"][0]["delta"].get("content")):
                pieces.append(content)
                if leave is not None and len(pieces) == 3:
                    await leave.wait()
                    break  # leaving the block closes the connection mid-stream
    outcome.text = "".join(pieces)
    return outcome


async def run_streams(base_url: str, workers: list[Worker], load: LoadWatcher) -> list[Outcome]:
    limits = httpx.Limits(max_connections=STREAMS * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        leave = asyncio.Event()
        completed = [index for index in range(STREAMS) if not abandoned(index)]
        tasks = [
            asyncio.create_task(stream(client, index, leave if abandoned(index) else None)) for index in range(STREAMS)
        ]
        # The abandoned streams stay open until both workers have reported them as active.
        await asyncio.to_thread(
            load.wait_for,
            lambda load: all(max(load.active_requests(w.instance_id), default=0) >= 2 for w in workers),
            15,
            "the workers never reported several active streams",
        )
        leave.set()
        outcomes = await asyncio.gather(*tasks)
        # What an undisturbed request for each completed prompt answers: the echo of its template.
        replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat(i)) for i in completed))
    for index, reply in zip(completed, replies, strict=True):
        assert outcomes[index].text == reply.json()["choices"][0]["message"]["content"], f"stream {index} was garbled"
    return outcomes


def test_many_streams_over_two_workers_complete_intact_and_abandoned_ones_free_the_workers(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    workers = cluster.start_workers(2, f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL, delay_ms=20)
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    with LoadWatcher(cluster.nats.url, f"flotilla.{MODEL}.backend.load_metrics") as load:
        outcomes = asyncio.run(run_streams(ingress.base_url, workers, load))
        # The abandoned echoes would run for tens of seconds more; stopped, every worker is idle within a few reports.
        load.wait_for(
            lambda load: all(load.last(w.instance_id) == 0 for w in workers),
            6,
            "a worker kept generating for an abandoned stream",
        )
    completed = [outcome for index, outcome in enumerate(outcomes) if not abandoned(index)]
    assert all(not outcome.errors for outcome in outcomes)
    # The echo answers with as many tokens as its prompt had.
    assert all(o.usage["completion_tokens"] == o.usage["prompt_tokens"] > 0 for o in completed)
    assert Counter(outcome.instance for outcome in outcomes) == {w.instance_id: STREAMS // 2 for w in workers}
