"""``POST /v1/embeddings`` for models whose engine embeds (the card's ``embeddings``: llama.cpp).

The engine is the model's own in one process, or its workers' through the request plane
(models/remote_embeddings.py, behind ``RemoteTokenEngine.embed``).

Text in (a string or a list of strings), one unit-length vector per text out, as floats or, as the
openai client asks by default, base64 of little-endian float32s. Each text must fit the model's
context: a longer one is a 400, never silently cut. Token-id inputs and ``dimensions`` are refused.
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
from runtime.protocol import float32_bytes

__all__ = ["EmbeddingRequest", "count_tokens", "create", "decoder", "embedder_of", "texts"]

MAX_INPUTS = 2048  # OpenAI's limit on the texts of one request


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    # Strings, or token ids (accepted by the type only to be refused with a clear message).
    input: str | Annotated[list[str | int | list[int]], Meta(min_length=1, max_length=MAX_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


decoder = msgspec.json.Decoder(EmbeddingRequest)


def texts(request: EmbeddingRequest) -> list[str]:
    """The texts to embed. Raises InvalidRequest for token ids, empty texts or ``dimensions``."""
    if request.dimensions is not None:
        raise InvalidRequest("dimensions is not supported: the vectors have the model's own size", param="dimensions")
    items = [request.input] if isinstance(request.input, str) else request.input
    result = []
    for index, item in enumerate(items):
        if not isinstance(item, str):
            raise InvalidRequest("input must be text (a string or a list of strings), not token ids", param="input")
        if not item:
            raise InvalidRequest(
                "an input text must not be empty",
                param="input" if isinstance(request.input, str) else f"input[{index}]",
            )
        result.append(item)
    return result


def embedder_of(model: ServedModel) -> tuple[ModelCard, Embedder]:
    """The model's card and its embedding engine; raises InvalidRequest for a model that does not embed."""
    card: ModelCard | None = getattr(model, "card", None)
    engine = getattr(model, "engine", None)
    if card is None or not card.embeddings or not isinstance(engine, Embedder):
        raise InvalidRequest(
            f"model {model.name!r} does not embed (llama.cpp models do, in one process or on workers)", param="model"
        )
    return card, engine


async def count_tokens(card: ModelCard, request: EmbeddingRequest, inputs: list[str]) -> int:
    """The prompt tokens of ``inputs`` (what an API key's token limits reserve before they are embedded).
    Raises ContextLengthExceeded, naming the input that does not fit the model's context."""
    params = ["input"] if isinstance(request.input, str) else [f"input[{index}]" for index in range(len(inputs))]
    counts = await preprocessor.token_counts(card, inputs, add_special_tokens=True, params=params)
    for count, param in zip(counts, params, strict=True):
        if count > card.context_length:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {card.context_length} tokens, and this input has "
                f"{count}; shorten it",
                param=param,
            )
    return sum(counts)


async def create(
    card: ModelCard, embedder: Embedder, request: EmbeddingRequest, inputs: list[str]
) -> tuple[bytes, int]:
    """The embeddings response body of ``inputs`` (counted first: ``count_tokens``), and the prompt tokens
    the engine says they took. Raises the GatewayError of the engine's failure (a 503 when no instance can
    embed now)."""
    try:
        vectors, tokens = await embedder.embed(inputs)
    except EngineError as exc:
        raise from_engine_error(exc) from exc
    data: list[dict[str, Any]] = [
        {"object": "embedding", "index": index, "embedding": _encoded(vector, request.encoding_format)}
        for index, vector in enumerate(vectors)
    ]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return msgspec.json.encode({"object": "list", "data": data, "model": card.name, "usage": usage}), tokens


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(float32_bytes(vector)).decode()
