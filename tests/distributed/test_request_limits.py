"""A request a worker refuses as too large reaches the client as a 413 in the OpenAI envelope."""

import httpx

from tests.distributed.cluster import Cluster, served_models, wait_until
from tests.distributed.streaming import MODEL


def test_a_request_over_the_workers_size_limit_is_a_413_with_the_openai_envelope(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    cluster.start_worker(
        f"dyn://{MODEL}", "out=echo_core", "--model-name", MODEL, env={"FLOTILLA_MAX_REQUEST_BYTES": "1024"}
    )
    wait_until(lambda: served_models(ingress) == [MODEL], 15, "the model did not appear")
    # ~1,500 tokens: several kB as token ids, far under the ingress's 8 MiB body limit and the model's context.
    prompt = " ".join(f"w{i}" for i in range(400))
    for stream in (False, True):
        reply = httpx.post(
            ingress.base_url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": stream},
            timeout=10,
        )
        assert reply.status_code == 413
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "request_too_large"
        assert "over the limit of 1024" in error["message"]
    small = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(ingress.base_url + "/v1/chat/completions", json=small, timeout=10).status_code == 200
