"""A model that a pipeline serves but that has no replica registered is a 503 "no ready replica" (with
Retry-After) on the ingress, not a 404 "does not exist": the ingress watches the names the control plane
publishes (runtime/served_names.py)."""

import httpx
import openai
import pytest

from runtime.served_names import etcd_key
from tests.distributed.cluster import Cluster, etcd_put, served_models, wait_until


def chat(server_url: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(server_url + "/v1/chat/completions", json=body, timeout=30)


def test_a_stopped_or_starting_pipelines_model_is_a_503_and_an_unknown_one_a_404(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    cluster.start_worker("dyn://alpha", "out=echo_core", "--model-name", "alpha")
    wait_until(lambda: served_models(ingress) == ["alpha"], 15, "the model did not appear")
    etcd_put(cluster.etcd, etcd_key("org/stopped"), '{"state":"stopped"}')
    etcd_put(cluster.etcd, etcd_key("starting"), '{"state":"running"}')
    wait_until(lambda: chat(ingress.base_url, "org/stopped").status_code == 503, 5, "the names never arrived")

    stopped = chat(ingress.base_url, "org/stopped")
    assert stopped.headers["retry-after"] == "5"
    error = stopped.json()["error"]
    assert error["code"] == "model_not_ready" and "no ready replica (its pipeline is stopped)" in error["message"]
    starting = chat(ingress.base_url, "starting").json()["error"]
    assert "no ready replica (its replicas are starting)" in starting["message"]
    assert chat(ingress.base_url, "gamma").json()["error"]["code"] == "model_not_found"

    client = openai.OpenAI(base_url=ingress.api_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError, match="no ready replica") as refused:
        client.chat.completions.create(model="org/stopped", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 503
