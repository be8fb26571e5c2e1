"""POST /v1/embeddings on llama.cpp through the official openai client: unit-length vectors of the
model's size, texts that mean alike closer than texts that do not; refused where it cannot be served."""

import math
from typing import Any

import openai
import pytest

from runtime.models.loading import load_model_card
from tests.servers import Server, llama_cpp_available, smollm2_path

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed (`make install`)"),
]

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture
def client(llamacpp_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=llamacpp_server.api_url, api_key="unused", max_retries=0)


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))  # the vectors are unit length


def test_a_text_is_embedded_as_a_unit_vector_of_the_models_size(client: openai.OpenAI) -> None:
    reply = client.embeddings.create(model=MODEL, input="The capital of France is Paris.")
    [item] = reply.data
    assert (item.object, item.index, len(item.embedding)) == ("embedding", 0, 576)  # SmolLM2's hidden size
    assert math.isclose(math.sqrt(sum(x * x for x in item.embedding)), 1.0, rel_tol=1e-4)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > 5
    assert reply.model == MODEL


def test_texts_that_mean_alike_are_closer(client: openai.OpenAI) -> None:
    texts = ["The cat sat on the mat.", "A cat was sitting on the rug.", "Quarterly revenue grew by 4 percent."]
    vectors = [item.embedding for item in client.embeddings.create(model=MODEL, input=texts).data]
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])


def test_float_and_base64_encodings_carry_the_same_vector(client: openai.OpenAI) -> None:
    # The client asks for base64 by default and decodes it; float is asked explicitly.
    default = client.embeddings.create(model=MODEL, input="hello").data[0].embedding
    floats = client.embeddings.create(model=MODEL, input="hello", encoding_format="float").data[0].embedding
    assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(default, floats, strict=True))


def test_token_ids_are_embedded_as_the_text_they_stand_for(client: openai.OpenAI, llamacpp_server: Server) -> None:
    texts = ["The cat sat on the mat.", "Quarterly revenue grew by 4 percent."]
    card = load_model_card(smollm2_path())
    ids = [card.tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
    by_text = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    for text_item, ids_item in zip(by_text.data, by_ids.data, strict=True):
        assert text_item.index == ids_item.index
        assert all(
            math.isclose(a, b, abs_tol=1e-6) for a, b in zip(text_item.embedding, ids_item.embedding, strict=True)
        )
    assert by_ids.usage.prompt_tokens == sum(map(len, ids)) == by_text.usage.prompt_tokens
    # One list of token ids is one input, as in vLLM and OpenAI.
    [single] = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float").data
    assert all(
        math.isclose(a, b, abs_tol=1e-6) for a, b in zip(single.embedding, by_text.data[0].embedding, strict=True)
    )


@pytest.mark.parametrize(
    ("fields", "param", "contains"),
    [
        ({"input": ""}, "input", "must not be empty"),
        ({"input": ["fine", ""]}, "input[1]", "must not be empty"),
        ({"input": [[1, 2], []]}, "input[1]", "must not be empty"),
        ({"input": [[1, 2], [3, 49_152]]}, "input[1]", "token id 49152 is outside the vocabulary"),
        ({"input": [5, -1]}, "input", "token id -1 is outside the vocabulary"),
        ({"input": [1] * 3000}, "input", "maximum context length"),
        ({"input": ["x"] * 2049}, "input", "at most 2048"),
        ({"input": ["text", [1, 2]]}, "input", "not a mix"),
        ({"input": [1, [2]]}, "input", "not a mix"),
        ({"input": "hi", "dimensions": 64}, "dimensions", "dimensions"),
        ({"input": "word " * 3000}, "input", "maximum context length"),
    ],
)
def test_what_cannot_be_embedded_is_a_bad_request(
    client: openai.OpenAI, fields: dict[str, Any], param: str, contains: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=contains) as caught:
        client.embeddings.create(model=MODEL, **fields)
    assert caught.value.param == param


def test_a_model_that_does_not_embed_refuses(echo_full_server: Server) -> None:
    plain = openai.OpenAI(base_url=echo_full_server.api_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="does not embed") as caught:
        plain.embeddings.create(model="echo", input="hi")
    assert caught.value.param == "model"
