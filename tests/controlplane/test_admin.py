"""The Django admin: the admin account `flotilla up` creates (role admin, not a superuser) can use it, and
whatever it changes there goes through the actions and has its audit entry; the rest is read-only."""

import pytest
from django.test import Client

from controlplane.accounts import actions
from controlplane.accounts.models import ApiToken, Role, User
from controlplane.audit.models import AuditEntry
from controlplane.audit.records import Actor
from tests.controlplane.factories import deploy, make_user, person_token

pytestmark = pytest.mark.django_db
PASSWORD = "a long passphrase"


def logged_in(role: Role = Role.ADMIN, username: str = "admin") -> Client:
    # As `manage.py bootstrapaccounts` makes the admin of `flotilla up`.
    actions.create_user(Actor.system("flotilla up"), username, role, password=PASSWORD)
    client = Client()
    assert client.post("/admin/login/", {"username": username, "password": PASSWORD}).status_code == 302
    return client


def entries(action: str) -> list[AuditEntry]:
    return list(AuditEntry.objects.filter(action=action).order_by("id"))


def test_the_admin_of_flotilla_up_sees_the_models_the_admin_links_to() -> None:
    page = logged_in().get("/admin/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "permission to view or edit anything" not in text
    for link in ("/admin/accounts/user/", "/admin/accounts/apitoken/", "/admin/deployments/pipeline/"):
        assert link in text
    assert logged_in(username="other-admin").get("/admin/audit/auditentry/").status_code == 200


def test_an_operator_cannot_use_the_admin() -> None:
    actions.create_user(Actor.system("tests"), "olga", Role.OPERATOR, password=PASSWORD)
    client = Client()
    assert client.post("/admin/login/", {"username": "olga", "password": PASSWORD}).status_code == 200  # refused
    client.force_login(User.objects.get(username="olga"))
    page = client.get("/admin/accounts/user/")
    assert page.status_code == 302 and page["Location"].startswith("/admin/login/")


def test_a_role_changed_in_the_admin_goes_through_the_action_with_its_audit_entry() -> None:
    client = logged_in()
    bob = make_user("bob", Role.READ_ONLY)
    form = {"username": "bob", "first_name": "", "last_name": "", "email": "", "role": "admin", "is_active": "on"}
    response = client.post(f"/admin/accounts/user/{bob.pk}/change/", form)
    assert response.status_code == 302, response.content
    bob.refresh_from_db()
    assert (bob.role, bob.is_staff) == (Role.ADMIN, True)  # staff follows the role
    [entry] = entries("user.update")
    assert (entry.actor_name, entry.before["role"], entry.after["role"]) == ("admin", "read_only", "admin")


def test_an_admin_who_is_not_a_superuser_cannot_make_one() -> None:
    client = logged_in()
    bob = make_user("bob", Role.READ_ONLY)
    form = {"username": "bob", "role": "read_only", "is_active": "on", "is_superuser": "on"}
    client.post(f"/admin/accounts/user/{bob.pk}/change/", form)
    bob.refresh_from_db()
    assert not bob.is_superuser


def test_a_deactivation_and_a_new_person_in_the_admin_are_audited() -> None:
    client = logged_in()
    bob = make_user("bob", Role.OPERATOR)
    client.post(f"/admin/accounts/user/{bob.pk}/change/", {"username": "bob", "role": "operator"})
    bob.refresh_from_db()
    assert not bob.is_active
    assert entries("user.update")[-1].after["is_active"] is False
    new = {"username": "carol", "role": "operator", "usable_password": "true"}
    response = client.post("/admin/accounts/user/add/", {**new, "password1": PASSWORD, "password2": PASSWORD})
    assert response.status_code == 302, response.content
    assert entries("user.create")[-1].target_name == "carol"
    assert User.objects.get(username="carol").check_password(PASSWORD)


def test_a_password_set_in_the_admin_is_validated_and_audited() -> None:
    client = logged_in()
    bob = make_user("bob", Role.OPERATOR)
    url = f"/admin/accounts/user/{bob.pk}/password/"
    weak = client.post(url, {"password1": "12345", "password2": "12345", "set_usable_password": "true"})
    assert weak.status_code == 200 and not entries("user.password")
    strong = {"password1": PASSWORD, "password2": PASSWORD, "set_usable_password": "true"}
    assert client.post(url, strong).status_code == 302
    bob.refresh_from_db()
    assert bob.check_password(PASSWORD)
    [entry] = entries("user.password")
    assert (entry.actor_name, entry.target_name, entry.after) == ("admin", "bob", {"password": "changed"})


def test_a_token_deleted_in_the_admin_is_revoked_through_the_action_and_cannot_be_edited() -> None:
    client = logged_in()
    person_token(make_user("bob"))
    token = ApiToken.objects.get(user__username="bob")
    edit = client.post(f"/admin/accounts/apitoken/{token.pk}/change/", {"description": "mine now"})
    token.refresh_from_db()
    assert token.description == ""
    assert edit.status_code in (200, 403)
    response = client.post(f"/admin/accounts/apitoken/{token.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302
    assert not ApiToken.objects.filter(pk=token.pk).exists()
    [entry] = entries("token.revoke")
    assert entry.actor_name == "admin"


def test_pipelines_are_shown_in_the_admin_but_not_changed_there() -> None:
    client = logged_in()
    pipeline = deploy("chat")
    assert client.get(f"/admin/deployments/pipeline/{pipeline.pk}/change/").status_code == 200
    assert client.post(f"/admin/deployments/pipeline/{pipeline.pk}/delete/", {"post": "yes"}).status_code == 403
    assert client.get("/admin/deployments/pipeline/add/").status_code == 403


def test_the_last_admin_cannot_deactivate_or_demote_themself_in_the_admin() -> None:
    client = logged_in()
    admin_row = User.objects.get(username="admin")
    for form in ({"username": "admin", "role": "admin"}, {"username": "admin", "role": "operator", "is_active": "on"}):
        response = client.post(f"/admin/accounts/user/{admin_row.pk}/change/", form)
        assert response.status_code == 200  # the form again, with the reason
        assert "admin is the only active admin: make another person an admin first." in response.content.decode()
    admin_row.refresh_from_db()
    assert (admin_row.is_active, admin_row.role) == (True, Role.ADMIN)
    assert not entries("user.update")
