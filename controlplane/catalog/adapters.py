"""Changes to a model's LoRA adapters in the catalog: add and delete. Each runs in one transaction and writes an
audit entry.

An adapter is served under its own name, so that name is a served model name like a pipeline's: unique among
the pipelines' and the adapters' names, letter case aside (a client would not tell "Chat" from "chat"). Its
source is checked as a model's is (catalog/actions.py ``check_source``; a local one under the local model
roots, catalog/local_roots.py). Loading one on a pipeline is controlplane/deployments/adapters.py's.
"""

import re
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction

from controlplane.audit.records import Actor, record, snapshot
from controlplane.catalog.actions import check_source
from controlplane.catalog.local_roots import check_local_source
from controlplane.catalog.models import Adapter, LanguageModel
from controlplane.deployments.models import Pipeline
from controlplane.errors import Conflict, Invalid
from runtime.lora import MAX_NAME_LENGTH

#: runtime/lora.py's rule for an adapter's name: a served model name of letters, digits and ``._-:/``.
ADAPTER_NAME_PATTERN = rf"^[A-Za-z0-9][A-Za-z0-9._:/-]{{0,{MAX_NAME_LENGTH - 1}}}$"
_ADAPTER_NAME = re.compile(ADAPTER_NAME_PATTERN)
#: An adapter is a PEFT folder or one GGUF file: a local source is a folder or a gguf file, as a model's.
ADAPTER_FIELDS = frozenset({"name", "source_kind", "source", "revision", "filename"})


def served_name_owner(name: str) -> str | None:
    """What already serves ``name``, letter case aside, in words ("pipeline 'Chat'", "adapter 'chat-sql' of
    model 'smol'"); None when nothing does."""
    pipeline = Pipeline.objects.filter(name__iexact=name).values_list("name", flat=True).first()
    if pipeline is not None:
        return f"pipeline {pipeline!r}"
    adapter = Adapter.objects.filter(name__iexact=name).select_related("model").first()
    if adapter is not None:
        return f"adapter {adapter.name!r} of model {adapter.model.name!r}"
    return None


def served_name_taken_message(name: str, owner: str) -> str:
    """Why ``name`` is refused, naming what serves it (``served_name_owner``)."""
    return f"the served name {name!r} is taken by {owner} (served names may not differ only in letter case)"


@transaction.atomic
def create_adapter(actor: Actor, model: LanguageModel, **fields: Any) -> Adapter:
    """Add an adapter to ``model``. Raises Invalid naming the field (name, source; a name served already, a
    pipeline's or another adapter's, letter case aside), Conflict when one of its name was added meanwhile."""
    unknown = sorted(set(fields) - ADAPTER_FIELDS)
    if unknown:
        raise Invalid(f"an adapter has no field {unknown[0]!r}", field=unknown[0])
    adapter = Adapter(model=model, **fields)
    if not _ADAPTER_NAME.match(adapter.name):
        raise Invalid(
            f"{adapter.name!r}: 1-{MAX_NAME_LENGTH} letters, digits or . _ : / -, starting with a letter or digit",
            field="name",
        )
    if adapter.source_kind not in LanguageModel.SourceKind.values:
        kinds = ", ".join(LanguageModel.SourceKind.values)
        raise Invalid(f"{adapter.source_kind!r} is not a source kind ({kinds})", field="source_kind")
    check_source(adapter.source_kind, adapter.source, adapter.revision, adapter.filename)
    if adapter.source_kind != LanguageModel.SourceKind.HUGGING_FACE:
        check_local_source(adapter.source, settings.LOCAL_MODEL_ROOTS)
    if (owner := served_name_owner(adapter.name)) is not None:
        raise Invalid(served_name_taken_message(adapter.name, owner), field="name")
    try:
        with transaction.atomic():  # a savepoint: the clash of a concurrent add is read after it
            adapter.save()
    except IntegrityError as exc:
        raise Conflict(served_name_taken_message(adapter.name, served_name_owner(adapter.name) or "another")) from exc
    record(actor, "adapter.create", adapter, before=None, after=snapshot(adapter))
    return adapter


@transaction.atomic
def delete_adapter(actor: Actor, adapter: Adapter) -> None:
    """Remove an adapter from the catalog. Raises Conflict while a pipeline has it loaded."""
    users = list(adapter.pipelines.order_by("name").values_list("name", flat=True)[:6])
    if users:
        shown = ", ".join(users[:5]) + (" and more" if len(users) > 5 else "")
        raise Conflict(f"adapter {adapter.name!r} is loaded on pipelines {shown}; unload it first")
    record(actor, "adapter.delete", adapter, before=snapshot(adapter), after=None)
    adapter.delete()
