"""The llama.cpp engine generates real text from SmolLM2, fed token ids by our preprocessor."""

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from frontend_gateway.models.pipeline import TokenModel
from frontend_gateway.openai_api.types import ChatCompletionRequest, ChatMessage
from runtime.engine import RequestContext
from runtime.models.loading import load_model_card
from runtime.protocol import PreprocessedRequest, SamplingOptions, StopConditions
from tests.servers import Server, llama_cpp_available

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed (`make install`)"),
]

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
async def model(smollm2: Path) -> AsyncIterator[TokenModel]:
    from engines.llamacpp.engine import LlamaCppEngine

    card = load_model_card(smollm2, context_length=2048)
    engine = LlamaCppEngine(smollm2, context_length=card.context_length, threads=2)
    await engine.start()
    yield TokenModel(card, engine)
    await engine.close()


def chat(content: str, **fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=MODEL, messages=[ChatMessage(role="user", content=content)], **fields)


async def answer(model: TokenModel, request: ChatCompletionRequest) -> tuple[str, Any]:
    generation = await model.prepare_chat(request)
    text = "".join([piece async for piece in generation.pieces()])
    return text, generation


def test_the_capital_of_france_is_paris_over_http(llamacpp_server: Server) -> None:
    client = openai.OpenAI(base_url=llamacpp_server.api_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=40)  # type: ignore[arg-type]
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 40


def test_cached_prompt_tokens_reach_the_client_in_usage(llamacpp_server: Server) -> None:
    client = openai.OpenAI(base_url=llamacpp_server.api_url, api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "You answer in one word. " * 30}, *PARIS]
    client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=2)  # type: ignore[arg-type]
    again = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=2)  # type: ignore[arg-type]
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and again.usage.prompt_tokens - 2 <= cached < again.usage.prompt_tokens


def test_a_streamed_answer_matches_the_unary_one(llamacpp_server: Server) -> None:
    client = openai.OpenAI(base_url=llamacpp_server.api_url, api_key="unused", max_retries=0)
    unary = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=30)  # type: ignore[arg-type]
    stream = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=30, stream=True)  # type: ignore[arg-type]
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == unary.choices[0].message.content


async def test_concurrent_requests_do_not_corrupt_each_other(model: TokenModel) -> None:
    prompts = ["What is the capital of France?", "Name a color.", "What is 2+2?"]
    alone = [(await answer(model, chat(p, temperature=0.0, max_tokens=24)))[0] for p in prompts]
    together = await asyncio.gather(*(answer(model, chat(p, temperature=0.0, max_tokens=24)) for p in prompts))
    assert [text for text, _ in together] == alone


async def test_a_shared_prefix_is_not_evaluated_again(model: TokenModel) -> None:
    engine: Any = model.engine
    prefix = "You are a careful assistant. " * 20
    before = engine.decoded_rows
    _, first = await answer(model, chat(prefix + "First question: name a fruit.", temperature=0.0, max_tokens=2))
    first_prompt = engine.decoded_rows - before - 1  # the first generated token is decoded too
    before = engine.decoded_rows
    _, second = await answer(model, chat(prefix + "Second question: name a tree.", temperature=0.0, max_tokens=2))
    evaluated = engine.decoded_rows - before - 1
    assert first_prompt == first.prompt_tokens > 100
    # Only the differing tail (a dozen tokens) is evaluated for the second prompt.
    assert evaluated < second.prompt_tokens - 100
    # ... and the client is told so, as vLLM tells it (usage.prompt_tokens_details.cached_tokens).
    assert second.cached_tokens == second.prompt_tokens - evaluated


async def test_closing_the_stream_stops_generation_and_frees_the_engine(model: TokenModel) -> None:
    generation = await model.prepare_chat(chat("Tell me a very long story.", max_tokens=500, ignore_eos=True))
    pieces = generation.pieces()
    for _ in range(3):
        await anext(pieces)
    await pieces.aclose()  # type: ignore[attr-defined]
    assert generation.context.stopped
    assert generation.completion_tokens < 10
    engine: Any = model.engine
    before = engine.decoded_rows
    text, paris = await answer(model, chat("What is the capital of France?", temperature=0.0, max_tokens=20))
    assert "Paris" in text
    # The story stopped within a step or two: little besides this answer's own rows was decoded since.
    own = paris.prompt_tokens - paris.cached_tokens + paris.completion_tokens
    assert engine.decoded_rows - before <= own + 2


async def test_min_tokens_keeps_generating_past_eos(model: TokenModel) -> None:
    _, short = await answer(model, chat("Reply with one word: yes or no?", temperature=0.0, max_tokens=50))
    assert short.finish_reason == "stop"
    _, longer = await answer(
        model,
        chat(
            "Reply with one word: yes or no?",
            temperature=0.0,
            max_tokens=50,
            min_tokens=short.completion_tokens + 10,
        ),
    )
    assert longer.completion_tokens >= short.completion_tokens + 10


async def test_max_tokens_ends_with_length(model: TokenModel) -> None:
    _, generation = await answer(model, chat("Tell me a story.", max_tokens=5, ignore_eos=True))
    assert (generation.completion_tokens, generation.finish_reason) == (5, "length")


async def test_the_same_seed_gives_the_same_sample(model: TokenModel) -> None:
    first, _ = await answer(model, chat("Write a word.", temperature=1.0, seed=7, max_tokens=12))
    second, _ = await answer(model, chat("Write a word.", temperature=1.0, seed=7, max_tokens=12))
    assert first == second


def chatml(engine: Any, content: str) -> list[int]:
    """SmolLM2's chat prompt for one user message, as token ids (what the gateway would send)."""
    text = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    )
    tokens: list[int] = engine.tokenize(text)
    return tokens


async def greedy(engine: Any, token_ids: list[int], max_tokens: int, migrated_tokens: int = 0) -> list[int]:
    """The token ids the engine generates at temperature 0 (llama.cpp's default repeat penalty on)."""
    request = PreprocessedRequest(
        request_id="r",
        model=MODEL,
        token_ids=token_ids,
        sampling=SamplingOptions(temperature=0.0),
        stop_conditions=StopConditions(max_tokens=max_tokens),
        migrated_tokens=migrated_tokens,
    )
    return [token async for output in engine.generate(request, RequestContext("r")) for token in output.token_ids]


@pytest.fixture
async def other(smollm2: Path) -> AsyncIterator[Any]:
    """A second engine on the same model: the worker a request migrates to."""
    from engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(smollm2, context_length=2048, threads=2)
    await engine.start()
    yield engine
    await engine.close()


async def test_a_migrated_request_continues_exactly_as_the_undisturbed_run(model: TokenModel, other: Any) -> None:
    # Before the fix, each of these diverged: a batch-decoded migrated part rounds differently from
    # the one-at-a-time decode it had where it was generated, and the repeat penalty forgot it.
    for content in ("Tell me a long story about a dragon.", "Write a poem about the sea."):
        prompt = chatml(model.engine, content)
        undisturbed = await greedy(model.engine, prompt, 48)
        assert len(undisturbed) == 48
        for done in (5, 17, 33):
            resumed = await greedy(other, prompt + undisturbed[:done], 48 - done, migrated_tokens=done)
            assert resumed == undisturbed[done:], f"{content!r} resumed after {done} tokens"


async def test_the_same_prompt_twice_gets_the_same_answer(model: TokenModel) -> None:
    # The second time the whole prompt is cached; re-decoding its last token alone used to round
    # differently from the batch it was first decoded in, and this answer changed.
    prompt = chatml(model.engine, "Explain how photosynthesis works in detail.")
    first = await greedy(model.engine, prompt, 48)
    assert await greedy(model.engine, prompt, 48) == first
