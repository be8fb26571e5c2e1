"""API keys for the OpenAI endpoint in the control plane: made, listed, scoped and revoked over the REST
API with audit entries, and published to etcd as signed records that a sync keeps equal to the database."""

import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.accounts.models import Role, User
from controlplane.apikeys import publication
from controlplane.apikeys.models import ApiKey
from controlplane.audit.models import AuditEntry
from runtime.errors import DiscoveryUnavailable
from runtime.fleet_contract.api_keys import API_KEYS_PREFIX, BadRecord, etcd_key, key_hash, read_secret, verify
from tests.distributed.cluster import etcd_put, etcd_values
from tests.infra import EtcdServer
from tests.servers import free_port

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def secret_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "api-keys.secret"
    path.write_text("s" * 64)
    monkeypatch.setenv("FLOTILLA_API_KEYS_SECRET_FILE", str(path))
    return path


@pytest.fixture
def etcd(etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> EtcdServer:
    monkeypatch.setenv("ETCD_ENDPOINTS", etcd_server.endpoint)
    return etcd_server


@pytest.fixture
def committing(django_capture_on_commit_callbacks: Any) -> Callable[[], Any]:
    """``with committing():`` runs what the actions inside leave for after their commit, as a commit would."""
    return lambda: django_capture_on_commit_callbacks(execute=True)


def create(client: APIClient, **fields: Any) -> Any:
    return client.post("/api/v1/api-keys/", {"name": "chat-app", **fields}, format="json")


def test_an_operator_makes_a_key_shown_once_and_stored_as_its_hash(operator: APIClient) -> None:
    response = create(operator, allowed_models=["smol", "org/big"], requests_per_minute=60, tokens_per_minute=10_000)
    assert response.status_code == 201, response.json()
    made = response.json()
    secret = made["key"]
    assert secret.startswith("sk-flt-") and len(secret) == 7 + 43
    assert made["key_start"] == secret[:12] and made["allowed_models"] == ["org/big", "smol"]
    row = ApiKey.objects.get()
    assert row.key_hash == key_hash(secret) and secret not in str(ApiKey.objects.values().get())

    listed = operator.get("/api/v1/api-keys/").json()["results"]
    assert [key["name"] for key in listed] == ["chat-app"] and "key" not in listed[0]
    entry = AuditEntry.objects.get(action="api_key.create")
    assert entry.after["name"] == "chat-app" and "key_hash" not in entry.after


def test_people_see_and_revoke_only_their_own_keys_and_admins_everyones(
    client_for: Callable[[Role | None], APIClient],
) -> None:
    alice, bob, admin = client_for(Role.OPERATOR), client_for(Role.OPERATOR), client_for(Role.ADMIN)
    key_id = create(alice).json()["id"]
    assert bob.get(f"/api/v1/api-keys/{key_id}/").status_code == 404
    assert bob.post(f"/api/v1/api-keys/{key_id}/revoke/").status_code == 404
    assert bob.get("/api/v1/api-keys/").json()["results"] == []
    assert [key["id"] for key in admin.get("/api/v1/api-keys/").json()["results"]] == [key_id]

    revoked = admin.post(f"/api/v1/api-keys/{key_id}/revoke/")
    assert revoked.status_code == 200 and revoked.json()["revoked"]
    again = alice.post(f"/api/v1/api-keys/{key_id}/revoke/")
    assert again.status_code == 409 and "revoked already" in again.json()["detail"]
    assert AuditEntry.objects.filter(action="api_key.revoke").count() == 1
    # The name is free again once its key is revoked.
    assert create(alice).status_code == 201


def test_only_an_admin_makes_a_key_for_someone_else_and_readers_make_none(
    client_for: Callable[[Role | None], APIClient],
) -> None:
    operator, admin, reader = client_for(Role.OPERATOR), client_for(Role.ADMIN), client_for(Role.READ_ONLY)
    owner = User.objects.get(role=Role.OPERATOR).username
    refused = create(operator, owner=User.objects.get(role=Role.ADMIN).username)
    assert refused.status_code == 403 and "only an admin" in refused.json()["detail"]
    made = create(admin, owner=owner)
    assert made.status_code == 201 and made.json()["owner"] == owner
    assert create(reader).status_code == 403


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"name": ""}, "name"),
        ({"name": "   "}, "name"),
        ({"name": "x" * 101}, "name"),
        ({"allowed_models": "smol"}, "allowed_models"),
        ({"allowed_models": ["bad name!"]}, "allowed_models"),
        ({"allowed_models": [f"m{i}" for i in range(101)]}, "allowed_models"),
        ({"requests_per_minute": 0}, "requests_per_minute"),
        ({"tokens_per_minute": "lots"}, "tokens_per_minute"),
        ({"monthly_token_budget": -5}, "monthly_token_budget"),
        ({"max_concurrent_requests": 0}, "max_concurrent_requests"),
        ({"expires_at": "yesterday"}, "expires_at"),
        ({"expires_at": "2020-01-01T00:00:00Z"}, "expires_at"),
        ({"owner": "nobody-of-that-name"}, "owner"),
    ],
)
def test_bad_keys_are_refused_naming_the_field(admin: APIClient, fields: dict[str, Any], field: str) -> None:
    response = create(admin, **fields)
    assert response.status_code == 400, response.json()
    assert field in str(response.json())


def test_a_second_live_key_of_the_same_name_is_a_conflict(operator: APIClient) -> None:
    assert create(operator).status_code == 201
    second = create(operator)
    assert second.status_code == 409 and "pick another name" in second.json()["detail"]


def test_a_key_and_its_revocation_are_published_to_etcd_signed(
    operator: APIClient, etcd: EtcdServer, committing: Callable[[], Any]
) -> None:
    expires = timezone.now() + datetime.timedelta(days=30)
    with committing():
        made = create(
            operator,
            allowed_models=["smol"],
            expires_at=expires.isoformat(),
            tokens_per_minute=500,
            max_concurrent_requests=4,
        ).json()
    assert made["max_concurrent_requests"] == 4
    hashed = key_hash(made["key"])
    secret = read_secret(publication.secret_file())

    value = etcd_values(etcd, API_KEYS_PREFIX)[etcd_key(hashed)].encode()
    record = verify(value, hashed, secret)
    assert (record.key_id, record.name, record.models, record.tokens_per_minute) == (
        made["id"],
        "chat-app",
        ["smol"],
        500,
    )
    assert record.expires_at == pytest.approx(expires.timestamp()) and not record.revoked
    assert record.max_concurrent_requests == 4
    with pytest.raises(BadRecord, match="signature"):
        verify(value, key_hash("sk-flt-another"), secret)  # a record cannot be moved to another key

    with committing():
        operator.post(f"/api/v1/api-keys/{made['id']}/revoke/")
    revoked = verify(etcd_values(etcd, API_KEYS_PREFIX)[etcd_key(hashed)].encode(), hashed, secret)
    assert revoked.revoked and revoked.version > record.version


def test_the_sync_rewrites_tampered_records_and_deletes_forged_ones(
    operator: APIClient, etcd: EtcdServer, committing: Callable[[], Any]
) -> None:
    with committing():
        made = create(operator).json()
    key = etcd_key(key_hash(made["key"]))
    published = etcd_values(etcd, API_KEYS_PREFIX)[key]
    etcd_put(etcd, key, published.replace('"chat-app"', '"other"'))  # altered: its signature no longer fits
    etcd_put(etcd, etcd_key(key_hash("sk-flt-forged")), published)  # a copy under a key nobody made

    report = publication.sync()
    assert (report.written, report.deleted) == (1, 1)
    assert etcd_values(etcd, API_KEYS_PREFIX) == {key: published}
    assert publication.sync().written == 0  # nothing left to do


def test_after_a_new_secret_is_put_first_in_the_file_the_sync_re_signs_every_record_with_it(
    operator: APIClient, etcd: EtcdServer, secret_file: Path, committing: Callable[[], Any]
) -> None:
    with committing():
        made = create(operator).json()
    hashed = key_hash(made["key"])
    old, new = b"s" * 64, b"n" * 64
    secret_file.write_bytes(new + b"\n" + old + b"\n")  # the rotation's second step: the new secret signs

    assert publication.sync().written == 1
    value = etcd_values(etcd, API_KEYS_PREFIX)[etcd_key(hashed)].encode()
    assert verify(value, hashed, new).key_id == made["id"]
    with pytest.raises(BadRecord, match="signature"):
        verify(value, hashed, old)


def test_with_etcd_down_a_key_is_still_made_and_the_sync_says_so(
    operator: APIClient, monkeypatch: pytest.MonkeyPatch, committing: Callable[[], Any]
) -> None:
    monkeypatch.setenv("ETCD_ENDPOINTS", f"http://127.0.0.1:{free_port()}")
    with committing():
        assert create(operator).status_code == 201  # published by the next sync instead
    with pytest.raises(DiscoveryUnavailable, match="cannot reach etcd to publish to the ingresses"):
        publication.sync()
