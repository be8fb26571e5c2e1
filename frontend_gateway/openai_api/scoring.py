"""``POST /v1/score`` (vLLM's shape) and ``POST /v1/rerank`` (Jina's and Cohere's, as vLLM serves it), for models
whose engine embeds: a pair's score is the cosine similarity of its texts' embeddings, as vLLM scores with an
embedding model (the vectors are unit-length, so it is their dot product)::

    {"model": "m", "text_1": "q", "text_2": ["a", "b"]}       -> {"object": "list", "data": [{"index": 0,
                                                                  "object": "score", "score": 0.71}, ...]}
    {"model": "m", "query": "q", "documents": ["a", "b"],      -> {"results": [{"index": 1, "relevance_score":
     "top_n": 1}                                                   0.83, "document": {"text": "b"}}], ...}

``text_1`` and ``text_2`` pair up as vLLM's do: one with one, one with each of a list, or two lists of the
same length item by item. Rerank results come best first, ``top_n`` of them (all when 0 or absent), each
with its document unless ``return_documents`` is false. Every text is embedded once; what the texts cost
in tokens is charged to the key as an embeddings request's inputs are (counted, and reserved, first).
Cross-encoder rerankers (a model that scores a pair in one pass) are not served: a model that does not
embed is a 400 naming ``model``.
"""

import time
import uuid
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from frontend_gateway.errors import InvalidRequest
from frontend_gateway.models.pipeline import ServedModel
from frontend_gateway.openai_api import preprocessor
from frontend_gateway.openai_api.embeddings import embedder_of, fitting_total, vectors
from runtime.engine import Embedder
from runtime.models.card import ModelCard

__all__ = ["RerankRequest", "ScoreRequest", "Scoring", "pairs", "rerank_decoder", "score_decoder"]

#: The most texts one request may embed (what an embeddings request may send).
MAX_TEXTS = 2048

Texts = Annotated[list[str], Meta(min_length=1, max_length=MAX_TEXTS)]


class ScoreRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    text_1: str | Texts
    text_2: str | Texts
    user: str | None = None


class RerankRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    query: str
    documents: Texts
    top_n: Annotated[int, Meta(ge=0)] | None = None
    return_documents: bool = True
    user: str | None = None


score_decoder = msgspec.json.Decoder(ScoreRequest)
rerank_decoder = msgspec.json.Decoder(RerankRequest)


def pairs(request: ScoreRequest) -> tuple[list[str], list[tuple[int, int]]]:
    """The distinct texts to embed, and each scored pair as indexes into them. Raises InvalidRequest."""
    first = [request.text_1] if isinstance(request.text_1, str) else request.text_1
    second = [request.text_2] if isinstance(request.text_2, str) else request.text_2
    if len(first) == 1:
        matched = [(0, len(first) + index) for index in range(len(second))]
    elif len(first) == len(second):
        matched = [(index, len(first) + index) for index in range(len(first))]
    else:
        raise InvalidRequest(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1 for all of text_2, or two "
            "lists of the same length",
            param="text_2",
        )
    texts = [*first, *second]
    if len(texts) > MAX_TEXTS:
        raise InvalidRequest(f"at most {MAX_TEXTS} texts in all", param="text_2")
    return texts, matched


class Scoring:
    """One score or rerank request on ``model``: its texts' tokens counted (``count_tokens``), then the
    answer (``run``). Raises InvalidRequest for a model that does not embed or texts that do not pair."""

    def __init__(self, model: ServedModel, request: "ScoreRequest | RerankRequest") -> None:
        self.card, self.embedder = embedder_of(model)
        self.request = request
        if isinstance(request, ScoreRequest):
            self.texts = pairs(request)[0]
            self.params = [*_params("text_1", request.text_1), *_params("text_2", request.text_2)]
        else:
            self.texts = [request.query, *request.documents]
            self.params = ["query", *_params("documents", request.documents)]

    async def count_tokens(self) -> int:
        return await _count_tokens(self.card, self.texts, self.params)

    async def run(self) -> tuple[bytes, int]:
        """The response body, and the prompt tokens the engine says the texts took."""
        if isinstance(self.request, ScoreRequest):
            return await _score(self.card, self.embedder, self.request)
        return await _rerank(self.card, self.embedder, self.request)


def _params(field: str, texts: str | list[str]) -> list[str]:
    """How an error names each of ``texts``, the value of request field ``field``."""
    return [field] if isinstance(texts, str) else [f"{field}[{index}]" for index in range(len(texts))]


async def _count_tokens(card: ModelCard, texts: list[str], params: list[str]) -> int:
    """The prompt tokens of ``texts`` (reserved against a key's limits before they are embedded). Raises
    ContextLengthExceeded naming the ``params`` entry of a text that does not fit the model's context."""
    counts = await preprocessor.token_counts(card, texts, add_special_tokens=True, params=params)
    return fitting_total(card, counts, params, what="text")


def _cosine(first: list[float], second: list[float]) -> float:
    return sum(a * b for a, b in zip(first, second, strict=True))


async def _score(card: ModelCard, embedder: Embedder, request: ScoreRequest) -> tuple[bytes, int]:
    """vLLM's score response for ``request``, and the prompt tokens the engine says its texts took."""
    texts, matched = pairs(request)
    embedded, tokens = await vectors(embedder, list(texts))
    data = [
        {"index": index, "object": "score", "score": _cosine(embedded[left], embedded[right])}
        for index, (left, right) in enumerate(matched)
    ]
    body: dict[str, Any] = {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": card.name,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return msgspec.json.encode(body), tokens


async def _rerank(card: ModelCard, embedder: Embedder, request: RerankRequest) -> tuple[bytes, int]:
    """The rerank response (Jina's and Cohere's shape, as vLLM's) for ``request``, and its prompt tokens."""
    embedded, tokens = await vectors(embedder, [request.query, *request.documents])
    query = embedded[0]
    scored = sorted(
        ((_cosine(query, vector), index) for index, vector in enumerate(embedded[1:])), key=lambda item: -item[0]
    )
    if request.top_n:
        scored = scored[: request.top_n]
    results = []
    for relevance, index in scored:
        result: dict[str, Any] = {"index": index, "relevance_score": relevance}
        if request.return_documents:
            result["document"] = {"text": request.documents[index]}
        results.append(result)
    body = {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": card.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }
    return msgspec.json.encode(body), tokens
