"""``echo`` on completions, as vLLM serves it, on the echo engines: the prompt before the answer, whole and
streamed, ``max_tokens: 0`` for the prompt alone, and the prompt's log probabilities refused, naming the
engine, where the engine cannot compute them (llama.cpp's and vLLM's are in tests/engines/)."""

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engines.echo import EchoCoreEngine
from frontend_gateway.errors import EngineFailed
from frontend_gateway.models.pipeline import TokenModel
from frontend_gateway.openai_api.types import CompletionRequest
from runtime.models.loading import load_model_card
from tests.servers import Server

MODEL = "SmolLM2-135M-Instruct.Q4_1"  # out=echo_core: it answers with the prompt's tokens


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


def test_the_prompt_comes_back_before_the_answer(echo_core_server: Server) -> None:
    reply = client_of(echo_core_server).completions.create(model=MODEL, prompt="Hi there", max_tokens=2, echo=True)
    assert reply.choices[0].text == "Hi there" + "Hi there"
    assert reply.usage is not None and (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (2, 2)


def test_token_ids_are_echoed_as_their_text(echo_core_server: Server) -> None:
    reply = client_of(echo_core_server).completions.create(model=MODEL, prompt=[19556, 905], max_tokens=1, echo=True)
    assert reply.choices[0].text == "Hello world" + "Hello"


def test_max_tokens_0_shows_the_prompt_alone_and_counts_as_vllm_does(echo_core_server: Server) -> None:
    reply = client_of(echo_core_server).completions.create(model=MODEL, prompt="Hi there", max_tokens=0, echo=True)
    choice = reply.choices[0]
    assert (choice.text, choice.finish_reason, choice.logprobs) == ("Hi there", "length", None)
    # vLLM computes one token it does not show, and counts it.
    assert reply.usage is not None and (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (2, 1)


def test_a_streamed_echo_sends_the_prompt_first(echo_core_server: Server) -> None:
    stream = client_of(echo_core_server).completions.create(
        model=MODEL, prompt=["Hi there", "Bye"], max_tokens=1, echo=True, stream=True
    )
    texts: dict[int, list[str]] = {0: [], 1: []}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index].append(choice.text)
    assert texts == {0: ["Hi thereHi", ""], 1: ["ByeBy", ""]}


def test_a_streamed_echo_of_max_tokens_0_is_one_chunk_with_the_prompt(echo_core_server: Server) -> None:
    stream = client_of(echo_core_server).completions.create(
        model=MODEL, prompt="Hi there", max_tokens=0, echo=True, stream=True
    )
    assert [(choice.text, choice.finish_reason) for chunk in stream for choice in chunk.choices] == [
        ("Hi there", "length")
    ]


def test_a_text_engine_echoes_the_prompt_too(echo_full_server: Server) -> None:
    reply = client_of(echo_full_server).completions.create(model="echo", prompt="abc", max_tokens=0, echo=True)
    assert reply.choices[0].text == "abc"


def post(server: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.api_url}/completions", json=body, timeout=30)


def test_max_tokens_0_without_echo_is_a_bad_request(echo_core_server: Server) -> None:
    response = post(echo_core_server, {"model": MODEL, "prompt": "Hi", "max_tokens": 0})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens" and "only for echo" in response.text


@pytest.mark.parametrize(
    ("fixture", "model", "engine"),
    [("echo_core_server", MODEL, "out=echo_core"), ("echo_full_server", "echo", "out=echo_full")],
)
def test_echo_with_logprobs_is_refused_naming_the_engine(
    request: pytest.FixtureRequest, fixture: str, model: str, engine: str
) -> None:
    server: Server = request.getfixturevalue(fixture)
    body = {"model": model, "prompt": "Hi", "max_tokens": 1, "echo": True, "logprobs": 1}
    response = post(server, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "logprobs" and engine in error["message"]


async def test_an_engine_that_ignores_the_prompts_logprobs_fails_the_request_saying_so(smollm2: Path) -> None:
    # A worker of an older version whose card claimed them would answer without them: never shown as if whole.
    card = load_model_card(smollm2).replace(logprobs=True, prompt_logprobs=True)
    generation = await TokenModel(card, EchoCoreEngine(0.0)).prepare_completion(
        CompletionRequest(model=MODEL, prompt="Hi there", echo=True, max_tokens=1, logprobs=1)
    )
    with pytest.raises(EngineFailed, match="did not report the prompt's log probabilities"):
        async for _ in generation.pieces():
            pass
