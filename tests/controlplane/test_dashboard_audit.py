"""The audit log page: filtered by actor, kind of action and object, newest first, a page at a time, taking
in new entries as they come; an entry's page with its before/after."""

import re

import pytest
from django.test import Client

from controlplane.accounts.models import Role
from controlplane.apikeys.actions import create_key
from controlplane.audit.models import AuditEntry
from controlplane.audit.records import Actor
from controlplane.dashboard.audit_log import PAGE_SIZE
from controlplane.deployments.pipelines import delete_pipeline, scale_pipeline, stop_pipeline
from tests.controlplane.factories import TEST_ACTOR, deploy, make_node, make_user
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


def poll_after(html: str) -> int:
    """The ``after`` of the page's poll for newer entries."""
    found = re.search(r'id="audit-poll" hx-get="/audit/newer/\?(?:[^"]*&amp;)?after=(\d+)"', html)
    assert found, "the page does not poll for newer entries"
    return int(found.group(1))


def test_the_first_page_polls_for_the_entries_newer_than_its_newest_with_its_filters() -> None:
    browser = logged_in(Role.OPERATOR)
    chat = deploy("chat")
    first = browser.get("/audit/", {"action": "pipeline."}).content.decode()
    newest = shown(first)[0]
    assert poll_after(first) == newest and "action=pipeline." in first
    assert browser.get("/audit/newer/", {"action": "pipeline.", "after": newest}).status_code == 204

    scale_pipeline(Actor(name="olga"), chat, 2)
    make_node("gpu-a")  # not a pipeline entry: the filter leaves it out
    scale_pipeline(Actor(name="olga"), chat, 3)
    answer = browser.get("/audit/newer/", {"action": "pipeline.", "after": newest})
    html = answer.content.decode()
    scales = list(AuditEntry.objects.filter(action="pipeline.scale").order_by("-id").values_list("pk", flat=True))
    assert answer.status_code == 200 and shown(html) == scales
    assert 'hx-swap-oob="true"' in html and poll_after(html) == scales[0] and "action=pipeline." in html
    assert "scaled aggregated 2 → 3" in html


def test_the_poll_answers_a_bad_after_or_filter_with_its_reason() -> None:
    browser = logged_in(Role.OPERATOR)
    for after in ("", "x", "-1"):
        answer = browser.get("/audit/newer/", {"after": after})
        assert answer.status_code == 400 and "after must be the id of the newest entry shown" in answer.content.decode()
    answer = browser.get("/audit/newer/", {"after": "0", "target_type": "spaceship"})
    assert answer.status_code == 400 and "these filters cannot be used: target_type" in answer.content.decode()
    assert logged_in(Role.READ_ONLY, username="reader").get("/audit/newer/", {"after": "0"}).status_code == 403


def test_older_pages_do_not_poll() -> None:
    browser = logged_in(Role.OPERATOR)
    pipeline = deploy("chat")
    for replicas in range(PAGE_SIZE + 1):
        scale_pipeline(Actor(name="olga"), pipeline, replicas % 2)
    assert 'id="audit-poll"' not in browser.get("/audit/", {"page": "2"}).content.decode()


def test_an_entry_opens_its_diff_and_a_link_to_what_it_is_about() -> None:
    browser = logged_in(Role.OPERATOR)
    chat = deploy("chat")
    scale_pipeline(Actor(name="olga"), chat, 3)
    entry = AuditEntry.objects.get(action="pipeline.scale")
    assert f'href="/audit/{entry.pk}/"' in browser.get("/audit/").content.decode()

    html = browser.get(f"/audit/{entry.pk}/").content.decode()
    changed, unchanged = html.split('id="audit-unchanged"')
    assert "<code>groups[aggregated].replicas</code></td><td>1</td><td>3</td>" in changed
    assert "<code>name</code></td><td>chat</td>" in unchanged and "<code>name</code>" not in changed
    assert f'id="audit-target" href="/pipelines/{chat.pk}/"' in html and "scaled aggregated 1 → 3" in html

    gone = deploy("gone", replicas=0)
    stop_pipeline(TEST_ACTOR, gone)
    delete_pipeline(TEST_ACTOR, gone)
    deployed = AuditEntry.objects.get(action="pipeline.deploy", target_name="gone")
    assert 'id="audit-target"' not in browser.get(f"/audit/{deployed.pk}/").content.decode()


def test_an_api_key_entry_shows_no_secret() -> None:
    browser = logged_in(Role.ADMIN)
    key, secret = create_key(TEST_ACTOR, make_user("olga"), "ci")
    entry = AuditEntry.objects.get(action="api_key.create")
    html = browser.get(f"/audit/{entry.pk}/").content.decode()
    assert secret not in html and key.key_hash not in html
    assert f'href="/api-keys/#api-key-{key.pk}"' in html


def test_an_entry_page_needs_the_audit_role_and_an_existing_entry() -> None:
    deploy("chat")
    entry = AuditEntry.objects.latest("id")
    assert logged_in(Role.OPERATOR).get(f"/audit/{entry.pk + 1000}/").status_code == 404
    assert logged_in(Role.READ_ONLY, username="reader").get(f"/audit/{entry.pk}/").status_code == 403
    anonymous = Client().get(f"/audit/{entry.pk}/")
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/login/")
