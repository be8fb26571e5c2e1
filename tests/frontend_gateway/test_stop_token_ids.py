"""stop_token_ids, include_stop_str_in_output, and the finish reason of an answer that ends exactly at
max_tokens, through the openai client against real servers.

echo_core answers with the prompt's tokens, one by one, and ends with "stop" when they are all sent: so
a prompt of token ids stands for a model generating exactly those tokens, and its last one for an EOS.
"""

import openai
import pytest

from tests.servers import Server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
HELLO_WORLD = [19556, 905, 17, 1073, 359, 346, 47]  # "Hello world! How are you?"


@pytest.fixture(scope="module")
def client(echo_core_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=echo_core_server.api_url, api_key="unused", max_retries=0)


def test_the_prompt_is_what_the_test_expects(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt=HELLO_WORLD)
    assert reply.choices[0].text == "Hello world! How are you?"


def test_a_stop_token_ends_the_answer_without_its_text(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt=HELLO_WORLD, extra_body={"stop_token_ids": [17, 346]})
    assert reply.choices[0].text == "Hello world"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens == 3  # the stop token was generated


def test_include_stop_str_in_output_shows_the_stop_tokens_text(client: openai.OpenAI) -> None:
    fields = {"stop_token_ids": [17], "include_stop_str_in_output": True}
    reply = client.completions.create(model=MODEL, prompt=HELLO_WORLD, extra_body=fields)
    assert reply.choices[0].text == "Hello world!"


def test_no_stop_token_ends_the_answer_before_min_tokens(client: openai.OpenAI) -> None:
    fields = {"stop_token_ids": [905, 359], "min_tokens": 2}
    reply = client.completions.create(model=MODEL, prompt=HELLO_WORLD, extra_body=fields)
    assert reply.choices[0].text == "Hello world! How"


def test_a_streamed_answer_stops_at_the_stop_token(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL, prompt=HELLO_WORLD, stream=True, extra_body={"stop_token_ids": [1073]}
    )
    chunks = list(stream)
    assert "".join(chunk.choices[0].text for chunk in chunks) == "Hello world!"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_ignore_eos_does_not_ignore_stop_token_ids(client: openai.OpenAI) -> None:
    fields = {"stop_token_ids": [17], "ignore_eos": True}
    reply = client.completions.create(model=MODEL, prompt=HELLO_WORLD, extra_body=fields)
    assert reply.choices[0].text == "Hello world"


def test_include_stop_str_in_output_shows_the_stop_string(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt=HELLO_WORLD, stop=["How"], extra_body={"include_stop_str_in_output": True}
    )
    assert reply.choices[0].text == "Hello world! How"
    assert reply.choices[0].finish_reason == "stop"


def test_an_answer_whose_end_is_its_max_tokens_th_token_is_stop_not_length(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt=HELLO_WORLD, max_tokens=len(HELLO_WORLD))
    assert reply.choices[0].finish_reason == "stop"
    cut = client.completions.create(model=MODEL, prompt=HELLO_WORLD, max_tokens=len(HELLO_WORLD) - 1)
    assert cut.choices[0].finish_reason == "length"


def test_a_text_engine_refuses_stop_token_ids_naming_the_field(echo_full_server: Server) -> None:
    plain = openai.OpenAI(base_url=echo_full_server.api_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no token ids") as raised:
        plain.completions.create(model="echo", prompt="hi", extra_body={"stop_token_ids": [2]})
    assert raised.value.body["param"] == "stop_token_ids"  # type: ignore[index]


def test_include_stop_str_in_output_works_on_a_text_engine(echo_full_server: Server) -> None:
    plain = openai.OpenAI(base_url=echo_full_server.api_url, api_key="unused", max_retries=0)
    reply = plain.completions.create(
        model="echo", prompt="one two three", stop=["two"], extra_body={"include_stop_str_in_output": True}
    )
    assert reply.choices[0].text == "one two"


def test_an_engine_without_logit_bias_refuses_it_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="does not apply logit_bias") as raised:
        client.completions.create(model=MODEL, prompt=HELLO_WORLD, logit_bias={"17": -100})
    assert raised.value.body["param"] == "logit_bias"  # type: ignore[index]
