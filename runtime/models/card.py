"""The model card: everything a gateway needs to pre/post-process for a model, without its files.

A card is built from a GGUF file's metadata or from a Hugging Face folder, and it is serializable
(msgspec) so that workers can later publish it through etcd/NATS and a gateway can serve a model it
has no files for.
"""

import enum
import time
from functools import cached_property
from pathlib import Path
from typing import Any

import msgspec
from tokenizers import Tokenizer

from runtime.errors import ModelError
from runtime.models.chat_template import ChatTemplate

# Tokens scanned between two releases of the GIL in ``max_token_chars``: about 1 ms of work.
_VOCAB_CHUNK = 1024


class ModelType(enum.StrEnum):
    """What level of request a model's engine takes."""

    TOKENS = "tokens"  # token ids in and out: the gateway templates, tokenizes and detokenizes
    CHAT = "chat"  # OpenAI chat requests: the engine does its own processing
    COMPLETION = "completion"  # OpenAI completion requests: the engine does its own processing


class ModelCard(msgspec.Struct, kw_only=True, dict=True):
    """A served model's description. ``tokenizer_json`` is the serialized ``tokenizers`` model."""

    name: str
    model_type: ModelType = ModelType.TOKENS
    context_length: int
    kv_cache_block_size: int = 16
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None
    tokenizer_json: str | None = None
    #: Where the weights are on this machine (a GGUF file or a folder); not meaningful remotely.
    source: str | None = None
    #: How the gateway splits reasoning (``<think>``) from the answer, by vLLM's parser names
    #: (``deepseek_r1``, ``qwen3``); None: the answer is all content.
    reasoning_parser: str | None = None
    #: How the gateway finds tool calls in the answer (``hermes``, ``llama3_json``, ``mistral``);
    #: None: the model cannot be offered tools.
    tool_call_parser: str | None = None
    #: Whether the engine can constrain its output to a JSON schema (``response_format``
    #: ``json_object``/``json_schema``; llama.cpp by grammars). False: such requests are refused.
    structured_output: bool = False
    #: The guided decoding the engine follows (vLLM's ``guided_*`` fields and ``structured_outputs``), named
    #: as in ``runtime.protocol.GUIDED_KINDS``: llama.cpp ``json``, ``choice`` and ``grammar``; vLLM all. A
    #: request asking for another is refused. Empty (older workers too): none.
    guided_decoding: list[str] = msgspec.field(default_factory=list)
    #: Whether the engine reports tokens' log probabilities (``logprobs``/``top_logprobs``; llama.cpp).
    logprobs: bool = False
    #: Whether the engine reports the prompt's tokens' log probabilities too (``echo`` with ``logprobs``, as
    #: evaluation harnesses ask: llama.cpp, vLLM). False: such requests are refused.
    prompt_logprobs: bool = False
    #: The engine that serves the model (``out=``: llamacpp, vllm, mocker...), named in the refusals of what it
    #: cannot do; None: not said (a worker of an older version).
    engine: str | None = None
    #: Whether the engine adds ``logit_bias`` to its logits (llama.cpp, vLLM). False: such requests are refused.
    logit_bias: bool = False
    #: Whether the model embeds text (``POST /v1/embeddings``; llama.cpp, mean-pooled and normalized).
    embeddings: bool = False
    #: Whether the model takes images (``image_url`` content parts): a vision model on an engine that feeds
    #: them to it (vLLM; llama.cpp with a projector). False (every other engine, older workers): text only, and
    #: images are refused.
    vision: bool = False
    #: The placeholder token the prompt holds for each image; set when ``vision``. With Hugging Face templates
    #: (vLLM) the template writes it (LLaVA's ``<image>``) for each ``{"type": "image"}`` part; with
    #: ``images_in_text`` the gateway puts it where the image stands.
    image_token_id: int | None = None
    #: Whether the chat template is given each image as a place in its message's text rather than an image part
    #: (llama.cpp: a GGUF's template knows no image parts, and llama-server puts a text marker there). The
    #: gateway then tokenizes the text around each image and puts ``image_token_id`` between, an id outside the
    #: vocabulary, so that no text can stand for an image.
    images_in_text: bool = False
    #: How many placeholder tokens the engine widens each image to, when that is the same for every image
    #: (LLaVA's, from its vision tower's image and patch sizes); None: it depends on the image (Qwen2-VL).
    image_tokens: int | None = None

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer, built once from ``tokenizer_json`` (~100 ms, holding the GIL: see ``prepare``).

        Raises ModelError if the card has none or it cannot be loaded.
        """
        if self.tokenizer_json is None:
            raise ModelError(f"model {self.name!r} has no tokenizer")
        try:
            return Tokenizer.from_str(self.tokenizer_json)
        except Exception as exc:  # tokenizers raises a bare Exception for malformed JSON
            raise ModelError(f"the tokenizer of model {self.name!r} cannot be loaded: {exc}") from exc

    @cached_property
    def max_token_chars(self) -> int:
        """The length of the vocabulary's longest token string: no token stands for more characters."""
        tokenizer = self.tokenizer
        # Token by token rather than get_vocab(): that one call holds the GIL for ~30 ms (SmolLM2). Run on
        # a thread (prepare), this loop lets the GIL go after every ~1 ms chunk, so the event loop runs.
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        longest = 1
        for start in range(0, size, _VOCAB_CHUNK):
            chunk = range(start, min(start + _VOCAB_CHUNK, size))
            longest = max(longest, max(len(tokenizer.id_to_token(i) or "") for i in chunk))
            time.sleep(0)  # releases the GIL
        return longest

    @cached_property
    def template(self) -> ChatTemplate | None:
        """The compiled chat template, or None when the model has none (a base model)."""
        if self.chat_template is None:
            return None
        return ChatTemplate(self.chat_template, bos_token=self.bos_token, eos_token=self.eos_token)

    def prepare(self, tokenizer: Tokenizer | None = None) -> "ModelCard":
        """Build the tokenizer, its longest token and the chat template now; return this card.

        ``tokenizer``, if given, was built from this very ``tokenizer_json`` earlier and is used as is.
        Each step costs milliseconds to a hundred (docs/benchmarks.md): an event loop calls this on a
        thread, ``await asyncio.to_thread(card.prepare)``, before the card serves requests.
        Raises ModelError for a bad tokenizer, TemplateError for a bad chat template.
        """
        if tokenizer is not None:
            self.__dict__["tokenizer"] = tokenizer  # where cached_property keeps its value
        if self.tokenizer_json is not None or tokenizer is not None:
            _ = self.max_token_chars  # builds the tokenizer too
        _ = self.template
        return self

    def replace(self, **changes: Any) -> "ModelCard":
        """A copy with ``changes`` (``msgspec.structs.replace``) that keeps what this card has already built
        from fields left unchanged: the tokenizer (~60 ms to build again from its JSON, on a worker's start)
        and its longest token, and the compiled chat template."""
        card = msgspec.structs.replace(self, **changes)
        built = self.__dict__  # where cached_property keeps its values
        if "tokenizer_json" not in changes:
            card.__dict__.update({key: built[key] for key in ("tokenizer", "max_token_chars") if key in built})
        if "template" in built and changes.keys().isdisjoint({"chat_template", "bos_token", "eos_token"}):
            card.__dict__["template"] = built["template"]
        return card

    @property
    def source_path(self) -> Path | None:
        return Path(self.source) if self.source else None
