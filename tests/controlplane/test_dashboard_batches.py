"""The Batches page: the batches of the person's keys (an admin's: everyone's) with their progress, the table
polling itself only while one is running; read-only people may not see it."""

import datetime

import pytest
from django.utils import timezone

from controlplane.accounts.models import Role, User
from controlplane.apikeys.models import ApiKey
from controlplane.batches.models import Batch, StoredFile
from tests.controlplane.factories import make_user
from tests.controlplane.test_dashboard import logged_in
from tests.controlplane.test_dashboard_usage import make_key

pytestmark = pytest.mark.django_db


def batch_of(key: ApiKey, status: str, total: int, completed: int, failed: int = 0) -> Batch:
    file = StoredFile.objects.create(api_key=key, purpose="batch", filename="in.jsonl", bytes=10)
    return Batch.objects.create(
        api_key=key,
        endpoint="/v1/chat/completions",
        input_file=file,
        status=status,
        total=total,
        completed=completed,
        failed=failed,
        expires_at=timezone.now() + datetime.timedelta(hours=24),
    )


def test_an_operator_sees_the_progress_of_their_keys_batches_only() -> None:
    browser = logged_in(Role.OPERATOR, username="olga")
    mine = batch_of(make_key(User.objects.get(username="olga")), Batch.Status.IN_PROGRESS, 40, 25, failed=3)
    theirs = batch_of(make_key(make_user("bob"), "bobs-app"), Batch.Status.COMPLETED, 5, 5)

    page = browser.get("/batches/").content.decode()

    assert mine.id in page and theirs.id not in page
    assert '<progress max="40" value="28"></progress> 28 / 40' in page and "(3 failed)" in page
    assert 'hx-trigger="every 2s"' in page  # one is running: the table refreshes itself
    partial = browser.get("/batches/", headers={"HX-Request": "true"}).content.decode()
    assert partial.startswith('<section id="batches"') and mine.id in partial


def test_an_admin_sees_everyones_and_a_finished_list_stops_polling() -> None:
    browser = logged_in(Role.ADMIN, username="ada")
    finished = batch_of(make_key(make_user("bob"), "bobs-app"), Batch.Status.COMPLETED, 5, 5)
    page = browser.get("/batches/").content.decode()
    assert finished.id in page and "<th>Owner</th>" in page and "bob" in page
    assert "hx-trigger" not in page.split('<section id="batches"')[1].split(">")[0]


def test_read_only_people_may_not_see_batches() -> None:
    assert logged_in(Role.READ_ONLY).get("/batches/").status_code == 403
