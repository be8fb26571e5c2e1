"""OpenAI requests -> engine requests: chat template, tokenization, sampling and stop conditions.

Everything here depends only on the request and the model card, and raises InvalidRequest /
ContextLengthExceeded with the offending parameter named, before any response has started.
"""

import asyncio
import secrets
from typing import Annotated, Any, Literal, Protocol

import msgspec
from msgspec import Meta

from frontend_gateway.errors import ContextLengthExceeded, InvalidRequest
from frontend_gateway.openai_api.types import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    SamplingFields,
)
from runtime.errors import TemplateError
from runtime.models.card import ModelCard
from runtime.protocol import SamplingOptions, StopConditions


class _FunctionCall(msgspec.Struct):
    name: str
    arguments: str


class _ToolCall(msgspec.Struct):
    """What an assistant message's ``tool_calls`` entry must hold (checked, then passed on as given)."""

    id: str
    type: Literal["function"]
    function: _FunctionCall


# Roles whose messages must have content: only an assistant's may be empty (when it calls tools).
_CONTENT_REQUIRED = frozenset({"system", "developer", "user", "tool", "function"})


def check_chat(request: ChatCompletionRequest) -> None:
    """Refuse a chat request whose parts contradict each other, as OpenAI's API does, before any work.

    msgspec checked each field on its own; this checks what depends on several: each message has
    what its role needs, a tool message names its call, a forced function is among ``tools``.
    Raises InvalidRequest naming the parameter.
    """
    check_stream_options(request)
    if request.functions is not None or request.function_call is not None:
        param = "functions" if request.functions is not None else "function_call"
        raise InvalidRequest(
            f"{param} is the deprecated form of tools and tool_choice, and is not supported; use tools and tool_choice",
            param=param,
        )
    if request.audio is not None or (request.modalities is not None and request.modalities != ["text"]):
        param = "audio" if request.audio is not None else "modalities"
        raise InvalidRequest("only text output is served here; leave audio and modalities out", param=param)
    if request.web_search_options is not None:
        raise InvalidRequest(
            "web search is not available here; leave web_search_options out", param="web_search_options"
        )
    for index, message in enumerate(request.messages):
        if message.content is None and message.role in _CONTENT_REQUIRED:
            raise InvalidRequest(
                f"a message with role {message.role!r} needs content", param=f"messages[{index}].content"
            )
        if message.role == "assistant" and message.content is None and not message.tool_calls:
            raise InvalidRequest("an assistant message needs content or tool_calls", param=f"messages[{index}].content")
        if message.role == "tool" and not message.tool_call_id:
            raise InvalidRequest(
                "a message with role 'tool' needs the tool_call_id it answers", param=f"messages[{index}].tool_call_id"
            )
        if message.function_call is not None:
            raise InvalidRequest(
                "function_call is the deprecated form of tool_calls, and is not supported; use tool_calls",
                param=f"messages[{index}].function_call",
            )
        if message.tool_calls is not None:
            if message.role != "assistant":
                raise InvalidRequest(
                    "only assistant messages may have tool_calls", param=f"messages[{index}].tool_calls"
                )
            try:
                calls = msgspec.convert(message.tool_calls, list[_ToolCall])
            except msgspec.ValidationError as exc:
                raise InvalidRequest(f"invalid tool call: {exc}", param=f"messages[{index}].tool_calls") from exc
            _check_arguments(calls, index)
    choice = request.tool_choice
    if choice is not None and request.tools is None:
        raise InvalidRequest("tool_choice is only allowed when tools are given", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        names = [tool.function.name for tool in request.tools or ()]
        if choice.function.name not in names:
            raise InvalidRequest(
                f"tool_choice names the function {choice.function.name!r}, which is not among tools",
                param="tool_choice",
            )


def _check_arguments(calls: list[_ToolCall], index: int) -> None:
    """Each call's ``arguments`` must be JSON text (or empty): the chat template is given the value it holds
    (runtime/models/chat_template.py), as vLLM gives it, and text that is not JSON has none."""
    for number, call in enumerate(calls):
        text = call.function.arguments
        if not text.strip():
            continue
        try:
            msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise InvalidRequest(
                f"a tool call's arguments must be JSON text, as the model returned them: {exc}",
                param=f"messages[{index}].tool_calls[{number}].function.arguments",
            ) from exc


def check_stream_options(request: SamplingFields) -> None:
    """stream_options without streaming is a mistake OpenAI refuses (the usage it asks for never comes)."""
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")


def message_dicts(
    messages: list[ChatMessage], *, images: bool = False, image_marker: str | None = None
) -> list[dict[str, Any]]:
    """Messages as the plain dicts chat templates expect.

    Text parts are joined into one string; with ``images`` (a vision model's template) a message with parts
    keeps them, as Hugging Face processors' templates read them: ``{"type": "text", "text": ...}`` and
    ``{"type": "image"}``, where the template writes the image's placeholder token. With ``image_marker``
    instead, each image part is that text in the joined string (llama-server's way, for templates that know
    no image parts). Without either, an image part is refused naming it.
    """
    result: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        content: str | list[dict[str, str]] | None
        if isinstance(message.content, list):
            parts: list[dict[str, str]] = []
            for number, part in enumerate(message.content):
                param = f"messages[{index}].content[{number}]"
                if part.type == "image_url" and image_marker is not None:
                    parts.append({"type": "text", "text": image_marker})
                    continue
                if part.type == "image_url" and images:
                    parts.append({"type": "image"})
                    continue
                if part.type != "text":
                    raise InvalidRequest(
                        f"content part of type {part.type!r} is not supported here; only text parts are", param=param
                    )
                if part.text is None:
                    raise InvalidRequest("a text content part needs its text", param=f"messages[{index}].content")
                parts.append({"type": "text", "text": part.text})
            content = parts if images else "".join(part["text"] for part in parts)
        else:
            content = message.content
        entry: dict[str, Any] = {"role": message.role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls is not None:
            check_wire_ints(message.tool_calls, f"messages[{index}].tool_calls")
            entry["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        result.append(entry)
    return result


_WIRE_INT_MIN, _WIRE_INT_MAX = -(2**63), 2**64 - 1  # what msgpack can encode


def check_wire_ints(value: Any, param: str) -> None:
    """Refuse free-form JSON (tool calls) holding an integer that msgpack cannot carry to a worker.

    JSON integers are unbounded and msgspec decodes them exactly; one beyond 64 bits would fail to
    encode only after routing. Raises InvalidRequest.
    """
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif type(item) is int and not _WIRE_INT_MIN <= item <= _WIRE_INT_MAX:
            raise InvalidRequest("an integer here is beyond 64 bits", param=param)


# Below this many characters a prompt is tokenized in place; above, on a thread (see tokenize()).
# SmolLM2's BPE takes about 0.4 ms per KB (bench/event_loop_costs.py): 2 KB keeps the loop under ~1 ms.
_INLINE_TOKENIZE_CHARS = 2048


async def tokenize(card: ModelCard, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
    """Token ids of ``text``, without stalling the event loop on a long prompt.

    A text too long to fit the context whatever its tokens is refused before any work (no token is
    longer than the vocabulary's longest entry). A long one is encoded on a thread with
    ``encode_batch``, which releases the GIL (``encode`` does not): a megabyte prompt costs seconds.
    Raises ContextLengthExceeded.
    """
    if len(text) > card.context_length * card.max_token_chars:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {card.context_length} tokens, and a prompt of "
            f"{len(text)} characters cannot fit it; shorten the prompt",
            param=param,
        )
    tokenizer = card.tokenizer
    if len(text) <= _INLINE_TOKENIZE_CHARS:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids
    encodings = await asyncio.to_thread(tokenizer.encode_batch, [text], add_special_tokens=add_special_tokens)
    long_ids: list[int] = encodings[0].ids
    return long_ids


async def token_counts(card: ModelCard, texts: list[str], *, add_special_tokens: bool, params: list[str]) -> list[int]:
    """How many tokens each of ``texts`` is, without stalling the event loop however many there are.

    Many short texts (an embeddings request of 2,048 lines) cost as much as one long prompt: together over
    ``_INLINE_TOKENIZE_CHARS`` they are encoded on a thread with ``encode_batch`` (which releases the GIL),
    where one at a time in place each would be cheap and all of them would stall every stream on this
    process for a second. Raises ContextLengthExceeded, naming ``params[i]``, for a text that cannot fit.
    """
    for text, param in zip(texts, params, strict=True):
        if len(text) > card.context_length * card.max_token_chars:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {card.context_length} tokens, and an input of "
                f"{len(text)} characters cannot fit it; shorten it",
                param=param,
            )
    tokenizer = card.tokenizer
    if sum(len(text) for text in texts) <= _INLINE_TOKENIZE_CHARS:
        return [len(tokenizer.encode(text, add_special_tokens=add_special_tokens).ids) for text in texts]
    encodings = await asyncio.to_thread(tokenizer.encode_batch, texts, add_special_tokens=add_special_tokens)
    return [len(encoding.ids) for encoding in encodings]


async def chat_prompt_ids(
    card: ModelCard, request: ChatCompletionRequest, tools: list[dict[str, Any]] | None
) -> list[int]:
    """Render the chat template with ``tools`` (what the model is offered: see chat_output) and
    tokenize it as Hugging Face's apply_chat_template does."""
    template = card.template
    if template is None:
        raise InvalidRequest(
            f"model {card.name!r} has no chat template; use /v1/completions, "
            "or pass --model-config with a tokenizer_config.json that has one",
            param="messages",
        )
    # A marker no text of the request can hold (a fresh random one), where the template is given images as text.
    marker = f"<flotilla-image-{secrets.token_hex(8)}>" if card.vision and card.images_in_text else None
    try:
        text = template.render(
            message_dicts(request.messages, images=card.vision and marker is None, image_marker=marker),
            add_generation_prompt=True,
            tools=tools,
            **template_variables(request),
        )
    except TemplateError as exc:
        raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc
    # The template already placed BOS and special tokens; HF encodes it without adding more.
    if marker is None or card.image_token_id is None:
        return await tokenize(card, text, add_special_tokens=False, param="messages")
    # The text between images is tokenized piece by piece (as llama.cpp's mtmd_tokenize does), each image a
    # placeholder between them.
    ids: list[int] = []
    for index, piece in enumerate(text.split(marker)):
        if index:
            ids.append(card.image_token_id)
        ids += await tokenize(card, piece, add_special_tokens=False, param="messages")
    return ids


_SET_BY_THE_REQUEST = frozenset({"messages", "tools", "add_generation_prompt"})


class _TemplateFields(Protocol):
    """What a request adds to its chat template's render (a chat request's, or a tokenize request's)."""

    @property
    def chat_template_kwargs(self) -> dict[str, Any] | None: ...

    @property
    def reasoning_effort(self) -> str | None: ...


def template_variables(request: _TemplateFields) -> dict[str, Any]:
    """The variables a chat request adds to its template's render: ``chat_template_kwargs`` and
    ``reasoning_effort`` (vLLM's rule: the explicit field wins over the same name in the kwargs).

    Raises InvalidRequest when the kwargs name what the request itself sets (messages, tools,
    add_generation_prompt), or hold an integer that cannot travel to a worker (a text engine renders the
    template itself).
    """
    variables = dict(request.chat_template_kwargs or {})
    if taken := sorted(_SET_BY_THE_REQUEST.intersection(variables)):
        raise InvalidRequest(
            f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields give them",
            param="chat_template_kwargs",
        )
    check_wire_ints(variables, "chat_template_kwargs")
    if request.reasoning_effort is not None:
        variables["reasoning_effort"] = request.reasoning_effort
    return variables


async def completion_prompt_ids(card: ModelCard, request: CompletionRequest) -> list[int]:
    """Tokenize one completion prompt: a string, a one-string list, or a list of token ids (a batch of
    several is split first: completion_batch.py)."""
    prompt = request.prompt
    if isinstance(prompt, list):
        if prompt and (bounds := _int_bounds(prompt)) is not None:
            return _check_bounds(card, prompt, *bounds, param="prompt")  # type: ignore[arg-type]
        if len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        elif len(prompt) == 1 and isinstance(prompt[0], list):
            return check_token_ids(card, prompt[0], param="prompt")
        else:
            raise InvalidRequest(
                "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists, "
                "not a mix",
                param="prompt",
            )
    assert isinstance(prompt, str)
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    return await tokenize(card, prompt, add_special_tokens=True, param="prompt")


def check_token_ids(card: ModelCard, ids: list[int], *, param: str) -> list[int]:
    """Return ``ids`` if all are in the vocabulary; raises InvalidRequest naming the first that is not
    (the error's ``param``: ``param``)."""
    return _check_bounds(card, ids, min(ids), max(ids), param=param) if ids else ids


def _int_bounds(items: list[str | int | list[int]]) -> tuple[int, int] | None:
    """The smallest and largest item when every item is an int, else None.

    msgspec typed each item as a str, an int or a list of ints; min and max compare an int with either
    of the others only by raising TypeError. Both run in C: for a 4.5k-token prompt they cost a third
    of a generator over the items, which showed as 7% of the ingress's CPU in a profile.
    """
    try:
        low, high = min(items), max(items)
    except TypeError:
        return None  # ints mixed with strings or lists
    return (low, high) if type(low) is int and type(high) is int else None


def _check_bounds(card: ModelCard, ids: list[int], low: int, high: int, *, param: str) -> list[int]:
    vocab_size = card.tokenizer.get_vocab_size(with_added_tokens=True)
    if low < 0 or high >= vocab_size:
        token = next(token for token in ids if not 0 <= token < vocab_size)
        raise InvalidRequest(f"token id {token} is outside the vocabulary (0..{vocab_size - 1})", param=param)
    return ids


def refuse_unsupported(request: SamplingFields) -> None:
    """Refuse the OpenAI features this version does not implement, rather than ignore them.

    A client that asks for one of these would otherwise get an answer that silently lacks it.
    Raises InvalidRequest naming the field.
    """
    if isinstance(request, CompletionRequest) and request.suffix:
        raise InvalidRequest("suffix (insertion) is not supported; leave the field out", param="suffix")


class _JsonSchemaFormat(msgspec.Struct):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class _ResponseFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchemaFormat | None = None


# json_object asks for any JSON object: as a schema, this one.
_ANY_OBJECT = '{"type": "object"}'


def output_schema(request: SamplingFields, *, model: str, structured_output: bool) -> str | None:
    """The JSON schema (as JSON text) that ``response_format`` asks the answer to follow; None: free text.

    Raises InvalidRequest for a malformed response_format, and for one asking for JSON from a model
    whose engine cannot constrain its output (it would answer free text that merely may be JSON).
    """
    if request.response_format is None:
        return None
    try:
        response_format = msgspec.convert(request.response_format, _ResponseFormat)
    except msgspec.ValidationError as exc:
        message = str(exc)
        _, _, path = message.rpartition(" - at `$.")
        param = "response_format." + path.rstrip("`") if path else "response_format"
        raise InvalidRequest(f"invalid response_format: {message}", param=param) from exc
    if response_format.type == "text":
        return None
    if not structured_output:
        raise InvalidRequest(
            f"model {model!r} cannot constrain its output to JSON (its engine has no structured output; "
            "out=llamacpp has, by grammars); leave response_format out or set its type to text",
            param="response_format",
        )
    if response_format.type == "json_object":
        return _ANY_OBJECT
    if response_format.json_schema is None:
        raise InvalidRequest(
            "response_format of type json_schema needs json_schema: {name, schema}", param="response_format.json_schema"
        )
    schema = response_format.json_schema.schema
    return msgspec.json.encode(schema).decode() if schema else _ANY_OBJECT


MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (completions: 5; vLLM allows 20 there too)


def logprob_count(request: SamplingFields, *, model: str, supported: bool, engine: str | None = None) -> int | None:
    """How many alternatives to report with each token's log probability (0: none); None: no logprobs.

    Chat takes ``logprobs: true`` and ``top_logprobs: N``; completions ``logprobs: N``. Raises
    InvalidRequest for a malformed pair, and for logprobs asked of a model whose engine does not
    report them (the answer would lack them).
    """
    logprobs, top = request.logprobs, request.top_logprobs
    if isinstance(request, ChatCompletionRequest):
        if logprobs is not None and type(logprobs) is not bool:
            raise InvalidRequest("logprobs is a boolean in chat completions; use top_logprobs: N", param="logprobs")
        if top is not None and not logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        count = (top or 0) if logprobs else None
    else:
        if top is not None:
            raise InvalidRequest("completions take logprobs: N, not top_logprobs", param="top_logprobs")
        if type(logprobs) is bool:
            if logprobs:
                raise InvalidRequest("logprobs is a number in completions (0 to 20)", param="logprobs")
            logprobs = None
        count = logprobs
    if count is None:
        return None
    param = "top_logprobs" if isinstance(request, ChatCompletionRequest) else "logprobs"
    if count > MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"{param} must be at most {MAX_TOP_LOGPROBS}", param=param)
    if not supported:
        served_by = f"out={engine}" if engine else "its engine"
        raise InvalidRequest(
            f"model {model!r} does not report log probabilities ({served_by} has none to give; out=llamacpp "
            "and out=vllm have); leave logprobs out",
            param="logprobs",
        )
    return count


def logit_bias(request: SamplingFields, *, model: str, vocab_size: int | None) -> dict[int, float] | None:
    """``logit_bias`` as token ids and biases, for a model whose engine applies it (``vocab_size``: its
    vocabulary's; None: the engine cannot). Raises InvalidRequest naming the field for a key that is not
    a token id of the vocabulary, or when the engine cannot apply it (the answer would ignore it)."""
    given = request.logit_bias
    if not given:
        return None
    if vocab_size is None:
        raise InvalidRequest(
            f"model {model!r} is served by an engine that does not apply logit_bias (out=llamacpp and out=vllm "
            "do); leave logit_bias out",
            param="logit_bias",
        )
    biases: dict[int, float] = {}
    for key, bias in given.items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 10 else -1
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"logit_bias keys are token ids of the vocabulary (0..{vocab_size - 1}); {key[:40]!r} is not one",
                param="logit_bias",
            )
        biases[token] = bias
    return biases


def sampling_options(request: SamplingFields, *, biases: dict[int, float] | None = None) -> SamplingOptions:
    """The request's sampling settings; ``biases``: its ``logit_bias`` as checked by ``logit_bias``."""
    refuse_unsupported(request)
    return SamplingOptions(
        logit_bias=biases,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        seed=request.seed,
        frequency_penalty=request.frequency_penalty,
        presence_penalty=request.presence_penalty,
        repetition_penalty=request.repetition_penalty,
    )


def requested_max_tokens(request: SamplingFields) -> int | None:
    """The tokens the engine is asked to generate at most (None: as many as fit). Raises InvalidRequest for
    ``max_tokens: 0`` without ``echo``, as vLLM does: it asks for nothing."""
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    if request.max_tokens == 0:
        if not (isinstance(request, CompletionRequest) and request.echo):
            raise InvalidRequest(
                "max_tokens must be at least 1; 0 (no generated token) is only for echo, which returns the prompt",
                param="max_tokens",
            )
        return 1  # vLLM's echo without generation: one token is computed, and not shown (openai_api/echo.py)
    return request.max_tokens


def stop_conditions(request: SamplingFields, prompt_tokens: int, context_length: int) -> StopConditions:
    """Stop conditions, with max_tokens checked against (or defaulted to) the room left in context.

    Raises ContextLengthExceeded when the prompt, or the prompt plus max_tokens, does not fit.
    """
    room = context_length - prompt_tokens
    if room <= 0:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {context_length} tokens, "
            f"but the prompt has {prompt_tokens} tokens; shorten the prompt",
            param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
        )
    max_tokens = requested_max_tokens(request)
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {context_length} tokens; the prompt has "
            f"{prompt_tokens} tokens and max_tokens asks for {max_tokens} more; lower max_tokens "
            f"to at most {room} or shorten the prompt",
            param="max_tokens",
        )
    min_tokens = request.min_tokens or 0
    if min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({min_tokens}) exceeds max_tokens ({max_tokens})", param="min_tokens")
    stop = request.stop
    ignore_eos = bool(request.ignore_eos or (request.nvext is not None and request.nvext.ignore_eos))
    return StopConditions(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=[stop] if isinstance(stop, str) else list(stop or ()),
        ignore_eos=ignore_eos,
        stop_token_ids=list(request.stop_token_ids or ()),
        include_stop_str_in_output=bool(request.include_stop_str_in_output),
    )
