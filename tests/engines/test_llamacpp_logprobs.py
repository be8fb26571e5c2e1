"""Log probabilities from llama.cpp through the official openai client: chat and completions, whole
and streamed, each token's own and its likeliest alternatives."""

import math
from typing import Any

import openai
import pytest

from tests.servers import Server, llama_cpp_available

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed (`make install`)"),
]

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PARIS: Any = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(llamacpp_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=llamacpp_server.api_url, api_key="unused", max_retries=0)


def test_chat_logprobs_cover_every_token_with_its_top_alternatives(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert reply.usage is not None and len(entries) == reply.usage.completion_tokens == 8
    assert "".join(entry.token for entry in entries) == choice.message.content
    for entry in entries:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and sum(math.exp(v) for v in values) <= 1.0001
        # Greedy decoding picks the likeliest token: it is the first alternative, with its logprob.
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)


def test_chat_logprobs_without_top_logprobs_have_no_alternatives(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=3, logprobs=True)
    assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.content is not None
    assert [entry.top_logprobs for entry in reply.choices[0].logprobs.content] == [[], [], []]


def test_streamed_chat_logprobs_match_the_unary_ones(client: openai.OpenAI) -> None:
    fields: Any = {"model": MODEL, "messages": PARIS, "temperature": 0, "max_tokens": 8, "logprobs": True}
    unary = client.chat.completions.create(**fields, top_logprobs=2)
    stream = client.chat.completions.create(**fields, top_logprobs=2, stream=True)
    streamed = [
        (entry.token, round(entry.logprob, 5))
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content
        for entry in chunk.choices[0].logprobs.content
    ]
    assert unary.choices[0].logprobs is not None and unary.choices[0].logprobs.content is not None
    assert streamed == [(entry.token, round(entry.logprob, 5)) for entry in unary.choices[0].logprobs.content]


def test_completion_logprobs_have_offsets_into_the_text(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5, logprobs=2
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
    assert logprobs.text_offset is not None
    text = reply.choices[0].text
    assert "".join(logprobs.tokens) == text
    pairs = zip(logprobs.text_offset, logprobs.tokens, strict=True)
    assert [text[offset : offset + len(token)] for offset, token in pairs] == logprobs.tokens
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


def test_streamed_completion_logprobs_arrive_with_their_text(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5, logprobs=0, stream=True
    )
    offsets, tokens, text = [], [], ""
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens or []
            offsets += choice.logprobs.text_offset or []
    assert "".join(tokens) == text and len(tokens) == 5
    assert offsets == [sum(len(token) for token in tokens[:i]) for i in range(5)]


@pytest.mark.parametrize(
    ("fields", "param", "contains"),
    [
        ({"logprobs": True}, "logprobs", "number in completions"),
        ({"logprobs": 21}, "logprobs", "at most 20"),
        ({"logprobs": 1, "top_logprobs": 1}, "top_logprobs", "not top_logprobs"),
    ],
)
def test_malformed_completion_logprobs_are_a_bad_request(
    client: openai.OpenAI, fields: dict[str, Any], param: str, contains: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=contains) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body=fields)
    assert caught.value.param == param


def test_best_of_returns_the_likeliest_candidates_and_counts_them_all(client: openai.OpenAI) -> None:
    # The candidates of best_of=3 are the three choices of n=3 with the same seed (the j-th seeded seed + j).
    fields: Any = {"prompt": "Once upon a time", "temperature": 1.0, "seed": 7, "max_tokens": 6, "logprobs": 0}
    every = client.completions.create(model=MODEL, n=3, **fields)
    best = client.completions.create(model=MODEL, n=2, best_of=3, **fields)

    def score(choice: Any) -> float:
        return sum(choice.logprobs.token_logprobs)

    ranked = sorted(every.choices, key=score, reverse=True)[:2]
    assert [(choice.index, choice.text) for choice in best.choices] == [(0, ranked[0].text), (1, ranked[1].text)]
    assert best.usage is not None and every.usage is not None
    assert best.usage.completion_tokens == every.usage.completion_tokens  # all three candidates are charged
    plain = client.completions.create(model=MODEL, best_of=3, **{**fields, "logprobs": None})
    assert plain.choices[0].text == ranked[0].text and plain.choices[0].logprobs is None
