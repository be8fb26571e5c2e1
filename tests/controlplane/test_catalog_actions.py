"""Catalog actions: what they check, and the audit entry each writes."""

import pytest

from controlplane.audit.models import AuditEntry
from controlplane.catalog import actions
from controlplane.catalog.models import LanguageModel
from controlplane.errors import Conflict, Invalid
from tests.controlplane.factories import TEST_ACTOR, deploy, make_model

pytestmark = pytest.mark.django_db


def test_creating_a_model_records_it_after_and_nothing_before() -> None:
    model = make_model("smol", size_bytes=123)
    entry = AuditEntry.objects.get(action="model.create")
    assert (entry.target_type, entry.target_id, entry.target_name) == ("languagemodel", str(model.pk), "smol")
    assert entry.before is None
    assert entry.after["size_bytes"] == 123
    assert entry.actor_name == "system:tests"


def test_updating_a_model_records_before_and_after() -> None:
    model = make_model("smol", memory_bytes=1)
    actions.update_model(TEST_ACTOR, model, memory_bytes=2)
    entry = AuditEntry.objects.get(action="model.update")
    assert (entry.before["memory_bytes"], entry.after["memory_bytes"]) == (1, 2)


def test_deleting_a_model_records_what_it_was() -> None:
    model = make_model("smol")
    actions.delete_model(TEST_ACTOR, model)
    entry = AuditEntry.objects.get(action="model.delete")
    assert entry.before["name"] == "smol"
    assert entry.after is None
    assert not LanguageModel.objects.exists()


def test_a_model_in_use_cannot_be_deleted_and_nothing_is_recorded() -> None:
    model = make_model("smol")
    deploy("chat", model)
    with pytest.raises(Conflict, match="used by pipelines chat"):
        actions.delete_model(TEST_ACTOR, model)
    assert not AuditEntry.objects.filter(action="model.delete").exists()


def test_a_taken_name_is_a_conflict() -> None:
    make_model("smol")
    with pytest.raises(Conflict, match="already exists"):
        make_model("smol")


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"source": "not a repo"}, "source", "not a Hugging Face repo id"),
        ({"source": "org/name", "revision": "../main"}, "revision", "not a branch"),
        ({"source": "org/name", "filename": "../x.gguf"}, "filename", "not a file name"),
        ({"source_kind": "folder", "source": "models/smol"}, "source", "absolute path"),
        ({"source_kind": "gguf", "source": "/models/smol.bin"}, "source", "ending in .gguf"),
        ({"source_kind": "folder", "source": "/models/smol", "revision": "main"}, "revision", "only a Hugging Face"),
        ({"engine": "llamacpp"}, "engine", "llamacpp loads GGUF files"),
        ({"no_such_field": 1}, "no_such_field", "no field"),
        # A multimodal projector: llama.cpp's only, a GGUF file, inside the repo or under the local model roots.
        ({"projector": "mmproj-f16.gguf"}, "projector", "only llamacpp takes a multimodal projector"),
        (
            {"source": "org/repo-GGUF", "filename": "m.Q4_0.gguf", "engine": "llamacpp", "projector": "mmproj.bin"},
            "projector",
            "a projector is a GGUF file",
        ),
        (
            {"source": "org/repo-GGUF", "filename": "m.Q4_0.gguf", "engine": "llamacpp", "projector": "../mm.gguf"},
            "projector",
            "not a file name inside the repo",
        ),
        (
            {"source_kind": "gguf", "source": "/models/m.gguf", "engine": "llamacpp", "projector": "mmproj.gguf"},
            "projector",
            "absolute path on the nodes",
        ),
        (
            {"source_kind": "gguf", "source": "/models/m.gguf", "engine": "llamacpp", "projector": "/etc/mmproj.gguf"},
            "projector",
            "outside the local model folders",
        ),
    ],
)
def test_sources_that_do_not_suit_their_kind_or_engine_name_the_field(fields: dict, field: str, message: str) -> None:
    with pytest.raises(Invalid, match=message) as caught:
        make_model("bad", **fields)
    assert caught.value.field == field
    assert not LanguageModel.objects.exists()


@pytest.mark.parametrize(
    "fields",
    [
        {"source_kind": "gguf", "source": "/models/SmolLM2.Q4_1.GGUF", "engine": "llamacpp"},
        {"source": "org/repo-GGUF", "filename": "model.Q4_K_M.gguf", "engine": "llamacpp"},
        {"source_kind": "folder", "source": "/srv/models/smol", "engine": "vllm"},
        {"source": "gpt2", "revision": "refs/pr/1"},
        {"source": "org/repo-GGUF", "filename": "m.Q4_0.gguf", "engine": "llamacpp", "projector": "mmproj-f16.gguf"},
        {"source_kind": "gguf", "source": "/models/m.gguf", "engine": "llamacpp", "projector": "/models/mmproj.gguf"},
    ],
)
def test_sources_that_suit_their_kind_and_engine_are_accepted(fields: dict) -> None:
    assert make_model("ok", **fields).pk is not None


@pytest.mark.django_db
def test_a_model_name_the_field_would_refuse_is_invalid_for_every_caller() -> None:
    with pytest.raises(Invalid, match="'bad name!'") as refused:
        actions.create_model(
            TEST_ACTOR, name="bad name!", source_kind="huggingface", source="org/model", engine="mocker"
        )
    assert refused.value.field == "name"
    assert not LanguageModel.objects.exists()


@pytest.mark.django_db
def test_a_projector_moved_outside_the_local_model_folders_is_refused_and_the_model_keeps_its_own() -> None:
    model = make_model(
        "vision", source_kind="gguf", source="/models/m.gguf", engine="llamacpp", projector="/models/mmproj.gguf"
    )
    with pytest.raises(Invalid, match="outside the local model folders") as refused:
        actions.update_model(TEST_ACTOR, model, projector="/etc/mmproj.gguf")
    assert refused.value.field == "projector"
    model.refresh_from_db()
    assert model.projector == "/models/mmproj.gguf"
