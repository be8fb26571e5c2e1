"""The model card: everything a gateway needs to pre/post-process for a model, without its files.

A card is built from a GGUF file's metadata or from a Hugging Face folder, and it is serializable
(msgspec) so that workers can later publish it through etcd/NATS and a gateway can serve a model it
has no files for.
"""

import enum
from functools import cached_property
from pathlib import Path

import msgspec
from tokenizers import Tokenizer

from runtime.chat_template import ChatTemplate


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

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer, built once from ``tokenizer_json``. Raises ValueError if the card has none."""
        if self.tokenizer_json is None:
            raise ValueError(f"model {self.name!r} has no tokenizer")
        return Tokenizer.from_str(self.tokenizer_json)

    @cached_property
    def max_token_chars(self) -> int:
        """The length of the vocabulary's longest token string: no token stands for more characters."""
        return max((len(token) for token in self.tokenizer.get_vocab(with_added_tokens=True)), default=1)

    @cached_property
    def template(self) -> ChatTemplate | None:
        """The compiled chat template, or None when the model has none (a base model)."""
        if self.chat_template is None:
            return None
        return ChatTemplate(self.chat_template, bos_token=self.bos_token, eos_token=self.eos_token)

    @property
    def source_path(self) -> Path | None:
        return Path(self.source) if self.source else None
