"""The audit log's writer: entries only inside an action's transaction, announced after commit."""

from typing import Any

import pytest

from controlplane.audit.models import AuditEntry
from controlplane.audit.records import Actor, entry_committed, record, snapshot
from controlplane.catalog.models import LanguageModel
from controlplane.errors import Invalid
from tests.controlplane.factories import make_model

pytestmark = [pytest.mark.django_db, pytest.mark.postgresql]


def test_an_entry_is_announced_once_its_transaction_commits(django_capture_on_commit_callbacks: Any) -> None:
    announced: list[AuditEntry] = []

    def receiver(sender: object, entry: AuditEntry, **kwargs: object) -> None:
        announced.append(entry)

    entry_committed.connect(receiver)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            make_model("smol")
            assert announced == []
        assert [entry.action for entry in announced] == ["model.create"]
    finally:
        entry_committed.disconnect(receiver)


def test_a_refused_action_announces_nothing(django_capture_on_commit_callbacks: Any) -> None:
    with django_capture_on_commit_callbacks() as callbacks, pytest.raises(Invalid):
        make_model("bad", engine="llamacpp")
    assert callbacks == []
    assert not AuditEntry.objects.exists()


@pytest.mark.django_db(transaction=True)  # no test-wide transaction around it
def test_recording_outside_a_transaction_is_a_programming_error() -> None:
    model = LanguageModel.objects.create(name="raw", source_kind="hf", source="a/b", engine="mocker")
    with pytest.raises(RuntimeError, match="inside the action's transaction"):
        record(Actor.system("tests"), "model.create", model, before=None, after=snapshot(model))


def test_snapshots_are_json_ready_and_name_foreign_keys_by_id() -> None:
    model = make_model("smol")
    values = snapshot(model)
    assert isinstance(values["created_at"], str)
    assert values["name"] == "smol"
