"""POST /v1/score and /v1/rerank (and vLLM's and Cohere's other paths) on llama.cpp embeddings, in vLLM's
shapes: each score is the cosine of the pair's embeddings as /v1/embeddings gives them, the ranking puts
the document that means what the query means first, and what cannot be scored is a 400 naming the field."""

import math
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
QUERY = "Where do cats like to sleep?"
DOCUMENTS = ["Quarterly revenue grew by 4 percent.", "Cats often nap on warm windowsills.", "The train leaves at six."]


def embedded(server: Server, texts: list[str]) -> list[list[float]]:
    client = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)
    return [item.embedding for item in client.embeddings.create(model=MODEL, input=texts).data]


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_scores_are_the_cosines_of_the_embeddings_paired_as_vllm_pairs_them(llamacpp_server: Server) -> None:
    vectors = embedded(llamacpp_server, [QUERY, *DOCUMENTS])
    answer = httpx.post(
        f"{llamacpp_server.api_url}/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCUMENTS}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["object"], body["model"]) == ("list", MODEL) and body["id"].startswith("score-")
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    for item, vector in zip(body["data"], vectors[1:], strict=True):
        assert item["object"] == "score"
        assert math.isclose(item["score"], cosine(vectors[0], vector), rel_tol=1e-4, abs_tol=1e-5)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 10

    zipped = {"model": MODEL, "text_1": [QUERY, DOCUMENTS[0]], "text_2": [DOCUMENTS[1], DOCUMENTS[2]]}
    pairwise = httpx.post(f"{llamacpp_server.base_url}/score", json=zipped, timeout=60).json()["data"]
    assert math.isclose(pairwise[0]["score"], cosine(vectors[0], vectors[2]), rel_tol=1e-4, abs_tol=1e-5)
    assert math.isclose(pairwise[1]["score"], cosine(vectors[1], vectors[3]), rel_tol=1e-4, abs_tol=1e-5)


def test_rerank_puts_the_document_that_answers_the_query_first(llamacpp_server: Server) -> None:
    body = {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 2}
    answer = httpx.post(f"{llamacpp_server.api_url}/rerank", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert len(results) == 2 and results[0]["index"] == 1
    assert results[0]["document"] == {"text": DOCUMENTS[1]}
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]
    bare = httpx.post(f"{llamacpp_server.base_url}/rerank", json={**body, "return_documents": False}, timeout=60)
    assert "document" not in bare.json()["results"][0]
    # Cohere's v2 path is the same endpoint (a request it refuses before embedding shows it, cheaply).
    refused = httpx.post(f"{llamacpp_server.base_url}/v2/rerank", json={**body, "documents": []}, timeout=60)
    assert refused.status_code == 400 and "documents" in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "fields", "param", "contains"),
    [
        ("score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "same length"),
        ("score", {"text_1": "a", "text_2": []}, None, "text_2"),
        ("rerank", {"query": "q", "documents": ["d", "word " * 3000]}, "documents[1]", "maximum context length"),
        ("score", {"text_1": "word " * 3000, "text_2": "d"}, "text_1", "maximum context length"),
        ("rerank", {"query": "q", "documents": ["d"], "top_n": -1}, None, "top_n"),
        ("rerank", {"query": "q", "documents": ["d"], "guided_json": {}}, None, "guided_json"),
    ],
)
def test_what_cannot_be_scored_is_a_400_naming_the_field(
    llamacpp_server: Server, path: str, fields: dict[str, Any], param: str | None, contains: str
) -> None:
    answer = httpx.post(f"{llamacpp_server.api_url}/{path}", json={"model": MODEL, **fields}, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert contains in error["message"]
    if param is not None:
        assert error["param"] == param


def test_a_model_that_does_not_embed_cannot_score(echo_full_server: Server) -> None:
    answer = httpx.post(f"{echo_full_server.api_url}/rerank", json={"model": "echo", "query": "q", "documents": ["d"]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "model"
