"""OpenAI request bodies as msgspec Structs.

Decoding validates types and ranges in one pass (msgspec's errors name the field, e.g. "Expected
`int`, got `str` - at `$.max_tokens`"). A field the request structs do not declare is refused, naming it
(``unknown_fields.py``): a client asking for what Flotilla does not do (vLLM's ``use_beam_search``, say) must not
get an answer made without it. The few fields known to be harmless to ignore are declared, and ignored.
Responses are built as plain dicts/bytes in ``encoding.py``: no per-token object validation.

Every integer that travels to a worker is bounded here by the type it has on the wire: JSON numbers
have no limit, and one that msgpack cannot encode would otherwise pass validation and fail later,
after routing, as a 500. ``seed`` is a signed 64-bit integer (as in Dynamo and vLLM); ``top_k``,
``max_tokens`` and ``min_tokens`` are 32-bit.
"""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
PositiveInt = Annotated[int, Meta(ge=1, le=INT32_MAX)]
NonNegativeInt = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Seed = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
StopStrings = str | Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(max_length=16)]


#: The efforts a template may be given (gpt-oss's reads ``reasoning_effort``).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    # vLLM's: usage so far in every chunk too (needs include_usage, as there).
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None  # harmless: padding against side channels, no change in content


class NvExt(msgspec.Struct, forbid_unknown_fields=True):
    """Dynamo's extension block; ``ignore_eos`` keeps generating past EOS (for benchmarks)."""

    ignore_eos: bool | None = None
    annotations: list[str] | None = None


class ImageUrl(msgspec.Struct, forbid_unknown_fields=True):
    """An ``image_url`` part's image: an http(s) URL the gateway fetches, or a ``data:image/...;base64,`` URI."""

    url: Annotated[str, Meta(min_length=1)]
    # OpenAI's resolution hint; vLLM accepts and ignores it, and so does Flotilla (the model's processor decides).
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None
    # ``type: "image_url"`` (openai_api/images.py): for models whose card says ``vision``.
    image_url: ImageUrl | None = None


# The roles OpenAI's API accepts ("function" is the deprecated predecessor of "tool"); anything else
# is a 400, as there, rather than text a chat template renders in some unforeseen way.
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # An earlier answer's reasoning, as this gateway returned it: given to the chat template (Qwen3's shows
    # it within a tool loop), as vLLM gives it.
    reasoning_content: str | None = None
    # Harmless: what the openai client's message objects carry when an earlier answer is sent back whole.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any | None = None
    function_call: Any | None = None  # a deprecated call; refused unless null (preprocessor.check_chat)


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` (0.12 and later): one constraint, and options of a JSON one (guided.py).

    ``structural_tag`` is not declared: it is refused, naming it, as an unknown field.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by chat and completion requests."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    min_tokens: NonNegativeInt | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None = None
    min_p: Probability | None = None
    seed: Seed | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    stop: StopStrings | None = None
    # How many choices: each its own generation (openai_api/completion_batch.py, chat_choices.py).
    n: Annotated[int, Meta(ge=1, le=128)] | None = None
    stop_token_ids: Annotated[list[NonNegativeInt], Meta(max_length=64)] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    nvext: NvExt | None = None
    user: str | None = None
    # Refused with a clear message where the engine lacks them (preprocessor), instead of silently ignored.
    logprobs: bool | Annotated[int, Meta(ge=0, le=INT32_MAX)] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=INT32_MAX)] | None = None
    # Token id (as a string) -> bias added to its logit, OpenAI's range (checked in preprocessor.logit_bias).
    logit_bias: Annotated[dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(max_length=1024)] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's guided decoding: its fields up to 0.11, and structured_outputs since. Checked and carried to the
    # engines whose card says they follow them (openai_api/guided.py); refused, naming the field, elsewhere.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # Known to be harmless to ignore (docs/openai-api.md): OpenAI's storage, billing and caching hints, and a
    # prediction that only speeds an answer up; none of them changes what the answer is.
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prediction: dict[str, Any] | None = None


class FunctionDefinition(msgspec.Struct, omit_defaults=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, omit_defaults=True):
    """One entry of ``tools``; only functions exist in the Chat Completions API."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(msgspec.Struct):
    name: Annotated[str, Meta(min_length=1)]


class NamedToolChoice(msgspec.Struct):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call this function."""

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    tools: Annotated[list[Tool], Meta(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # The deprecated forms of tools and tool_choice: accepted only to be refused with a pointer to
    # the current ones (preprocessor.check_chat), since ignoring them would answer without tools.
    functions: list[Any] | None = None
    function_call: Any | None = None
    # Asked-for outputs no engine here produces: refused rather than answered without them.
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # Extra variables for the chat template (vLLM's): Qwen3's ``enable_thinking: false``, say. They cannot
    # replace what the gateway gives every template (messages, tools, add_generation_prompt).
    chat_template_kwargs: dict[str, Any] | None = None
    # Given to the chat template as ``reasoning_effort``, as vLLM gives it (gpt-oss's template reads it); a
    # template that does not read it ignores it, as there.
    reasoning_effort: ReasoningEffort | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, a one-element list of strings, or a list of token ids (checked in the preprocessor:
    # msgspec cannot tell list[str] from list[int] inside one union); batches of prompts are refused.
    prompt: str | list[str | int | list[int]]
    # 0 only with echo (openai_api/echo.py): the prompt comes back alone, as vLLM serves it.
    max_tokens: NonNegativeInt | None = None
    # The prompt before the answer, with its tokens' log probabilities when logprobs is asked (openai_api/echo.py).
    echo: bool = False
    # Candidates per prompt, of which the n best are returned (openai_api/best_of.py); vLLM's bound is n's.
    best_of: Annotated[int, Meta(ge=1, le=128)] | None = None
    suffix: str | None = None


chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
completion_decoder = msgspec.json.Decoder(CompletionRequest)
