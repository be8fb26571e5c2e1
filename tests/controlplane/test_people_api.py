"""People in the API: admins add, edit, deactivate and reactivate them and reset their passwords
(/api/v1/people/); each person reads themself, changes their password and revokes their own tokens
(/api/v1/me/). Every change has its audit entry, and the fleet always keeps an active admin."""

from collections.abc import Callable

import pytest
from django.test import Client
from rest_framework.test import APIClient

from controlplane.accounts import actions
from controlplane.accounts.models import ApiToken, Role, User
from controlplane.audit.models import AuditEntry
from controlplane.errors import Conflict
from tests.controlplane.factories import TEST_ACTOR, make_user, person_token

pytestmark = pytest.mark.django_db
PASSWORD = "a long passphrase"


def client_of(user: User) -> APIClient:
    client = APIClient()
    client.default_format = "json"  # the API reads JSON only
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {person_token(user)}")
    return client


@pytest.fixture
def boss() -> User:
    """The fleet's only admin."""
    return make_user("boss", Role.ADMIN)


@pytest.fixture
def as_boss(boss: User) -> APIClient:
    return client_of(boss)


def entries(action: str) -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(action=action).order_by("id"))


def test_an_admin_adds_a_person_who_logs_in_with_the_password_shown_once(as_boss: APIClient) -> None:
    response = as_boss.post("/api/v1/people/", {"username": "carol", "role": "operator", "email": "c@example.org"})
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["username"], body["role"], body["is_active"], body["has_password"]) == (
        "carol",
        "operator",
        True,
        True,
    )
    assert len(body["password"]) >= 32
    assert Client().login(username="carol", password=body["password"])
    assert "password" not in as_boss.get(f"/api/v1/people/{body['id']}/").json()
    [entry] = entries("user.create")[-1:]
    assert (entry.actor_name, entry.target_name, entry.after["role"]) == ("boss", "carol", "operator")
    assert "password" not in entry.after


def test_a_person_made_for_tokens_only_has_no_password(as_boss: APIClient) -> None:
    body = as_boss.post("/api/v1/people/", {"username": "ci-bot", "can_log_in": False}).json()
    assert (body["role"], body["has_password"], body["password"]) == ("read_only", False, None)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "username"),
        ({"username": "boss"}, "username"),
        ({"username": "has space"}, "username"),
        ({"username": "x" * 151}, "username"),
        ({"username": "dora", "role": "king"}, "role"),
        ({"username": "dora", "email": "not-an-address"}, "email"),
        ({"username": "dora", "can_log_in": "perhaps"}, "can_log_in"),
    ],
)
def test_bad_input_for_a_new_person_is_a_400_naming_the_field(
    as_boss: APIClient, body: dict[str, object], field: str
) -> None:
    response = as_boss.post("/api/v1/people/", body, format="json")
    assert response.status_code == 400
    assert list(response.json()) == [field]
    assert not User.objects.filter(username="dora").exists()


def test_an_admin_edits_a_persons_role_and_details(as_boss: APIClient) -> None:
    olga = make_user("olga", Role.READ_ONLY)
    response = as_boss.patch(f"/api/v1/people/{olga.pk}/", {"role": "admin", "first_name": "Olga"}, format="json")
    assert response.status_code == 200, response.content
    assert (response.json()["role"], response.json()["first_name"]) == ("admin", "Olga")
    olga.refresh_from_db()
    assert (olga.role, olga.is_staff) == (Role.ADMIN, True)
    [entry] = entries("user.update")
    assert (entry.before["role"], entry.after["role"], entry.after["first_name"]) == ("read_only", "admin", "Olga")
    bad = as_boss.patch(f"/api/v1/people/{olga.pk}/", {"role": "emperor"}, format="json")
    assert bad.status_code == 400 and list(bad.json()) == ["role"]


def test_an_unknown_person_is_a_404(as_boss: APIClient) -> None:
    for method, path in [
        ("get", "/api/v1/people/999/"),
        ("patch", "/api/v1/people/999/"),
        ("post", "/api/v1/people/999/deactivate/"),
        ("post", "/api/v1/people/999/reactivate/"),
        ("post", "/api/v1/people/999/reset-password/"),
        ("delete", "/api/v1/me/tokens/999/"),
    ]:
        assert getattr(as_boss, method)(path, {}, format="json").status_code == 404, path


@pytest.mark.parametrize("role", [Role.READ_ONLY, Role.OPERATOR])
def test_only_admins_manage_people(role: Role, boss: User) -> None:
    client = client_of(make_user("someone", role))
    assert client.get("/api/v1/people/").status_code == 403
    assert client.get(f"/api/v1/people/{boss.pk}/").status_code == 403
    assert client.post("/api/v1/people/", {"username": "eve", "role": "admin"}).status_code == 403
    response = client.patch("/api/v1/people/{}/".format(User.objects.get(username="someone").pk), {"role": "admin"})
    assert response.status_code == 403
    assert response.json()["detail"] == f"this needs the admin role; yours is {role.label}"
    assert client.post(f"/api/v1/people/{boss.pk}/deactivate/").status_code == 403
    assert client.post(f"/api/v1/people/{boss.pk}/reset-password/").status_code == 403
    assert User.objects.get(username="someone").role == role and boss.is_active


def test_a_deactivated_persons_token_session_and_login_stop_and_come_back_with_reactivation(
    as_boss: APIClient,
) -> None:
    olga = make_user("olga", Role.OPERATOR)
    actions.set_password(TEST_ACTOR, olga, PASSWORD)
    token_client = client_of(olga)
    browser = Client()
    assert browser.login(username="olga", password=PASSWORD)
    assert token_client.get("/api/v1/models/").status_code == 200
    assert browser.get("/api/v1/models/").status_code == 200

    response = as_boss.post(f"/api/v1/people/{olga.pk}/deactivate/")
    assert response.status_code == 200 and response.json()["is_active"] is False
    assert token_client.get("/api/v1/models/").status_code == 401
    assert browser.get("/api/v1/models/").status_code in (401, 403)  # the session is no one's now
    assert browser.get("/").status_code == 302  # the dashboard sends it to the login page
    assert not Client().login(username="olga", password=PASSWORD)
    again = as_boss.post(f"/api/v1/people/{olga.pk}/deactivate/")
    assert again.status_code == 409 and again.json()["detail"] == "olga is inactive already"

    assert as_boss.post(f"/api/v1/people/{olga.pk}/reactivate/").json()["is_active"] is True
    assert token_client.get("/api/v1/models/").status_code == 200
    assert [e.target_name for e in entries("user.deactivate") + entries("user.reactivate")] == ["olga", "olga"]
    assert as_boss.post(f"/api/v1/people/{olga.pk}/reactivate/").status_code == 409


def test_the_last_admin_cannot_deactivate_or_demote_themself(boss: User, as_boss: APIClient) -> None:
    response = as_boss.post(f"/api/v1/people/{boss.pk}/deactivate/")
    assert response.status_code == 409
    assert response.json()["detail"] == (
        "you are the only active admin: deactivating would leave no one to manage people and tokens; "
        "make another person an admin first"
    )
    response = as_boss.patch(f"/api/v1/people/{boss.pk}/", {"role": "operator"}, format="json")
    assert response.status_code == 409 and "you are the only active admin: demoting" in response.json()["detail"]
    boss.refresh_from_db()
    assert (boss.is_active, boss.role) == (True, Role.ADMIN)
    assert not entries("user.update") and not entries("user.deactivate")


def test_with_a_second_admin_an_admin_may_step_down(boss: User, as_boss: APIClient) -> None:
    make_user("deputy", Role.ADMIN)
    inactive = make_user("old-admin", Role.ADMIN)
    actions.deactivate_user(TEST_ACTOR, inactive)
    assert as_boss.patch(f"/api/v1/people/{boss.pk}/", {"role": "operator"}, format="json").status_code == 200
    deputy = User.objects.get(username="deputy")
    # The deputy is now the only active admin (an inactive one does not count).
    with pytest.raises(Conflict, match="deputy is the only active admin"):
        actions.deactivate_user(TEST_ACTOR, deputy)


def test_a_superuser_counts_as_an_admin_whatever_their_role(boss: User, as_boss: APIClient) -> None:
    User.objects.create_superuser("root", password=PASSWORD, role=Role.READ_ONLY)
    assert as_boss.post(f"/api/v1/people/{boss.pk}/deactivate/").status_code == 200


def test_an_admin_resets_another_persons_password_shown_once_and_ends_their_sessions(as_boss: APIClient) -> None:
    olga = make_user("olga", Role.OPERATOR)
    actions.set_password(TEST_ACTOR, olga, PASSWORD)
    browser = Client()
    assert browser.login(username="olga", password=PASSWORD)
    response = as_boss.post(f"/api/v1/people/{olga.pk}/reset-password/")
    assert response.status_code == 200
    new = response.json()["password"]
    assert browser.get("/").status_code == 302  # the old session ended with the old password
    assert not Client().login(username="olga", password=PASSWORD)
    assert Client().login(username="olga", password=new)
    [entry] = entries("user.password")[-1:]
    assert (entry.actor_name, entry.target_name, entry.after) == ("boss", "olga", {"password": "reset"})


def test_an_admin_cannot_reset_their_own_password(boss: User, as_boss: APIClient) -> None:
    response = as_boss.post(f"/api/v1/people/{boss.pk}/reset-password/")
    assert response.status_code == 403
    assert response.json()["detail"] == "you cannot reset your own password: change it with your current one"


@pytest.mark.parametrize("role", [Role.READ_ONLY, Role.OPERATOR, Role.ADMIN])
def test_each_person_reads_themself(role: Role) -> None:
    body = client_of(make_user("me", role)).get("/api/v1/me/").json()
    assert (body["username"], body["role"]) == ("me", role.value)


def test_a_person_changes_their_password_giving_the_old_one(boss: User) -> None:
    reader = make_user("rita", Role.READ_ONLY)
    actions.set_password(TEST_ACTOR, reader, PASSWORD)
    client = client_of(reader)
    other_session = Client()
    assert other_session.login(username="rita", password=PASSWORD)

    wrong = client.post("/api/v1/me/password/", {"old_password": "nope", "new_password": "another long one"})
    assert wrong.status_code == 400
    assert wrong.json() == {"old_password": ["this is not your current password"]}
    weak = client.post("/api/v1/me/password/", {"old_password": PASSWORD, "new_password": "123"})
    assert weak.status_code == 400 and list(weak.json()) == ["new_password"]
    assert "too short" in weak.json()["new_password"][0]
    missing = client.post("/api/v1/me/password/", {})
    assert missing.status_code == 400 and set(missing.json()) == {"old_password", "new_password"}

    ok = client.post("/api/v1/me/password/", {"old_password": PASSWORD, "new_password": "another long one"})
    assert ok.status_code == 204
    assert Client().login(username="rita", password="another long one")
    assert other_session.get("/").status_code == 302  # the person's other sessions end
    assert client.get("/api/v1/me/").status_code == 200  # tokens go on
    assert [e.after for e in entries("user.password")][-1] == {"password": "changed"}


def test_wrong_old_passwords_are_throttled_like_logins(settings: pytest.FixtureRequest) -> None:
    settings.LOGIN_MAX_FAILURES = 2  # type: ignore[attr-defined]
    rita = make_user("rita", Role.READ_ONLY)
    actions.set_password(TEST_ACTOR, rita, PASSWORD)
    client = client_of(rita)
    for _ in range(2):
        client.post("/api/v1/me/password/", {"old_password": "guess", "new_password": "another long one"})
    right = client.post("/api/v1/me/password/", {"old_password": PASSWORD, "new_password": "another long one"})
    assert right.status_code == 400
    assert right.json()["old_password"][0].startswith("too many wrong passwords: try again in ")


def test_a_read_only_token_changes_no_password() -> None:
    rita = make_user("rita", Role.ADMIN)
    _, key = actions.create_person_token(TEST_ACTOR, rita, scope=ApiToken.Scope.READ)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    assert client.post("/api/v1/me/password/", {"old_password": "x", "new_password": "y"}).status_code == 403


def test_a_person_lists_and_revokes_only_their_own_tokens(client_for: Callable[[Role | None], APIClient]) -> None:
    rita = make_user("rita", Role.READ_ONLY)
    client = client_of(rita)
    second, _ = actions.create_person_token(TEST_ACTOR, rita, "laptop")
    other, _ = actions.create_person_token(TEST_ACTOR, make_user("other", Role.ADMIN), "theirs")
    listed = client.get("/api/v1/me/tokens/").json()["results"]
    assert [t["description"] for t in listed] == ["", "laptop"]
    assert client.get(f"/api/v1/me/tokens/{other.pk}/").status_code == 404
    assert client.delete(f"/api/v1/me/tokens/{other.pk}/").status_code == 404
    assert client.delete(f"/api/v1/me/tokens/{second.pk}/").status_code == 204
    assert not ApiToken.objects.filter(pk=second.pk).exists() and ApiToken.objects.filter(pk=other.pk).exists()
    [entry] = entries("token.revoke")
    assert entry.actor_name == "rita"
    assert client_for(None).get("/api/v1/me/tokens/").status_code == 401
