"""The overview's gateway traffic: read from the gateway's own Prometheus exposition, rates between two
looks, and a sentence when the gateway is not configured or does not answer."""

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core.cache import cache

from controlplane.accounts.models import Role
from controlplane.dashboard.gateway import ModelCounters, Reading, parse_metrics, traffic
from frontend_gateway.metrics import GatewayMetrics
from tests.controlplane.test_dashboard import logged_in

pytestmark = pytest.mark.django_db


def finished(metrics: GatewayMetrics, model: str, *, tokens: int, ttft_s: float) -> None:
    """One request as the gateway counts it."""
    model_metrics = metrics.for_model(model)
    model_metrics.ttft.observe(ttft_s)
    model_metrics.finished(
        endpoint="chat", streaming=True, status="success", duration=1.0, prompt_tokens=10, completion_tokens=tokens
    )


def test_the_gateways_own_exposition_is_read_per_model() -> None:
    metrics = GatewayMetrics()
    finished(metrics, "chat", tokens=30, ttft_s=0.1)
    finished(metrics, "chat", tokens=10, ttft_s=0.3)
    metrics.for_model("chat").inflight.inc()
    metrics.queued_requests.inc(2)
    reading = parse_metrics(metrics.exposition().decode(), at=100.0)
    chat = reading.models["chat"]
    assert (chat.requests, chat.output_tokens, chat.ttft_count, chat.inflight) == (2, 40, 2, 1)
    assert chat.ttft_sum_s == pytest.approx(0.4) and reading.queued == 2


def test_rates_come_from_the_difference_with_the_previous_reading() -> None:
    before = Reading(
        at=100.0, models={"chat": ModelCounters(requests=10, output_tokens=1000, ttft_sum_s=1, ttft_count=10)}
    )
    now = Reading(
        at=110.0, models={"chat": ModelCounters(requests=30, output_tokens=3000, ttft_sum_s=5, ttft_count=30)}
    )
    result = traffic(now, before)
    [chat] = result.models
    assert result.window_s == 10.0
    assert (chat.requests_per_s, chat.tokens_per_s, chat.requests_total) == (2.0, 200.0, 30)
    assert chat.ttft_mean_s == pytest.approx(0.2)  # (5 - 1) / (30 - 10): the window's requests only


def test_without_a_recent_previous_reading_there_are_totals_and_no_rates() -> None:
    now = Reading(at=5000.0, models={"chat": ModelCounters(requests=30, ttft_sum_s=6, ttft_count=30)})
    for previous in (None, Reading(at=10.0)):  # none, or too old
        [chat] = traffic(now, previous).models
        assert (chat.requests_per_s, chat.tokens_per_s) == (None, None)
        assert chat.ttft_mean_s == pytest.approx(0.2)


def test_a_gateway_restart_between_readings_gives_no_negative_rates() -> None:
    before = Reading(at=100.0, models={"chat": ModelCounters(requests=500, ttft_count=500, ttft_sum_s=50)})
    now = Reading(at=110.0, models={"chat": ModelCounters(requests=5, ttft_count=5, ttft_sum_s=1)})
    [chat] = traffic(now, before).models
    assert chat.requests_per_s is None and chat.ttft_mean_s == pytest.approx(0.2)


@pytest.fixture
def gateway(monkeypatch: pytest.MonkeyPatch) -> Iterator[GatewayMetrics]:
    """A real HTTP server on a free port that answers /metrics with a GatewayMetrics' exposition."""
    metrics = GatewayMetrics()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = metrics.exposition() if self.path == "/metrics" else b"not found"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("FLOTILLA_GATEWAY_URL", f"http://127.0.0.1:{server.server_address[1]}/")
    cache.clear()
    yield metrics
    server.shutdown()
    server.server_close()
    thread.join()


def test_the_overview_section_shows_totals_then_rates_on_the_next_look(gateway: GatewayMetrics) -> None:
    finished(gateway, "chat", tokens=20, ttft_s=0.25)
    browser = logged_in(Role.READ_ONLY)
    first = browser.get("/gateway/").content.decode()
    assert "<td>chat</td>" in first and "250 ms" in first and "rates show from the next look" in first
    finished(gateway, "chat", tokens=20, ttft_s=0.05)
    second = browser.get("/gateway/").content.decode()
    assert "50 ms" in second and "since the previous look" in second


def test_without_a_gateway_url_the_section_says_how_to_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOTILLA_GATEWAY_URL", raising=False)
    html = logged_in(Role.READ_ONLY).get("/gateway/").content.decode()
    assert "No gateway configured: set <code>FLOTILLA_GATEWAY_URL</code>" in html


def test_an_unreachable_or_malformed_gateway_url_is_a_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    browser = logged_in(Role.READ_ONLY)
    monkeypatch.setenv("FLOTILLA_GATEWAY_URL", "http://127.0.0.1:9")  # discard: nothing listens
    assert "/metrics could not be read" in browser.get("/gateway/").content.decode()
    monkeypatch.setenv("FLOTILLA_GATEWAY_URL", "gateway:8080")
    assert (
        "FLOTILLA_GATEWAY_URL must be the gateway&#x27;s http(s) base URL" in browser.get("/gateway/").content.decode()
    )


def test_the_overview_loads_the_gateway_section_after_the_page_and_again_every_few_seconds() -> None:
    html = logged_in(Role.READ_ONLY).get("/").content.decode()
    assert '<section id="gateway" hx-get="/gateway/" hx-trigger="load, every 5s">' in html
