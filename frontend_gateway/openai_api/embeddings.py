"""``POST /v1/embeddings`` for models whose engine embeds (the card's ``embeddings``: llama.cpp).

The engine is the model's own in one process, or its workers' through the request plane
(models/remote_embeddings.py, behind ``RemoteTokenEngine.embed``).

Text or token ids in, one unit-length vector per input out, as floats or, as the openai client asks by
default, base64 of little-endian float32s. The inputs are a string, a list of strings, a list of token ids
(one input) or a list of token-id lists, as vLLM takes them (LangChain's ``OpenAIEmbeddings`` sends
token-id lists by default); token ids are embedded as given, and must be in the model's vocabulary. Each
input must fit the model's context: a longer one is a 400, never silently cut. ``dimensions`` is refused.
"""

import base64
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from frontend_gateway.errors import ContextLengthExceeded, InvalidRequest, from_engine_error
from frontend_gateway.models.pipeline import ServedModel
from frontend_gateway.openai_api import preprocessor
from runtime.engine import Embedder
from runtime.errors import EngineError
from runtime.models.card import ModelCard
from runtime.protocol import EmbedInput, float32_bytes

__all__ = ["EmbeddingRequest", "count_tokens", "create", "decoder", "embedder_of", "fitting_total", "inputs", "vectors"]

MAX_INPUTS = 2048  # OpenAI's limit on the texts of one request


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    # A string, strings, token ids (one input) or token-id lists: told apart by ``inputs``.
    # (At most MAX_INPUTS inputs, checked there: one list of token ids may be longer.)
    input: str | Annotated[list[str | int | list[int]], Meta(min_length=1)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


decoder = msgspec.json.Decoder(EmbeddingRequest)


def inputs(request: EmbeddingRequest) -> list[str] | list[list[int]]:
    """The inputs to embed: texts, or token-id lists. Raises InvalidRequest for an empty input, a mix of
    shapes or ``dimensions`` (token ids are checked against the vocabulary by ``count_tokens``)."""
    if request.dimensions is not None:
        raise InvalidRequest("dimensions is not supported: the vectors have the model's own size", param="dimensions")
    given = request.input
    items: list[str] | list[list[int]]
    if isinstance(given, str):
        items = [given]
    elif all(type(item) is int for item in given):
        items = [given]  # type: ignore[assignment]  # checked: one input of token ids
    elif all(isinstance(item, str) for item in given) or all(isinstance(item, list) for item in given):
        items = given  # type: ignore[assignment]  # checked: all strings, or all token-id lists
    else:
        raise InvalidRequest(
            "input must be a string, a list of strings, a list of token ids or a list of token-id lists, not a mix",
            param="input",
        )
    if len(items) > MAX_INPUTS:
        raise InvalidRequest(
            f"input holds {len(items)} inputs; at most {MAX_INPUTS} are embedded at once", param="input"
        )
    for index, item in enumerate(items):
        if not item:
            raise InvalidRequest("an input must not be empty", param=_param(request, index))
    return items


def _param(request: EmbeddingRequest, index: int) -> str:
    """How an error names the ``index``-th input: ``input`` when the request holds one."""
    given = request.input
    return "input" if isinstance(given, str) or type(given[0]) is int else f"input[{index}]"


def embedder_of(model: ServedModel) -> tuple[ModelCard, Embedder]:
    """The model's card and its embedding engine; raises InvalidRequest for a model that does not embed."""
    card: ModelCard | None = getattr(model, "card", None)
    engine = getattr(model, "engine", None)
    if card is None or not card.embeddings or not isinstance(engine, Embedder):
        raise InvalidRequest(
            f"model {model.name!r} does not embed (llama.cpp models do, in one process or on workers)", param="model"
        )
    return card, engine


async def count_tokens(card: ModelCard, request: EmbeddingRequest, inputs: list[str] | list[list[int]]) -> int:
    """The prompt tokens of ``inputs`` (what an API key's token limits reserve before they are embedded).
    Raises ContextLengthExceeded, naming the input that does not fit the model's context, and
    InvalidRequest for a token id outside the vocabulary."""
    params = [_param(request, index) for index in range(len(inputs))]
    if isinstance(inputs[0], list):
        counts = []
        for ids, param in zip(inputs, params, strict=True):
            assert isinstance(ids, list)
            preprocessor.check_token_ids(card, ids, param=param)
            counts.append(len(ids))
    else:
        counts = await preprocessor.token_counts(card, inputs, add_special_tokens=True, params=params)
    return fitting_total(card, counts, params)


def fitting_total(card: ModelCard, counts: list[int], params: list[str], what: str = "input") -> int:
    """The sum of ``counts`` (each text's tokens). Raises ContextLengthExceeded naming the ``params`` entry of
    the first text (an ``what``) over the model's context: an embedding is never of a text cut short."""
    for count, param in zip(counts, params, strict=True):
        if count > card.context_length:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {card.context_length} tokens, and this {what} has "
                f"{count}; shorten it",
                param=param,
            )
    return sum(counts)


async def vectors(embedder: Embedder, inputs: list[EmbedInput]) -> tuple[list[list[float]], int]:
    """``embedder``'s vectors of ``inputs`` and the prompt tokens it says they took. Raises the GatewayError
    of the engine's failure (a 503 when no instance can embed now)."""
    try:
        return await embedder.embed(inputs)
    except EngineError as exc:
        raise from_engine_error(exc) from exc


async def create(
    card: ModelCard, embedder: Embedder, request: EmbeddingRequest, inputs: list[str] | list[list[int]]
) -> tuple[bytes, int]:
    """The embeddings response body of ``inputs`` (counted first: ``count_tokens``), and the prompt tokens
    the engine says they took. Raises the GatewayError of the engine's failure (a 503 when no instance can
    embed now)."""
    embedded, tokens = await vectors(embedder, list(inputs))
    data: list[dict[str, Any]] = [
        {"object": "embedding", "index": index, "embedding": _encoded(vector, request.encoding_format)}
        for index, vector in enumerate(embedded)
    ]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return msgspec.json.encode({"object": "list", "data": data, "model": card.name, "usage": usage}), tokens


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(float32_bytes(vector)).decode()
