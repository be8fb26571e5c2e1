"""Log probabilities from llama.cpp through the official openai client: chat and completions, whole
and streamed, each token's own and its likeliest alternatives."""

import math
from operator import itemgetter
from pathlib import Path
from typing import Any

import httpx
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


# --- echo: the prompt's log probabilities, as evaluation harnesses read them -------------------------------

CONTEXT = "The capital of France is"
CONTINUATION = " Paris, a city on the Seine."


@pytest.fixture(scope="module")
def reference(smollm2: Path) -> Any:
    """llama-cpp-python alone on the same GGUF file, keeping every position's logits."""
    import llama_cpp

    # A small context: its logits for every position are kept (a 512-token one made each eval ~1.7 s here).
    return llama_cpp.Llama(model_path=str(smollm2), n_ctx=64, n_batch=64, n_threads=2, logits_all=True, verbose=False)


def own_logprobs(llama: Any, token_ids: list[int]) -> list[float]:
    """Each token's log probability after the ones before it (from the second), from llama-cpp-python's own
    logits of the same tokens: a float64 log-softmax of each position's scores."""
    import numpy as np

    llama.reset()
    llama.eval(token_ids)
    scores = np.asarray(llama.scores[: len(token_ids)], dtype=np.float64)
    peak = scores.max(axis=1, keepdims=True)
    log_softmax = scores - peak - np.log(np.exp(scores - peak).sum(axis=1, keepdims=True))
    return [float(log_softmax[i, token_ids[i + 1]]) for i in range(len(token_ids) - 1)]


def tokens(llama: Any, text: str) -> list[int]:
    return list(llama.tokenize(text.encode(), add_bos=False, special=False))


def test_echoed_prompt_logprobs_equal_llama_cpp_pythons_own(client: openai.OpenAI, reference: Any) -> None:
    ids = tokens(reference, CONTEXT + CONTINUATION)
    reply = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=0, logprobs=1, temperature=0)
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.tokens is not None and logprobs.text_offset is not None
    # The first token has nothing before it: null, as in OpenAI's and vLLM's answers.
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(own_logprobs(reference, ids), abs=1e-4)
    assert choice.text == CONTEXT + CONTINUATION == "".join(logprobs.tokens)
    assert logprobs.text_offset == [sum(len(token) for token in logprobs.tokens[:i]) for i in range(len(ids))]
    assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])
    assert reply.usage is not None and (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 1)


def test_a_streamed_echo_carries_the_prompts_logprobs_then_the_answers(client: openai.OpenAI) -> None:
    fields: Any = {"model": MODEL, "prompt": CONTEXT, "echo": True, "max_tokens": 2, "logprobs": 2, "temperature": 0}
    whole = client.completions.create(**fields)
    stream = client.completions.create(**fields, stream=True)
    text, values = "", []
    for chunk in stream:
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs is not None:
            values += chunk.choices[0].logprobs.token_logprobs or []
    assert whole.choices[0].logprobs is not None and whole.choices[0].text.startswith(CONTEXT)
    assert text == whole.choices[0].text and values == whole.choices[0].logprobs.token_logprobs
    assert whole.usage is not None and len(values) == whole.usage.prompt_tokens + 2


def test_lm_eval_local_completions_loglikelihood_matches_llama_cpp_python(
    llamacpp_server: Server, reference: Any
) -> None:
    """The request lm-evaluation-harness's ``local-completions`` model sends for loglikelihood tasks, and
    how it reads the answer (lm_eval/models/openai_completions.py: ``_create_payload`` with
    ``generate=False``, ``parse_logprobs``): token-id prompts, context + continuation, batched; the
    continuation's log probabilities are ``token_logprobs[ctxlen:-1]``, the last being the generated token's."""
    items = [(CONTEXT, " Paris"), (CONTEXT, " London"), ("Two plus two is", " four")]
    contexts = [tokens(reference, context) for context, _ in items]
    prompts = [ctx + tokens(reference, continuation) for ctx, (_, continuation) in zip(contexts, items, strict=True)]
    payload = {
        "model": MODEL,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    response = httpx.post(f"{llamacpp_server.api_url}/completions", json=payload, timeout=60)
    assert response.status_code == 200, response.text
    results = []
    for choice, ctxlen in zip(
        sorted(response.json()["choices"], key=itemgetter("index")), map(len, contexts), strict=True
    ):
        continuation = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        results.append(
            (sum(continuation), all(value == max(top.values()) for value, top in zip(continuation, tops, strict=True)))
        )
    for (total, _), prompt, ctx in zip(results, prompts, contexts, strict=True):
        assert total == pytest.approx(sum(own_logprobs(reference, prompt)[len(ctx) - 1 :]), abs=1e-4)
    # Paris is the likelier capital, and greedy decoding would have written it.
    assert results[0][0] > results[1][0] and results[0][1] and not results[1][1]
