"""vLLM's guided decoding on llama.cpp, through `flotilla run` and the official openai client (``extra_body``):
the answer is one of ``guided_choice``, JSON that validates against ``guided_json``, a sentence of
``guided_grammar``; what llama.cpp cannot follow, or a grammar it cannot parse, is a 400 and the server serves on."""

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from tests.servers import Server, llama_cpp_available

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed (`make install`)"),
]

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CHOICES = ["yes", "no", "maybe"]
PERSON: Any = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture
def client(llamacpp_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=llamacpp_server.api_url, api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, question: str, max_tokens: int, **extra: Any) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        seed=7,
        extra_body=extra,
    )


def test_a_guided_choice_answer_is_one_of_the_choices(client: openai.OpenAI) -> None:
    questions = ["Is the sky blue?", "Write a poem about the sea.", "What is 2 + 2?"]
    for question in questions:
        reply = ask(client, question, 4, guided_choice=CHOICES)
        assert reply.choices[0].message.content in CHOICES, question
        assert reply.choices[0].finish_reason == "stop"  # the grammar ended the answer with the choice


def test_a_completion_takes_structured_outputs_choice(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL,
        prompt="The colour of grass is",
        max_tokens=4,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert reply.choices[0].text in ("red", "green", "blue")


def test_a_guided_json_answer_validates_against_the_schema(client: openai.OpenAI) -> None:
    reply = ask(client, "Describe a person as JSON.", 40, guided_json=PERSON)
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), PERSON)
    # The schema as JSON text, on completions, as vLLM takes it too.
    completion = client.completions.create(
        model=MODEL, prompt="A person, as JSON:", max_tokens=40, seed=7, extra_body={"guided_json": json.dumps(PERSON)}
    )
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON)


def test_a_guided_grammar_answer_is_a_sentence_of_the_grammar(client: openai.OpenAI) -> None:
    grammar = 'root ::= ("cat" | "dog") " " [0-9] [0-9]?'
    reply = ask(client, "Name a pet and its age.", 6, guided_grammar=grammar)
    assert re.fullmatch(r"(cat|dog) [0-9][0-9]?", reply.choices[0].message.content or "")


@pytest.mark.parametrize(
    ("extra", "param", "contains"),
    [
        ({"guided_regex": "[0-9]+"}, "guided_regex", "use a grammar"),
        ({"guided_json": PERSON, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "cannot follow"),
        ({"guided_grammar": 'root ::= "\\d"'}, None, "cannot parse guided_grammar"),
        ({"guided_grammar": 'answer ::= "x"'}, None, "cannot parse guided_grammar"),  # no root rule
    ],
)
def test_what_llamacpp_cannot_follow_is_a_400_and_it_serves_on(
    client: openai.OpenAI, extra: dict[str, Any], param: str | None, contains: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=contains) as refused:
        ask(client, "Is the sky blue?", 4, **extra)
    assert refused.value.param == param
    assert ask(client, "Is the sky blue?", 4, guided_choice=CHOICES).choices[0].message.content in CHOICES


def test_a_json_schema_whose_pattern_llamacpp_cannot_convert_is_a_400_not_a_crash(client: openai.OpenAI) -> None:
    # llama.cpp's converter turns \d into a grammar that does not parse; the process segfaulted on its first token.
    digits = {"type": "object", "properties": {"pin": {"type": "string", "pattern": "^\\d{4}$"}}}
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "pin", "schema": digits}}
    with pytest.raises(openai.BadRequestError, match="cannot parse the JSON schema's grammar"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "A PIN?"}], max_tokens=8, response_format=response_format
        )
    assert ask(client, "Is the sky blue?", 4, guided_choice=CHOICES).choices[0].message.content in CHOICES
