"""Health, liveness and Prometheus metrics."""

import httpx
import openai

from tests.servers import Server


def test_health_reports_the_served_models(echo_full_server: Server) -> None:
    response = httpx.get(echo_full_server.base_url + "/health")
    assert response.status_code == 200
    assert response.json() == {"status": "healthy", "models": ["echo"]}


def test_live_answers_while_the_process_runs(echo_full_server: Server) -> None:
    assert httpx.get(echo_full_server.base_url + "/live").json() == {"status": "live"}


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_requests_tokens_and_latency(echo_full_server: Server) -> None:
    before = httpx.get(echo_full_server.base_url + "/metrics").text
    client = openai.OpenAI(base_url=echo_full_server.api_url, api_key="unused", max_retries=0)
    list(client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "abcd"}], stream=True))
    httpx.post(echo_full_server.base_url + "/v1/chat/completions", content=b"{bad")
    after = httpx.get(echo_full_server.base_url + "/metrics").text

    def grew(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    success = {"model": "echo", "endpoint": "chat_completions", "request_type": "stream", "status": "success"}
    assert grew("flotilla_frontend_requests_total", **success) == 1
    assert grew("flotilla_frontend_output_tokens_total", model="echo") == 4
    assert grew("flotilla_frontend_input_tokens_total", model="echo") == 4
    assert grew("flotilla_frontend_time_to_first_token_seconds_count", model="echo") == 1
    # One observation per streamed request (the mean time between its tokens), not one per token.
    assert grew("flotilla_frontend_inter_token_latency_seconds_count", model="echo") == 1
    assert grew("flotilla_frontend_errors_total", error_type="invalid_request_error", status_code="400") == 1
    assert metric_value(after, "flotilla_frontend_inflight_requests", model="echo") == 0
    assert "# TYPE flotilla_frontend_request_duration_seconds histogram" in after
