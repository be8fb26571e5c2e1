"""stream_options.continuous_usage_stats: every chunk carries the usage so far, in vLLM's shape."""

import openai
import pytest

from tests.servers import Server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
HELLO_WORLD = [19556, 905, 17, 1073, 359, 346, 47]  # "Hello world! How are you?": echo_core answers it
EVERY_CHUNK = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture(scope="module")
def client(echo_core_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=echo_core_server.api_url, api_key="unused", max_retries=0)


def test_every_completion_chunk_carries_the_usage_so_far(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(model=MODEL, prompt=HELLO_WORLD, stream=True, stream_options=EVERY_CHUNK)  # type: ignore[arg-type]
    )
    assert all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in chunks if chunk.usage is not None]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == len(HELLO_WORLD)
    assert {chunk.usage.prompt_tokens for chunk in chunks if chunk.usage is not None} == {len(HELLO_WORLD)}
    assert all(
        chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        for chunk in chunks
        if chunk.usage
    )
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == "Hello world! How are you?"


def test_every_chat_chunk_carries_the_usage_so_far(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options=EVERY_CHUNK,  # type: ignore[typeddict-unknown-key]
    )
    chunks = list(stream)
    assert all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in chunks if chunk.usage is not None]
    assert counts == sorted(counts)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == chunks[-1].usage.prompt_tokens  # echo_core: the prompt back


def test_without_continuous_usage_stats_only_the_last_chunk_has_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(model=MODEL, prompt=HELLO_WORLD, stream=True, stream_options={"include_usage": True})
    )
    assert [chunk.usage is not None for chunk in chunks].count(True) == 1 and chunks[-1].usage is not None


def test_a_batch_of_prompts_carries_the_summed_usage_so_far(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=[HELLO_WORLD, HELLO_WORLD[:3]],
            stream=True,
            stream_options=EVERY_CHUNK,  # type: ignore[arg-type]
        )
    )
    assert all(chunk.usage is not None for chunk in chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(HELLO_WORLD) + 3
