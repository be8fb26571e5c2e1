"""A batch of completion prompts (``prompt`` as a list of strings or of token-id lists), as vLLM serves it.

LangChain's ``OpenAI.generate``/``batch`` and other clients of the legacy API send several prompts in one
request. Each prompt is its own generation, all of them at once; the answer has one choice per prompt,
its ``index`` the prompt's, and usage summed over them. ``n`` choices per prompt are served the same
way: each prompt ``n`` times, each its own generation (``choices``). Streamed, the chunks of the prompts interleave,
each naming its choice's ``index``, and each choice ends with a chunk carrying its ``finish_reason``.

The batch is one request to everything around it: one admission slot, one reservation of all its prompts'
tokens against an API key's limits, one usage record (``Batch.total``). A prompt that fails fails the
request: a whole answer is then that error, a stream ends with an error event.
"""

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

import msgspec

from frontend_gateway.errors import EngineFailed, GatewayError, InvalidRequest
from frontend_gateway.models.pipeline import Generation, ServedModel
from frontend_gateway.openai_api import encoding
from frontend_gateway.openai_api.best_of import BestOf
from frontend_gateway.openai_api.logprobs import CompletionLogprobs
from frontend_gateway.openai_api.types import CompletionRequest

__all__ = ["Batch", "ChoiceShape", "CompletionChoices", "choice_seed", "choices", "prepare", "prompts"]

log = logging.getLogger(__name__)

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Prompt = str | list[int]

#: The most prompts one request may hold: they all generate at once, on one admission slot.
MAX_PROMPTS = 256

_encode = msgspec.json.encode


def prompts(request: CompletionRequest) -> list[Prompt]:
    """The request's prompts: one for a string or a list of token ids, one per item for a list of strings
    or of token-id lists. Raises InvalidRequest for an empty list, a mix of shapes or too many prompts."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    first = prompt[0]
    if type(first) is int:
        # One prompt of token ids, the hot path: its ids are checked (mixes included) by one min/max in C
        # when it is tokenized (preprocessor.completion_prompt_ids), not by a pass in Python here.
        return [prompt]  # type: ignore[list-item]
    if isinstance(first, str):
        if all(isinstance(item, str) for item in prompt):
            return _bounded(prompt)  # type: ignore[arg-type]  # checked: every item is a string
    elif all(isinstance(item, list) for item in prompt):
        return _bounded(prompt)  # type: ignore[arg-type]  # checked: every item is a list of ints (msgspec)
    raise InvalidRequest(
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists, not a mix",
        param="prompt",
    )


def _bounded(items: list[Prompt]) -> list[Prompt]:
    if len(items) > MAX_PROMPTS:
        raise InvalidRequest(
            f"prompt holds {len(items)} prompts; at most {MAX_PROMPTS} are served in one request: send several",
            param="prompt",
        )
    return items


def choices(request: CompletionRequest) -> list[Prompt]:
    """One prompt per choice of the answer: each of the request's prompts ``n`` times in a row, so that a
    choice's index is ``prompt index * n + j``, as vLLM numbers them. Raises InvalidRequest as ``prompts``
    does, and when there are more than MAX_PROMPTS choices."""
    items = prompts(request)
    n = request.n or 1
    if n == 1:
        return items
    if len(items) * n > MAX_PROMPTS:
        raise InvalidRequest(
            f"{len(items)} prompts with n={n} make {len(items) * n} choices; at most {MAX_PROMPTS} are served "
            "in one request: send several",
            param="n",
        )
    return [prompt for prompt in items for _ in range(n)]


class Batch:
    """The generations of a batch's prompts, in order, and ``total``: the one Generation that stands for
    them all in usage counts, reservations and metrics (its counts are summed by ``respond``)."""

    def __init__(self, generations: list[Generation], shape: "ChoiceShape | None" = None) -> None:
        self.generations = generations
        #: How each choice is shaped: a completion's text, or a chat message (chat_choices.py).
        self.shape = shape if shape is not None else CompletionChoices(generations)
        prompt_tokens = sum(generation.prompt_tokens for generation in generations)
        bound = sum(generation.token_bound for generation in generations)
        self.total = Generation(uuid.uuid4().hex, prompt_tokens, token_bound=bound)
        #: Which of the generations are the answer, when they are best_of candidates (best_of.py).
        self.best_of: BestOf | None = None

    async def respond(
        self,
        *,
        stream: bool,
        include_usage: bool,
        model: str,
        headers: list[tuple[bytes, bytes]],
        send: Send,
        first_piece: Callable[[], None],
    ) -> GatewayError | None:
        """Run every prompt's generation at once and send the answer, whole or streamed (``first_piece`` is
        called when the first text arrives); returns the failure that ended a stream early.

        A prompt that fails before anything was sent raises its error (the client gets its status); one
        that fails after the status line ends the stream with an error event and ``[DONE]``.
        """
        created = int(time.time())
        shape = self.shape
        response_id = shape.id_prefix + self.total.request_id
        obj = shape.chunk_object if stream else shape.whole_object
        head = {"id": response_id, "object": obj, "created": created, "model": model}
        count = len(self.generations)
        texts: list[list[str]] = [[] for _ in range(count)]
        queue: asyncio.Queue[tuple[int, str | BaseException | None]] = asyncio.Queue()
        tasks = [
            asyncio.create_task(_pump(index, generation, queue)) for index, generation in enumerate(self.generations)
        ]
        first = True
        started = False
        try:
            remaining = count
            while remaining:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    self.total.finish_reason = "error"
                    if not started:
                        raise item
                    failure = _mid_stream(item, self.total)
                    frame = encoding.error_frame(failure.message, failure.error_type, failure.code)
                    await send({"type": "http.response.body", "body": frame + encoding.DONE_FRAME})
                    return failure
                if first and item is not None:
                    first = False
                    first_piece()
                if not stream:
                    if item is None:
                        remaining -= 1
                    else:
                        texts[index].append(item)
                    continue
                if not started:
                    await send({"type": "http.response.start", "status": 200, "headers": headers})
                    started = True
                try:
                    if item is None:
                        remaining -= 1
                        choices = shape.end(index)
                    else:
                        choices = shape.piece(index, item)
                except GatewayError as exc:  # ToolCallMissing: the choice lacks the call asked for
                    self.total.finish_reason = "error"
                    failure = _mid_stream(exc, self.total)
                    frame = encoding.error_frame(failure.message, failure.error_type, failure.code)
                    await send({"type": "http.response.body", "body": frame + encoding.DONE_FRAME})
                    return failure
                for choice in choices:
                    await send({"type": "http.response.body", "body": _frame(head, [choice]), "more_body": True})
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.tally()
        total = self.total
        reasoning = [g.reasoning_tokens for g in self.generations if g.reasoning_tokens is not None]
        usage = encoding.usage(
            total.prompt_tokens, total.completion_tokens, total.cached_tokens, sum(reasoning) if reasoning else None
        )
        if stream:
            if not started:  # every prompt answered nothing at all: the status line is still to be sent
                await send({"type": "http.response.start", "status": 200, "headers": headers})
            tail = _frame(head, [], usage) if include_usage else b""
            await send({"type": "http.response.body", "body": tail + encoding.DONE_FRAME})
            return None
        choices = [shape.whole(index, "".join(texts[index])) for index in range(count)]
        if self.best_of is not None:
            choices = self.best_of.pick(choices, self.generations)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": _encode({**head, "choices": choices, "usage": usage})})
        return None

    def tally(self) -> Generation:
        """``total``, its counts summed from the prompts' generations now."""
        total, generations = self.total, self.generations
        total.prompt_tokens = sum(generation.prompt_tokens for generation in generations)  # a text engine's: now
        total.completion_tokens = sum(generation.completion_tokens for generation in generations)
        cached = [generation.cached_tokens for generation in generations if generation.cached_tokens is not None]
        total.cached_tokens = sum(cached) if cached else None
        return total


class ChoiceShape(Protocol):
    """The choices of an answer of several generations, as one kind of answer shapes them."""

    id_prefix: str
    chunk_object: str
    whole_object: str

    def piece(self, index: int, text: str) -> list[dict[str, Any]]:
        """The stream choices (none, when all is held back) for a piece of choice ``index``'s text."""
        ...

    def end(self, index: int) -> list[dict[str, Any]]:
        """The stream choices that end choice ``index``, the last with its finish reason."""
        ...

    def whole(self, index: int, text: str) -> dict[str, Any]:
        """Choice ``index`` of a whole answer, whose text was ``text``."""
        ...


class CompletionChoices:
    """The choices of a completion: text, and log probabilities in the completions' shape.

    With ``echo`` a choice's first piece (or its end, when it has none) starts with the prompt's text and
    its tokens' log probabilities, as vLLM's does; with ``max_tokens: 0`` the generated token is not shown.
    """

    id_prefix = "cmpl-"
    chunk_object = whole_object = "text_completion"

    def __init__(self, generations: list[Generation]) -> None:
        self._generations = generations
        self._logprobs = [CompletionLogprobs() for _ in generations]
        self._echoed = [generation.echo is None for generation in generations]

    def piece(self, index: int, text: str) -> list[dict[str, Any]]:
        if self._generations[index].hidden:
            return []  # the prompt comes alone, with the choice's end
        return [self._choice(index, text, None)]

    def end(self, index: int) -> list[dict[str, Any]]:
        return [self._choice(index, "", encoding.openai_finish_reason(self._generations[index].finish_reason))]

    def whole(self, index: int, text: str) -> dict[str, Any]:
        return self._choice(index, text, encoding.openai_finish_reason(self._generations[index].finish_reason))

    def _choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        generation = self._generations[index]
        entries = generation.take_logprobs()
        if generation.hidden:
            text, entries = "", []
        if not self._echoed[index]:
            self._echoed[index] = True
            text = (generation.echo or "") + text
            entries = (generation.prompt_logprobs or []) + entries
        logprobs = self._logprobs[index].shape(entries) if generation.logprobs is not None else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


async def prepare(model: ServedModel, request: CompletionRequest, batch: list[Prompt], disagg: str | None) -> Batch:
    """The batch's generations, each prompt checked and tokenized as a request of its own; ``disagg`` is the
    client's x-flotilla-disagg. Raises the InvalidRequest of the first prompt that cannot be served,
    naming it (``prompt[i]``)."""
    generations: list[Generation] = []
    n = request.n or 1
    try:
        for index, prompt in enumerate(batch):
            # The choices of one prompt draw differently with one seed, as in vLLM: the j-th is seeded seed + j.
            seed = choice_seed(request.seed, index % n)
            try:
                generation = await model.prepare_completion(
                    msgspec.structs.replace(request, prompt=prompt, n=1, seed=seed)
                )
            except InvalidRequest as exc:
                if exc.param == "prompt" and len(batch) > n:
                    exc.param = f"prompt[{index // n}]"
                raise
            generation.context.disagg = disagg
            generations.append(generation)
    except BaseException:
        for generation in generations:  # not started: closing them only settles their cleanup
            await generation.aclose()
        raise
    return Batch(generations)


def choice_seed(seed: int | None, number: int) -> int | None:
    """The seed of a prompt's ``number``-th choice: ``seed + number`` as a signed 64-bit integer (what
    travels to a worker), wrapping past the largest; None without a seed."""
    return None if seed is None else (seed + number + 2**63) % 2**64 - 2**63


async def _pump(
    index: int, generation: Generation, queue: "asyncio.Queue[tuple[int, str | BaseException | None]]"
) -> None:
    """Put ``(index, piece)`` for each of the generation's pieces, then ``(index, None)``, or its failure."""
    try:
        async with contextlib.aclosing(generation):
            async for piece in generation.pieces():
                queue.put_nowait((index, piece))
    except Exception as exc:
        queue.put_nowait((index, exc))
        return
    queue.put_nowait((index, None))


def _frame(head: dict[str, Any], choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
    body = {**head, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + _encode(body) + b"\n\n"


def _mid_stream(exc: BaseException, total: Generation) -> GatewayError:
    """The error to report for a prompt that failed mid-stream, logged here (nothing else will see it)."""
    if isinstance(exc, GatewayError):
        log.warning("request %s failed mid-stream: %s", total.request_id, exc.message)
        return exc
    log.error("request %s failed mid-stream", total.request_id, exc_info=exc)
    return EngineFailed("internal error while generating; see the server log")
