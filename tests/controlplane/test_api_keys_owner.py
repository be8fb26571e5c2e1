"""A person's API keys follow their account: deactivating them (REST API, dashboard or Django admin)
suspends their live keys, published at once as revoked records that every ingress refuses with a 401, and
reactivating them restores those keys; a revoked key stays revoked. Checked over the REST API against a
real etcd, and end to end against a real ingress process."""

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from rest_framework.test import APIClient

from controlplane.accounts import actions as account_actions
from controlplane.accounts.models import Role, User
from controlplane.apikeys import actions as key_actions
from controlplane.apikeys import publication
from controlplane.apikeys.models import ApiKey
from controlplane.audit.models import AuditEntry
from controlplane.errors import Conflict
from runtime.fleet_contract.api_keys import API_KEYS_PREFIX, KeyRecord, etcd_key, key_hash, read_secret, verify
from tests.controlplane.factories import TEST_ACTOR, make_user
from tests.distributed.cluster import Cluster, etcd_values, wait_until
from tests.infra import EtcdServer, NatsServer
from tests.servers import Server

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def secret_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "api-keys.secret"
    path.write_text("s" * 64)
    path.chmod(0o600)
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


def make_key(admin: APIClient, owner: User, name: str, committing: Callable[[], Any]) -> dict[str, Any]:
    with committing():
        response = admin.post("/api/v1/api-keys/", {"name": name, "owner": owner.username}, format="json")
    assert response.status_code == 201, response.json()
    made: dict[str, Any] = response.json()
    return made


def published(etcd: EtcdServer, key: str) -> KeyRecord:
    """The record of ``key`` in etcd, checked as an ingress checks it."""
    hashed = key_hash(key)
    value = etcd_values(etcd, API_KEYS_PREFIX)[etcd_key(hashed)].encode()
    return verify(value, hashed, read_secret(publication.secret_file()))


def set_active(admin: APIClient, person: User, active: bool, committing: Callable[[], Any]) -> None:
    with committing():
        response = admin.post(f"/api/v1/people/{person.pk}/{'reactivate' if active else 'deactivate'}/")
    assert response.status_code == 200, response.json()


def test_deactivating_the_owner_suspends_their_keys_and_reactivating_restores_them(
    admin: APIClient, etcd: EtcdServer, committing: Callable[[], Any]
) -> None:
    olga = make_user("olga", Role.OPERATOR)
    live = make_key(admin, olga, "chat-app", committing)
    ended = make_key(admin, olga, "old-app", committing)
    with committing():
        assert admin.post(f"/api/v1/api-keys/{ended['id']}/revoke/").status_code == 200
    before = published(etcd, live["key"])
    assert not before.revoked

    set_active(admin, olga, False, committing)
    suspended = published(etcd, live["key"])
    assert suspended.revoked and suspended.suspended and suspended.version > before.version
    listed = {key["name"]: key for key in admin.get("/api/v1/api-keys/").json()["results"]}
    assert (listed["chat-app"]["suspended"], listed["chat-app"]["revoked"]) == (True, False)
    assert AuditEntry.objects.filter(action="api_key.suspend", target_id=str(live["id"])).count() == 1
    assert publication.sync().written == 0  # the periodic sync agrees with what was published

    set_active(admin, olga, True, committing)
    restored = published(etcd, live["key"])
    assert not restored.revoked and not restored.suspended and restored.version > suspended.version
    assert AuditEntry.objects.filter(action="api_key.restore").count() == 1
    # The key revoked before stays revoked, and was never "suspended".
    still_revoked = published(etcd, ended["key"])
    assert still_revoked.revoked and not still_revoked.suspended
    assert AuditEntry.objects.filter(action__in=["api_key.suspend", "api_key.restore"]).count() == 2


def test_deactivating_someone_in_the_django_admin_suspends_their_keys_too(
    admin: APIClient, etcd: EtcdServer, committing: Callable[[], Any]
) -> None:
    olga = make_user("olga", Role.OPERATOR)
    live = make_key(admin, olga, "chat-app", committing)
    olga.is_active = False
    with committing():
        account_actions.save_user(TEST_ACTOR, olga)  # what the admin's change form calls
    assert published(etcd, live["key"]).suspended
    olga.first_name = "Olga"
    with committing():
        account_actions.save_user(TEST_ACTOR, olga)  # an edit that leaves her inactive changes no key
    assert AuditEntry.objects.filter(action="api_key.suspend").count() == 1


def test_no_key_is_made_for_a_deactivated_person(admin: APIClient) -> None:
    olga = make_user("olga", Role.OPERATOR)
    account_actions.deactivate_user(TEST_ACTOR, olga)
    refused = admin.post("/api/v1/api-keys/", {"name": "chat-app", "owner": "olga"}, format="json")
    assert refused.status_code == 400 and "owner" in refused.json()
    # The action checks it too, under a lock on her row: a deactivation racing the form cannot miss the key.
    with pytest.raises(Conflict, match="olga is deactivated"):
        key_actions.create_key(TEST_ACTOR, olga, "chat-app")
    assert not ApiKey.objects.exists()


def test_a_live_ingress_refuses_a_deactivated_persons_key_and_serves_it_again_after_reactivation(
    admin: APIClient,
    etcd: EtcdServer,
    nats_server: NatsServer,
    tmp_path: Path,
    secret_file: Path,
    committing: Callable[[], Any],
) -> None:
    olga = make_user("olga", Role.OPERATOR)
    key = make_key(admin, olga, "chat-app", committing)["key"]
    with serving(Cluster(etcd, nats_server, tmp_path / "serving"), secret_file) as ingress:
        assert ask(ingress, key)

        set_active(admin, olga, False, committing)
        wait_until(lambda: refused(ingress, key), 10, "the deactivated person's key still worked")
        with pytest.raises(openai.AuthenticationError, match="suspended: its owner's account is deactivated"):
            ask(ingress, key)

        set_active(admin, olga, True, committing)
        wait_until(lambda: not refused(ingress, key), 10, "the reactivated person's key stayed refused")
        assert ask(ingress, key)


@contextlib.contextmanager
def serving(cluster: Cluster, secret_file: Path) -> Iterator[Server]:
    """An ingress that requires keys, with an echo worker serving "alpha"; both stopped on exit."""
    cluster.directory.mkdir()
    try:
        ingress = cluster.start_ingress("--api-keys-secret-file", str(secret_file))
        # Not the control plane's secret, which this process's environment holds: a worker takes no such flag.
        worker_env = {"FLOTILLA_API_KEYS_SECRET_FILE": ""}
        cluster.start_worker("dyn://alpha", "out=echo_core", "--model-name", "alpha", env=worker_env)
        wait_until(lambda: serves_alpha(ingress), 15, "the model did not appear")
        yield ingress
    finally:
        cluster.stop()


def serves_alpha(ingress: Server) -> bool:
    return "alpha" in httpx.get(ingress.base_url + "/health", timeout=5).json()["models"]


def ask(ingress: Server, key: str) -> str:
    client = openai.OpenAI(base_url=ingress.api_url, api_key=key, max_retries=0, timeout=30)
    reply = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}])
    return reply.choices[0].message.content or ""


def refused(ingress: Server, key: str) -> bool:
    try:
        ask(ingress, key)
    except openai.AuthenticationError:
        return True
    return False
