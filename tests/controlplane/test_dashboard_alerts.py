"""The Alerts page: firing and resolved alerts, silences; operators silence and expire from the page,
read-only people see no controls and get 403 on posting; the nav's badge and the overview count firing alerts."""

import datetime

import pytest
from django.test import Client
from django.utils import timezone

from controlplane.accounts.models import Role
from controlplane.alerts.models import Alert, Rule, Silence
from tests.controlplane.factories import deploy
from tests.controlplane.test_api_alerts import make_alert
from tests.controlplane.test_dashboard import logged_in

pytestmark = pytest.mark.django_db


def test_the_page_shows_firing_and_resolved_alerts_and_the_nav_counts_the_firing_ones() -> None:
    make_alert("gpu-a")
    make_alert("gpu-b", resolved=True)
    page = logged_in(Role.READ_ONLY).get("/alerts/").content.decode()
    firing, resolved = page.split('id="firing-alerts"')[1].split('id="resolved-alerts"')
    assert "node gpu-a is offline" in firing and "gpu-b" not in firing
    assert "node gpu-b is offline" in resolved
    assert 'hx-get="/alerts/badge/" hx-trigger="every 10s"' in page and ">1</span>" in page


def test_the_pages_tables_refresh_themselves_and_leave_the_new_silence_form_alone() -> None:
    browser = logged_in(Role.OPERATOR)
    page = browser.get("/alerts/").content.decode()
    live = page[page.index('<div id="alerts-live"') : page.index('id="silence-form"')]
    assert 'hx-get="/alerts/" hx-swap="innerHTML"' in live
    assert "hx-trigger=\"every 5s[!document.querySelector('#alerts-live :focus')]\"" in live  # not while typing
    assert "No alert is firing." in live
    make_alert("gpu-a")
    tables = browser.get("/alerts/", HTTP_HX_REQUEST="true").content.decode()
    assert "<html" not in tables and 'id="silence-form"' not in tables  # the tables alone
    firing = tables[tables.index('id="firing-alerts"') : tables.index("<h2>Silences</h2>")]
    assert "node gpu-a is offline" in firing and "csrfmiddlewaretoken" in firing  # its Silence button works


def test_the_badge_refreshes_itself_with_the_count() -> None:
    browser = logged_in(Role.READ_ONLY)
    assert ">0</span>" in browser.get("/alerts/badge/").content.decode()
    make_alert("gpu-a")
    badge = browser.get("/alerts/badge/").content.decode()
    assert 'class="badge firing"' in badge and ">1</span>" in badge
    assert Client().get("/alerts/badge/").status_code == 302  # anonymous: the login page


def test_the_overview_shows_the_firing_count_and_its_line_refreshes_itself() -> None:
    browser = logged_in(Role.READ_ONLY)
    page = browser.get("/").content.decode()
    assert "No alert firing" in page
    assert 'hx-get="/alerts/summary/" hx-trigger="every 10s"' in page  # not drawn once and left stale
    make_alert("gpu-a")
    make_alert("gpu-b")
    assert "2 alerts firing" in browser.get("/").content.decode()
    line = browser.get("/alerts/summary/").content.decode()
    assert line.startswith('<p id="overview-alerts" class="error"') and "2 alerts firing" in line
    assert Client().get("/alerts/summary/").status_code == 302  # anonymous: the login page


def test_an_operator_silences_an_alert_from_its_row_and_it_shows_silenced() -> None:
    make_alert("gpu-a")
    browser = logged_in(Role.OPERATOR, username="olga")
    page = browser.get("/alerts/").content.decode()
    assert 'action="/alerts/silences/"' in page
    answer = browser.post(
        "/alerts/silences/", {"rule": "node_offline", "subject": "gpu-a", "duration_minutes": 60, "comment": "reboot"}
    )
    assert answer.status_code == 302
    silence = Silence.objects.get()
    assert (silence.rule, silence.subject, silence.created_by_name) == (Rule.NODE_OFFLINE, "gpu-a", "olga")
    page = browser.get("/alerts/").content.decode()
    assert "silenced until" in page and "by olga" in page and "reboot" in page


def test_a_bad_silence_is_shown_on_the_page_with_a_400() -> None:
    browser = logged_in(Role.OPERATOR)
    answer = browser.post("/alerts/silences/", {"rule": "", "subject": "", "duration_minutes": 60, "comment": "x"})
    assert answer.status_code == 400 and "needs a rule or a subject" in answer.content.decode()
    answer = browser.post("/alerts/silences/", {"subject": "gpu-a", "duration_minutes": 7, "comment": "x"})
    assert answer.status_code == 400 and "Select a valid choice" in answer.content.decode()
    assert Silence.objects.count() == 0


def test_an_operator_expires_a_silence() -> None:
    browser = logged_in(Role.OPERATOR)
    browser.post("/alerts/silences/", {"subject": "gpu-a", "duration_minutes": 60, "comment": "x"})
    silence = Silence.objects.get()
    assert browser.post(f"/alerts/silences/{silence.pk}/expire/").status_code == 302
    silence.refresh_from_db()
    assert silence.ends_at <= timezone.now()
    assert "No silence is in force" in browser.get("/alerts/").content.decode()


def test_read_only_people_see_no_silence_controls_and_may_not_post() -> None:
    make_alert("gpu-a")
    silence = Silence.objects.create(
        subject="gpu-b", ends_at=timezone.now() + datetime.timedelta(hours=1), comment="x", created_by_name="olga"
    )
    browser = logged_in(Role.READ_ONLY)
    page = browser.get("/alerts/").content.decode()
    assert "/alerts/silences/" not in page and "<button" not in page.split("<main>")[1]
    refused = browser.post("/alerts/silences/", {"subject": "gpu-a", "duration_minutes": 60, "comment": "x"})
    assert refused.status_code == 403
    assert browser.post(f"/alerts/silences/{silence.pk}/expire/").status_code == 403
    assert Silence.objects.count() == 1 and Silence.objects.get().ends_at > timezone.now()


def test_the_pipeline_edit_form_sets_and_clears_the_ttft_target() -> None:
    pipeline = deploy("chat")
    browser = logged_in(Role.OPERATOR)
    form = browser.get(f"/pipelines/{pipeline.pk}/edit/").context["form"]
    data = {name: ("" if value is None else value) for name, value in form.initial.items()}
    data["ttft_target_ms"] = 750
    answer = browser.post(f"/pipelines/{pipeline.pk}/edit/", data)
    assert answer.status_code in (200, 302), answer.content.decode()[:2000]
    pipeline.refresh_from_db()
    assert pipeline.ttft_target_ms == 750
    data["ttft_target_ms"] = ""
    browser.post(f"/pipelines/{pipeline.pk}/edit/", data)
    pipeline.refresh_from_db()
    assert pipeline.ttft_target_ms is None
    assert Alert.objects.count() == 0
