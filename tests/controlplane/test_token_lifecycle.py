"""Tokens over their life: an agent's rotated (the old one revoked), any token expiring, a person's read-only."""

import datetime
import io
from collections.abc import Callable

import pytest
from django.core.management import CommandError, call_command
from django.db import OperationalError
from django.db.models import QuerySet
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.accounts import actions
from controlplane.accounts.models import ApiToken, Role
from controlplane.accounts.task_keys import node_task_keys
from controlplane.audit.models import AuditEntry
from runtime.fleet_contract.signing import agent_signing_key
from tests.controlplane.factories import TEST_ACTOR, make_user

pytestmark = [pytest.mark.django_db, pytest.mark.postgresql]


def create_token(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("createtoken", *args, stdout=out, stderr=err)
    return out.getvalue().strip(), err.getvalue()


def client_with(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def register(key: str) -> int:
    return client_with(key).post("/api/v1/agent/register/", {"name": "gpu-a"}, format="json").status_code


def test_a_rotated_agent_token_revokes_the_old_one_and_its_task_key() -> None:
    old, _ = create_token("--agent", "gpu-a")
    assert register(old) == 200
    new, note = create_token("--agent", "gpu-a", "--revoke-old")
    assert f"revoked node gpu-a's older agent token(s): {old[:12]}… (agent of gpu-a)" in note
    response = client_with(old).post("/api/v1/agent/heartbeat/", {}, format="json")
    assert (response.status_code, response.json()) == (401, {"detail": "unknown or revoked token"})
    assert register(new) == 200
    # Tasks are signed for the new token's agent only: the old key signs nothing more.
    assert node_task_keys("gpu-a") == [agent_signing_key(new, "gpu-a")]
    assert AuditEntry.objects.filter(action="token.revoke", actor_name="system:manage.py createtoken").count() == 1


def test_a_new_agent_token_without_revoke_old_leaves_the_old_one_working_and_says_so() -> None:
    old, _ = create_token("--agent", "gpu-a")
    new, note = create_token("--agent", "gpu-a")
    assert "older agent token(s) still work" in note and "--revoke-old revokes them" in note
    assert register(old) == 200 and register(new) == 200
    assert len(node_task_keys("gpu-a")) == 2


def test_the_api_rotates_an_agent_token(admin: APIClient) -> None:
    old, _ = create_token("--agent", "gpu-a")
    response = admin.post("/api/v1/tokens/", {"kind": "agent", "node_name": "gpu-a", "revoke_old": True}, format="json")
    assert response.status_code == 201, response.json()
    assert register(old) == 401
    assert register(response.json()["key"]) == 200
    assert ApiToken.objects.filter(node_name="gpu-a").count() == 1


def test_an_expired_token_is_refused_with_401_saying_when_it_expired() -> None:
    user = make_user("carol", Role.OPERATOR)
    token, key = actions.create_person_token(TEST_ACTOR, user, expires_at=timezone.now() + datetime.timedelta(hours=1))
    assert client_with(key).get("/api/v1/nodes/").status_code == 200
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    ApiToken.objects.filter(pk=token.pk).update(expires_at=when)
    response = client_with(key).get("/api/v1/nodes/")
    assert response.status_code == 401
    assert response.json() == {"detail": "this token expired at 2026-01-02 03:04:05 UTC: ask an admin for a new one"}


def test_an_expired_agent_token_is_refused_and_its_key_signs_no_task() -> None:
    _, key = actions.create_agent_token(TEST_ACTOR, "gpu-a", expires_at=timezone.now() + datetime.timedelta(days=1))
    assert register(key) == 200 and len(node_task_keys("gpu-a")) == 1
    ApiToken.objects.update(expires_at=timezone.now() - datetime.timedelta(seconds=1))
    assert register(key) == 401
    assert node_task_keys("gpu-a") == []


def test_createtoken_expires_in_sets_the_expiry() -> None:
    create_token("--user", "dave", "--expires-in", "30d")
    token = ApiToken.objects.get(user__username="dave")
    assert token.expires_at is not None
    left = token.expires_at - timezone.now()
    assert datetime.timedelta(days=29, hours=23) < left <= datetime.timedelta(days=30)


@pytest.mark.parametrize("text", ["30", "0d", "1y", "-1d", "d"])
def test_createtoken_refuses_a_duration_it_cannot_read(text: str) -> None:
    with pytest.raises(CommandError, match="is not a duration like 90m, 12h, 30d or 2w"):
        create_token("--user", "dave", f"--expires-in={text}")


def test_a_token_cannot_be_made_already_expired(admin: APIClient) -> None:
    response = admin.post(
        "/api/v1/tokens/",
        {"kind": "agent", "node_name": "gpu-a", "expires_at": "2020-01-01T00:00:00Z"},
        format="json",
    )
    assert response.status_code == 400 and "expires_at" in response.json()


def test_a_read_scoped_token_of_an_admin_can_get_and_cannot_post() -> None:
    key, _ = create_token("--user", "grafana", "--role", "admin", "--scope", "read")
    client = client_with(key)
    assert client.get("/api/v1/tokens/").status_code == 200  # reading what the admin role may read
    response = client.post("/api/v1/tokens/", {"kind": "agent", "node_name": "gpu-b"}, format="json")
    assert response.status_code == 403
    assert "is read-only (scope 'read'): it may only read, whatever your role" in response.json()["detail"]
    assert client.delete(f"/api/v1/tokens/{ApiToken.objects.get().pk}/").status_code == 403
    assert ApiToken.objects.count() == 1


def test_a_full_token_of_the_same_person_still_writes() -> None:
    create_token("--user", "erin", "--role", "admin", "--scope", "read")
    key, _ = create_token("--user", "erin")
    response = client_with(key).post("/api/v1/tokens/", {"kind": "agent", "node_name": "gpu-b"}, format="json")
    assert response.status_code == 201


def test_scopes_and_revocation_belong_to_their_kind_of_token(admin: APIClient) -> None:
    with pytest.raises(CommandError, match="--scope is for a person's token"):
        create_token("--agent", "gpu-a", "--scope", "read")
    with pytest.raises(CommandError, match="--revoke-old is for an agent's token"):
        create_token("--user", "frank", "--revoke-old")
    response = admin.post("/api/v1/tokens/", {"kind": "agent", "node_name": "gpu-a", "scope": "read"}, format="json")
    assert response.status_code == 400 and "scope" in response.json()


def test_the_token_listing_shows_scope_and_expiry(admin: APIClient, agent_client: Callable[[str], APIClient]) -> None:
    create_token("--user", "gina", "--scope", "read", "--expires-in", "2w")
    rows = admin.get("/api/v1/tokens/", {"kind": "person"}).json()["results"]
    [gina] = [row for row in rows if row["user"] == "gina"]
    assert gina["scope"] == "read" and gina["expires_at"] is not None


def test_a_request_is_served_when_recording_its_tokens_use_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The last-used time is bookkeeping: SQLite's "table is locked" (two requests at once on a shared
    in-memory database) on that write is logged, and the request is answered as if it had succeeded."""
    _, key = actions.create_person_token(TEST_ACTOR, make_user("bob", Role.READ_ONLY))

    def locked(self: QuerySet[ApiToken], **fields: object) -> int:
        raise OperationalError("database table is locked: accounts_apitoken")

    monkeypatch.setattr(QuerySet, "update", locked)
    assert client_with(key).get("/api/v1/nodes/").status_code == 200
    assert "could not record that token" in caplog.text
    monkeypatch.undo()
    assert ApiToken.objects.get(kind=ApiToken.Kind.PERSON).last_used_at is None
    # The next request records it.
    assert client_with(key).get("/api/v1/nodes/").status_code == 200
    assert ApiToken.objects.get(kind=ApiToken.Kind.PERSON).last_used_at is not None
