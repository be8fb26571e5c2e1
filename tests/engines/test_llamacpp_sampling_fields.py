"""Per-request sampling fields on llama.cpp through the openai client: seed (and logit_bias)."""

import openai
import pytest

from tests.servers import Server, llama_cpp_available

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed (`make install`)"),
]

MODEL = "SmolLM2-135M-Instruct.Q4_1"
STORY = [{"role": "user", "content": "Tell me a short story about a cat."}]


@pytest.fixture(scope="module")
def client(llamacpp_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=llamacpp_server.api_url, api_key="unused", max_retries=0)


def sample(client: openai.OpenAI, seed: int) -> str | None:
    reply = client.chat.completions.create(model=MODEL, messages=STORY, temperature=1.0, seed=seed, max_tokens=16)
    return reply.choices[0].message.content


def test_the_same_seed_and_prompt_give_the_same_text_at_temperature_one(client: openai.OpenAI) -> None:
    assert sample(client, 1234) == sample(client, 1234)


def test_other_seeds_draw_other_texts(client: openai.OpenAI) -> None:
    assert len({sample(client, seed) for seed in (1, 2, 3)}) > 1


def test_n_seeded_choices_differ_from_each_other_and_repeat_with_the_seed(client: openai.OpenAI) -> None:
    def choices() -> list[str]:
        reply = client.completions.create(
            model=MODEL, prompt="Once upon a time", n=3, temperature=1.0, seed=42, max_tokens=16
        )
        return [choice.text for choice in reply.choices]

    first = choices()
    assert len(set(first)) > 1  # the j-th choice is seeded seed + j, as in vLLM
    assert choices() == first


def test_n_seeded_chat_choices_differ_and_repeat_with_the_seed(client: openai.OpenAI) -> None:
    def choices() -> list[str | None]:
        reply = client.chat.completions.create(
            model=MODEL, messages=STORY, n=3, temperature=1.0, seed=42, max_tokens=16
        )
        return [choice.message.content for choice in reply.choices]

    first = choices()
    assert len(set(first)) > 1
    assert choices() == first


HELLO = 19556  # SmolLM2's token "Hello"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def greedy(client: openai.OpenAI, bias: dict[str, int] | None = None) -> str | None:
    reply = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0.0, max_tokens=3, logit_bias=bias)
    return reply.choices[0].message.content


def test_a_logit_bias_of_100_all_but_forces_its_token(client: openai.OpenAI) -> None:
    assert greedy(client, {str(HELLO): 100}) == "HelloHelloHello"


def test_a_logit_bias_of_minus_100_bans_the_token_the_model_would_choose(client: openai.OpenAI) -> None:
    first = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0.0, max_tokens=1)
    token = client.post(
        "/tokenize", body={"model": MODEL, "prompt": first.choices[0].text, "add_special_tokens": False}, cast_to=object
    )
    (banned,) = token["tokens"]  # type: ignore[index]
    again = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0.0, max_tokens=1, logit_bias={str(banned): -100}
    )
    assert again.choices[0].text != first.choices[0].text


def test_a_logit_bias_key_that_is_not_a_token_id_is_refused_naming_the_field(client: openai.OpenAI) -> None:
    for key in ("hello", "99999999"):
        with pytest.raises(openai.BadRequestError, match="token ids of the vocabulary") as raised:
            greedy(client, {key: 1})
        assert raised.value.body["param"] == "logit_bias"  # type: ignore[index]
