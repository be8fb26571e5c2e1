"""Counting the tokens of many inputs at once (an embeddings request): the same counts as one at a time, and
the work off the event loop once the inputs together are long, however short each one is."""

import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest

from frontend_gateway.errors import ContextLengthExceeded
from frontend_gateway.openai_api import embeddings, preprocessor
from frontend_gateway.openai_api.embeddings import EmbeddingRequest
from runtime.models.card import ModelCard
from runtime.models.loading import load_model_card


@pytest.fixture
def card(smollm2: Path) -> ModelCard:
    return load_model_card(smollm2).prepare()


class Watched:
    """The card's tokenizer, noting on which thread each call encodes."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.threads: set[str] = set()

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.add(threading.current_thread().name)
        return self._tokenizer.encode(*args, **kwargs)

    def encode_batch(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.add(threading.current_thread().name)
        return self._tokenizer.encode_batch(*args, **kwargs)


class Embedder:
    """Answers a vector per text: the engine is not what is looked at here."""

    async def embed(self, texts: list[str]) -> tuple[list[list[float]], int]:
        return [[1.0, 0.0] for _ in texts], len(texts)


async def test_an_embeddings_request_of_many_short_inputs_is_tokenized_off_the_event_loop(card: ModelCard) -> None:
    # 2,048 lines of a few words: each cheap, all together a second of the loop's time when done in place,
    # during which every stream on this ingress stalls.
    texts = [f"line {number}: the quick brown fox" for number in range(2048)]
    watched = Watched(card.tokenizer)
    card.__dict__["tokenizer"] = watched  # the cached property's value, replaced for this card

    request = EmbeddingRequest(model="m", input=list(texts))
    assert await embeddings.count_tokens(card, request, texts) > len(texts)
    body, _ = await embeddings.create(card, Embedder(), request, texts)

    assert len(msgspec.json.decode(body)["data"]) == len(texts)
    assert watched.threads and threading.main_thread().name not in watched.threads


async def test_the_counts_of_many_inputs_are_those_of_each_alone(card: ModelCard) -> None:
    texts = [f"line {number}: the quick brown fox" for number in range(600)]
    expected = [len(card.tokenizer.encode(text, add_special_tokens=True).ids) for text in texts]
    params = [f"input[{i}]" for i in range(len(texts))]
    assert await preprocessor.token_counts(card, texts, add_special_tokens=True, params=params) == expected


async def test_a_few_short_inputs_are_counted_in_place(card: ModelCard) -> None:
    watched = Watched(card.tokenizer)
    card.__dict__["tokenizer"] = watched
    assert await preprocessor.token_counts(card, ["hi", "there"], add_special_tokens=False, params=["a", "b"]) == [1, 1]
    assert watched.threads == {threading.main_thread().name}  # a thread costs more than this work


async def test_an_input_too_long_to_fit_is_refused_before_any_encoding_naming_it(card: ModelCard) -> None:
    watched = Watched(card.tokenizer)
    card.__dict__["tokenizer"] = watched
    too_long = "x" * (card.context_length * card.max_token_chars + 1)
    with pytest.raises(ContextLengthExceeded) as refused:
        await preprocessor.token_counts(card, ["fine", too_long], add_special_tokens=True, params=["i0", "i1"])
    assert refused.value.param == "i1" and watched.threads == set()
