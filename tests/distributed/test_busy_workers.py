"""Workers that are busy take no new request, and when every worker of a model is, the ingress answers 503
with Retry-After (on which load balancers fail over) in the OpenAI error envelope.

Two limits: a worker's own (FLOTILLA_MAX_WAITING_REQUESTS, which it refuses past, whatever router sent
the request) and the KV router's busy thresholds (--busy-waiting, --busy-kv-usage), read from the load
the workers report. Real worker processes on real etcd and NATS.
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.distributed.cluster import Cluster, served_models, wait_until
from tests.distributed.kv_pool import MODEL as KV_MODEL
from tests.distributed.kv_pool import mocker_settings, start_workers, unique_tokens, wait_for_every_worker
from tests.distributed.streaming import MODEL, PROMPT
from tests.servers import Server

pytestmark = pytest.mark.timeout(120)


@contextmanager
def streaming(url: str, body: dict[str, object], count: int, *, running: bool = True) -> Iterator[None]:
    """Keep ``count`` streams of ``body`` open while the block runs; with ``running``, each has sent its
    first chunk when the block begins (else some may be waiting for their turn)."""
    started = [threading.Event() for _ in range(count)]
    done = threading.Event()

    def run(first: threading.Event) -> None:
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
            assert response.status_code == 200
            for _ in response.iter_lines():
                first.set()
                if done.is_set():
                    return

    # Daemons: a stream still waiting for its turn when the block ends is left to the workers' shutdown.
    threads = [threading.Thread(target=run, args=(event,), daemon=True) for event in started]
    for thread, event in zip(threads, started, strict=True):
        thread.start()
        assert not running or event.wait(30), "a stream did not start"
    try:
        yield
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=5 if running else 0)


def chat(ingress: Server) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    return httpx.post(ingress.base_url + "/v1/chat/completions", json=body, timeout=30)


def assert_all_busy(reply: httpx.Response) -> None:
    assert reply.status_code == 503, reply.text
    assert reply.headers["retry-after"] == "1"
    error = reply.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "all_workers_busy")


def test_workers_whose_own_queues_are_full_send_requests_elsewhere_and_then_it_is_a_503(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    for _ in range(2):  # each takes one request at a time (an echo engine: every request it holds waits)
        cluster.start_worker(
            f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL, delay_ms=100,
            env={"FLOTILLA_MAX_WAITING_REQUESTS": "1"},
        )  # fmt: skip
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    url = ingress.base_url + "/v1/chat/completions"
    long_chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
    with streaming(url, long_chat, 1):
        # One worker is full: whichever the router picks, the request is served (by the other).
        assert {chat(ingress).status_code for _ in range(4)} == {200}
    with streaming(url, long_chat, 2):  # round-robin: one on each; a refused one went to the other
        assert_all_busy(chat(ingress))
    assert chat(ingress).status_code == 200  # free again


def test_with_kv_routing_workers_past_the_waiting_threshold_get_nothing_and_then_it_is_a_503(
    cluster: Cluster,
) -> None:
    # One sequence at a time per worker, in real time: a second request waits in its scheduler's queue.
    settings = mocker_settings(cluster.directory, speedup_ratio=1, max_num_seqs=1, block_size=16)
    workers = start_workers(cluster, 2, *settings)
    ingress = cluster.start_ingress("--router-mode", "kv", "--busy-waiting", "1")
    wait_for_every_worker(ingress, workers)
    url = ingress.base_url + "/v1/completions"

    def complete(timeout: float = 30) -> httpx.Response:
        body = {"model": KV_MODEL, "prompt": unique_tokens(8), "max_tokens": 1}
        return httpx.post(url, json=body, timeout=timeout)

    def refused() -> bool:
        try:
            return complete(timeout=2).status_code == 503
        except httpx.TimeoutException:
            return False  # routed before the reports came, and queued: it leaves as the client does

    assert complete().status_code == 200
    long_completion = {"model": KV_MODEL, "prompt": unique_tokens(8), "max_tokens": 5000}
    with streaming(url, long_completion, 4, running=False):  # spread by load: one running, one waiting on each
        # The workers report their queues every second: the router learns they are full within a few.
        wait_until(refused, 20, "the ingress never found every worker busy")
        assert_all_busy(complete())
