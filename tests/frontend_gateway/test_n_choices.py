"""n > 1: several choices, each its own generation, numbered as vLLM numbers them, usage summed."""

import openai
import pytest

from tests.servers import Server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
HELLO = [19556, 905]  # "Hello world": echo_core answers with it
HOW = [1073, 359, 346, 47]  # " How are you?"


@pytest.fixture(scope="module")
def client(echo_core_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=echo_core_server.api_url, api_key="unused", max_retries=0)


def test_n_completions_of_one_prompt_are_n_choices_with_usage_summed(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt=HELLO, n=3)
    assert [(choice.index, choice.text) for choice in reply.choices] == [(i, "Hello world") for i in range(3)]
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (3 * len(HELLO), 3 * len(HELLO))


def test_choices_of_several_prompts_are_numbered_prompt_times_n_plus_j(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt=[HELLO, HOW], n=2)
    texts = [(choice.index, choice.text) for choice in reply.choices]
    assert texts == [(0, "Hello world"), (1, "Hello world"), (2, " How are you?"), (3, " How are you?")]


def test_streamed_choices_interleave_each_with_its_index_and_finish(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL, prompt=HOW, n=2, stream=True, stream_options={"include_usage": True}
    )
    texts = {0: "", 1: ""}
    finished = {}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert texts == {0: " How are you?", 1: " How are you?"}
    assert finished == {0: "stop", 1: "stop"}
    assert usage is not None and usage.completion_tokens == 2 * len(HOW)


def test_too_many_choices_are_refused_naming_n(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt=[HELLO, HOW, HELLO], n=100)
    assert raised.value.body["param"] == "n"  # type: ignore[index]
