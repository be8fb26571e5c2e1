"""A worker started with --metrics-port serves its own Prometheus metrics: a real mocker worker process
behind a real ingress, on real etcd and NATS."""

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.distributed.cluster import Cluster, served_models, wait_until
from tests.distributed.kv_pool import MODEL, mocker_settings
from tests.servers import free_port

pytestmark = pytest.mark.timeout(120)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reply = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert reply.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(reply.text)
        for sample in family.samples
    }


def test_a_worker_started_with_a_metrics_port_serves_its_queues_kv_cache_and_publisher(
    cluster: Cluster, tmp_path: Path
) -> None:
    port = free_port()
    ingress = cluster.start_ingress()
    settings = mocker_settings(tmp_path, speedup_ratio=1000, block_size=16, num_gpu_blocks=512)
    cluster.start_worker(f"dyn://{MODEL}", *settings, "--model-name", MODEL, "--metrics-port", str(port))
    wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
    rank = (("dp_rank", "0"),)
    idle = scrape(port)
    assert idle[("flotilla_worker_running_requests", rank)] == 0
    assert idle[("flotilla_worker_waiting_requests", rank)] == 0
    assert idle[("flotilla_worker_kv_total_blocks", rank)] == 512
    assert idle[("flotilla_worker_preemptions_total", rank)] == 0
    assert idle[("flotilla_worker_kv_event_batches_lost_total", ())] == 0

    body = {"model": MODEL, "prompt": list(range(1000, 1064)), "max_tokens": 5}
    reply = httpx.post(ingress.base_url + "/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    served = scrape(port)
    assert served[("flotilla_worker_generated_tokens_total", rank)] == 5
    assert served[("flotilla_worker_kv_event_batches_published_total", ())] >= 1
    assert served[("flotilla_worker_streams", ())] == 0
