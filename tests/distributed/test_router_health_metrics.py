"""The ingress's /metrics counts what the fleet refused and what it moved: busy refusals (503
all_workers_busy), migrations by cause and progress deadlines passed. Real worker and ingress processes
on real etcd and NATS."""

import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.distributed.cluster import Cluster, served_models, wait_until
from tests.distributed.streaming import MODEL, PROMPT, start_ingress, while_streaming
from tests.distributed.test_busy_workers import assert_all_busy, chat, streaming
from tests.distributed.test_stuck_engines import start_worker as start_stuck_worker
from tests.distributed.test_stuck_engines import stream as stream_stuck
from tests.servers import Server

pytestmark = pytest.mark.timeout(120)


def scraped(ingress: Server, name: str, **labels: str) -> float:
    """The value of the sample ``name`` with ``labels`` in the ingress's /metrics (0 when absent)."""
    text = httpx.get(ingress.base_url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def test_a_request_refused_because_every_worker_is_busy_is_counted(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    for _ in range(2):  # each takes one request at a time
        cluster.start_worker(
            f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL, delay_ms=100,
            env={"FLOTILLA_MAX_WAITING_REQUESTS": "1"},
        )  # fmt: skip
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    assert scraped(ingress, "flotilla_router_busy_refusals_total", model=MODEL) == 0
    long_chat: dict[str, object] = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
    with streaming(ingress.base_url + "/v1/chat/completions", long_chat, 2):
        assert_all_busy(chat(ingress))
    assert scraped(ingress, "flotilla_router_busy_refusals_total", model=MODEL) == 1


def test_a_stream_migrated_off_a_draining_worker_is_counted_with_its_cause(cluster: Cluster) -> None:
    ingress = start_ingress(cluster, "--migration-limit", "3", silence_s=5)
    for _ in range(2):  # the ~2.4 s stream outlives the 0.3 s drain: the worker cuts it
        cluster.start_worker(
            f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL, delay_ms=40, env={"FLOTILLA_DRAIN_S": "0.3"}
        )
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")

    result, victim = while_streaming(
        cluster, ingress.base_url, lambda worker: worker.process.send_signal(signal.SIGTERM)
    )
    assert victim.process.wait(timeout=30) == 0
    assert not result.errors
    assert scraped(ingress, "flotilla_router_migrations_total", model=MODEL, cause="cut") == 1
    assert scraped(ingress, "flotilla_router_deadline_expiries_total", model=MODEL, deadline="progress") == 0


def test_a_stream_whose_engine_makes_no_progress_is_counted_as_a_progress_deadline_expiry(cluster: Cluster) -> None:
    ingress = start_ingress(cluster, "--progress-deadline", "2")
    start_stuck_worker(cluster, stuck_after=3)
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    _, errors, _ = stream_stuck(ingress, 40)
    assert [error["code"] for error in errors] == ["progress_deadline_exceeded"]
    assert scraped(ingress, "flotilla_router_deadline_expiries_total", model=MODEL, deadline="progress") == 1
    assert scraped(ingress, "flotilla_router_migrations_total", model=MODEL, cause="stalled") == 0
