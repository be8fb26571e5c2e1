"""A chat answer with ``n`` > 1 choices: each choice its own generation, served as a completion batch is
(completion_batch.py), shaped as chat messages and deltas.

Each choice goes through its own parsers (reasoning, tool calls) and numbers its own tool calls; a stream
announces each choice's role in its first chunk, as vLLM does, and ends it with its finish reason.
"""

from collections.abc import Sequence
from typing import Any

import msgspec

from frontend_gateway.models.pipeline import Generation, ServedModel
from frontend_gateway.openai_api import encoding
from frontend_gateway.openai_api.chat_output import Delta
from frontend_gateway.openai_api.completion_batch import Batch, choice_seed
from frontend_gateway.openai_api.images import LoadedImage
from frontend_gateway.openai_api.logprobs import chat_logprobs
from frontend_gateway.openai_api.types import ChatCompletionRequest

__all__ = ["ChatChoices", "prepare"]


class ChatChoices:
    """The choices of a chat answer (``completion_batch.ChoiceShape``)."""

    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"
    whole_object = "chat.completion"

    def __init__(self, generations: list[Generation]) -> None:
        self._generations = generations
        self._announced = [False] * len(generations)  # whether the choice's role was sent

    def piece(self, index: int, text: str) -> list[dict[str, Any]]:
        parser = self._generations[index].output
        delta = parser.feed(text) if parser is not None else Delta(content=text)
        choice = self._delta(index, delta, None)
        return [choice] if choice is not None else []

    def end(self, index: int) -> list[dict[str, Any]]:
        """The rest the parsers held back, and the finish; raises ToolCallMissing when the choice lacks the
        call that tool_choice asked for."""
        generation = self._generations[index]
        parser = generation.output
        reason: str | None = generation.finish_reason
        choices = []
        if parser is not None:
            if (held := self._delta(index, parser.flush(), None)) is not None:
                choices.append(held)
            parser.check_required(reason)
            reason = parser.finish_reason(reason)
        finish = self._delta(index, Delta(), encoding.openai_finish_reason(reason), always=True)
        assert finish is not None
        return [*choices, finish]

    def whole(self, index: int, text: str) -> dict[str, Any]:
        generation = self._generations[index]
        parser = generation.output
        reason: str | None = generation.finish_reason
        message = None
        if parser is not None:
            parsed = parser.feed(text).extend(parser.flush())
            parser.check_required(reason)
            reasoning = parsed.reasoning if parser.has_reasoning else None
            message = encoding.chat_message(parsed.content, reasoning=reasoning, tool_calls=parser.calls)
            reason = parser.finish_reason(reason)
        entries = generation.take_logprobs()
        return {
            "index": index,
            "message": message or {"role": "assistant", "content": text},
            "logprobs": chat_logprobs(entries) if generation.logprobs is not None else None,
            "finish_reason": encoding.openai_finish_reason(reason),
        }

    def _delta(
        self, index: int, delta: Delta, finish_reason: str | None, *, always: bool = False
    ) -> dict[str, Any] | None:
        generation = self._generations[index]
        entries = generation.take_logprobs()
        if not delta and not entries and not always:
            return None  # held back: part of a tag, or a call not yet complete
        body: dict[str, Any] = {}
        if not self._announced[index]:
            self._announced[index] = True
            body["role"] = "assistant"
        if delta.reasoning:
            body["reasoning_content"] = delta.reasoning
        if delta.content:
            body["content"] = delta.content
        if delta.tool_calls:
            body["tool_calls"] = [piece.as_openai() for piece in delta.tool_calls]
        logprobs = chat_logprobs(entries) if generation.logprobs is not None else None
        return {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish_reason}


async def prepare(
    model: ServedModel, request: ChatCompletionRequest, disagg: str | None, images: Sequence[LoadedImage] = ()
) -> Batch:
    """The ``n`` generations of a chat request, the j-th seeded ``seed + j`` (as vLLM seeds them); ``disagg``
    is the client's x-flotilla-disagg; ``images``: its image parts, loaded. Raises what preparing the request
    raises."""
    generations: list[Generation] = []
    try:
        for number in range(request.n or 1):
            one = msgspec.structs.replace(request, n=1, seed=choice_seed(request.seed, number))
            generation = await model.prepare_chat(one, images)
            generation.context.disagg = disagg
            generations.append(generation)
    except BaseException:
        for generation in generations:  # not started: closing them only settles their cleanup
            await generation.aclose()
        raise
    return Batch(generations, ChatChoices(generations))
