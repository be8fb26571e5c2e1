"""The audit log page: filtered by actor, kind of action and object, newest first, a page at a time."""

import re

import pytest

from controlplane.accounts.models import Role
from controlplane.audit.models import AuditEntry
from controlplane.audit.records import Actor
from controlplane.dashboard.audit_log import PAGE_SIZE
from controlplane.deployments.pipelines import scale_pipeline
from tests.controlplane.factories import deploy, make_node
from tests.controlplane.test_dashboard import logged_in

pytestmark = pytest.mark.django_db


def shown(html: str) -> list[int]:
    """The ids of the entries on the page, in order."""
    return [int(pk) for pk in re.findall(r'<li id="audit-(\d+)">', html)]


def test_entries_are_filtered_by_actor_kind_and_object() -> None:
    browser = logged_in(Role.OPERATOR)
    chat, other = deploy("chat"), deploy("other")
    scale_pipeline(Actor(name="olga", user_id=None), chat, 2)
    scale_pipeline(Actor(name="pete", user_id=None), other, 3)
    make_node("gpu-a")

    by_olga = shown(browser.get("/audit/", {"actor": "olga"}).content.decode())
    assert by_olga and {e.actor_name for e in AuditEntry.objects.filter(pk__in=by_olga)} == {"olga"}
    scales = shown(browser.get("/audit/", {"action": "pipeline.scale"}).content.decode())
    assert sorted(scales) == sorted(AuditEntry.objects.filter(action="pipeline.scale").values_list("pk", flat=True))
    about_chat = shown(browser.get("/audit/", {"target_type": "pipeline", "target": "chat"}).content.decode())
    assert set(AuditEntry.objects.filter(pk__in=about_chat).values_list("target_name", flat=True)) == {"chat"}
    assert len(about_chat) == 2  # deployed, scaled
    by_id = shown(browser.get("/audit/", {"target_type": "pipeline", "target": str(other.pk)}).content.decode())
    assert set(AuditEntry.objects.filter(pk__in=by_id).values_list("target_id", flat=True)) == {str(other.pk)}
    nothing = browser.get("/audit/", {"actor": "nobody"}).content.decode()
    assert shown(nothing) == [] and "No entry matches these filters." in nothing


def test_the_log_is_newest_first_and_paginated_keeping_the_filters() -> None:
    browser = logged_in(Role.ADMIN)
    pipeline = deploy("chat")
    for replicas in range(PAGE_SIZE + 5):
        scale_pipeline(Actor(name="olga", user_id=None), pipeline, replicas % 2)
    first = browser.get("/audit/", {"action": "pipeline.scale"}).content.decode()
    newest = list(AuditEntry.objects.filter(action="pipeline.scale").order_by("-created_at", "-id"))
    assert shown(first) == [entry.pk for entry in newest[:PAGE_SIZE]]
    assert "page 1 of 2" in first and 'href="?action=pipeline.scale&amp;page=2">Older</a>' in first
    second = browser.get("/audit/", {"action": "pipeline.scale", "page": "2"}).content.decode()
    assert shown(second) == [entry.pk for entry in newest[PAGE_SIZE:]]
    assert shown(browser.get("/audit/", {"action": "pipeline.scale", "page": "x"}).content.decode()) == shown(first)
