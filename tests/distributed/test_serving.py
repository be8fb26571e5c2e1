"""Serving across processes: workers found through etcd, reached over NATS, through one ingress."""

import itertools
from collections import Counter

import httpx
import openai

from tests.distributed.cluster import Cluster, served_models, wait_until

PROMPT = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau"


def chat(server_url: str, model: str, content: str = "hi", **fields: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], **fields}
    return httpx.post(server_url + "/v1/chat/completions", json=body, timeout=30)


def test_two_models_with_two_instances_each_are_served_round_robin(cluster: Cluster) -> None:
    ingress = cluster.start_ingress("--router-mode", "round-robin")
    workers = {
        name: cluster.start_workers(2, f"dyn://{name}", "out=echo_core", "--model-name", name)
        for name in ("alpha", "beta")
    }
    wait_until(lambda: served_models(ingress) == ["alpha", "beta"], 15, "models did not appear")
    for name, pair in workers.items():
        wait_until(
            lambda: len({chat(ingress.base_url, name).headers["x-flotilla-instance"] for _ in range(4)}) == 2,  # noqa: B023
            15,
            f"{name}'s second instance never got traffic",
        )
        served = Counter(chat(ingress.base_url, name).headers["x-flotilla-instance"] for _ in range(6))
        assert served == {pair[0].instance_id: 3, pair[1].instance_id: 3}


def test_random_routing_reaches_every_instance_in_no_fixed_order(cluster: Cluster) -> None:
    ingress = cluster.start_ingress("--router-mode", "random")
    pair = cluster.start_workers(2, "dyn://alpha", "out=echo_core", "--model-name", "alpha")
    wait_until(lambda: served_models(ingress) == ["alpha"], 15, "the model did not appear")
    wait_until(
        lambda: len({chat(ingress.base_url, "alpha").headers["x-flotilla-instance"] for _ in range(4)}) == 2,
        15,
        "the second instance never got traffic",
    )
    served = [chat(ingress.base_url, "alpha").headers["x-flotilla-instance"] for _ in range(40)]
    assert set(served) == {worker.instance_id for worker in pair}
    # Round-robin over two instances alternates strictly; random repeats an instance back to back
    # (40 strict alternations by chance: 1 in 2**39).
    assert any(first == second for first, second in itertools.pairwise(served)), "the instances strictly alternated"


def test_the_instance_is_named_in_nvext_on_request(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    worker = cluster.start_worker("dyn://alpha", "out=echo_core", "--model-name", "alpha")
    wait_until(lambda: served_models(ingress) == ["alpha"], 15, "the model did not appear")
    reply = chat(ingress.base_url, "alpha", nvext={"annotations": ["instance_id"]}).json()
    assert reply["nvext"] == {"instance_id": worker.instance_id}


def test_a_remote_model_answers_like_the_local_pipeline(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    cluster.start_worker("dyn://alpha", "out=echo_core", "--model-name", "alpha")
    wait_until(lambda: served_models(ingress) == ["alpha"], 15, "the model did not appear")
    client = openai.OpenAI(base_url=ingress.api_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "Hi 👋"}])
    assert reply.choices[0].message.content is not None
    assert reply.choices[0].message.content.endswith("<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n")
    assert reply.usage is not None and reply.usage.prompt_tokens == reply.usage.completion_tokens


def test_a_text_engine_worker_is_served_too(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    cluster.start_worker("dyn://echo", "out=echo_full", "--model-name", "echo")
    wait_until(lambda: served_models(ingress) == ["echo"], 15, "the model did not appear")
    client = openai.OpenAI(base_url=ingress.api_url, api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="echo", messages=[{"role": "user", "content": PROMPT}], stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == PROMPT


def test_a_killed_worker_leaves_the_models_list_within_its_lease(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    worker = cluster.start_worker("dyn://alpha", "out=echo_core", "--model-name", "alpha")
    wait_until(lambda: served_models(ingress) == ["alpha"], 15, "the model did not appear")
    worker.kill()
    wait_until(lambda: served_models(ingress) == [], cluster.lease_ttl + 3, "the dead worker's model stayed listed")
    response = chat(ingress.base_url, "alpha")
    assert response.status_code == 404


def test_a_cleanly_stopped_worker_leaves_at_once(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    worker = cluster.start_worker("dyn://alpha", "out=echo_core", "--model-name", "alpha")
    wait_until(lambda: served_models(ingress) == ["alpha"], 15, "the model did not appear")
    worker.stop()
    assert worker.process.returncode == 0
    wait_until(lambda: served_models(ingress) == [], 1.0, "a clean exit should deregister at once")


def test_an_instance_with_a_different_card_for_the_same_name_is_reported(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    cluster.start_worker("dyn://alpha", "out=echo_core", "--model-name", "same")
    wait_until(lambda: served_models(ingress) == ["same"], 15, "the model did not appear")
    cluster.start_worker("dyn://beta", "out=echo_full", "--model-name", "same")
    wait_until(lambda: "of model 'same' is refused" in ingress.log(), 15, "the mismatch was not reported")
