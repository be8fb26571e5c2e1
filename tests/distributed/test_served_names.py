"""A model that a pipeline serves but that has no replica registered is a 503 "no ready replica" (with
Retry-After) on the ingress, not a 404 "does not exist": the ingress watches the names the control plane
publishes (runtime/fleet_contract/served_names.py)."""

import json
import time

import httpx
import openai
import pytest

from runtime.cluster.discovery import MODELS_PREFIX
from runtime.fleet_contract.served_names import etcd_key
from tests.distributed.cluster import Cluster, etcd_put, etcd_values, served_models, wait_until

#: Less than the ingress's longest wait for an arriving model (ARRIVAL_WAIT_S, 10 s): an answer this soon
#: shows the wait ended with the failed registration, not at its cap.
ANSWER_WITHIN_S = 5.0


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


@pytest.mark.parametrize("name", ["beta", "gamma", "delta"])
def test_a_request_sent_as_soon_as_the_worker_is_registered_waits_for_the_ingress_to_take_it_in(
    cluster: Cluster, name: str
) -> None:
    """The agent reports a worker ready once its model is registered in etcd (agent/workers/readiness.py); the
    ingress then still builds the model's pool (its tokenizer, its router) for 40-250 ms. A client that
    acts on "ready" at once is served, not told to come back in 5 s (each name is one more try at the
    race: on the ingress that did not wait, at least one of them met the 503)."""
    ingress = cluster.start_ingress()
    etcd_put(cluster.etcd, etcd_key(name), '{"state":"running"}')
    wait_until(lambda: chat(ingress.base_url, name).status_code == 503, 5, "the served name never arrived")

    cluster.start_worker(f"dyn://{name}", "out=echo_core", "--model-name", name)
    deadline = time.monotonic() + 30
    while not any(f'"{name}"' in value for value in etcd_values(cluster.etcd, MODELS_PREFIX).values()):
        assert time.monotonic() < deadline, "the worker never registered its model"
        time.sleep(0.002)  # as the agent's watch sees it: within milliseconds of the registration
    # The agent's report reaches a client through the control plane (a task, the database, an API call):
    # tens of ms at the least, by which time the ingress has heard the registration too.
    time.sleep(0.02)

    answer = chat(ingress.base_url, name)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]


def test_a_registration_whose_pool_cannot_be_built_does_not_hold_its_requests(cluster: Cluster) -> None:
    """A registration the ingress cannot take in (here a forged copy of a worker's, naming a tokenizer that
    is not in the object store) ends the wait of the requests for its model as soon as it fails: they are
    answered as for any model with no instance, well within the wait's 10 s cap."""
    ingress = cluster.start_ingress()
    cluster.start_worker("dyn://alpha", "out=echo_core", "--model-name", "alpha")
    wait_until(lambda: served_models(ingress) == ["alpha"], 15, "the model did not appear")
    key, value = next(iter(etcd_values(cluster.etcd, MODELS_PREFIX).items()))
    entry = json.loads(value)
    assert entry["card"]["model_type"] == "tokens", "the forgery needs a model whose tokenizer is fetched"
    entry["card"]["name"], entry["tokenizer_sha256"] = "ghost", "0" * 64
    etcd_put(cluster.etcd, etcd_key("ghost"), '{"state":"running"}')
    etcd_put(cluster.etcd, key.rsplit("/", 1)[0] + "/1234abcd", json.dumps(entry))

    body = {"model": "ghost", "messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(ingress.base_url + "/v1/chat/completions", json=body, timeout=ANSWER_WITHIN_S)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "model_not_ready"
    assert served_models(ingress) == ["alpha"]
