"""The Usage page: what the person's keys used (an admin's: every key's) per UTC day, by key and by
model, in charts and a table, filtered by key, model and dates, with a CSV link carrying the same filters."""

import csv
import datetime
import html
import io
import json
import re
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from controlplane.accounts.models import Role, User
from controlplane.apikeys import actions
from controlplane.apikeys.models import ApiKey, KeyUsage
from controlplane.audit.records import Actor
from controlplane.dashboard import usage
from tests.controlplane.factories import make_user
from tests.controlplane.test_dashboard import logged_in

pytestmark = pytest.mark.django_db

DAY = datetime.date(2027, 1, 15)


def make_key(owner: User, name: str = "chat-app") -> ApiKey:
    return actions.create_key(Actor.person(owner), owner, name)[0]


def used(key: ApiKey, model: str, day: datetime.date, requests: int = 1, prompt: int = 0, completion: int = 0) -> None:
    """A day's usage row, as the drain (controlplane/apikeys/usage.py) leaves it."""
    KeyUsage.objects.create(
        key=key, model=model, day=day, requests=requests, prompt_tokens=prompt, completion_tokens=completion
    )


def charts_of(page: str) -> Any:
    match = re.search(r'<script id="usage-data" type="application/json">(.*?)</script>', page, re.S)
    assert match, "no chart data on the page"
    return json.loads(match.group(1))


@pytest.fixture
def two_people() -> tuple[Client, ApiKey, ApiKey]:
    """Olga (logged in) with a key that used two models on two days; Bob with a key of his own."""
    browser = logged_in(Role.OPERATOR, username="olga")
    olgas, bobs = make_key(User.objects.get(username="olga")), make_key(make_user("bob"), "bobs-app")
    used(olgas, "smol", DAY, requests=2, prompt=10, completion=5)
    used(olgas, "big", DAY, requests=1, prompt=100, completion=1)
    used(olgas, "smol", DAY + datetime.timedelta(days=2), requests=3, prompt=30, completion=3)
    used(bobs, "smol", DAY, requests=7, prompt=700, completion=70)
    return browser, olgas, bobs


def test_read_only_people_may_not_see_usage() -> None:
    assert logged_in(Role.READ_ONLY).get("/usage/").status_code == 403
    assert Client().get("/usage/").status_code == 302


def test_an_operator_sees_their_keys_usage_per_day_in_charts_and_the_table(
    two_people: tuple[Client, ApiKey, ApiKey],
) -> None:
    browser, olgas, _ = two_people
    response = browser.get("/usage/", {"since": "2027-01-15", "until": "2027-01-17"})
    assert response.status_code == 200
    page = response.content.decode()
    assert "bobs-app" not in page and 'id="usage-table"' in page
    assert 'id="usage-requests">6<' in page and 'id="usage-prompt-tokens">140<' in page
    charts = charts_of(page)
    midnight = int(datetime.datetime(2027, 1, 15, tzinfo=datetime.UTC).timestamp())
    assert charts["days"] == [midnight, midnight + 86400, midnight + 2 * 86400]
    ((key_line),) = charts["by_key"]
    assert key_line["label"] == f"chat-app ({olgas.key_start}…)"
    assert key_line["tokens"] == [116, 0, 33] and key_line["requests"] == [3, 0, 3]
    by_model = [(line["label"], line["tokens"]) for line in charts["by_model"]]
    assert by_model == [("big", [101, 0, 0]), ("smol", [15, 0, 33])]
    assert page.count("<tr><td>2027-01-") == 3
    assert "uPlot.iife.min.js" in page and "usage_charts.js" in page and "cdn" not in page.lower()


def test_the_filters_narrow_the_rows_and_the_csv_link_carries_them(two_people: tuple[Client, ApiKey, ApiKey]) -> None:
    browser, olgas, _ = two_people
    response = browser.get("/usage/", {"key": olgas.pk, "model": "smol", "since": "2027-01-16", "until": ""})
    page = html.unescape(response.content.decode())
    assert page.count("<tr><td>2027-01-") == 1 and 'id="usage-requests">3<' in page
    match = re.search(r'<a id="usage-csv" href="([^"]+)"', page)
    assert match and match.group(1) == f"/api/v1/usage/export/?key={olgas.pk}&model=smol&since=2027-01-16"
    exported = browser.get(match.group(1))
    assert exported.status_code == 200
    rows = list(csv.DictReader(io.StringIO(exported.content.decode())))
    assert [(row["day"], row["model"], row["requests"]) for row in rows] == [("2027-01-17", "smol", "3")]


def test_without_filters_the_page_shows_the_last_thirty_days() -> None:
    browser = logged_in(Role.OPERATOR, username="olga")
    key = make_key(User.objects.get(username="olga"))
    today = timezone.now().date()
    used(key, "smol", today, requests=4)
    used(key, "smol", today - datetime.timedelta(days=40), requests=100)
    page = browser.get("/usage/").content.decode()
    assert 'id="usage-requests">4<' in page and len(charts_of(page)["days"]) == 30
    assert f'value="{(today - datetime.timedelta(days=29)).isoformat()}"' in page  # the since it used
    assert 'id="usage-requests">104<' in browser.get("/usage/", {"since": ""}).content.decode()  # all days


def test_an_admin_sees_every_keys_usage_with_its_owner(two_people: tuple[Client, ApiKey, ApiKey]) -> None:
    _, _, bobs = two_people
    admin = logged_in(Role.ADMIN, username="ada")
    page = admin.get("/usage/", {"since": "2027-01-01"}).content.decode()
    assert 'id="usage-requests">13<' in page and "<td>bob</td>" in page
    page = admin.get("/usage/", {"key": bobs.pk, "since": ""}).content.decode()
    assert 'id="usage-requests">7<' in page


def test_bad_filters_are_refused_with_a_message(two_people: tuple[Client, ApiKey, ApiKey]) -> None:
    browser, _, bobs = two_people
    cases = [
        ({"since": "yesterday"}, "Enter a valid date."),
        ({"since": "2027-02-01", "until": "2027-01-01"}, "Until is before since."),
        ({"key": "nope"}, "Select a valid choice."),
        ({"key": bobs.pk}, "Select a valid choice."),  # another person's key is not one of yours
    ]
    for params, reason in cases:
        response = browser.get("/usage/", params)
        assert response.status_code == 400, params
        page = response.content.decode()
        assert reason in page and 'id="usage-table"' not in page and "usage-data" not in page, params


def test_many_series_are_folded_into_others() -> None:
    owner = make_user("olga")
    keys = [make_key(owner, f"app-{n}") for n in range(usage.MAX_SERIES + 2)]
    for n, key in enumerate(keys):
        used(key, "smol", DAY, prompt=n + 1)
    rows = usage.usage_rows(owner)
    lines = usage.charts(rows, [DAY], {key.pk: key.name for key in keys})["by_key"]
    assert len(lines) == usage.MAX_SERIES + 1 and lines[0]["label"] == f"app-{usage.MAX_SERIES + 1}"
    assert lines[-1] == {"label": "2 others", "tokens": [3], "requests": [2]}


def test_a_key_without_usage_yet_shows_zeros_and_says_so() -> None:
    browser = logged_in(Role.OPERATOR, username="olga")
    make_key(User.objects.get(username="olga"))
    page = browser.get("/usage/").content.decode()
    assert 'id="usage-requests">0<' in page and "No usage on these days." in page
    assert charts_of(page)["by_key"] == []
    assert "make one" in logged_in(Role.OPERATOR, username="kim").get("/usage/").content.decode()
