"""The Requests page (the request log): filtered by model, key, status class, worker and request id, newest first,
polled for new rows; bad filters are a 400 with the form's errors; a row opens the router's decision; and the
pipeline page's router view lists its last requests."""

import datetime
import re

import pytest

from controlplane.accounts.models import Role
from controlplane.traffic.models import RequestRecord
from tests.controlplane.factories import deploy
from tests.controlplane.test_dashboard import logged_in

pytestmark = pytest.mark.django_db

T0 = datetime.datetime(2026, 1, 2, 12, 0, tzinfo=datetime.UTC)


def add(request_id: str, seconds: int, **fields: object) -> RequestRecord:
    values: dict[str, object] = {"model": "chat", "endpoint": "chat", "status": 200}
    return RequestRecord.objects.create(
        request_id=request_id, at=T0 + datetime.timedelta(seconds=seconds), **{**values, **fields}
    )


def shown(html: str) -> list[str]:
    """The request ids on the page, in order."""
    return re.findall(r'<a href="/requests/\d+/">([^<]+)</a>', html)


def test_requests_are_listed_newest_first_and_filtered() -> None:
    browser = logged_in(Role.OPERATOR)
    add("old-ok", 0, api_key_id=3, endpoint_instance_id=0xAB)
    add("refused", 1, model="other", status=429, error="rate_limit_error")
    add("broke", 2, status=200, error="internal_error", endpoint_instance_id=0xCD)
    add("new-ok", 3, api_key_id=4)

    assert shown(browser.get("/requests/").content.decode()) == ["new-ok", "broke", "refused", "old-ok"]
    assert shown(browser.get("/requests/", {"model": "other"}).content.decode()) == ["refused"]
    assert shown(browser.get("/requests/", {"key": "3"}).content.decode()) == ["old-ok"]
    assert shown(browser.get("/requests/", {"status": "4xx"}).content.decode()) == ["refused"]
    assert shown(browser.get("/requests/", {"status": "failed"}).content.decode()) == ["broke", "refused"]
    assert shown(browser.get("/requests/", {"status": "2xx"}).content.decode()) == ["new-ok", "old-ok"]
    assert shown(browser.get("/requests/", {"worker": "cd"}).content.decode()) == ["broke"]
    assert shown(browser.get("/requests/", {"q": "-OK"}).content.decode()) == ["new-ok", "old-ok"]
    # The poll's partial: the same rows for the same filters, and the first page polls again.
    rows = browser.get("/requests/rows/", {"model": "chat"}).content.decode()
    assert shown(rows) == ["new-ok", "broke", "old-ok"] and 'hx-trigger="every 3s"' in rows


@pytest.mark.parametrize(
    ("field", "value"),
    [("key", "abc"), ("key", "-1"), ("status", "7xx"), ("worker", "not-hex"), ("model", "m" * 300)],
)
def test_bad_filters_are_a_form_error_with_a_400_never_a_500(field: str, value: str) -> None:
    response = logged_in(Role.OPERATOR).get("/requests/", {field: value})
    assert response.status_code == 400
    assert "errorlist" in response.content.decode()
    assert logged_in(Role.OPERATOR, username="op-2").get("/requests/rows/", {field: value}).status_code == 400


def test_the_request_log_needs_the_operator_role() -> None:
    assert logged_in(Role.READ_ONLY).get("/requests/").status_code == 403
    assert 'href="/requests/"' in logged_in(Role.OPERATOR, username="op").get("/").content.decode()


def test_a_request_opens_the_routers_decision() -> None:
    record = add(
        "routed",
        0,
        router_mode="kv",
        endpoint_instance_id=0x1F,
        dp_rank=0,
        overlap_blocks=6,
        prompt_blocks=8,
        cost=2.5,
        candidates=3,
    )
    page = logged_in(Role.OPERATOR).get(f"/requests/{record.pk}/").content.decode()
    assert "6 of the prompt&#x27;s 8 blocks already cached there" in page or "6 of the prompt's 8 blocks" in page
    assert "2.50 blocks (the cheapest of 3 workers weighed)" in page and "<code>1f</code>" in page


def test_the_pipeline_page_shows_the_routers_view_of_its_last_requests() -> None:
    pipeline = deploy("chat")
    add(
        "mine",
        0,
        pipeline=pipeline,
        router_mode="kv",
        endpoint_instance_id=0x2A,
        overlap_blocks=4,
        prompt_blocks=5,
        cost=1.0,
    )
    add("theirs", 1)  # no pipeline
    page = logged_in(Role.READ_ONLY).get(f"/pipelines/{pipeline.pk}/").content.decode()
    view = page.split('id="router-view"', 1)[1].split("</section>", 1)[0]
    assert "<code>2a</code>" in view and "4 / 5" in view and "1.00" in view
    assert view.count("<tr>") == 2  # the header and its one request
    # It refreshes itself (a request routed since shows without a reload), and its refresh is the same view.
    assert f'hx-get="/pipelines/{pipeline.pk}/router-view/" hx-trigger="every 5s"' in page
    add("later", 2, pipeline=pipeline, router_mode="kv", endpoint_instance_id=0x2B, overlap_blocks=1, prompt_blocks=5)
    refreshed = logged_in(Role.READ_ONLY, username="reader-2").get(f"/pipelines/{pipeline.pk}/router-view/")
    assert refreshed.status_code == 200
    body = refreshed.content.decode()
    assert body.startswith('<section id="router-view"') and "<code>2b</code>" in body and body.count("<tr>") == 3
    assert logged_in(Role.READ_ONLY, username="reader-3").get("/pipelines/999999/router-view/").status_code == 404
