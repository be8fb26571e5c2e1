"""The planner reads several ingress processes that share one port (``--reuse-port``) one by one, each at its own
``--metrics-port`` (``manage.py planner --ingress-metrics``): real ``flotilla run in=http`` processes, requests
sent to the shared port, and the interval counts every request once, whichever process took it."""

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from controlplane.planning.loop import scrape_gateway, scrape_ingresses
from planner.measure import ingress_snapshot, ingress_stats
from tests.servers import free_port, stop_process

pytestmark = pytest.mark.slow
REQUESTS = 24


def wait_for(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, log.read_text(errors="replace")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text(errors="replace")
        time.sleep(0.1)  # a process we do not control: polling is all there is


@pytest.fixture
def ingresses(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """Two ingress processes on one shared port, each with a metrics port of its own: the shared base URL and
    the two metrics base URLs."""
    shared = free_port()
    metrics_urls = []
    with contextlib.ExitStack() as stack:  # each process stopped, even when stopping another fails
        for index in range(2):
            metrics_port = free_port()
            log = tmp_path / f"ingress{index}.log"
            command = [
                sys.executable, "-m", "launcher.cli", "run", "in=http", "out=echo_full", "--model-name", "echo",
                "--http-port", str(shared), "--reuse-port", "--metrics-port", str(metrics_port),
            ]  # fmt: skip
            with log.open("wb") as out:
                process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
            stack.callback(stop_process, process, signal.SIGINT, timeout=20)
            url = f"http://127.0.0.1:{metrics_port}"
            wait_for(f"{url}/metrics", process, log)
            metrics_urls.append(url)
        yield f"http://127.0.0.1:{shared}", metrics_urls


async def test_the_interval_counts_every_request_once_whichever_process_took_it(
    ingresses: tuple[str, list[str]],
) -> None:
    shared, metrics_urls = ingresses
    body = {"model": "echo", "messages": [{"role": "user", "content": "count me"}], "max_tokens": 4}
    async with httpx.AsyncClient() as client:
        before = ingress_snapshot(await scrape_ingresses(client, metrics_urls), "echo", at_s=0.0)
        for _ in range(REQUESTS):
            # A connection each, so that the kernel spreads them over the two processes.
            async with httpx.AsyncClient() as fresh:
                answer = await fresh.post(f"{shared}/v1/chat/completions", json=body, timeout=30)
                assert answer.status_code == 200, answer.text
        after = ingress_snapshot(await scrape_ingresses(client, metrics_urls), "echo", at_s=6.0)
        shared_scrape = ingress_snapshot(await scrape_gateway(client, shared), "echo", at_s=6.0)
    assert len(after.sources) == 2
    stats = ingress_stats(before, after)
    assert stats.request_rate == pytest.approx(REQUESTS / 6.0)
    per_process = sorted(source.input_tokens.count for source in after.sources.values())
    assert sum(per_process) == REQUESTS
    # The shared port's /metrics is one process's, whichever the kernel gave the scrape to.
    assert shared_scrape.input_tokens.count in per_process
