"""Real llama.cpp workers (SmolLM2, greedy) behind an ingress: migration is exact, disconnects free them."""

import json
import signal
import threading
from pathlib import Path

import httpx
import pytest

from tests.distributed.cluster import Cluster, Worker, served_models, wait_until
from tests.distributed.load_watch import LoadWatcher
from tests.engines.image_requests import data_uri
from tests.engines.tiny_projector import IMAGE_TOKENS, write_projector
from tests.servers import Server, llama_cpp_available, smollm2_path

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed (`make install`)"),
]

MODEL = "smol"
STORY = "Tell me a long story about a dragon."


def start_llamacpp_worker(cluster: Cluster) -> Worker:
    # One thread each: two workers and the test share a small machine.
    return cluster.start_worker(
        f"dyn://{MODEL}",
        "out=llamacpp",
        str(smollm2_path()),
        "--model-name",
        MODEL,
        "--threads",
        "1",
        "--context-length",
        "2048",
    )


def stream_story(
    server: Server, max_tokens: int, on_chunk: "threading.Event | None" = None
) -> tuple[str, dict[str, object], list[str]]:
    """Stream a greedy answer of exactly ``max_tokens`` tokens; set ``on_chunk`` after the fifth chunk.

    Returns (text, usage, error messages seen in the stream).
    """
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": STORY}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    pieces, usage, errors = [], {}, []
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                errors.append(event["error"]["message"])
            elif event.get("usage"):
                usage = event["usage"]
            elif event["choices"] and (content := event["choices"][0]["delta"].get("content")):
                pieces.append(content)
                if on_chunk is not None and len(pieces) == 5:
                    on_chunk.set()
    return "".join(pieces), usage, errors


def next_worker(cluster: Cluster, server: Server) -> Worker:
    """The worker that answers the next request (round-robin over two: ask once, the next one is the other)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    first = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60).headers["x-flotilla-instance"]
    return next(worker for worker in cluster.workers if worker.instance_id != first)


def test_a_stream_migrated_after_sigkill_has_the_text_of_an_undisturbed_run(cluster: Cluster) -> None:
    ingress = cluster.start_ingress("--migration-limit", "3")
    for _ in range(2):
        start_llamacpp_worker(cluster)
    wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
    undisturbed, usage, errors = stream_story(ingress, 64)
    assert not errors
    assert usage["completion_tokens"] == 64

    victim = next_worker(cluster, ingress)
    started = threading.Event()

    def kill_once_started() -> None:
        started.wait(60)
        victim.kill()

    killer = threading.Thread(target=kill_once_started)
    killer.start()
    text, migrated_usage, errors = stream_story(ingress, 64, on_chunk=started)
    killer.join()
    assert victim.process.returncode == -signal.SIGKILL
    assert not errors
    assert "migrating request" in ingress.log()
    # Greedy decoding continued on the other worker exactly where the dead one stopped: the same
    # penalty window and the same one-token-at-a-time decoding of what was already generated.
    assert text == undisturbed
    # Token counts match; how much of the prompt was cached depends on which worker ran the first request.
    cached = migrated_usage.pop("prompt_tokens_details")["cached_tokens"]
    usage.pop("prompt_tokens_details")
    assert migrated_usage == usage
    assert 0 <= cached < usage["prompt_tokens"]


def test_a_client_that_disconnects_frees_the_llamacpp_worker(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    worker = start_llamacpp_worker(cluster)
    wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": STORY}],
        "stream": True,
        "max_tokens": 1500,
        "ignore_eos": True,
    }
    with LoadWatcher(cluster.nats.url, f"flotilla.{MODEL}.backend.load_metrics") as load:
        # 1,500 tokens on one thread take far longer than this test: leave after the first few.
        with httpx.stream("POST", ingress.base_url + "/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for _ in range(4):
                next(lines)
            load.wait_for(
                lambda load: load.last(worker.instance_id) == 1,
                5,
                "the stream never counted as active",
            )
        load.wait_for(lambda load: load.last(worker.instance_id) == 0, 6, "the worker kept generating")
    # The engine has let go of its context: the next request is answered at once, not after 1,500 tokens.
    reply = httpx.post(
        ingress.base_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True},
        timeout=10,
    )
    assert reply.status_code == 200
    assert reply.json()["usage"]["completion_tokens"] == 4


def test_a_worker_with_a_projector_answers_an_image_through_the_ingress(cluster: Cluster, tmp_path: Path) -> None:
    """The card crosses etcd saying how the template takes images, the image crosses NATS with the request, and
    the worker's count of the widened prompt comes back in the usage."""
    projector = write_projector(tmp_path / "mmproj-tiny.gguf")
    ingress = cluster.start_ingress("--router-mode", "kv")
    cluster.start_worker(
        "dyn://vision", "out=llamacpp", str(smollm2_path()), "--model-name", "vision", "--threads", "1",
        "--mmproj", str(projector),
    )  # fmt: skip
    wait_until(lambda: served_models(ingress) == ["vision"], 30, "the model did not appear")
    image = {"url": data_uri((255, 0, 0))}
    content = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": image}]
    body = {"model": "vision", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": content}]}
    with_image = httpx.post(ingress.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert with_image.status_code == 200, with_image.text
    text_only = {**body, "messages": [{"role": "user", "content": "What is it?"}]}
    without = httpx.post(ingress.base_url + "/v1/chat/completions", json=text_only, timeout=60)
    assert without.status_code == 200, without.text
    # The same text with the image: one placeholder more in the gateway's prompt, widened to the image's tokens.
    grown = with_image.json()["usage"]["prompt_tokens"] - without.json()["usage"]["prompt_tokens"]
    assert grown == IMAGE_TOKENS
