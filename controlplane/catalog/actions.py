"""Changes to the model catalog. Each runs in one transaction and writes an audit entry.

A model whose ``memory_bytes`` the operator leaves out gets an estimate (catalog/memory.py), kept up to
date when what it is made of changes (size, config, context length, source); a local source this
machine can read gives its own size and config when they are not given. A local source lies under the
local model roots (catalog/local_roots.py): the control plane reads no other path of its host.
"""

import re
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from controlplane.audit.records import Actor, record, snapshot
from controlplane.catalog.engines import GGUF_ONLY_ENGINES, PROJECTOR_ENGINE
from controlplane.catalog.local_roots import check_local_source
from controlplane.catalog.memory import estimate_memory_bytes, local_file_size, read_local_model
from controlplane.catalog.models import LanguageModel, validate_model_name
from controlplane.catalog.remote_code import check_model_change, record_change
from controlplane.errors import Conflict, Invalid, InvalidDocument
from planner.errors import ProfileError
from planner.profile import Profile

# Fields an action may set; everything else is the database's.
MODEL_FIELDS = frozenset(
    {
        "name",
        "source_kind",
        "source",
        "revision",
        "filename",
        "projector",
        "engine",
        "default_engine_args",
        "size_bytes",
        "memory_bytes",
        "context_length",
        "config",
    }
)
# Where a model's files come from: trusting its remote code trusts these (catalog/remote_code.py).
_SOURCE_FIELDS = ("source_kind", "source", "revision", "filename", "projector")
# What an estimate is made of: a change to any of them makes a new one.
_ESTIMATE_INPUTS = frozenset(
    {"size_bytes", "config", "context_length", "source", "source_kind", "engine", "projector", "revision"}
)
# huggingface_hub's own rule for a repo id: "name" or "owner/name".
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")
_FILENAME = re.compile(r"^[A-Za-z0-9._-][A-Za-z0-9._ /-]{0,254}$")


@transaction.atomic
def create_model(actor: Actor, **fields: Any) -> LanguageModel:
    """Add a model to the catalog.

    Raises Invalid naming the field when the source does not suit its kind or the engine, Conflict
    when the name is taken, Forbidden when its default engine args trust remote code and ``actor`` may not
    allow that (catalog/remote_code.py).
    """
    _check_fields(fields)
    model = LanguageModel(**fields)
    _check_name(model.name)
    check_model(model)
    remote_code = check_model_change(actor, before=None, after=model.default_engine_args, source_changed=False)
    _check_local_root(model)
    _check_projector_root(model)
    _fill_from_local_files(model)
    _fill_projector_size(model)
    if model.memory_bytes is None:
        _estimate(model)
    try:
        model.save()
    except IntegrityError as exc:
        raise Conflict(f"a model named {model.name!r} already exists") from exc
    record(actor, "model.create", model, before=None, after=snapshot(model))
    record_change(actor, model, remote_code, kind="model", where="default_engine_args")
    return model


@transaction.atomic
def update_model(actor: Actor, model: LanguageModel, **changes: Any) -> LanguageModel:
    """Change a model's fields; pipelines already deployed keep running with what they were started with.

    Raises Invalid, Conflict or Forbidden as ``create_model`` does; Forbidden too for a new source of a model
    whose default engine args trust remote code.
    """
    _check_fields(changes)
    model = LanguageModel.objects.select_for_update().get(pk=model.pk)
    before = snapshot(model)
    for name, value in changes.items():
        setattr(model, name, value)
    check_model(model)
    remote_code = check_model_change(
        actor,
        before=before["default_engine_args"],
        after=model.default_engine_args,
        source_changed=any(before[name] != getattr(model, name) for name in _SOURCE_FIELDS),
    )
    if "source" in changes or "source_kind" in changes:
        _check_local_root(model)
        _fill_from_local_files(model)
    if "projector" in changes or "source_kind" in changes:
        _check_projector_root(model)
    if any(before[name] != getattr(model, name) for name in ("projector", "source_kind", "source", "revision")):
        model.projector_bytes = None  # another file: its size is read or reported again
        _fill_projector_size(model)
    if "memory_bytes" in changes:
        model.memory_estimated = False
        if model.memory_bytes is None:  # "forget my figure": estimate instead
            _estimate(model)
    elif (model.memory_estimated or model.memory_bytes is None) and _ESTIMATE_INPUTS & set(changes):
        _estimate(model)
    try:
        model.save()
    except IntegrityError as exc:
        raise Conflict(f"a model named {model.name!r} already exists") from exc
    record(actor, "model.update", model, before=before, after=snapshot(model))
    record_change(actor, model, remote_code, kind="model", where="default_engine_args")
    return model


@transaction.atomic
def record_model_size(
    actor: Actor, model: LanguageModel, size_bytes: int | None, projector_bytes: int | None = None
) -> bool:
    """Learn a model's size on disk, and its projector's, from a finished download, when nobody gave them; the
    memory estimate follows. Returns whether anything changed (a known size is kept; a projector's size is
    taken only for a model that has a projector)."""
    model = LanguageModel.objects.select_for_update().get(pk=model.pk)
    learn_size = model.size_bytes is None and size_bytes is not None and size_bytes > 0
    learn_projector = (
        bool(model.projector) and model.projector_bytes is None and projector_bytes is not None and projector_bytes > 0
    )
    if not (learn_size or learn_projector):
        return False
    before = snapshot(model)
    if learn_size:
        model.size_bytes = size_bytes
    if learn_projector:
        model.projector_bytes = projector_bytes
    if model.memory_bytes is None or model.memory_estimated:
        _estimate(model)
    model.save()
    record(actor, "model.update", model, before=before, after=snapshot(model))
    return True


@transaction.atomic
def set_profile(actor: Actor, model: LanguageModel, profile: Any) -> LanguageModel:
    """Store the model's profile (a decoded JSON document, as planner/profile.py reads it), or remove it
    (None). Stored as given, so that notes and unknown-to-the-planner keys it accepts stay. Raises
    InvalidDocument listing every problem with its path (``decode.points[1].tokens_per_s``)."""
    if profile is not None:
        try:
            Profile.from_dict(profile)
        except ProfileError as exc:
            raise InvalidDocument(f"the profile does not validate: {exc}", exc.problems) from exc
    model = LanguageModel.objects.select_for_update().get(pk=model.pk)
    before = snapshot(model)
    model.profile = profile
    model.save(update_fields=["profile", "updated_at"])
    record(actor, "model.profile", model, before=before, after=snapshot(model))
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
    check_source(model.source_kind, model.source, model.revision, model.filename)
    if model.engine in GGUF_ONLY_ENGINES and not model.is_gguf:
        raise Invalid(
            f"{model.engine} loads GGUF files: use a gguf source, or a Hugging Face filename ending in .gguf",
            field="engine",
        )
    check_projector(model)


def check_projector(model: LanguageModel) -> None:
    """Raise Invalid (field ``projector``) unless the model's projector, when it has one, is a GGUF file its
    engine takes: llama.cpp's, a file of the model's Hugging Face repo or an absolute path on the nodes."""
    projector = model.projector
    if not projector:
        return
    if model.engine != PROJECTOR_ENGINE:
        raise Invalid(
            f"only llamacpp takes a multimodal projector, not {model.engine}: leave projector empty", field="projector"
        )
    if not projector.lower().endswith(".gguf"):
        raise Invalid(f"a projector is a GGUF file (llama.cpp's mmproj-*.gguf), not {projector!r}", field="projector")
    if model.source_kind == LanguageModel.SourceKind.HUGGING_FACE:
        if not _repo_file(projector):
            raise Invalid(f"{projector!r} is not a file name inside the repo", field="projector")
    elif not projector.startswith("/") or "\x00" in projector:
        raise Invalid(
            f"with a {model.source_kind} source a projector is an absolute path on the nodes", field="projector"
        )


def check_source(kind: str, source: str, revision: str, filename: str) -> None:
    """Raise Invalid (naming the field) unless ``source`` (with ``revision`` and ``filename``) suits its ``kind``
    (a model's or an adapter's: ``LanguageModel.SourceKind``)."""
    if kind == LanguageModel.SourceKind.HUGGING_FACE:
        if not _REPO_ID.match(source):
            raise Invalid(f"{source!r} is not a Hugging Face repo id (owner/name)", field="source")
        if revision and (not _REVISION.match(revision) or ".." in revision):
            raise Invalid(f"{revision!r} is not a branch, tag or commit", field="revision")
        if filename and not _repo_file(filename):
            raise Invalid(f"{filename!r} is not a file name inside the repo", field="filename")
    else:
        if not source.startswith("/") or "\x00" in source:
            raise Invalid(f"a {kind} source is an absolute path on the nodes, not {source!r}", field="source")
        if kind == LanguageModel.SourceKind.GGUF and not source.lower().endswith(".gguf"):
            raise Invalid(f"a GGUF source is a path ending in .gguf, not {source!r}", field="source")
        for field_name, value in (("revision", revision), ("filename", filename)):
            if value:
                raise Invalid(f"only a Hugging Face source has a {field_name}", field=field_name)


def _repo_file(name: str) -> bool:
    """Whether ``name`` names a file inside a Hugging Face repo (no ``..`` out of it)."""
    return bool(_FILENAME.match(name)) and ".." not in name.split("/")


def _check_local_root(model: LanguageModel) -> None:
    """A local source must lie under the local model roots (catalog/local_roots.py); raise Invalid otherwise.

    Checked when the source is set, not on every edit: a model added before the roots were narrowed
    keeps working until its source changes.
    """
    if model.source_kind != LanguageModel.SourceKind.HUGGING_FACE:
        check_local_source(model.source, settings.LOCAL_MODEL_ROOTS)


def _check_projector_root(model: LanguageModel) -> None:
    """A local projector lies under the local model roots, as a local source does; raise Invalid otherwise."""
    if model.projector and model.source_kind != LanguageModel.SourceKind.HUGGING_FACE:
        check_local_source(model.projector, settings.LOCAL_MODEL_ROOTS, field="projector")


def _estimate(model: LanguageModel) -> None:
    if not model.loads_weights:  # its replicas hold no weights: the files' size says nothing of their need
        model.memory_bytes, model.memory_estimated = None, False
        return
    model.memory_bytes = estimate_memory_bytes(
        model.size_bytes, model.config or {}, model.context_length, model.projector_bytes
    )
    model.memory_estimated = model.memory_bytes is not None


def _fill_from_local_files(model: LanguageModel) -> None:
    """Take the size and config of a local source from its files, when this machine sees them."""
    if model.source_kind == LanguageModel.SourceKind.HUGGING_FACE:
        return
    if model.size_bytes is not None and model.config:
        return
    files = read_local_model(model.source, settings.LOCAL_MODEL_ROOTS)
    if files is None:
        return
    if model.size_bytes is None:
        model.size_bytes = files.size_bytes
    if not model.config:
        model.config = files.config


def _fill_projector_size(model: LanguageModel) -> None:
    """Take a local projector's size from its file, when this machine sees it (a hub one's is reported by the
    first node that fetches it)."""
    if model.projector and model.source_kind != LanguageModel.SourceKind.HUGGING_FACE:
        model.projector_bytes = local_file_size(model.projector, settings.LOCAL_MODEL_ROOTS)


def _check_fields(fields: dict[str, Any]) -> None:
    unknown = sorted(set(fields) - MODEL_FIELDS)
    if unknown:
        raise Invalid(f"a model has no field {unknown[0]!r}", field=unknown[0])


def _check_name(name: str) -> None:
    """The model's name as its field's validator checks it (forms and the API check it first; this is
    the check every caller gets). Raises Invalid naming ``name``."""
    try:
        validate_model_name(name)
    except ValidationError as exc:
        raise Invalid(f"{name!r}: {' '.join(exc.messages)}", field="name") from exc
