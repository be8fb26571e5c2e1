"""The planner reads the ingresses' latency histograms from a real Prometheus (``--prometheus``) as it reads one
gateway's /metrics: two ingresses' series are added up, and the interval's rate, lengths and TTFT p90 come out as
from the ingresses themselves. A Prometheus that does not answer is said, naming its URL."""

import asyncio
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.planning.loop import ScrapeFailed, query_prometheus
from frontend_gateway.metrics import GatewayMetrics
from planner.measure import ingress_snapshot, ingress_stats
from tests.servers import free_port, stop_process

pytestmark = pytest.mark.slow


class Ingress:
    """A stand-in ingress: its metrics are the gateway's own collectors (``GatewayMetrics``), served on /metrics."""

    def __init__(self) -> None:
        self.metrics = GatewayMetrics()
        metrics = self.metrics

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = metrics.exposition()
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def served(self, count: int, *, ttft_s: float, prompt_tokens: int, completion_tokens: int) -> None:
        model = self.metrics.for_model("chat")
        for _ in range(count):
            model.ttft.observe(ttft_s)
            model.finished(
                endpoint="chat",
                streaming=True,
                status="success",
                duration=1.0,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
            )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def ingresses() -> Iterator[list[Ingress]]:
    started = [Ingress(), Ingress()]
    yield started
    for ingress in started:
        ingress.close()


@pytest.fixture
def prometheus(tmp_path: Path, ingresses: list[Ingress]) -> Iterator[str]:
    """A real Prometheus scraping both ingresses every second; its base URL."""
    targets = ", ".join(f"'127.0.0.1:{ingress.port}'" for ingress in ingresses)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: ingress\n    static_configs:\n"
        f"      - targets: [{targets}]\n"
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.1)
        yield url
    finally:
        stop_process(process, signal.SIGTERM)
        log.close()


async def requests_seen(client: httpx.AsyncClient, prometheus: str, count: int) -> str:
    """The exposition Prometheus answers once it has scraped ``count`` requests of "chat" in all."""
    async with asyncio.timeout(20):
        while True:
            text = await query_prometheus(client, prometheus)
            if ingress_snapshot(text, "chat", 0.0).input_tokens.count == count:
                return text
            await asyncio.sleep(0.2)


async def test_the_interval_read_from_prometheus_adds_up_both_ingresses(
    prometheus: str, ingresses: list[Ingress]
) -> None:
    first, second = ingresses
    first.served(10, ttft_s=0.1, prompt_tokens=100, completion_tokens=20)
    second.served(10, ttft_s=0.1, prompt_tokens=100, completion_tokens=20)
    async with httpx.AsyncClient() as client:
        before = ingress_snapshot(await requests_seen(client, prometheus, 20), "chat", 0.0)
        # The next interval: 30 more requests, longer, and a slow first token on one ingress.
        first.served(20, ttft_s=0.1, prompt_tokens=300, completion_tokens=60)
        second.served(10, ttft_s=4.0, prompt_tokens=300, completion_tokens=60)
        after = ingress_snapshot(await requests_seen(client, prometheus, 50), "chat", 10.0)
    stats = ingress_stats(before, after, percentile=90)
    assert stats.request_rate == pytest.approx(3.0)  # 30 requests over the 10 s between the readings
    assert (stats.mean_isl, stats.mean_osl) == (pytest.approx(300.0), pytest.approx(60.0))
    assert stats.ttft_s is not None and stats.ttft_s > 2.5  # a third of them waited 4 s: p90 is among those


async def test_a_prometheus_that_does_not_answer_is_said_naming_its_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with httpx.AsyncClient() as client:
        with pytest.raises(ScrapeFailed, match=f"{url}/api/v1/query could not be read"):
            await query_prometheus(client, url)
