"""Served models: the pre-process -> engine -> post-process pipeline behind one model name.

``prepare_chat`` / ``prepare_completion`` validate and preprocess (raising GatewayError before
any response starts) and return a ``Generation``: an async stream of text pieces
whose usage and finish reason are known once it ends. Every front end (HTTP, text, batch) consumes
the same ``Generation``.
"""

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from frontend_gateway.errors import (
    EngineFailed,
    InvalidRequest,
    from_engine_error,
)
from frontend_gateway.openai_api import preprocessor
from frontend_gateway.openai_api.chat_output import ChatOutputParser, plan_chat_output
from frontend_gateway.openai_api.echo import echo_plan
from frontend_gateway.openai_api.guided import guided_constraint
from frontend_gateway.openai_api.images import LoadedImage, image_parts, place_images, refuse_images
from frontend_gateway.openai_api.images import prompt_tokens as count_prompt_tokens
from frontend_gateway.openai_api.logprobs import LogprobEntry
from frontend_gateway.openai_api.stop_strings import StopStringMatcher
from frontend_gateway.openai_api.types import ChatCompletionRequest, CompletionRequest, SamplingFields
from frontend_gateway.parsers.reasoning import REASONING_PARSERS, ReasoningCounter, reasoning_parser
from frontend_gateway.parsers.tool_calls import TOOL_CALL_PARSERS
from frontend_gateway.request_log import RecordPublisher
from runtime.engine import RequestContext, TextEngine, TokenEngine
from runtime.errors import (
    EngineError,
    ModelError,
)
from runtime.models.card import ModelCard
from runtime.protocol import FinishReason, ImageInput, PreprocessedRequest, TextOutput, TextRequest, TokenLogprob


class Generation:
    """One request's output stream. Iterate ``pieces()`` once; then read usage and finish_reason."""

    __slots__ = (
        "_logprobs_sent",
        "_source",
        "cached_tokens",
        "completion_tokens",
        "context",
        "echo",
        "error_type",
        "finish_reason",
        "hidden",
        "itl_s",
        "logprobs",
        "output",
        "prompt_logprobs",
        "prompt_tokens",
        "reasoning",
        "request_id",
        "token_bound",
        "ttft_s",
    )

    def __init__(self, request_id: str, prompt_tokens: int, *, token_bound: int | None = None) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        #: The most tokens (prompt and completion) it may use, known before it starts: what an API key's
        #: token limits reserve for it. Unknown (a text engine's, with no context length or max_tokens): the
        #: prompt's tokens known then.
        self.token_bound = token_bound if token_bound is not None else prompt_tokens
        self.completion_tokens = 0
        #: Prompt tokens the engine found in its cache, when it says (usage.prompt_tokens_details).
        self.cached_tokens: int | None = None
        self.finish_reason: FinishReason | None = None
        self.context = RequestContext(request_id)
        #: For the request log (frontend_gateway/request_log.py): its TTFT and mean ITL in seconds, as the app
        #: observed them, and the error type of a failure after the answer began (None: none).
        self.ttft_s: float | None = None
        self.itl_s: float | None = None
        self.error_type: str | None = None
        #: How a chat answer's text splits into reasoning, content and tool calls (None: all content).
        self.output: ChatOutputParser | None = None
        #: Counts the answer's reasoning tokens, when its model has a reasoning parser (None: it has none).
        self.reasoning: ReasoningCounter | None = None
        #: Each generated token's log probability, in order, when the request asked for them.
        self.logprobs: list[LogprobEntry] | None = None
        #: ``echo``: the prompt's text, shown before the answer (openai_api/echo.py); None: no echo.
        self.echo: str | None = None
        #: With echo and logprobs: each prompt token's entry (the first with no numbers), from the engine's
        #: first output.
        self.prompt_logprobs: list[LogprobEntry] | None = None
        #: ``max_tokens: 0`` with echo: the generated token is computed, and not shown.
        self.hidden = False
        self._logprobs_sent = 0
        self._source: AsyncIterator[str] | None = None

    @property
    def reasoning_tokens(self) -> int | None:
        """The answer's reasoning tokens so far; None when its model has no reasoning parser."""
        return self.reasoning.tokens if self.reasoning is not None else None

    def take_logprobs(self) -> list[LogprobEntry]:
        """The log probabilities that arrived since the last call (a stream sends each once)."""
        if self.logprobs is None:
            return []
        new = self.logprobs[self._logprobs_sent :]
        self._logprobs_sent = len(self.logprobs)
        return new

    def bind(self, source: AsyncIterator[str]) -> "Generation":
        """Attach the stream that fills this generation in (it needs the generation to count into)."""
        self._source = source
        return self

    def pieces(self) -> AsyncIterator[str]:
        """The non-empty text pieces, in order."""
        assert self._source is not None, "Generation.bind() was not called"
        return self._source

    async def aclose(self) -> None:
        """Close the stream now (again is harmless): the pipeline's cleanup runs and the engine is
        told to stop, at this point rather than whenever the garbage collector finalizes it."""
        if self._source is not None:
            await _aclose(self._source)


class ServedModel(Protocol):
    """A model name the gateway serves, and how to turn requests into generations."""

    name: str
    created: int
    context_length: int | None
    reasoning_parser: str | None
    tool_call_parser: str | None

    async def prepare_chat(self, request: ChatCompletionRequest, images: Sequence[LoadedImage] = ()) -> Generation:
        """``images``: the request's image parts, loaded (openai_api/images.py), for a model that takes them."""
        ...

    async def prepare_completion(self, request: CompletionRequest) -> Generation: ...


def _new_request_id() -> str:
    return uuid.uuid4().hex


class TokenModel:
    """A model whose engine takes token ids: Flotilla templates, tokenizes and detokenizes."""

    #: The base model's name when this is a LoRA adapter of it (runtime/lora.py; ``/v1/models`` says so).
    parent: str | None = None

    def __init__(self, card: ModelCard, engine: TokenEngine) -> None:
        self.card = card
        self.name = card.name
        self.created = int(time.time())
        self.context_length: int | None = card.context_length
        self.engine = engine
        self._tokenizer: Tokenizer = card.tokenizer  # built now: a bad tokenizer fails at start-up
        self.reasoning_parser, self.tool_call_parser = check_parsers(
            card.name, card.reasoning_parser, card.tool_call_parser
        )

    async def prepare_chat(self, request: ChatCompletionRequest, images: Sequence[LoadedImage] = ()) -> Generation:
        parts = image_parts(request)
        refuse_images(parts, model=self.name, vision=self.card.vision)
        if len(parts) != len(images):
            # Only the HTTP front end loads images (it owns the fetching client): not a batch file, say.
            raise InvalidRequest("image inputs are taken over HTTP only", param=parts[0].param)
        plan = plan_chat_output(
            request,
            model=self.name,
            reasoning=self.reasoning_parser,
            tool_calls=self.tool_call_parser,
            structured_output=self.card.structured_output,
        )
        prompt_ids = await preprocessor.chat_prompt_ids(self.card, request, plan.tools)
        keep_special = plan.parser is not None and plan.parser.needs_special_tokens
        generation = self._prepare(
            request,
            prompt_ids,
            keep_special_tokens=keep_special,
            json_schema=plan.json_schema,
            images=place_images(self.card, prompt_ids, images) if images else None,
        )
        _count_reasoning(generation, plan.parser, self.reasoning_parser)
        return generation

    async def prepare_completion(self, request: CompletionRequest) -> Generation:
        prompt_ids = await preprocessor.completion_prompt_ids(self.card, request)
        generation = self._prepare(request, prompt_ids)
        if request.echo:
            # The prompt as the client wrote it; token ids as their text (special tokens shown), as vLLM echoes.
            prompt = request.prompt
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            generation.echo = (
                prompt if isinstance(prompt, str) else self._tokenizer.decode(prompt_ids, skip_special_tokens=False)
            )
        return generation

    def _prepare(
        self,
        request: SamplingFields,
        prompt_ids: list[int],
        *,
        keep_special_tokens: bool = False,
        json_schema: str | None = None,
        images: list[ImageInput] | None = None,
    ) -> Generation:
        """The generation of a templated, tokenized request; ``json_schema``: a forced tool call's (guided decoding
        and response_format give the others); ``images``: a chat request's, placed in ``prompt_ids``."""
        prompt_tokens = count_prompt_tokens(prompt_ids, images) if images else len(prompt_ids)
        stop = preprocessor.stop_conditions(request, prompt_tokens, self.card.context_length)
        constraint = guided_constraint(request, model=self.name, follows=self.card.guided_decoding)
        schema = (
            json_schema
            or preprocessor.output_schema(request, model=self.name, structured_output=self.card.structured_output)
            or constraint.json_schema
        )
        card = self.card
        logprobs = preprocessor.logprob_count(request, model=self.name, supported=card.logprobs, engine=card.engine)
        echo = echo_plan(request, logprobs, model=self.name, engine=card.engine, prompt_logprobs=card.prompt_logprobs)
        request_id = _new_request_id()
        engine_request = PreprocessedRequest(
            request_id=request_id,
            model=self.name,
            token_ids=prompt_ids,
            sampling=preprocessor.sampling_options(request, biases=self._logit_bias(request)),
            stop_conditions=stop,
            eos_token_ids=self.card.eos_token_ids,
            json_schema=schema,
            guided=constraint.guided,
            logprobs=logprobs,
            prompt_logprobs=echo.prompt_logprobs if echo is not None else None,
            images=images,
        )
        skip_special = request.skip_special_tokens
        if skip_special is None:
            # A tool-call format marked by special tokens ([TOOL_CALLS]) needs them in the text it parses.
            skip_special = self.engine.skip_special_tokens and not keep_special_tokens
        generation = Generation(request_id, prompt_tokens, token_bound=prompt_tokens + stop.max_tokens)
        if logprobs is not None:
            generation.logprobs = []
        generation.hidden = echo is not None and echo.hidden
        tokens = self._postprocess(generation, engine_request, skip_special)
        return generation.bind(_finish(generation, tokens))

    def _logit_bias(self, request: SamplingFields) -> dict[int, float] | None:
        vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True) if self.card.logit_bias else None
        return preprocessor.logit_bias(request, model=self.name, vocab_size=vocab_size)

    async def _postprocess(
        self, generation: Generation, request: PreprocessedRequest, skip_special_tokens: bool
    ) -> AsyncIterator[str]:
        """Detokenize incrementally and enforce max_tokens and stop strings.

        Yields one piece per engine output (a remote engine's output stands for a whole network
        frame), so the tokens that arrived together leave together, as one SSE event. With stop
        strings, each token's text is matched in turn: the tokens after the one that completes a
        stop string are neither shown nor counted, as when each token arrives alone (vLLM's count),
        and none ends the stream before ``min_tokens`` tokens.
        Raises EngineFailed when the tokens cannot be detokenized.
        """
        tokenizer = self._tokenizer
        step = DecodeStream(skip_special_tokens=skip_special_tokens).step
        conditions = request.stop_conditions
        max_tokens, min_tokens = conditions.max_tokens, conditions.min_tokens
        matcher = (
            StopStringMatcher(conditions.stop, include=conditions.include_stop_str_in_output)
            if conditions.stop
            else None
        )
        stop_ids = frozenset(conditions.stop_token_ids)
        outputs = self.engine.generate(request, generation.context)
        try:
            async for output in outputs:
                if output.cached_tokens is not None and generation.cached_tokens is None:
                    generation.cached_tokens = output.cached_tokens  # the first worker's, after a migration
                wants_prompt = request.prompt_logprobs is not None and generation.prompt_logprobs is None
                if wants_prompt and output.finish_reason != "error":  # a failure says why itself, next
                    generation.prompt_logprobs = self._prompt_entries(request.token_ids, output.prompt_logprobs)
                if output.prompt_tokens is not None:
                    generation.prompt_tokens = output.prompt_tokens  # images widened as the engine widened them
                token_ids = output.token_ids
                room = max_tokens - generation.completion_tokens
                # The engine's finish reason is for its last token: kept only when none is cut off here.
                engine_finish = output.finish_reason if len(token_ids) <= room else None
                if len(token_ids) > room:
                    token_ids = token_ids[:room]
                counted = token_ids  # the tokens this output bills; ``token_ids``: those shown
                stopped = hit = False
                if stop_ids and (at := _stop_token_at(token_ids, stop_ids, generation.completion_tokens, min_tokens)):
                    stopped = True
                    counted = token_ids[:at]
                    token_ids = counted if conditions.include_stop_str_in_output else token_ids[: at - 1]
                piece: str | None
                try:
                    if matcher is not None:
                        piece, sent, hit = self._match_stops(generation, token_ids, step, matcher, min_tokens)
                        if hit:
                            stopped, counted = True, token_ids[:sent]
                    elif len(token_ids) == 1:
                        piece = step(tokenizer, token_ids[0])
                    else:
                        piece = "".join([text for token_id in token_ids if (text := step(tokenizer, token_id))])
                except Exception as exc:  # tokenizers raises plain Exception, e.g. "Invalid prefix encountered"
                    raise EngineFailed(f"the engine's tokens could not be detokenized: {exc}") from exc
                generation.completion_tokens += len(counted)
                if generation.logprobs is not None and output.logprobs:
                    generation.logprobs += map(self._logprob_entry, counted, output.logprobs)
                if stopped:
                    generation.finish_reason = "stop"
                elif engine_finish is not None:
                    # An EOS that is the max_tokens-th token ends the answer as "stop", as in vLLM.
                    generation.finish_reason = engine_finish
                elif generation.completion_tokens >= max_tokens:
                    generation.finish_reason = "length"
                if generation.finish_reason is not None and matcher is not None and not hit:
                    piece = (piece or "") + matcher.flush()
                if piece:
                    yield piece
                if generation.finish_reason is not None:
                    return
            if matcher is not None and (tail := matcher.flush()):
                yield tail
        finally:
            await _aclose(outputs)

    def _match_stops(
        self,
        generation: Generation,
        token_ids: list[int],
        step: Callable[[Tokenizer, int], str | None],
        matcher: StopStringMatcher,
        min_tokens: int,
    ) -> tuple[str, int, bool]:
        """(the text of ``token_ids`` that may be shown, how many of them count, whether a stop string
        was completed): all of them, or those up to the one that completes a stop string."""
        shown: list[str] = []
        done = generation.completion_tokens
        for index, token_id in enumerate(token_ids):
            text = step(self._tokenizer, token_id)
            if not text:
                continue
            safe, hit = matcher.feed(text, may_stop=done + index + 1 > min_tokens)
            shown.append(safe)
            if hit:
                return "".join(shown), index + 1, True
        return "".join(shown), len(token_ids), False

    def _prompt_entries(self, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> list[LogprobEntry]:
        """The entries of the prompt's tokens: the first with no numbers, each other with the engine's.
        Raises EngineFailed when the engine did not report them (a worker that ignores the field)."""
        if logprobs is None or len(logprobs) != len(token_ids) - 1:
            raise EngineFailed(
                f"the engine of {self.name!r} did not report the prompt's log probabilities it was asked for "
                f"({0 if logprobs is None else len(logprobs)} of {len(token_ids) - 1}); is the worker up to date?"
            )
        first = LogprobEntry(self._tokenizer.decode(token_ids[:1], skip_special_tokens=False), None, None)
        return [first, *map(self._logprob_entry, token_ids[1:], logprobs)]

    def _logprob_entry(self, token_id: int, logprob: TokenLogprob) -> LogprobEntry:
        # One token decoded alone: a character split over tokens shows as U+FFFD, as in vLLM.
        decode = self._tokenizer.decode
        top = [(decode([other], skip_special_tokens=False), value) for other, value in logprob.top]
        return LogprobEntry(decode([token_id], skip_special_tokens=False), logprob.logprob, top)


def _stop_token_at(token_ids: list[int], stop_ids: frozenset[int], done: int, min_tokens: int) -> int:
    """How many of ``token_ids`` there are up to and with the first of ``stop_ids`` that may end the
    answer (none among the first ``min_tokens`` tokens, ``done`` of which came before); 0 if none."""
    for index, token_id in enumerate(token_ids):
        if token_id in stop_ids and done + index + 1 > min_tokens:
            return index + 1
    return 0


_UNBOUNDED_CONTEXT = 1 << 31


class TextModel:
    """A model whose engine takes OpenAI-level requests and does its own processing."""

    card = None
    #: The base model's name when this is a LoRA adapter of it (runtime/lora.py; ``/v1/models`` says so).
    parent: str | None = None

    def __init__(
        self,
        name: str,
        engine: TextEngine,
        context_length: int | None = None,
        *,
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
        engine_name: str | None = None,
    ) -> None:
        self.name = name
        self.created = int(time.time())
        self.context_length = context_length
        self.engine = engine
        #: The engine's ``out=`` name, for the refusals of what it cannot do; None: not known.
        self.engine_name = engine_name
        self.reasoning_parser, self.tool_call_parser = check_parsers(name, reasoning_parser, tool_call_parser)

    async def prepare_chat(self, request: ChatCompletionRequest, images: Sequence[LoadedImage] = ()) -> Generation:
        # Text engines are given text: their models are text only here.
        refuse_images(image_parts(request), model=self.name, vision=False)
        plan = plan_chat_output(
            request, model=self.name, reasoning=self.reasoning_parser, tool_calls=self.tool_call_parser
        )
        messages = preprocessor.message_dicts(request.messages)
        if plan.tools is not None:
            preprocessor.check_wire_ints(plan.tools, "tools")  # they travel to the engine
        text_request = self._text_request(request, messages=messages, tools=plan.tools)
        text_request.chat_template_kwargs = preprocessor.template_variables(request) or None
        generation = self._prepare(text_request)
        _count_reasoning(generation, plan.parser, self.reasoning_parser)
        return generation

    async def prepare_completion(self, request: CompletionRequest) -> Generation:
        prompt = request.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise InvalidRequest(
                    f"model {self.name!r} takes text prompts only (a string or a list of one string)",
                    param="prompt",
                )
            prompt = prompt[0]
        generation = self._prepare(self._text_request(request, prompt=prompt))
        if request.echo:  # logprobs, the prompt's with them, were refused: a text engine reports none
            generation.echo = prompt
            generation.hidden = request.max_tokens == 0
        return generation

    def _text_request(
        self,
        request: SamplingFields,
        *,
        messages: list[dict[str, Any]] | None = None,
        prompt: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> TextRequest:
        # Without a tokenizer the prompt cannot be counted here: the engine checks its own context.
        stop = preprocessor.stop_conditions(request, 0, self.context_length or _UNBOUNDED_CONTEXT)
        if request.stop_token_ids:
            raise InvalidRequest(
                f"model {self.name!r} is served by an engine that answers in text, with no token ids to stop "
                "at; use stop strings, or leave stop_token_ids out",
                param="stop_token_ids",
            )
        # Text engines report neither, nor apply logit_bias: these refuse what the request asks of them.
        preprocessor.logit_bias(request, model=self.name, vocab_size=None)
        preprocessor.output_schema(request, model=self.name, structured_output=False)
        guided_constraint(request, model=self.name, follows=())
        preprocessor.logprob_count(request, model=self.name, supported=False, engine=self.engine_name)
        return TextRequest(
            request_id=_new_request_id(),
            model=self.name,
            messages=messages,
            prompt=prompt,
            sampling=preprocessor.sampling_options(request),
            stop_conditions=stop,
            tools=tools,
        )

    def _prepare(self, text_request: TextRequest) -> Generation:
        # The prompt is not counted here: the engine's context bounds prompt and answer together; without
        # one, max_tokens bounds the answer alone (the prompt's tokens are then known only as it ends).
        max_tokens = text_request.stop_conditions.max_tokens
        bound = self.context_length or (max_tokens if max_tokens < _UNBOUNDED_CONTEXT else None)
        generation = Generation(text_request.request_id, 0, token_bound=bound)
        return generation.bind(_finish(generation, self._postprocess(generation, text_request)))

    async def _postprocess(self, generation: Generation, request: TextRequest) -> AsyncIterator[str]:
        """Count usage as the engine reports it, and apply stop strings.

        An output that stands for several (a remote worker's frame: ``parts``) is matched one part at a
        time, so that a stop string bills the parts up to the one that completes it, as when each comes
        alone; none ends the stream before ``min_tokens`` tokens.
        """
        conditions = request.stop_conditions
        matcher = (
            StopStringMatcher(conditions.stop, include=conditions.include_stop_str_in_output)
            if conditions.stop
            else None
        )
        outputs = self.engine.generate(request, generation.context)
        try:
            async for output in outputs:
                if output.prompt_tokens is not None:
                    generation.prompt_tokens = output.prompt_tokens
                if matcher is None:
                    generation.completion_tokens += output.completion_tokens
                    piece = output.text
                else:
                    piece, stopped = self._match_stops(generation, output, matcher, conditions.min_tokens)
                    if stopped:
                        generation.finish_reason = "stop"
                        if piece:
                            yield piece
                        return
                    if output.finish_reason is not None:
                        piece += matcher.flush()
                if piece:
                    yield piece
                if output.finish_reason is not None:
                    generation.finish_reason = output.finish_reason
                    return
            if matcher is not None and (tail := matcher.flush()):
                yield tail
        finally:
            await _aclose(outputs)

    @staticmethod
    def _match_stops(
        generation: Generation, output: TextOutput, matcher: StopStringMatcher, min_tokens: int
    ) -> tuple[str, bool]:
        """(the text of ``output`` that may be shown, whether a stop string was completed); counts the
        tokens of its parts up to the one that completes a stop string, or all of them."""
        shown: list[str] = []
        start = 0
        for length, tokens in output.parts or [(len(output.text), output.completion_tokens)]:
            generation.completion_tokens += tokens
            text = output.text[start : start + length]
            start += length
            safe, hit = matcher.feed(text, may_stop=generation.completion_tokens > min_tokens)
            shown.append(safe)
            if hit:
                return "".join(shown), True
        return "".join(shown), False


def check_parsers(model: str, reasoning: str | None, tool_calls: str | None) -> tuple[str | None, str | None]:
    """The parser names a model's card gives, if this gateway has them; raises ModelError if not.

    A card may come from a worker of another version: better to refuse its model, saying why, than
    to answer with reasoning or tool calls left in the text.
    """
    if reasoning is not None and reasoning not in REASONING_PARSERS:
        raise ModelError(
            f"model {model!r} asks for the reasoning parser {reasoning!r}; "
            f"this gateway has {', '.join(REASONING_PARSERS)}"
        )
    if tool_calls is not None and tool_calls not in TOOL_CALL_PARSERS:
        raise ModelError(
            f"model {model!r} asks for the tool-call parser {tool_calls!r}; "
            f"this gateway has {', '.join(TOOL_CALL_PARSERS)}"
        )
    return reasoning, tool_calls


def _count_reasoning(generation: Generation, parser: ChatOutputParser | None, reasoning: str | None) -> None:
    """Give ``generation`` its answer's parser, and a counter of its reasoning tokens when it has reasoning."""
    generation.output = parser
    if parser is not None and parser.has_reasoning and reasoning is not None:
        generation.reasoning = ReasoningCounter(reasoning_parser(reasoning))


async def _finish(generation: Generation, pieces: AsyncIterator[str]) -> AsyncIterator[str]:
    """The tail every pipeline shares: the default finish reason, engine errors, cleanup (each
    pipeline's _postprocess applies stop strings, where it knows which tokens they leave out).

    Whatever ends the stream (its end, a stop string, the consumer closing it, a cancellation), the
    request's context is stopped and the engine's stream closed.
    """
    try:
        async for piece in pieces:
            if (reasoning := generation.reasoning) is not None:
                reasoning.feed(piece, generation.completion_tokens)
            yield piece
        if generation.finish_reason == "error":
            raise EngineFailed("the engine failed while generating; see the server log")
        if generation.finish_reason is None:
            generation.finish_reason = "stop"
    except EngineError as exc:
        generation.finish_reason = "error"
        raise from_engine_error(exc) from exc
    except Exception:
        # Anything else (a GatewayError from postprocessing, a bug in an engine) still means the
        # answer did not finish: no consumer may report it as stopped normally.
        generation.finish_reason = "error"
        raise
    finally:
        generation.context.stop()
        await _aclose(pieces)


async def _aclose(iterator: AsyncIterator[object]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


@dataclass(frozen=True, slots=True)
class ServingStatus:
    """What a distributed gateway's ``/health`` reports beyond its models: its connections, and the
    instances each model has."""

    nats: bool
    etcd: bool
    instances: dict[str, int]


class ModelRegistry:
    """The models a gateway serves, by name. Models may come and go while it runs.

    ``status``, when set (the ingress sets it), says how the gateway's connections and instances are.
    ``request_log``, when set (the model watcher sets it), takes a record of each finished request.
    ``arrival``, when set (the ingress sets it), returns once a model of that name that is being taken in
    (its first instance registered, its pool still being built) is served, or at once when none is.
    """

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}
        self.status: Callable[[], ServingStatus] | None = None
        self.arrival: Callable[[str], Awaitable[None]] | None = None
        #: Where finished requests' records go (frontend_gateway/request_log.py); the model watcher sets it
        #: (None: no request log, as in ``flotilla run`` without a control plane).
        self.request_log: RecordPublisher | None = None

    def add(self, model: ServedModel) -> None:
        self._models[model.name] = model

    def remove(self, name: str) -> None:
        self._models.pop(name, None)

    def get(self, name: str) -> ServedModel | None:
        return self._models.get(name)

    def names(self) -> list[str]:
        return list(self._models)

    def all(self) -> list[ServedModel]:
        return list(self._models.values())
