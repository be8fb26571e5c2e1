"""A real mistral.rs worker (SmolLM2 GGUF) behind an ingress: it answers through the network, streamed and not,
and a client that goes away ends its sequence in mistral.rs."""

import importlib.util

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.distributed.cluster import Cluster, Worker, served_models, wait_until
from tests.servers import smollm2_path

pytestmark = [
    pytest.mark.mistralrs,
    pytest.mark.skipif(
        importlib.util.find_spec("mistralrs") is None, reason="mistralrs is not installed (`make install`)"
    ),
]

MODEL = "smol"
PARIS: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


def start_mistralrs_worker(cluster: Cluster) -> Worker:
    # One sequence slot: a request runs only once the one before it has ended in mistral.rs.
    return cluster.start_worker(
        f"dyn://{MODEL}",
        "out=mistralrs",
        str(smollm2_path()),
        "--model-name",
        MODEL,
        "--extra-engine-args",
        '{"max_seqs": 1}',
        timeout=120,
    )


def test_a_mistralrs_worker_answers_chat_and_completions_through_the_ingress(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    worker = start_mistralrs_worker(cluster)
    wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
    client = openai.OpenAI(base_url=ingress.api_url, api_key="unused", max_retries=0, timeout=120)

    reply = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=PARIS,
        temperature=0,
        max_tokens=8,
    )
    assert reply.headers["x-flotilla-instance"] == worker.instance_id
    whole = reply.parse()
    assert whole.choices[0].message.content and whole.usage is not None and whole.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model=MODEL,
        messages=PARIS,
        temperature=0,
        max_tokens=8,
        stream=True,
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == (
        whole.choices[0].message.content
    )
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4)
    assert "Paris" in completion.choices[0].text


def test_a_client_that_disconnects_frees_the_mistralrs_worker(cluster: Cluster) -> None:
    ingress = cluster.start_ingress()
    start_mistralrs_worker(cluster)
    wait_until(lambda: served_models(ingress) == [MODEL], 30, "the model did not appear")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
        "stream": True,
        "max_tokens": 4000,
        "ignore_eos": True,
    }
    with httpx.stream("POST", ingress.base_url + "/v1/chat/completions", json=body, timeout=60) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: {"))
        for _ in range(3):
            next(lines)
    # One sequence slot: answered only once the story's sequence has ended in mistral.rs (4,000 tokens would
    # take minutes here).
    reply = httpx.post(
        ingress.base_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": PARIS, "max_tokens": 4, "ignore_eos": True},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
