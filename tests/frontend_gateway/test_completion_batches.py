"""POST /v1/completions with several prompts, as vLLM serves them: one choice per prompt, its index the
prompt's, usage summed; streamed, the prompts' chunks interleave, each naming its choice.

``echo_full`` answers a prompt with its text, ``echo_core`` with its tokens, so every choice shows which
prompt it answers; the in-process engine (``TokenScript``) shows what a client that leaves, or an engine
that fails, does to the whole batch.
"""

from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest

from frontend_gateway.http_app import GatewayApp
from frontend_gateway.models.pipeline import ModelRegistry, TokenModel
from frontend_gateway.openai_api.completion_batch import MAX_PROMPTS
from runtime.models.card import ModelCard
from runtime.models.loading import load_model_card
from tests.frontend_gateway.asgi import Client, Message, TokenScript, call
from tests.frontend_gateway.test_http_errors import assert_error, post
from tests.servers import Server, llama_cpp_available

SMOL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def card(smollm2: Path) -> ModelCard:
    return load_model_card(smollm2)


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)


def test_a_list_of_prompts_gets_one_choice_per_prompt_in_order(echo_full_server: Server) -> None:
    prompts = ["one", "two two", "three three three"]
    reply = client_of(echo_full_server).completions.create(model="echo", prompt=prompts, max_tokens=50)
    assert [(choice.index, choice.text, choice.finish_reason) for choice in reply.choices] == [
        (0, "one", "stop"),
        (1, "two two", "stop"),
        (2, "three three three", "stop"),
    ]
    assert reply.usage is not None and reply.usage.completion_tokens == sum(map(len, prompts))  # a character a token


def test_each_prompt_has_its_own_max_tokens_and_finish_reason(echo_full_server: Server) -> None:
    reply = client_of(echo_full_server).completions.create(model="echo", prompt=["abcdef", "ab"], max_tokens=3)
    assert [(choice.text, choice.finish_reason) for choice in reply.choices] == [("abc", "length"), ("ab", "stop")]


def test_a_list_of_token_id_prompts_gets_one_choice_per_prompt(echo_core_server: Server, card: ModelCard) -> None:
    texts = ["The cat sat.", "Quarterly revenue grew."]
    ids = [card.tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
    reply = client_of(echo_core_server).completions.create(model=SMOL, prompt=ids)
    assert [choice.text for choice in reply.choices] == texts
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == reply.usage.completion_tokens == sum(map(len, ids))


def test_a_streamed_batch_interleaves_chunks_that_name_their_choice(echo_full_server: Server) -> None:
    prompts = ["first answer", "second", "third one"]
    stream = client_of(echo_full_server).completions.create(
        model="echo", prompt=prompts, stream=True, stream_options={"include_usage": True}
    )
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
    assert dict(texts) == dict(enumerate(prompts))
    assert dict(finishes) == {0: ["stop"], 1: ["stop"], 2: ["stop"]}  # each choice ends once
    assert usage is not None and usage.completion_tokens == sum(map(len, prompts))


def test_a_batch_of_one_is_answered_as_a_single_prompt(echo_full_server: Server) -> None:
    reply = client_of(echo_full_server).completions.create(model="echo", prompt=["only"])
    assert [(choice.index, choice.text) for choice in reply.choices] == [(0, "only")]


@pytest.mark.parametrize(
    ("prompt", "param", "contains"),
    [
        ([], "prompt", "must not be empty"),
        (["text", [1, 2]], "prompt", "not a mix"),
        ([[1, 2], "text"], "prompt", "not a mix"),
        (["x"] * (MAX_PROMPTS + 1), "prompt", f"at most {MAX_PROMPTS}"),
    ],
)
def test_a_batch_that_cannot_be_served_is_a_400_naming_the_prompt(
    echo_full_server: Server, prompt: list[Any], param: str, contains: str
) -> None:
    response = post(echo_full_server, "/v1/completions", {"model": "echo", "prompt": prompt})
    assert_error(response, 400, param=param, contains=contains)


@pytest.mark.parametrize(
    ("prompt", "contains"),
    [([[1, 2], [3, 49_152]], "token id 49152 is outside the vocabulary"), (["fine", ""], "must not be empty")],
)
def test_a_prompt_that_cannot_be_served_is_named_by_its_index(
    echo_core_server: Server, prompt: list[Any], contains: str
) -> None:
    response = post(echo_core_server, "/v1/completions", {"model": SMOL, "prompt": prompt})
    assert_error(response, 400, param="prompt[1]", contains=contains)


@pytest.mark.llamacpp
@pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed (`make install`)")
def test_llamacpp_answers_each_prompt_of_a_batch_as_it_answers_it_alone(llamacpp_server: Server) -> None:
    client = client_of(llamacpp_server)
    prompts = ["The capital of France is", "One, two, three,"]
    fields: Any = {"model": SMOL, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    batch = client.completions.create(prompt=prompts, **fields)
    alone = [client.completions.create(prompt=prompt, **fields).choices[0] for prompt in prompts]
    assert [choice.text for choice in batch.choices] == [choice.text for choice in alone]
    for choice in batch.choices:
        assert choice.logprobs is not None and "".join(choice.logprobs.tokens or []) == choice.text


# --- in process: a client that leaves, an engine that fails ------------------------------------------


def app_with(card: ModelCard, engine: TokenScript) -> GatewayApp:
    registry = ModelRegistry()
    registry.add(TokenModel(card, engine))
    return GatewayApp(registry)


class LeavesAfterFrames(Client):
    """A client that leaves once it has read ``frames`` body messages."""

    def __init__(self, body: bytes, frames: int) -> None:
        super().__init__(body)
        self.frames = frames

    async def send(self, message: Message) -> None:
        await super().send(message)
        if sum(1 for sent in self.sent if sent.get("body")) >= self.frames:
            self.left.set()


async def test_a_client_that_leaves_a_streamed_batch_stops_every_prompts_generation(card: ModelCard) -> None:
    engine = TokenScript([11, 12], endless=True)
    body = msgspec.json.encode({"model": card.name, "prompt": ["a", "b", "c"], "stream": True})
    client = await call(app_with(card, engine), "/v1/completions", None, LeavesAfterFrames(body, frames=10))
    assert client.status == 200
    assert len(engine.contexts) == 3
    assert all(context.stopped for context in engine.contexts)


async def test_an_engine_failing_mid_stream_ends_the_batch_with_an_error_event(card: ModelCard) -> None:
    text = card.tokenizer.encode("one two three", add_special_tokens=False).ids
    engine = TokenScript(text, error=Exception("the engine tripped over itself"))
    client = await call(
        app_with(card, engine), "/v1/completions", {"model": card.name, "prompt": ["a", "b"], "stream": True}
    )
    assert client.status == 200
    events = client.events()
    assert events[-1] == "[DONE]"
    assert "internal error" in events[-2]["error"]["message"]
    assert all(context.stopped for context in engine.contexts)


async def test_an_engine_failing_before_any_text_is_an_error_status(card: ModelCard) -> None:
    engine = TokenScript([], error=Exception("the engine tripped over itself"))
    client = await call(app_with(card, engine), "/v1/completions", {"model": card.name, "prompt": ["a", "b"]})
    assert client.status == 500
