"""The charts' history: the metric samples of a scope over a range, as JSON; bad input a 400; and, where
FLOTILLA_PROMETHEUS_URL is set, Prometheus's range queries instead, read from a fake server that answers in the
shape Prometheus's HTTP API documents (https://prometheus.io/docs/prometheus/latest/querying/api/#range-queries:
``{"status": "success", "data": {"resultType": "matrix", "result": [{"metric": {...}, "values": [[t, "v"]...]}]}}``,
values as strings, "NaN" for a rate of nothing)."""

import datetime
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from controlplane.accounts.models import Role
from controlplane.traffic.history import sample_history
from controlplane.traffic.models import MetricSample
from controlplane.traffic.prometheus import PrometheusError, PrometheusReader
from tests.controlplane.factories import deploy, make_node
from tests.controlplane.test_dashboard import logged_in


class FakePrometheus:
    """A server answering /api/v1/query_range with ``answer`` (a JSON document), noting each query asked."""

    def __init__(self) -> None:
        self.queries: list[dict[str, list[str]]] = []
        self.answer: object = {}
        self.status = 200
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlparse(self.path)
                fake.queries.append({"path": [url.path], **parse_qs(url.query)})
                body = json.dumps(fake.answer).encode()
                self.send_response(fake.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def prometheus() -> Iterator[FakePrometheus]:
    fake = FakePrometheus()
    thread = threading.Thread(target=fake.server.serve_forever, daemon=True)
    thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def matrix(*points: tuple[float, str]) -> dict[str, object]:
    return {
        "status": "success",
        "data": {"resultType": "matrix", "result": [{"metric": {}, "values": [[at, value] for at, value in points]}]},
    }


def test_a_range_query_s_matrix_is_read_with_nan_as_no_value(prometheus: FakePrometheus) -> None:
    prometheus.answer = matrix((100.0, "1.5"), (110.0, "NaN"))
    reader = PrometheusReader(prometheus.url)
    assert reader.query_range("sum(rate(x[1m]))", 100.0, 110.0, 10) == [(100.0, 1.5), (110.0, None)]
    asked = prometheus.queries[0]
    assert asked["path"] == ["/api/v1/query_range"] and asked["query"] == ["sum(rate(x[1m]))"]
    assert (asked["start"], asked["end"], asked["step"]) == (["100.000"], ["110.000"], ["10"])


def test_a_pipeline_s_history_asks_for_its_model_s_gateway_series(prometheus: FakePrometheus) -> None:
    prometheus.answer = matrix((100.0, "0.25"))
    history = PrometheusReader(prometheus.url).history('chat "x"', 0, 100, 10)
    assert history["times"] == [100.0] and history["series"]["ttft_p95_s"] == [0.25]
    assert "queue_depth" not in history["series"]  # the workers' series carry no model label
    queries = [asked["query"][0] for asked in prometheus.queries]
    ttft_p95 = (
        "histogram_quantile(0.95, sum by (le) "
        '(rate(flotilla_frontend_time_to_first_token_seconds_bucket{model="chat \\"x\\""}[1m])))'
    )
    assert ttft_p95 in queries
    assert any('status="error"' in query for query in queries)


@pytest.mark.parametrize(
    ("status", "answer", "says"),
    [
        (400, {"status": "error", "errorType": "bad_data", "error": "parse error at char 3"}, "parse error at char 3"),
        (200, {"status": "success", "data": {"resultType": "vector", "result": []}}, "without a matrix"),
        (200, ["not", "prometheus"], "HTTP 200"),
    ],
)
def test_errors_and_other_shapes_are_a_prometheus_error_naming_the_server(
    prometheus: FakePrometheus, status: int, answer: object, says: str
) -> None:
    prometheus.status, prometheus.answer = status, answer
    with pytest.raises(PrometheusError, match=says) as raised:
        PrometheusReader(prometheus.url).query_range("up", 0, 1, 1)
    assert prometheus.url in str(raised.value)


def test_a_prometheus_that_does_not_answer_is_a_prometheus_error() -> None:
    with pytest.raises(PrometheusError, match="did not answer"):
        PrometheusReader("http://127.0.0.1:9", timeout_s=2).query_range("up", 0, 1, 1)


@pytest.mark.django_db
def test_the_samples_of_a_scope_and_range_are_its_history_oldest_first() -> None:
    now = datetime.datetime(2026, 1, 2, 12, 0, tzinfo=datetime.UTC)
    pipeline, other = deploy("chat"), deploy("other")
    for minutes, value in ((90, 9.0), (30, 1.0), (10, 2.0)):
        at = now - datetime.timedelta(minutes=minutes)
        MetricSample.objects.create(at=at, window_s=10, scope="pipeline", pipeline=pipeline, ttft_p95_s=value)
        MetricSample.objects.create(at=at, window_s=10, scope="pipeline", pipeline=other, ttft_p95_s=-1)
    history = sample_history("pipeline", pipeline.pk, 3600, now)
    assert history["series"]["ttft_p95_s"] == [1.0, 2.0] and len(history["times"]) == 2
    assert sample_history("pipeline", pipeline.pk, 21_600, now)["series"]["ttft_p95_s"] == [9.0, 1.0, 2.0]


@pytest.mark.django_db
def test_a_node_s_history_has_its_cpu_utilisation_null_where_its_agent_said_none() -> None:
    now = datetime.datetime(2026, 1, 2, 12, 0, tzinfo=datetime.UTC)
    node = make_node("gpu-a")
    for minutes, figure in ((20, None), (10, 12.5)):
        at = now - datetime.timedelta(minutes=minutes)
        MetricSample.objects.create(at=at, window_s=10, scope="node", node=node, cpu_utilization_percent=figure)
    series = sample_history("node", node.pk, 3600, now)["series"]
    assert series["cpu_utilization_percent"] == [None, 12.5]
    assert series["gpu_utilization_percent"] == [None, None]


@pytest.mark.django_db
def test_the_history_view_answers_json_and_bad_input_with_a_400() -> None:
    browser = logged_in(Role.READ_ONLY)
    node = make_node("gpu-a")
    now = datetime.datetime.now(tz=datetime.UTC)
    MetricSample.objects.create(
        at=now, window_s=10, scope="node", node=node, gpu_utilization_percent=40, cpu_utilization_percent=12.5
    )
    answer = browser.get("/metrics/history/", {"scope": "node", "id": str(node.pk), "range": "6h"})
    assert answer.status_code == 200 and answer.json()["series"]["gpu_utilization_percent"] == [40.0]
    assert answer.json()["series"]["cpu_utilization_percent"] == [12.5]
    assert browser.get("/metrics/history/").json()["source"] == "samples"  # the fleet, the last hour
    for bad in ({"scope": "galaxy"}, {"range": "1y"}, {"scope": "pipeline"}, {"scope": "node", "id": "x"}):
        response = browser.get("/metrics/history/", bad)
        assert response.status_code == 400 and response.json()["error"]
    assert browser.get("/metrics/history/", {"scope": "pipeline", "id": "999999"}).status_code == 404


@pytest.mark.django_db
def test_with_prometheus_configured_the_fleet_s_history_comes_from_it(
    prometheus: FakePrometheus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLOTILLA_PROMETHEUS_URL", prometheus.url)
    prometheus.answer = matrix((100.0, "3"))
    answer = logged_in(Role.READ_ONLY).get("/metrics/history/").json()
    assert answer["source"] == "prometheus" and answer["series"]["requests_per_s"] == [3.0]
    prometheus.status, prometheus.answer = 503, {"status": "error", "error": "overloaded"}
    failed = logged_in(Role.READ_ONLY, username="r2").get("/metrics/history/")
    assert failed.status_code == 502 and "overloaded" in failed.json()["error"]


@pytest.mark.django_db
def test_the_overview_pipeline_and_nodes_pages_carry_their_history_charts() -> None:
    pipeline = deploy("chat")
    node = make_node("gpu-a")
    browser = logged_in(Role.READ_ONLY)
    assert 'class="history" data-scope="fleet"' in browser.get("/").content.decode()
    assert (
        f'data-scope="pipeline" data-id="{pipeline.pk}"' in browser.get(f"/pipelines/{pipeline.pk}/").content.decode()
    )
    assert f'data-scope="node" data-id="{node.pk}"' in browser.get("/nodes/").content.decode()
