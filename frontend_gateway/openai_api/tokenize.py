"""``POST /v1/tokenize`` and ``POST /v1/detokenize`` (and vLLM's paths without ``/v1``), in vLLM's shapes.

Clients use them to count a prompt's tokens before sending it, to build token-id prompts, and to read
token ids back as text (evaluation harnesses, prompt-budgeting code written against vLLM)::

    {"model": "m", "prompt": "Hello"}                        -> {"count": 2, "max_model_len": 8192,
    {"model": "m", "messages": [...]}                            "tokens": [...], "token_strs": null}
    {"model": "m", "tokens": [19556, 28]}                    -> {"prompt": "Hello!"}

A prompt is tokenized with the model's special tokens added (``add_special_tokens``, default true), chat
messages through the model's chat template with the generation prompt (``add_generation_prompt``, default
true) and without more special tokens (the template placed them), as the chat endpoint tokenizes them, so
the count is what a request would be charged; with messages, ``chat_template_kwargs``, ``reasoning_effort``
and ``tools`` reach the template as on chat. Only models whose tokenizer the gateway holds can be
asked (those whose engine takes token ids); the others, and token ids outside the vocabulary, are a 400
that says why. Nothing reaches an engine.
"""

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from frontend_gateway.errors import InvalidRequest
from frontend_gateway.models.pipeline import ServedModel
from frontend_gateway.openai_api import preprocessor
from frontend_gateway.openai_api.types import ChatMessage, ReasoningEffort, Tool
from runtime.errors import TemplateError
from runtime.models.card import ModelCard

__all__ = ["DetokenizeRequest", "TokenizeRequest", "detokenize", "detokenize_decoder", "tokenize", "tokenize_decoder"]


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: ``prompt`` or ``messages``."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    #: None: true for a prompt, false for messages (their template places the special tokens).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    #: As on chat: variables for the template (Qwen3's ``enable_thinking``), and the tools it is shown, so that
    #: the count is what the same chat request is charged.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    tools: Annotated[list[Tool], Meta(min_length=1, max_length=128)] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    tokens: list[int]


tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


def _card(model: ServedModel) -> ModelCard:
    card: ModelCard | None = getattr(model, "card", None)
    if card is None:
        raise InvalidRequest(
            f"model {model.name!r} is tokenized by its engine, not by the gateway: it cannot be asked for tokens",
            param="model",
        )
    return card


async def tokenize(model: ServedModel, request: TokenizeRequest) -> dict[str, Any]:
    """The token ids of the request's prompt or messages. Raises InvalidRequest, ContextLengthExceeded."""
    card = _card(model)
    if (request.prompt is None) == (request.messages is None):
        raise InvalidRequest("give either prompt (a string) or messages (a chat), not both or neither", param="prompt")
    if request.prompt is not None:
        add_special = True if request.add_special_tokens is None else request.add_special_tokens
        ids = await preprocessor.tokenize(card, request.prompt, add_special_tokens=add_special, param="prompt")
    else:
        assert request.messages is not None
        if card.template is None:
            raise InvalidRequest(f"model {card.name!r} has no chat template: tokenize a prompt", param="messages")
        messages = preprocessor.message_dicts(request.messages)
        try:
            text = card.template.render(
                messages,
                add_generation_prompt=request.add_generation_prompt,
                tools=msgspec.to_builtins(request.tools) if request.tools else None,
                **preprocessor.template_variables(request),
            )
        except TemplateError as exc:
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc
        add_special = bool(request.add_special_tokens)
        ids = await preprocessor.tokenize(card, text, add_special_tokens=add_special, param="messages")
    token_strs = [card.tokenizer.id_to_token(token) for token in ids] if request.return_token_strs else None
    return {"count": len(ids), "max_model_len": card.context_length, "tokens": ids, "token_strs": token_strs}


def detokenize(model: ServedModel, request: DetokenizeRequest) -> dict[str, Any]:
    """The text of the request's token ids (special tokens kept, as vLLM's). Raises InvalidRequest."""
    card = _card(model)
    ids = preprocessor.check_token_ids(card, request.tokens, param="tokens")
    return {"prompt": card.tokenizer.decode(ids, skip_special_tokens=False)}
