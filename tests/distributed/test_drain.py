"""SIGTERM drains a worker: no new requests, those in flight finish or migrate at once, exit 0."""

import signal

import httpx

from tests.distributed.cluster import Cluster, Worker, served_models, wait_until
from tests.distributed.streaming import MODEL, start_ingress, stream_chat, while_streaming


def terminate(worker: Worker) -> None:
    worker.process.send_signal(signal.SIGTERM)


def start_workers(cluster: Cluster, drain_s: float) -> None:
    env = {"FLOTILLA_DRAIN_S": str(drain_s)}
    for _ in range(2):
        cluster.start_worker(f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL, delay_ms=40, env=env)


def test_a_stream_still_running_after_the_drain_migrates_at_once_and_is_unbroken(cluster: Cluster) -> None:
    ingress = start_ingress(cluster, "--migration-limit", "3", silence_s=5)
    start_workers(cluster, drain_s=0.3)  # the ~2.4 s stream outlives the grace period
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    undisturbed = stream_chat(ingress.base_url)

    result, victim = while_streaming(cluster, ingress.base_url, terminate)
    assert victim.process.wait(timeout=30) == 0
    assert not result.errors
    assert result.text == undisturbed.text
    assert result.usage == undisturbed.usage
    assert "shut down" in ingress.log()  # the worker cut the stream: it was not a silence
    assert result.longest_gap < 2.5  # far below the 5 s silence timeout


def test_a_stream_that_ends_within_the_drain_finishes_on_its_worker_which_takes_nothing_new(
    cluster: Cluster,
) -> None:
    ingress = start_ingress(cluster, "--migration-limit", "3", silence_s=5)
    start_workers(cluster, drain_s=30)
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    undisturbed = stream_chat(ingress.base_url)
    served_by: list[str] = []

    def terminate_then_ask(worker: Worker) -> None:
        terminate(worker)
        wait_until(lambda: "draining" in worker.log(), 10, "the worker did not start draining")
        for _ in range(3):  # while its stream runs on, the draining worker takes nothing new
            reply = httpx.post(
                ingress.base_url + "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                timeout=10,
            )
            assert reply.status_code == 200
            served_by.append(reply.headers["x-flotilla-instance"])

    result, victim = while_streaming(cluster, ingress.base_url, terminate_then_ask)
    assert not result.errors
    assert result.text == undisturbed.text
    assert "migrating request" not in ingress.log()
    assert victim.process.wait(timeout=30) == 0
    other = next(worker for worker in cluster.workers if worker is not victim)
    assert served_by == [other.instance_id] * 3
