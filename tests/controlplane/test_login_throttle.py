"""Login throttling: too many failed logins for one user name from one address wait, on the dashboard's and the
admin's login pages alike; a success clears the count; others are not locked out."""

import pytest
from django.test import Client, override_settings

from controlplane.accounts import actions
from controlplane.accounts.models import FailedLogin, Role
from controlplane.accounts.throttle import wait_s
from controlplane.audit.records import Actor
from controlplane.errors import Invalid
from tests.controlplane.factories import make_user

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("limits")]
PASSWORD = "a long passphrase"


@pytest.fixture
def limits() -> object:
    with override_settings(LOGIN_MAX_FAILURES=3, LOGIN_WINDOW_S=60):
        yield


def person(username: str = "bob", role: Role = Role.OPERATOR) -> None:
    user = make_user(username, role)
    user.set_password(PASSWORD)
    user.save()


def log_in(client: Client, password: str, *, username: str = "bob", address: str = "10.0.0.1", page: str = "/login/"):  # type: ignore[no-untyped-def]
    return client.post(page, {"username": username, "password": password}, REMOTE_ADDR=address)


def test_after_too_many_failures_the_login_page_says_how_long_to_wait_and_answers_429() -> None:
    person()
    client = Client()
    for _ in range(3):
        assert log_in(client, "wrong").status_code == 200
    refused = log_in(client, PASSWORD)  # even the right password waits
    assert refused.status_code == 429
    assert 55 <= int(refused["Retry-After"]) <= 60
    assert b"Too many failed attempts for this user name: try again in " in refused.content
    assert "_auth_user_id" not in client.session


def test_the_wait_ends_with_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    person()
    client = Client()
    for _ in range(3):
        log_in(client, "wrong")
    FailedLogin.objects.update(at=FailedLogin.objects.first().at.replace(year=2000))  # type: ignore[union-attr]
    assert log_in(client, PASSWORD).status_code == 302


def test_another_address_and_another_person_are_not_locked_out() -> None:
    person()
    person("carol")
    client = Client()
    for _ in range(3):
        log_in(client, "wrong")
    assert wait_s("bob", "10.0.0.1") > 0
    assert log_in(Client(), PASSWORD, address="10.0.0.2").status_code == 302
    assert log_in(Client(), PASSWORD, username="carol").status_code == 302


def test_a_success_clears_the_failures() -> None:
    person()
    client = Client()
    for _ in range(2):
        log_in(client, "wrong")
    assert log_in(client, PASSWORD).status_code == 302
    assert not FailedLogin.objects.exists()


def test_the_admin_login_is_throttled_with_the_same_count() -> None:
    person("root", Role.ADMIN)
    client = Client()
    for _ in range(2):
        log_in(client, "wrong", username="root")
    log_in(client, "wrong", username="root", page="/admin/login/")
    refused = log_in(client, PASSWORD, username="root", page="/admin/login/")
    assert b"Too many failed attempts for this user name: try again in " in refused.content
    assert "_auth_user_id" not in client.session


def test_a_password_the_validators_refuse_is_invalid() -> None:
    with pytest.raises(Invalid, match="too short") as raised:
        actions.create_user(Actor.system("tests"), "dave", Role.OPERATOR, password="abc123")
    assert raised.value.field == "password"
    with pytest.raises(Invalid, match="too common"):
        actions.create_user(Actor.system("tests"), "dave", Role.OPERATOR, password="password1234")


def test_failures_past_the_window_are_forgotten_whoever_they_were_about() -> None:
    person()
    log_in(Client(), "wrong", username="carol")
    FailedLogin.objects.update(at=FailedLogin.objects.get().at.replace(year=2000))
    log_in(Client(), "wrong")
    assert list(FailedLogin.objects.values_list("username", flat=True)) == ["bob"]
