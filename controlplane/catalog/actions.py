"""Changes to the model catalog. Each runs in one transaction and writes an audit entry."""

import re
from typing import Any

from django.db import IntegrityError, transaction

from controlplane.audit.records import Actor, record, snapshot
from controlplane.catalog.engines import GGUF_ONLY_ENGINES
from controlplane.catalog.models import LanguageModel
from controlplane.errors import Conflict, Invalid

# Fields an action may set; everything else is the database's.
MODEL_FIELDS = frozenset(
    {
        "name",
        "source_kind",
        "source",
        "revision",
        "filename",
        "engine",
        "default_engine_args",
        "size_bytes",
        "memory_bytes",
    }
)
# huggingface_hub's own rule for a repo id: "name" or "owner/name".
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")
_FILENAME = re.compile(r"^[A-Za-z0-9._-][A-Za-z0-9._ /-]{0,254}$")


@transaction.atomic
def create_model(actor: Actor, **fields: Any) -> LanguageModel:
    """Add a model to the catalog.

    Raises Invalid naming the field when the source does not suit its kind or the engine, Conflict
    when the name is taken.
    """
    _check_fields(fields)
    model = LanguageModel(**fields)
    check_model(model)
    try:
        model.save()
    except IntegrityError as exc:
        raise Conflict(f"a model named {model.name!r} already exists") from exc
    record(actor, "model.create", model, before=None, after=snapshot(model))
    return model


@transaction.atomic
def update_model(actor: Actor, model: LanguageModel, **changes: Any) -> LanguageModel:
    """Change a model's fields; pipelines already deployed keep running with what they were started with.

    Raises Invalid or Conflict as ``create_model`` does.
    """
    _check_fields(changes)
    model = LanguageModel.objects.select_for_update().get(pk=model.pk)
    before = snapshot(model)
    for name, value in changes.items():
        setattr(model, name, value)
    check_model(model)
    try:
        model.save()
    except IntegrityError as exc:
        raise Conflict(f"a model named {model.name!r} already exists") from exc
    record(actor, "model.update", model, before=before, after=snapshot(model))
    return model


@transaction.atomic
def delete_model(actor: Actor, model: LanguageModel) -> None:
    """Remove a model from the catalog. Raises Conflict while a pipeline uses it."""
    users = list(model.pipelines.order_by("name").values_list("name", flat=True)[:6])
    if users:
        shown = ", ".join(users[:5]) + (" and more" if len(users) > 5 else "")
        raise Conflict(f"model {model.name!r} is used by pipelines {shown}; delete them first")
    before = snapshot(model)
    record(actor, "model.delete", model, before=before, after=None)
    model.delete()


def check_model(model: LanguageModel) -> None:
    """Raise Invalid (naming the field) unless the source suits its kind and the engine can load it."""
    kind = model.source_kind
    if kind == LanguageModel.SourceKind.HUGGING_FACE:
        if not _REPO_ID.match(model.source):
            raise Invalid(f"{model.source!r} is not a Hugging Face repo id (owner/name)", field="source")
        if model.revision and (not _REVISION.match(model.revision) or ".." in model.revision):
            raise Invalid(f"{model.revision!r} is not a branch, tag or commit", field="revision")
        if model.filename and (not _FILENAME.match(model.filename) or ".." in model.filename.split("/")):
            raise Invalid(f"{model.filename!r} is not a file name inside the repo", field="filename")
    else:
        if not model.source.startswith("/") or "\x00" in model.source:
            raise Invalid(f"a {kind} source is an absolute path on the nodes, not {model.source!r}", field="source")
        if kind == LanguageModel.SourceKind.GGUF and not model.source.lower().endswith(".gguf"):
            raise Invalid(f"a GGUF source is a path ending in .gguf, not {model.source!r}", field="source")
        for field_name in ("revision", "filename"):
            if getattr(model, field_name):
                raise Invalid(f"only a Hugging Face source has a {field_name}", field=field_name)
    if model.engine in GGUF_ONLY_ENGINES and not model.is_gguf:
        raise Invalid(
            f"{model.engine} loads GGUF files: use a gguf source, or a Hugging Face filename ending in .gguf",
            field="engine",
        )


def _check_fields(fields: dict[str, Any]) -> None:
    unknown = sorted(set(fields) - MODEL_FIELDS)
    if unknown:
        raise Invalid(f"a model has no field {unknown[0]!r}", field=unknown[0])
