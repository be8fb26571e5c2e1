"""The audit log's one-line summaries and diffs, over the snapshots the real actions record."""

import datetime

import pytest
from django.utils import timezone

from controlplane.alerts.actions import create_silence
from controlplane.apikeys.actions import create_key
from controlplane.audit.models import AuditEntry
from controlplane.catalog.adapters import create_adapter
from controlplane.dashboard.audit_summary import HIDDEN, diff, summarize
from controlplane.deployments import adapters as adapter_actions
from controlplane.deployments import pipelines as pipeline_actions
from tests.controlplane.factories import TEST_ACTOR, deploy, make_model, make_user

pytestmark = pytest.mark.django_db


def latest_summary(action: str) -> str:
    entry = AuditEntry.objects.filter(action=action).latest("id")
    return summarize(entry.action, entry.before, entry.after)


def test_scaling_stopping_and_starting_a_pipeline_say_so() -> None:
    chat = deploy("chat")
    pipeline_actions.scale_pipeline(TEST_ACTOR, chat, 3)
    assert latest_summary("pipeline.scale") == "scaled aggregated 1 → 3"
    pipeline_actions.stop_pipeline(TEST_ACTOR, chat)
    assert latest_summary("pipeline.stop") == "stopped"
    pipeline_actions.start_pipeline(TEST_ACTOR, chat)
    assert latest_summary("pipeline.start") == "started"
    assert latest_summary("pipeline.deploy") == "pipeline created"


def test_router_and_engine_arg_edits_name_what_changed() -> None:
    chat = deploy("chat")
    pipeline_actions.update_pipeline(TEST_ACTOR, chat, router_mode="kv")
    assert latest_summary("pipeline.update") == "router round-robin → kv"
    pipeline_actions.update_group(TEST_ACTOR, chat, engine_args={"max_loras": 4})
    assert latest_summary("pipeline.update_group") == "engine args changed (max_loras)"


def test_loading_an_adapter_names_the_adapter() -> None:
    model = make_model("smol")
    create_adapter(TEST_ACTOR, model, name="sql", source_kind="hf", source="acme/smol-sql-lora", revision="v1")
    chat = deploy("chat", model)
    adapter_actions.load_adapter(TEST_ACTOR, chat, "sql")
    assert latest_summary("pipeline.load_adapter") == "adapter sql loaded"
    adapter_actions.unload_adapter(TEST_ACTOR, chat, "sql")
    assert latest_summary("pipeline.unload_adapter") == "adapter sql unloaded"


def test_creating_a_key_or_a_silence_says_created() -> None:
    create_key(TEST_ACTOR, make_user("olga"), "ci")
    assert latest_summary("api_key.create") == "api key created"
    ends = timezone.now() + datetime.timedelta(hours=1)
    create_silence(TEST_ACTOR, rule="", subject="chat", ends_at=ends, comment="upgrading")
    assert latest_summary("silence.create") == "silence created"


def test_a_secret_shows_that_it_changed_never_its_value() -> None:
    before = {"engine_args": {"hf_token": "hf_old_secret"}, "name": "chat"}
    after = {"engine_args": {"hf_token": "hf_new_secret"}, "name": "chat"}
    summary = summarize("pipeline.update", before, after)
    assert summary == "engine_args.hf_token changed"
    shown = [str(value) for change in diff(before, after) for value in (change.before, change.after)]
    assert not any("secret" in value for value in shown) and HIDDEN in shown
    assert summarize("user.password", None, {"password": "reset"}) == "password changed"
    # "tokens" in a limit's name is not a secret.
    assert summarize("api_key.update", {"tokens_per_minute": 10}, {"tokens_per_minute": 20}) == (
        "tokens_per_minute 10 → 20"
    )


def test_long_values_are_cut_and_many_changes_become_a_list() -> None:
    long = "x" * 100
    assert summarize("model.update", {"source": "a"}, {"source": long}) == f"source a → {'x' * 39}…"
    many_before = {"a": 1, "b": 1, "c": 1, "d": {"e": 1}}
    many_after = {"a": 2, "b": 2, "c": 2, "d": {"e": 2}}
    assert summarize("model.update", many_before, many_after) == "changed: a, b, c, d"
    assert summarize("model.delete", {"a": 1}, None) == "model deleted"


def test_a_diff_lists_the_changed_keys_first_and_nested_records_by_their_role() -> None:
    before = {"name": "chat", "groups": [{"role": "decode", "replicas": 1}], "state": "running"}
    after = {"name": "chat", "groups": [{"role": "decode", "replicas": 2}], "state": "running"}
    changes = diff(before, after)
    assert [(c.path, c.before, c.after, c.changed) for c in changes] == [
        ("groups[decode].replicas", 1, 2, True),
        ("name", "chat", "chat", False),
        ("groups[decode].role", "decode", "decode", False),
        ("state", "running", "running", False),
    ]
