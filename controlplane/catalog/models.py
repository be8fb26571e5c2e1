"""The model catalog: what can be deployed, where its files come from, and what it needs."""

import re
from typing import ClassVar

from django.core.validators import RegexValidator
from django.db import models
from django.db.models.functions import Lower

from controlplane.catalog.engines import WEIGHTLESS_ENGINES, Engine
from runtime.lora import MAX_NAME_LENGTH as MAX_ADAPTER_NAME_LENGTH

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
validate_model_name = RegexValidator(
    re.compile(NAME_PATTERN), "1-100 letters, digits, '.', '_' or '-', starting with a letter or digit"
)


class LanguageModel(models.Model):
    """A model in the catalog (named ``model`` in the API).

    ``source`` depends on ``source_kind``: a Hugging Face repo id (with ``revision`` and, for a repo of
    GGUF files, the ``filename`` to use), or an absolute path on the nodes to a folder or a GGUF file.
    ``projector`` gives a llama.cpp model images: its multimodal projector, a file of the repo or a path.
    ``memory_bytes`` is the memory one replica needs (GPU memory, split evenly over its GPUs; system
    memory for CPU engines): the operator's figure, or when they give none an estimate from
    ``size_bytes``, ``projector_bytes``, ``config`` and ``context_length`` (``memory_estimated``;
    catalog/memory.py says how).
    None means unknown, which makes placement give each GPU replica whole GPUs to itself.
    """

    class SourceKind(models.TextChoices):
        HUGGING_FACE = "hf", "Hugging Face repo"
        FOLDER = "folder", "local folder"
        GGUF = "gguf", "GGUF file"

    name = models.CharField(max_length=100, unique=True, validators=[validate_model_name])
    source_kind = models.CharField(max_length=8, choices=SourceKind.choices)
    source = models.CharField(max_length=1024)
    revision = models.CharField(max_length=255, blank=True)
    filename = models.CharField(max_length=255, blank=True)
    # llama.cpp's multimodal projector (an "mmproj" GGUF), with which the model takes images: a file of the
    # same Hugging Face repo at the same revision, or for a local source an absolute path on the nodes.
    projector = models.CharField(max_length=1024, blank=True)
    engine = models.CharField(max_length=16, choices=Engine.choices)
    default_engine_args = models.JSONField(default=dict, blank=True)
    size_bytes = models.BigIntegerField(null=True, blank=True)
    # The projector's size on disk (a replica loads it beside the weights): read from a local file, or reported
    # by the first node that fetched it. None: no projector, or not known yet.
    projector_bytes = models.BigIntegerField(null=True, blank=True)
    memory_bytes = models.BigIntegerField(null=True, blank=True)
    memory_estimated = models.BooleanField(default=False)
    context_length = models.PositiveIntegerField(null=True, blank=True)  # tokens; None: the model's own
    config = models.JSONField(default=dict, blank=True)  # what the estimate reads of its config.json
    # Measured capacity at latency targets, for the planner's SLA mode (planner/profile.py's document);
    # None: no profile, and pipelines of this model are planned in load mode.
    profile = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering: ClassVar = ["name"]
        verbose_name = "model"

    def __str__(self) -> str:
        return self.name

    @property
    def is_gguf(self) -> bool:
        """Whether the files are GGUF: a GGUF source, or a Hugging Face repo's GGUF file."""
        if self.source_kind == self.SourceKind.GGUF:
            return True
        return self.source_kind == self.SourceKind.HUGGING_FACE and self.filename.lower().endswith(".gguf")

    @property
    def loads_weights(self) -> bool:
        """Whether its engine loads the weights (the mocker and echo do not: they need no memory for them)."""
        return self.engine not in WEIGHTLESS_ENGINES

    @property
    def source_display(self) -> str:
        """``repo@revision[/filename]`` or the path, as a person would write it."""
        if self.source_kind == self.SourceKind.HUGGING_FACE:
            text = f"{self.source}@{self.revision or 'main'}"
            return f"{text}/{self.filename}" if self.filename else text
        return self.source


class Adapter(models.Model):
    """A LoRA adapter of a catalog model (runtime/lora.py): served under its own ``name`` (a served model name,
    unique with the pipelines' names, letter case aside) while a pipeline of its model has it loaded.

    ``source`` depends on ``source_kind`` as a model's does: a Hugging Face repo id (with ``revision`` and, for
    a GGUF adapter of llama.cpp, the ``filename``), or an absolute path on the nodes (a PEFT folder, or a GGUF
    file).
    """

    model = models.ForeignKey(LanguageModel, on_delete=models.CASCADE, related_name="adapters")
    name = models.CharField(max_length=MAX_ADAPTER_NAME_LENGTH)
    source_kind = models.CharField(max_length=8, choices=LanguageModel.SourceKind.choices)
    source = models.CharField(max_length=1024)
    revision = models.CharField(max_length=255, blank=True)
    filename = models.CharField(max_length=255, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering: ClassVar = ["name"]
        constraints: ClassVar = [
            # Served names that differ only in letter case are one name to a person typing it.
            models.UniqueConstraint(Lower("name"), name="adapter_name_unique_ignoring_case"),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def source_display(self) -> str:
        """``repo@revision[/filename]`` or the path, as a person would write it."""
        if self.source_kind == LanguageModel.SourceKind.HUGGING_FACE:
            text = f"{self.source}@{self.revision or 'main'}"
            return f"{text}/{self.filename}" if self.filename else text
        return self.source
