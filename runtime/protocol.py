"""Wire types between the gateway and engines.

They are msgspec Structs so that the same objects can later cross the network (msgpack over NATS)
without a second set of types. The gateway builds a ``PreprocessedRequest`` (token level) or a
``TextRequest`` (for engines that do their own pre/post-processing); engines answer with a stream of
``EngineOutput`` or ``TextOutput``.
"""

import array
import sys
from typing import Any, Literal

import msgspec

FinishReason = Literal["stop", "length", "cancelled", "error"]
#: What part of a request's life a worker serves: all of it, only the prompt (it hands the prompt's KV
#: cache on), or the rest (it takes a prompt's KV cache from a prefill worker, and generates).
DisaggRole = Literal["aggregated", "prefill", "decode"]
DISAGG_ROLES: tuple[DisaggRole, ...] = ("aggregated", "prefill", "decode")
#: What a model card may say its engine follows of guided decoding (``ModelCard.guided_decoding``): the
#: constraints (a JSON schema, a regex, a choice, a grammar) and the JSON options of ``GuidedDecoding``.
GUIDED_KINDS = (
    "json",
    "regex",
    "choice",
    "grammar",
    "whitespace_pattern",
    "disable_any_whitespace",
    "disable_additional_properties",
)


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
    #: Added to these token ids' logits before sampling (OpenAI's ``logit_bias``, -100 to 100); only
    #: engines whose card says ``logit_bias`` are sent one.
    logit_bias: dict[int, float] | None = None


class StopConditions(msgspec.Struct, omit_defaults=True, kw_only=True):
    """When generation ends.

    The engine enforces ``max_tokens``, ``min_tokens`` and EOS (it must not waste work past them);
    stop strings need text, so the gateway's postprocessor enforces ``stop`` and closes the stream. It
    enforces ``stop_token_ids`` too, the same way for every token engine (none of them needs to know).
    """

    max_tokens: int
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    #: Token ids that end the answer, after ``min_tokens`` (vLLM's ``stop_token_ids``; not ignored by
    #: ``ignore_eos``, as there).
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    #: Show the stop string (or stop token's text) that ended the answer, as vLLM's field does.
    include_stop_str_in_output: bool = False


class GuidedDecoding(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A constraint on the answer besides a JSON schema (``PreprocessedRequest.json_schema`` carries those),
    and the options of a JSON constraint: vLLM's guided decoding (``guided_regex``, ``guided_choice``,
    ``guided_grammar``; ``structured_outputs``). At most one of ``regex``, ``choice`` and ``grammar``, and
    none of them with a JSON schema; only engines whose card lists them in ``guided_decoding`` are sent one.
    """

    #: The answer matches this regular expression, whole.
    regex: str | None = None
    #: The answer is exactly one of these strings.
    choice: list[str] | None = None
    #: The answer is a sentence of this grammar (GBNF on llama.cpp; what vLLM's backend reads on vLLM).
    grammar: str | None = None
    #: JSON options (vLLM's): the whitespace allowed between JSON tokens, none at all, no properties
    #: beyond the schema's.
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


class KvHandoff(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What a prefill worker hands on for one request: where the KV cache of its prompt is, and how to take it.

    The ingress reads only ``prefill_instance``, ``prompt_tokens`` and ``cached_tokens``; ``params`` is for
    the decode worker's engine of the same ``kind`` (vLLM: the connector's ``kv_transfer_params``).
    """

    #: The engine that wrote it ("mocker", "vllm"): a decode worker of another kind computes the prompt itself.
    kind: str
    #: The instance that computed the prompt's KV (and may hold its blocks for the transfer): set by the
    #: ingress, which chose it (engines do not know their instance id and leave 0).
    prefill_instance: int = 0
    #: Prompt tokens the KV covers (the whole prompt the prefill worker was sent).
    prompt_tokens: int
    #: Prompt tokens the prefill worker found in its cache: the client's ``cached_tokens``.
    cached_tokens: int = 0
    #: The mocker's modelled transfer time, in simulated seconds: the decode side waits it first.
    transfer_s: float = 0.0
    params: dict[str, Any] = msgspec.field(default_factory=dict)


class ImageInput(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One image of a chat request, as the gateway checked it (a decodable image within its size limits).

    The prompt holds one placeholder token for it (the card's ``image_token_id``) at ``position``; the engine
    widens it to ``tokens`` placeholders (0: as many as the engine's processor makes of this image).
    """

    #: The image file's bytes (PNG, JPEG, WebP, GIF...), as the client sent them or the gateway fetched them.
    data: bytes
    #: The SHA-256 of ``data``, hex: the image's name in block hashes (runtime/kv/image_blocks.py) and, given
    #: to vLLM as the item's uuid, in vLLM's own (its KV events' ``extra_keys``).
    digest: str
    #: Where its placeholder token is in ``PreprocessedRequest.token_ids``.
    position: int
    #: How many placeholder tokens the engine makes of it (0: unknown to the gateway).
    tokens: int = 0


class PreprocessedRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A token-level request: the prompt already templated and tokenized by the gateway."""

    request_id: str
    model: str
    token_ids: list[int]
    sampling: SamplingOptions
    stop_conditions: StopConditions
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    #: The LoRA adapter to run the request with (its served name, runtime/lora.py); None: the base model. Sent
    #: only to instances that registered the adapter.
    lora_name: str | None = None
    #: After a migration: the last ``migrated_tokens`` of ``token_ids`` were generated by an instance
    #: that died, and ``max_tokens`` counts only what is still to come.
    migrated_tokens: int = 0
    #: The data-parallel rank of the instance the router chose (KV routing); None: the engine picks.
    dp_rank: int | None = None
    #: A JSON schema (as JSON text) the output must follow (``response_format``); only engines whose
    #: card says ``structured_output`` are sent one. None: free text.
    json_schema: str | None = None
    #: Guided decoding other than a JSON schema (a regex, a choice, a grammar) and JSON options; only
    #: engines whose card lists them in ``guided_decoding`` are sent one. None: no such constraint.
    guided: GuidedDecoding | None = None
    #: Report each token's log probability and this many most likely alternatives (0: none); None:
    #: no log probabilities. Only engines whose card says ``logprobs`` are sent one.
    logprobs: int | None = None
    #: Report the log probability of each prompt token after the first, given the tokens before it, and
    #: this many most likely alternatives at its place (vLLM's ``prompt_logprobs``; what ``echo`` with
    #: ``logprobs`` shows); None: none. Only engines whose card says ``prompt_logprobs`` are sent one.
    prompt_logprobs: int | None = None
    #: To a prefill worker: compute the prompt and hand its KV on; the last output carries the ``handoff``
    #: (its tokens are not the client's). Sent only to instances registered with the role "prefill".
    prefill_only: bool = False
    #: To a decode worker: the prompt's KV computed by a prefill worker, to take instead of computing it.
    #: None: the worker computes the prompt itself (an aggregated request, a fallback, a migration).
    handoff: KvHandoff | None = None
    #: The images of a chat request, in prompt order; only engines whose card says ``vision`` are sent any.
    images: list[ImageInput] | None = None


class TokenLogprob(msgspec.Struct, array_like=True):
    """A generated token's log probability under the model, and the likeliest tokens at its place."""

    logprob: float
    #: (token id, log probability), likeliest first: as many as the request asked for.
    top: list[tuple[int, float]] = msgspec.field(default_factory=list)


class EngineOutput(msgspec.Struct, omit_defaults=True):
    """One step of a token-level engine: new token ids, and a finish reason on the last step."""

    token_ids: list[int]
    finish_reason: FinishReason | None = None
    #: On the first output of a request: how many prompt tokens the engine found already in its
    #: cache (prefix caching); reported to clients as ``usage.prompt_tokens_details.cached_tokens``.
    cached_tokens: int | None = None
    #: One per token of ``token_ids``, when the request asked for log probabilities.
    logprobs: list[TokenLogprob] | None = None
    #: On the first output of a request that asked for ``prompt_logprobs``: one per prompt token after the
    #: first, in order (the first token has none: nothing comes before it).
    prompt_logprobs: list[TokenLogprob] | None = None
    #: On the last output of a ``prefill_only`` request: where its prompt's KV is, for a decode worker.
    handoff: KvHandoff | None = None
    #: On the first output of a request with images: its prompt's tokens as the engine counts them (each
    #: image's placeholders widened), when that is not ``len(token_ids)``.
    prompt_tokens: int | None = None


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
    #: The LoRA adapter to run the request with (runtime/lora.py); None: the base model.
    lora_name: str | None = None
    #: The tools the prompt should offer (OpenAI's ``tools`` entries), for an engine that templates.
    tools: list[dict[str, Any]] | None = None
    #: Extra variables for an engine that renders the chat template (``chat_template_kwargs``, and
    #: ``reasoning_effort``), as the gateway gives them to the templates it renders.
    chat_template_kwargs: dict[str, Any] | None = None


class TextOutput(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One step of a text engine: a piece of text, and usage / finish reason where known.

    ``completion_tokens`` counts the tokens this step stands for (default one) so that usage is
    right even when the engine groups several tokens into one piece of text.
    """

    text: str
    finish_reason: FinishReason | None = None
    completion_tokens: int = 1
    prompt_tokens: int | None = None
    #: Set by the ingress on an output that stands for several (a network frame's): each one's
    #: (characters of ``text``, completion tokens), in order, so that usage after a stop string counts
    #: only the outputs up to it. Engines leave it None.
    parts: list[tuple[int, int]] | None = None


#: What is embedded: a text, or the model's token ids as the client gave them (``POST /v1/embeddings``).
EmbedInput = str | list[int]


class EmbedRequest(msgspec.Struct, kw_only=True):
    """Inputs for a worker's embedding endpoint (``POST /v1/embeddings`` through an ingress).

    The ingress has checked each input against the model's context length (and token ids against its
    vocabulary); an ingress may split one client request into several of these (see
    frontend_gateway/models/remote_embeddings.py). ``texts`` keeps its name from when inputs were texts
    only: a request of texts reads the same to a worker of either version.
    """

    request_id: str
    texts: list[EmbedInput]


class EmbedOutput(msgspec.Struct, kw_only=True):
    """The vectors of some of an ``EmbedRequest``'s texts, in order, from ``start``.

    Each vector is its float32 values, little-endian, as bytes: under half the size of msgpack floats,
    and exactly what the engine computed (llama.cpp embeds in float32). ``prompt_tokens`` counts the
    tokens of the whole request on its first output, and is 0 on the others.
    """

    start: int
    vectors: list[bytes]
    prompt_tokens: int


def float32_bytes(vector: list[float]) -> bytes:
    """``vector`` as little-endian float32 values (``EmbedOutput.vectors``, OpenAI's base64 embeddings)."""
    packed = array.array("f", vector)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def float32_values(data: bytes) -> list[float]:
    """The values of little-endian float32 ``data``."""
    packed = array.array("f", data)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()
