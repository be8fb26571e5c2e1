"""POST /v1/embeddings through an ingress to real llama.cpp workers (SmolLM2), with the official openai
client: the vectors are the ones the same engine computes in one process, a long list is spread over
every worker, a worker killed mid-list costs the client nothing, a model whose workers do not embed is a
400, and the tokens embedded are charged to the caller's API key."""

import math
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from runtime.fleet_contract.api_keys import KeyRecord, etcd_key, key_hash, new_key, sign
from runtime.models.loading import load_model_card
from tests.distributed.cluster import Cluster, Worker, etcd_put, served_models, wait_until
from tests.distributed.test_api_keys import usage_in
from tests.infra import RedisServer
from tests.servers import Server, llama_cpp_available, smollm2_path

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed (`make install`)"),
]

MODEL = "smol"
SECRET = "e" * 64


def start_llamacpp_worker(cluster: Cluster) -> Worker:
    return cluster.start_worker(
        f"dyn://{MODEL}", "out=llamacpp", str(smollm2_path()), "--model-name", MODEL, "--threads", "1",
        "--context-length", "512",
    )  # fmt: skip


def client(server: Server, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=key, max_retries=0, timeout=300)


def ingress_health(server: Server) -> Any:
    return httpx.get(server.base_url + "/health", timeout=5).json()  # open without a key


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_a_worker_embeds_what_the_engine_embeds_in_one_process(cluster: Cluster, llamacpp_server: Server) -> None:
    ingress = cluster.start_ingress()
    start_llamacpp_worker(cluster)
    wait_until(lambda: served_models(ingress) == [MODEL], 60, "the llama.cpp worker did not register")
    texts = ["The capital of France is Paris.", "A cat was sitting on the rug.", "Quarterly revenue grew."]

    remote = client(ingress).embeddings.create(model=MODEL, input=texts)  # base64, as the client asks
    local = client(llamacpp_server).embeddings.create(model="SmolLM2-135M-Instruct.Q4_1", input=texts)

    assert [item.index for item in remote.data] == [0, 1, 2]
    for far, near in zip(remote.data, local.data, strict=True):
        assert len(far.embedding) == 576
        assert cosine(far.embedding, near.embedding) > 0.9999  # the same engine on the same texts
    assert remote.usage.prompt_tokens == local.usage.prompt_tokens > 10
    floats = client(ingress).embeddings.create(model=MODEL, input=texts[0], encoding_format="float")
    pairs = zip(floats.data[0].embedding, remote.data[0].embedding, strict=True)
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in pairs)
    # Token ids travel to the worker as they are, and are embedded as the text they stand for.
    tokenizer = load_model_card(smollm2_path()).tokenizer
    ids = [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
    by_ids = client(ingress).embeddings.create(model=MODEL, input=ids)
    for from_ids, from_text in zip(by_ids.data, remote.data, strict=True):
        assert all(
            math.isclose(a, b, abs_tol=1e-6) for a, b in zip(from_ids.embedding, from_text.embedding, strict=True)
        )
    assert by_ids.usage.prompt_tokens == remote.usage.prompt_tokens


def test_a_list_is_spread_over_the_workers_and_a_killed_one_costs_the_client_nothing(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    workers = [start_llamacpp_worker(cluster), start_llamacpp_worker(cluster)]
    wait_until(lambda: ingress_health(ingress).get("instances") == {MODEL: 2}, 60, "the workers did not register")
    texts = [f"Sentence number {index} is about the number {index}." for index in range(70)]  # 3 batches
    first = client(ingress).embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [item.index for item in first.data] == list(range(70))
    # Two texts that differ are two vectors (no batch's answer was put in another's place).
    assert cosine(first.data[0].embedding, first.data[69].embedding) < 0.9999

    # Killed without a word, and still listed (its lease has seconds to run): its batches go to the other.
    workers[0].kill()
    again = client(ingress).embeddings.create(model=MODEL, input=texts, encoding_format="float")
    for before, after in zip(first.data, again.data, strict=True):
        assert cosine(before.embedding, after.embedding) > 0.9999


def test_a_model_whose_workers_do_not_embed_is_a_bad_request(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    cluster.start_worker("dyn://mock", "out=mocker", "--model-name", "mock")
    wait_until(lambda: served_models(ingress) == ["mock"], 30, "the mocker did not register")
    with pytest.raises(openai.BadRequestError, match="does not embed") as refused:
        client(ingress).embeddings.create(model="mock", input="hi")
    assert refused.value.param == "model"


def test_the_tokens_embedded_are_charged_to_the_key(
    cluster: Cluster, tmp_path: Path, redis_server: RedisServer
) -> None:
    secret = tmp_path / "api-keys.secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    key = new_key()
    record = KeyRecord(key_id=7, name="search-app", owner="bob")
    etcd_put(cluster.etcd, etcd_key(key_hash(key)), sign(record, key_hash(key), SECRET.encode()).decode())
    ingress = cluster.start_ingress("--api-keys-secret-file", str(secret), "--quota-redis", redis_server.url)
    start_llamacpp_worker(cluster)
    wait_until(lambda: "smol" in ingress_health(ingress)["models"], 60, "the llama.cpp worker did not register")

    reply = client(ingress, key).embeddings.create(model=MODEL, input=["one text", "and another"])
    with pytest.raises(openai.AuthenticationError):
        client(ingress, new_key()).embeddings.create(model=MODEL, input="hi")

    wait_until(lambda: usage_in(redis_server).get(f"7\t{MODEL}\trequests") == 1, 5, "the usage did not reach Redis")
    usage = usage_in(redis_server)
    assert usage[f"7\t{MODEL}\tprompt_tokens"] == reply.usage.prompt_tokens > 0
    assert usage.get(f"7\t{MODEL}\tcompletion_tokens", 0) == 0
