"""The People page (admins add people, change their role and details, deactivate, reactivate and reset
passwords, through htmx POSTs answered with the fresh row) and the Account page (everyone changes their
password and revokes their own tokens)."""

import html
import re

import pytest
from django.test import Client

from controlplane.accounts import actions
from controlplane.accounts.models import ApiToken, Role, User
from controlplane.audit.models import AuditEntry
from tests.controlplane.factories import TEST_ACTOR, make_user
from tests.controlplane.test_dashboard import PASSWORD, logged_in

pytestmark = pytest.mark.django_db

HTMX = {"HTTP_HX_REQUEST": "true"}


def person(username: str, role: Role = Role.OPERATOR) -> User:
    user = make_user(username, role)
    actions.set_password(TEST_ACTOR, user, PASSWORD)
    return user


def test_the_nav_links_admins_to_the_people_page_and_everyone_to_their_account() -> None:
    admin_page = logged_in(Role.ADMIN, username="boss").get("/").content.decode()
    assert '<a href="/people/">People</a>' in admin_page and 'href="/admin/"' not in admin_page
    assert 'href="/account/"' in admin_page
    operator_page = logged_in(Role.OPERATOR, username="olga").get("/").content.decode()
    assert '<a href="/people/">People</a>' not in operator_page and 'href="/account/"' in operator_page


@pytest.mark.parametrize("role", [Role.READ_ONLY, Role.OPERATOR])
def test_only_admins_open_the_people_page_or_press_its_buttons(role: Role) -> None:
    browser = logged_in(role)
    target = person("target")
    assert browser.get("/people/").status_code == 403
    assert browser.post("/people/", {"username": "eve", "role": "admin", "can_log_in": "on"}).status_code == 403
    for button in ("edit", "deactivate", "reset-password"):
        assert browser.post(f"/people/{target.pk}/{button}/", {"role": "admin"}, **HTMX).status_code == 403
    target.refresh_from_db()
    assert target.is_active and target.role == Role.OPERATOR
    assert not User.objects.filter(username="eve").exists()
    assert Client().get("/people/").status_code == 302  # anonymous: the login page


def test_an_admin_adds_a_person_and_sees_their_password_once() -> None:
    browser = logged_in(Role.ADMIN, username="boss")
    form = {"username": "carol", "role": "operator", "email": "carol@example.org", "can_log_in": "on"}
    response = browser.post("/people/", form)
    assert response.status_code == 200
    page = response.content.decode()
    match = re.search(r'<code id="new-password">([^<]+)</code>', page)
    assert match and "carol is added as operator" in page
    assert Client().login(username="carol", password=match.group(1))
    assert 'id="new-password"' not in browser.get("/people/").content.decode()  # never again
    assert AuditEntry.objects.get(action="user.create", target_name="carol").actor_name == "boss"


def test_a_bad_or_taken_username_is_refused_on_its_field() -> None:
    browser = logged_in(Role.ADMIN, username="boss")
    for username, reason in [("boss", "exists already"), ("no spaces", "Enter a valid username"), ("", "required")]:
        response = browser.post("/people/", {"username": username, "role": "operator"})
        assert response.status_code == 400
        assert reason in response.content.decode(), username
    assert User.objects.count() == 1


def test_an_admin_changes_a_role_with_the_row_form_and_gets_the_fresh_row() -> None:
    browser = logged_in(Role.ADMIN, username="boss")
    olga = person("olga", Role.READ_ONLY)
    form = {"role": "operator", "first_name": "Olga", "last_name": "", "email": "olga@example.org"}
    response = browser.post(f"/people/{olga.pk}/edit/", form, **HTMX)
    assert response.status_code == 200
    row = response.content.decode()
    assert row.startswith(f'<div id="person-{olga.pk}" class="tr" role="row">')
    assert '<option value="operator" selected>' in row and "olga saved." in row and 'hx-swap-oob="true"' in row
    olga.refresh_from_db()
    assert (olga.role, olga.first_name, olga.email) == (Role.OPERATOR, "Olga", "olga@example.org")
    bad = browser.post(f"/people/{olga.pk}/edit/", {**form, "email": "nope"}, **HTMX)
    assert bad.status_code == 400 and "olga not changed: email: Enter a valid email address." in bad.content.decode()


def test_the_last_admin_is_told_why_they_cannot_step_down() -> None:
    browser = logged_in(Role.ADMIN, username="boss")
    boss = User.objects.get(username="boss")
    response = browser.post(f"/people/{boss.pk}/deactivate/", **HTMX)
    assert response.status_code == 409
    assert "you are the only active admin: deactivating would leave no one" in response.content.decode()
    form = {"role": "read_only", "first_name": "", "last_name": "", "email": ""}
    response = browser.post(f"/people/{boss.pk}/edit/", form, **HTMX)
    assert response.status_code == 409 and "you are the only active admin: demoting" in response.content.decode()
    boss.refresh_from_db()
    assert boss.is_active and boss.role == Role.ADMIN


def test_a_deactivated_person_is_logged_out_everywhere_until_reactivated() -> None:
    browser = logged_in(Role.ADMIN, username="boss")
    olga = person("olga")
    _, key = actions.create_person_token(TEST_ACTOR, olga)
    their_browser = Client()
    assert their_browser.login(username="olga", password=PASSWORD)

    response = browser.post(f"/people/{olga.pk}/deactivate/", **HTMX)
    assert response.status_code == 200 and "deactivated" in response.content.decode()
    assert their_browser.get("/").status_code == 302  # their session leads to the login page
    assert Client().get("/api/v1/models/", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 401
    assert not Client().login(username="olga", password=PASSWORD)

    response = browser.post(f"/people/{olga.pk}/reactivate/", **HTMX)
    assert response.status_code == 200 and "olga is active again" in response.content.decode()
    assert Client().get("/api/v1/models/", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 200
    assert [entry.action for entry in AuditEntry.objects.filter(target_name="olga").order_by("id")][-2:] == [
        "user.deactivate",
        "user.reactivate",
    ]


def test_a_reset_shows_the_new_password_once_and_ends_the_persons_sessions() -> None:
    browser = logged_in(Role.ADMIN, username="boss")
    olga = person("olga")
    their_browser = Client()
    assert their_browser.login(username="olga", password=PASSWORD)
    response = browser.post(f"/people/{olga.pk}/reset-password/", **HTMX)
    assert response.status_code == 200
    note = html.unescape(response.content.decode())
    match = re.search(r"olga's new password, shown this once: (\S+) \(their sessions have ended\)\.", note)
    assert match
    assert their_browser.get("/").status_code == 302
    assert Client().login(username="olga", password=match.group(1))


def test_a_person_changes_their_own_password_and_keeps_this_session() -> None:
    browser = logged_in(Role.READ_ONLY, username="rita")
    elsewhere = Client()
    assert elsewhere.login(username="rita", password=PASSWORD)
    form = {"old_password": "wrong", "new_password": "another long one", "new_password_again": "another long one"}
    wrong = browser.post("/account/", form)
    assert wrong.status_code == 400 and "this is not your current password" in wrong.content.decode()
    short = browser.post(
        "/account/", {**form, "old_password": PASSWORD, "new_password": "x", "new_password_again": "x"}
    )
    assert short.status_code == 400 and "This password is too short." in short.content.decode()
    differ = browser.post("/account/", {**form, "old_password": PASSWORD, "new_password_again": "other"})
    assert differ.status_code == 400 and "The two new passwords differ." in differ.content.decode()

    response = browser.post("/account/", {**form, "old_password": PASSWORD})
    assert response.status_code == 302
    assert "Your password is changed" in browser.get("/account/").content.decode()  # still logged in
    assert elsewhere.get("/").status_code == 302  # the other session ended
    assert Client().login(username="rita", password="another long one")


def test_a_person_sees_and_revokes_only_their_own_tokens() -> None:
    browser = logged_in(Role.READ_ONLY, username="rita")
    rita = User.objects.get(username="rita")
    mine, _ = actions.create_person_token(TEST_ACTOR, rita, "laptop")
    theirs, _ = actions.create_person_token(TEST_ACTOR, person("olga"), "olga's")
    page = browser.get("/account/").content.decode()
    assert f'id="token-{mine.pk}"' in page and "laptop" in page and f'id="token-{theirs.pk}"' not in page
    assert browser.post(f"/account/tokens/{theirs.pk}/revoke/", **HTMX).status_code == 404
    response = browser.post(f"/account/tokens/{mine.pk}/revoke/", **HTMX)
    assert response.status_code == 200 and f"Token {mine.key_start}… is revoked" in response.content.decode()
    assert list(ApiToken.objects.values_list("pk", flat=True)) == [theirs.pk]
    assert AuditEntry.objects.get(action="token.revoke").actor_name == "rita"


def test_an_admin_makes_a_token_on_the_account_page_and_sees_its_key_once() -> None:
    browser = logged_in(Role.ADMIN, username="boss")
    page = browser.get("/account/").content.decode()
    assert 'hx-post="/account/tokens/"' in page
    form = {"description": "grafana", "scope": "read", "expires_in_days": "30"}
    response = browser.post("/account/tokens/", form, **HTMX)
    answer = response.content.decode()
    assert response.status_code == 200 and answer.startswith('<section id="own-tokens">'), answer
    key = re.search(r'<code id="new-token">([^<]+)</code>', answer)
    assert key is not None and "shown this once" in answer
    token = ApiToken.objects.get(user__username="boss")
    assert (token.description, token.scope, token.kind) == ("grafana", "read", ApiToken.Kind.PERSON)
    assert token.expires_at is not None and f'id="token-{token.pk}"' in answer
    # The key works on the API, read-only, and the page shows it no more.
    api = Client(HTTP_AUTHORIZATION=f"Bearer {key.group(1)}")
    assert api.get("/api/v1/me/").json()["username"] == "boss"
    assert api.post("/api/v1/tokens/", {}).status_code == 403
    assert key.group(1) not in browser.get("/account/").content.decode()
    assert AuditEntry.objects.get(action="token.create").actor_name == "boss"


def test_a_bad_new_token_comes_back_with_the_error_by_its_field() -> None:
    browser = logged_in(Role.ADMIN, username="boss")
    response = browser.post("/account/tokens/", {"scope": "read", "expires_in_days": "0"}, **HTMX)
    assert response.status_code == 400 and "errorlist" in response.content.decode()
    assert not ApiToken.objects.exists()


def test_only_those_who_may_make_tokens_in_the_api_get_the_form_or_may_post_it() -> None:
    browser = logged_in(Role.OPERATOR, username="olga")
    page = browser.get("/account/").content.decode()
    assert 'action="/account/tokens/"' not in page and "An admin makes them" in page  # left out, not hidden
    assert browser.post("/account/tokens/", {"scope": "full"}, **HTMX).status_code == 403
    assert not ApiToken.objects.exists()
