"""A client that disconnects cancels its generation: the engine stops producing tokens for it."""

import contextlib
import time

import httpx

from tests.frontend_gateway.test_health_and_metrics import metric_value
from tests.servers import Server

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def test_a_disconnected_stream_stops_the_engine(echo_core_server: Server) -> None:
    metrics_url = echo_core_server.base_url + "/metrics"
    before = httpx.get(metrics_url).text
    # echo_core sends the ~60-token templated prompt back at 20 ms a token: about 1.2 s in all.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count " * 40}], "stream": True}
    with httpx.stream("POST", echo_core_server.base_url + "/v1/chat/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [next(lines) for _ in range(3)]
    assert all(line.startswith("data: ") for line in received if line)

    cancelled = {
        "model": MODEL,
        "endpoint": "chat_completions",
        "request_type": "stream",
        "status": "cancelled",
    }
    deadline = time.monotonic() + 5
    while True:
        after = httpx.get(metrics_url).text
        if metric_value(after, "flotilla_frontend_requests_total", **cancelled) > metric_value(
            before, "flotilla_frontend_requests_total", **cancelled
        ):
            break
        assert time.monotonic() < deadline, "the server never noticed the disconnect"
        time.sleep(0.05)  # polling another process's metrics: no event to await
    produced = metric_value(after, "flotilla_frontend_output_tokens_total", model=MODEL) - metric_value(
        before, "flotilla_frontend_output_tokens_total", model=MODEL
    )
    prompt = metric_value(after, "flotilla_frontend_input_tokens_total", model=MODEL) - metric_value(
        before, "flotilla_frontend_input_tokens_total", model=MODEL
    )
    assert prompt > 50
    assert 0 < produced < prompt / 2, f"the engine produced {produced} of {prompt} tokens after the disconnect"
    assert metric_value(after, "flotilla_frontend_inflight_requests", model=MODEL) == 0


def test_a_disconnected_unary_request_is_cancelled_too(echo_core_server: Server) -> None:
    metrics_url = echo_core_server.base_url + "/metrics"
    before = httpx.get(metrics_url).text
    body = {"model": MODEL, "messages": [{"role": "user", "content": "wait " * 40}]}
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(echo_core_server.base_url + "/v1/chat/completions", json=body, timeout=0.3)
    cancelled = {
        "model": MODEL,
        "endpoint": "chat_completions",
        "request_type": "unary",
        "status": "cancelled",
    }
    deadline = time.monotonic() + 5
    while metric_value(httpx.get(metrics_url).text, "flotilla_frontend_requests_total", **cancelled) <= metric_value(
        before, "flotilla_frontend_requests_total", **cancelled
    ):
        assert time.monotonic() < deadline, "the server never noticed the disconnect"
        time.sleep(0.05)  # polling another process's metrics: no event to await
