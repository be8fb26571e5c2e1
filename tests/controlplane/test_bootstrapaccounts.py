"""manage.py bootstrapaccounts: the accounts of `flotilla up`, made the first time and kept after.

Each run is given what launcher/stack/controlplane.py gives it (its arguments and secrets from
``bootstrap_command``, the tokens kept in the data folder from earlier runs), and its output is read as the
launcher reads it (``parse_bootstrap``).
"""

import io
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from controlplane.accounts.models import ApiToken, Role, User
from controlplane.apikeys.models import ApiKey
from controlplane.audit.models import AuditEntry
from launcher.stack.controlplane import (
    ADMIN_TOKEN_FILE,
    ADMIN_USERNAME,
    AGENT_TOKEN_FILE,
    API_KEY_FILE,
    API_KEY_NAME,
    LOCAL_NODE,
    Bootstrap,
    bootstrap_command,
    manage_command,
    parse_bootstrap,
    write_secret,
)
from runtime.fleet_contract.api_keys import API_KEYS_PREFIX, etcd_key, key_hash
from tests.distributed.cluster import etcd_values
from tests.infra import EtcdServer
from tests.servers import free_port

pytestmark = pytest.mark.django_db


def flotilla_up(data_dir: Path, monkeypatch: pytest.MonkeyPatch, *, api_key: bool = False) -> tuple[Bootstrap, str]:
    """Run the command as `flotilla up` does, keep the keys it prints as `flotilla up` does; (what the launcher
    read, the password it offered a new admin)."""
    argv, env, password = bootstrap_command(data_dir, api_key=api_key)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = io.StringIO()
    call_command(*argv[len(manage_command()) :], stdout=out)
    result = parse_bootstrap(out.getvalue())
    for file, key in (
        (ADMIN_TOKEN_FILE, result.admin_token),
        (AGENT_TOKEN_FILE, result.agent_token),
        (API_KEY_FILE, result.api_key),
    ):
        if key is not None:
            write_secret(data_dir / file, key)
    return result, password


def test_a_first_run_creates_the_admin_and_tokens_and_prints_them_for_the_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, password = flotilla_up(tmp_path, monkeypatch)
    assert result.admin_created and result.api_key is None
    admin = User.objects.get(username=ADMIN_USERNAME)
    assert (admin.role, admin.is_staff, admin.check_password(password)) == (Role.ADMIN, True, True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {result.admin_token}")
    assert client.get("/api/v1/tokens/").status_code == 200
    agent = ApiToken.objects.get(kind=ApiToken.Kind.AGENT)
    assert (agent.node_name, agent.description) == (LOCAL_NODE, "flotilla up: the local agent")
    assert result.agent_token is not None and result.agent_token.startswith(agent.key_start)
    audited = AuditEntry.objects.filter(actor_name="system:flotilla up").values_list("action", flat=True)
    assert sorted(audited) == ["token.create", "token.create", "user.create"]


def test_a_second_run_keeps_the_admin_and_the_tokens_that_still_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, password = flotilla_up(tmp_path, monkeypatch)
    again, offered = flotilla_up(tmp_path, monkeypatch)
    assert again == Bootstrap(admin_created=False, admin_token=None, agent_token=None, api_key=None)
    admin = User.objects.get(username=ADMIN_USERNAME)
    assert admin.check_password(password) and not admin.check_password(offered)  # the new password is not used
    assert ApiToken.objects.count() == 2
    assert AuditEntry.objects.filter(action="user.create").count() == 1


def test_kept_tokens_the_database_does_not_know_are_replaced_and_the_admin_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flotilla_up(tmp_path, monkeypatch)
    # As after a switch to another DATABASE_URL that has the admin: the kept tokens are another database's.
    write_secret(tmp_path / ADMIN_TOKEN_FILE, "flt_from_another_database")
    (tmp_path / AGENT_TOKEN_FILE).unlink()
    again, _ = flotilla_up(tmp_path, monkeypatch)
    assert not again.admin_created
    assert again.admin_token is not None and again.agent_token is not None
    assert ApiToken.objects.filter(user__username=ADMIN_USERNAME).count() == 2
    assert ApiToken.objects.filter(kind=ApiToken.Kind.AGENT, node_name=LOCAL_NODE).count() == 2


def test_the_api_key_is_made_once_and_replaced_when_its_file_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, _ = flotilla_up(tmp_path, monkeypatch, api_key=True)
    assert first.api_key is not None
    [key] = ApiKey.objects.filter(owner__username=ADMIN_USERNAME, name=API_KEY_NAME)
    assert first.api_key.startswith(key.key_start)
    assert flotilla_up(tmp_path, monkeypatch, api_key=True)[0].api_key is None  # the kept one still works

    (tmp_path / API_KEY_FILE).unlink()
    replaced, _ = flotilla_up(tmp_path, monkeypatch, api_key=True)
    assert replaced.api_key is not None and replaced.api_key != first.api_key
    key.refresh_from_db()
    assert key.revoked  # nobody can use it any more
    live = ApiKey.objects.filter(owner__username=ADMIN_USERNAME, name=API_KEY_NAME, revoked_at__isnull=True)
    assert replaced.api_key.startswith(live.get().key_start)


def test_a_new_admin_needs_its_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOTILLA_UP_PASSWORD", raising=False)
    with pytest.raises(CommandError, match="FLOTILLA_UP_PASSWORD is not set"):
        call_command("bootstrapaccounts", "--admin", "admin", "--node", "local", stdout=io.StringIO())
    assert not User.objects.exists()


def test_every_key_is_in_a_fresh_etcd_when_a_run_ends_not_only_after_the_beats_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, etcd_server: EtcdServer
) -> None:
    """`flotilla up` starts a fresh etcd each time and its gateway right after this command: a kept key (and
    any other) must be there at once, or the gateway refuses it (401) until the sync runs."""
    monkeypatch.setenv("ETCD_ENDPOINTS", etcd_server.endpoint)
    first, _ = flotilla_up(tmp_path, monkeypatch, api_key=True)
    assert first.api_key is not None
    other = ApiKey.objects.create(owner=User.objects.get(username=ADMIN_USERNAME), name="app", key_hash="a" * 64)
    etcd_server.restart(wipe=True)  # the stack stops, and the next one starts a fresh etcd
    assert etcd_values(etcd_server, API_KEYS_PREFIX) == {}
    again, _ = flotilla_up(tmp_path, monkeypatch, api_key=True)
    assert again.api_key is None  # the kept key still works: none is made
    published = etcd_values(etcd_server, API_KEYS_PREFIX)
    assert set(published) == {etcd_key(key_hash(first.api_key)), etcd_key(other.key_hash)}


def test_a_run_whose_etcd_does_not_answer_says_so_and_still_makes_the_accounts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ETCD_ENDPOINTS", f"http://127.0.0.1:{free_port()}")
    argv, env, _ = bootstrap_command(tmp_path, api_key=True)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out, err = io.StringIO(), io.StringIO()
    call_command(*argv[len(manage_command()) :], stdout=out, stderr=err)
    assert parse_bootstrap(out.getvalue()).api_key is not None
    assert "the API keys are not in etcd yet" in err.getvalue()
