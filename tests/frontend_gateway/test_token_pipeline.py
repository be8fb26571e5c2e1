"""The token pipeline: what reaches the engine, and what the client gets back from its tokens."""

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import pytest

from frontend_gateway.errors import ContextLengthExceeded, EngineFailed
from frontend_gateway.models.pipeline import Generation, TokenModel
from frontend_gateway.openai_api.types import ChatCompletionRequest, ChatMessage, CompletionRequest, NvExt
from runtime.engine import RequestContext
from runtime.errors import EngineError
from runtime.models.card import ModelCard
from runtime.models.loading import load_model_card
from runtime.protocol import EngineOutput, PreprocessedRequest


class ScriptedEngine:
    """A token engine that records its requests and answers with the token ids it is given."""

    kind: Literal["token"] = "token"
    skip_special_tokens = True

    def __init__(self, answer: list[int], *, fail_after: int | None = None) -> None:
        self.answer = answer
        self.fail_after = fail_after
        self.requests: list[PreprocessedRequest] = []
        self.contexts: list[RequestContext] = []

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        self.requests.append(request)
        self.contexts.append(context)
        for index, token in enumerate(self.answer):
            if self.fail_after is not None and index == self.fail_after:
                raise EngineError("the scripted engine broke")
            yield EngineOutput([token])
        yield EngineOutput([], "stop")


@pytest.fixture(scope="module")
def card(smollm2: Path) -> ModelCard:
    return load_model_card(smollm2)


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[ChatMessage(role="user", content="hi")], **fields)  # type: ignore[arg-type]


async def run(generation: Generation) -> list[str]:
    return [piece async for piece in generation.pieces()]


async def test_pieces_never_contain_broken_utf8(card: ModelCard) -> None:
    text = "héllo 🌍 中文 👩‍👩‍👧 ok"
    engine = ScriptedEngine(card.tokenizer.encode(text, add_special_tokens=False).ids)
    pieces = await run(await TokenModel(card, engine).prepare_chat(chat()))
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert len(pieces) > 5


async def test_sampling_and_stop_conditions_reach_the_engine(card: ModelCard) -> None:
    engine = ScriptedEngine([])
    request = chat(
        temperature=0.3,
        top_p=0.9,
        top_k=20,
        min_p=0.1,
        seed=11,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.2,
        max_tokens=7,
        min_tokens=2,
        nvext=NvExt(ignore_eos=True),
    )
    await run(await TokenModel(card, engine).prepare_chat(request))
    sent = engine.requests[0]
    sampling = sent.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, sampling.seed) == (
        0.3,
        0.9,
        20,
        0.1,
        11,
    )
    assert (sampling.frequency_penalty, sampling.presence_penalty, sampling.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (sent.stop_conditions.max_tokens, sent.stop_conditions.min_tokens) == (7, 2)
    assert sent.stop_conditions.ignore_eos is True
    assert 2 in sent.eos_token_ids
    assert sent.token_ids == card.tokenizer.encode(card.template.render([{"role": "user", "content": "hi"}])).ids  # type: ignore[union-attr]


async def test_max_tokens_defaults_to_the_room_left_in_the_context(card: ModelCard) -> None:
    engine = ScriptedEngine([])
    generation = await TokenModel(card, engine).prepare_chat(chat())
    await run(generation)
    assert engine.requests[0].stop_conditions.max_tokens == card.context_length - generation.prompt_tokens


async def test_an_engine_that_overruns_max_tokens_is_cut_with_length(card: ModelCard) -> None:
    engine = ScriptedEngine(card.tokenizer.encode("one two three four five six").ids)
    generation = await TokenModel(card, engine).prepare_chat(chat(max_tokens=3))
    assert "".join(await run(generation)) == "one two three"
    assert (generation.completion_tokens, generation.finish_reason) == (3, "length")
    assert engine.contexts[0].stopped


async def test_a_stop_string_spanning_tokens_stops_the_engine(card: ModelCard) -> None:
    engine = ScriptedEngine(card.tokenizer.encode("Paris is lovely. The end.").ids)
    generation = await TokenModel(card, engine).prepare_chat(chat(stop=["ly. The"]))
    assert "".join(await run(generation)) == "Paris is love"
    assert generation.finish_reason == "stop"
    assert engine.contexts[0].stopped


async def test_token_id_prompts_are_passed_through_unchanged(card: ModelCard) -> None:
    engine = ScriptedEngine([])
    await run(await TokenModel(card, engine).prepare_completion(CompletionRequest(model="m", prompt=[5, 6, 7])))
    assert engine.requests[0].token_ids == [5, 6, 7]


async def test_an_engine_failure_becomes_engine_failed(card: ModelCard) -> None:
    engine = ScriptedEngine(card.tokenizer.encode("a b c").ids, fail_after=1)
    with pytest.raises(EngineFailed, match="scripted engine broke"):
        await run(await TokenModel(card, engine).prepare_chat(chat()))


async def test_a_long_prompt_is_tokenized_off_the_loop_to_the_same_ids(card: ModelCard) -> None:
    text = "hello world " * 1700  # ~20 k characters: past the inline limit, well within the context
    engine = ScriptedEngine([])
    generation = await TokenModel(card, engine).prepare_completion(CompletionRequest(model="m", prompt=text))
    await run(generation)
    assert engine.requests[0].token_ids == card.tokenizer.encode(text).ids
    assert generation.prompt_tokens > 3000


async def test_a_prompt_that_cannot_fit_whatever_its_tokens_is_refused_before_tokenizing(card: ModelCard) -> None:
    text = "x" * (card.context_length * card.max_token_chars + 1)
    with pytest.raises(ContextLengthExceeded, match="cannot fit"):
        await TokenModel(card, ScriptedEngine([])).prepare_completion(CompletionRequest(model="m", prompt=text))


class FrameEngine:
    """A token engine that answers with whole frames of token ids, as a remote engine does."""

    kind: Literal["token"] = "token"
    skip_special_tokens = True

    def __init__(self, frames: list[list[int]]) -> None:
        self.frames = frames

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def generate(self, request: PreprocessedRequest, context: RequestContext) -> AsyncIterator[EngineOutput]:
        for frame in self.frames:
            yield EngineOutput(frame)
        yield EngineOutput([], "stop")


def split_ids(card: ModelCard, text: str, frames: int) -> list[list[int]]:
    ids: list[int] = card.tokenizer.encode(text, add_special_tokens=False).ids
    size = -(-len(ids) // frames)
    return [ids[start : start + size] for start in range(0, len(ids), size)]


async def test_the_tokens_of_one_frame_leave_as_one_piece(card: ModelCard) -> None:
    text = "The capital of France is Paris, é 中文 👍"
    frames = split_ids(card, text, 2)
    generation = await TokenModel(card, FrameEngine(frames)).prepare_chat(chat())
    pieces = await run(generation)
    assert "".join(pieces) == text
    assert len(pieces) == 2
    assert generation.completion_tokens == sum(len(frame) for frame in frames)


async def test_max_tokens_cuts_exactly_inside_a_frame(card: ModelCard) -> None:
    frames = split_ids(card, "one two three four five six", 1)
    generation = await TokenModel(card, FrameEngine(frames)).prepare_chat(chat(max_tokens=3))
    assert "".join(await run(generation)) == card.tokenizer.decode(frames[0][:3])
    assert (generation.completion_tokens, generation.finish_reason) == (3, "length")


async def test_a_stop_string_inside_a_frame_cuts_exactly_there(card: ModelCard) -> None:
    frames = split_ids(card, "alpha beta STOP gamma delta", 2)
    generation = await TokenModel(card, FrameEngine(frames)).prepare_chat(chat(stop=["STOP"]))
    assert "".join(await run(generation)) == "alpha beta "
    assert generation.finish_reason == "stop"
