"""Wire types between the gateway and engines.

They are msgspec Structs so that the same objects can later cross the network (msgpack over NATS)
without a second set of types. The gateway builds a ``PreprocessedRequest`` (token level) or a
``TextRequest`` (for engines that do their own pre/post-processing); engines answer with a stream of
``EngineOutput`` or ``TextOutput``.
"""

from typing import Any, Literal

import msgspec

FinishReason = Literal["stop", "length", "cancelled", "error"]


class SamplingOptions(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sampling parameters passed through to the engine; ``None`` means the engine's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None


class StopConditions(msgspec.Struct, omit_defaults=True, kw_only=True):
    """When generation ends.

    The engine enforces ``max_tokens``, ``min_tokens`` and EOS (it must not waste work past them);
    stop strings need text, so the gateway's postprocessor enforces ``stop`` and closes the stream.
    """

    max_tokens: int
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    ignore_eos: bool = False


class PreprocessedRequest(msgspec.Struct, kw_only=True):
    """A token-level request: the prompt already templated and tokenized by the gateway."""

    request_id: str
    model: str
    token_ids: list[int]
    sampling: SamplingOptions
    stop_conditions: StopConditions
    eos_token_ids: list[int] = msgspec.field(default_factory=list)


class EngineOutput(msgspec.Struct, omit_defaults=True):
    """One step of a token-level engine: new token ids, and a finish reason on the last step."""

    token_ids: list[int]
    finish_reason: FinishReason | None = None


class TextRequest(msgspec.Struct, kw_only=True):
    """An OpenAI-level request for engines that template, tokenize and detokenize themselves.

    Exactly one of ``messages`` (chat) and ``prompt`` (completion) is set.
    """

    request_id: str
    model: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    sampling: SamplingOptions
    stop_conditions: StopConditions


class TextOutput(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One step of a text engine: a piece of text, and usage / finish reason where known.

    ``completion_tokens`` counts the tokens this step stands for (default one) so that usage is
    right even when the engine groups several tokens into one piece of text.
    """

    text: str
    finish_reason: FinishReason | None = None
    completion_tokens: int = 1
    prompt_tokens: int | None = None
