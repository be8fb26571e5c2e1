"""Usage after a stop string, from a remote worker whose frames carry several outputs each.

An ``out=echo_core`` (token) or ``out=echo_full`` (text, a token per character) worker with no delay
between tokens hands all its outputs to the request plane before the first frame leaves, so they travel
merged. What is billed must still be what a stream of one token per frame would bill: the tokens up to
the one that completes the stop string (vLLM's count).
"""

from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from runtime.models.loading import load_model_card
from tests.distributed.cluster import Cluster, served_models, wait_until

TEXT = "one two three four five STOP six seven eight STOP nine ten " + " ".join(f"w{n}" for n in range(40))


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> Tokenizer:
    return load_model_card(smollm2).tokenizer


def tokens_through_stop(tokenizer: Tokenizer, ids: list[int], stop: str, occurrence: int = 1) -> int:
    """How many of ``ids`` are generated when the ``occurrence``-th ``stop`` is completed."""
    for count in range(1, len(ids) + 1):
        if tokenizer.decode(ids[:count]).count(stop) >= occurrence:
            return count
    raise AssertionError(f"{stop!r} does not occur {occurrence} times")


def complete(ingress_url: str, ids: list[int], **fields: object) -> httpx.Response:
    body = {"model": "alpha", "prompt": ids, "max_tokens": len(ids), "stop": ["STOP"], **fields}
    return httpx.post(ingress_url + "/v1/completions", json=body, timeout=30)


@pytest.fixture
def ingress_url(cluster: Cluster) -> str:
    ingress = cluster.start_ingress()
    cluster.start_worker("dyn://alpha", "out=echo_core", "--model-name", "alpha", delay_ms=0)
    wait_until(lambda: served_models(ingress) == ["alpha"], 15, "the model did not appear")
    return ingress.base_url


def test_a_stop_string_in_a_merged_frame_bills_only_the_tokens_up_to_it(ingress_url: str, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    reply = complete(ingress_url, ids).json()
    assert reply["choices"][0]["text"] == "one two three four five "
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == tokens_through_stop(tokenizer, ids, "STOP") < len(ids) // 4


def test_a_streamed_answer_bills_the_same_as_a_whole_one(ingress_url: str, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    body = {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", ingress_url + "/v1/completions", json={"model": "alpha", "prompt": ids, "stop": ["STOP"], **body}
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    usage = httpx.Response(200, content=lines[-1].removeprefix("data: ")).json()["usage"]
    assert usage["completion_tokens"] == tokens_through_stop(tokenizer, ids, "STOP")


def test_no_stop_string_ends_the_answer_before_min_tokens(ingress_url: str, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    first = tokens_through_stop(tokenizer, ids, "STOP")
    reply = complete(ingress_url, ids, min_tokens=first).json()
    assert reply["choices"][0]["text"] == "one two three four five STOP six seven eight "
    assert reply["usage"]["completion_tokens"] == tokens_through_stop(tokenizer, ids, "STOP", occurrence=2)


def test_a_stop_string_completed_by_the_first_token_past_min_tokens_ends_the_answer(
    ingress_url: str, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    first = tokens_through_stop(tokenizer, ids, "STOP")
    reply = complete(ingress_url, ids, min_tokens=first - 1).json()
    assert reply["choices"][0]["text"] == "one two three four five "
    assert reply["usage"]["completion_tokens"] == first


@pytest.fixture
def text_ingress_url(cluster: Cluster) -> str:
    ingress = cluster.start_ingress()
    cluster.start_worker("dyn://echo", "out=echo_full", "--model-name", "echo", delay_ms=0)
    wait_until(lambda: served_models(ingress) == ["echo"], 15, "the model did not appear")
    return ingress.base_url


@pytest.mark.parametrize(("min_tokens", "text", "billed"), [(0, "one two ", 12), (12, "one two STOP three ", 23)])
def test_a_text_engine_s_merged_frame_bills_only_the_characters_up_to_the_stop_string(
    text_ingress_url: str, min_tokens: int, text: str, billed: int
) -> None:
    body = {"model": "echo", "prompt": "one two STOP three STOP four " * 4, "stop": ["STOP"], "min_tokens": min_tokens}
    reply = httpx.post(text_ingress_url + "/v1/completions", json=body, timeout=30).json()
    assert reply["choices"][0]["text"] == text
    assert reply["usage"]["completion_tokens"] == billed
