"""The API keys page: operators make, list and revoke their own keys, admins everyone's (and make keys for
others); a new key is shown once with a copy button and snippets; refusals are shown next to their input;
every change goes through controlplane.apikeys.actions (audited)."""

import datetime
import html
import re

import pytest
from django.test import Client

from controlplane.accounts import actions as account_actions
from controlplane.accounts.models import Role, User
from controlplane.apikeys import actions
from controlplane.apikeys.models import ApiKey
from controlplane.audit.models import AuditEntry
from controlplane.audit.records import Actor
from controlplane.dashboard.api_keys import snippets
from runtime.fleet_contract.api_keys import key_hash
from tests.controlplane.factories import deploy, make_user
from tests.controlplane.test_dashboard import logged_in

pytestmark = pytest.mark.django_db

HTMX = {"HTTP_HX_REQUEST": "true"}


def make_key(owner: User, name: str = "chat-app") -> ApiKey:
    return actions.create_key(Actor.person(owner), owner, name)[0]


def new_key(page: str) -> str | None:
    match = re.search(r'<code id="new-key">([^<]+)</code>', page)
    return match.group(1) if match else None


def test_operators_and_admins_see_the_nav_links_and_read_only_people_do_not() -> None:
    page = logged_in(Role.OPERATOR, username="olga").get("/").content.decode()
    assert '<a href="/api-keys/">API keys</a>' in page and '<a href="/usage/">Usage</a>' in page
    page = logged_in(Role.READ_ONLY, username="rita").get("/").content.decode()
    assert 'href="/api-keys/"' not in page and 'href="/usage/"' not in page


def test_read_only_people_may_not_open_the_page_or_make_or_revoke_keys() -> None:
    browser = logged_in(Role.READ_ONLY)
    key = make_key(make_user("olga"))
    assert browser.get("/api-keys/").status_code == 403
    assert browser.post("/api-keys/", {"name": "sneaky"}).status_code == 403
    assert browser.post(f"/api-keys/{key.pk}/revoke/", **HTMX).status_code == 403
    assert ApiKey.objects.count() == 1 and not ApiKey.objects.get().revoked
    assert Client().get("/api-keys/").status_code == 302  # anonymous: the login page


def test_an_operator_makes_a_key_and_sees_it_once_with_snippets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_GATEWAY_URL", "http://gw.example:8080/")
    deploy("smol-chat")
    browser = logged_in(Role.OPERATOR, username="olga")
    page = browser.get("/api-keys/").content.decode()
    assert 'value="smol-chat"' in page  # the served names are offered as checkboxes
    form = {
        "name": "support-bot",
        "models": ["smol-chat"],
        "other_models": "org/next-model, later",
        "expires_at": "2099-01-31T12:00",
        "requests_per_minute": "600",
        "tokens_per_minute": "",
        "monthly_token_budget": "1000000",
        "max_concurrent_requests": "8",
    }
    response = browser.post("/api-keys/", form)
    assert response.status_code == 200
    page = html.unescape(response.content.decode())
    secret = new_key(page)
    assert secret and secret.startswith("sk-flt-")
    assert 'data-copy="#new-key"' in page and "shown this once" in page
    assert "curl http://gw.example:8080/v1/chat/completions" in page and f"Bearer {secret}" in page
    assert f'OpenAI(base_url="http://gw.example:8080/v1", api_key="{secret}")' in page
    assert 'model="later"' in page  # the first allowed model, by name

    key = ApiKey.objects.get()
    assert key.key_hash == key_hash(secret) and key.owner.username == "olga"
    assert key.allowed_models == ["later", "org/next-model", "smol-chat"]
    assert (key.requests_per_minute, key.tokens_per_minute, key.monthly_token_budget) == (600, None, 1_000_000)
    assert key.max_concurrent_requests == 8
    assert key.expires_at == datetime.datetime(2099, 1, 31, 12, 0, tzinfo=datetime.UTC)
    assert AuditEntry.objects.get(action="api_key.create").actor_name == "olga"

    listing = browser.get("/api-keys/").content.decode()
    assert new_key(listing) is None and secret not in listing  # never again
    assert f'id="api-key-{key.pk}"' in listing and f"{key.key_start}…" in listing and "600 requests/min" in listing
    assert "8 at once" in listing


def test_bad_input_is_refused_on_its_field_and_makes_no_key() -> None:
    browser = logged_in(Role.OPERATOR, username="olga")
    make_key(User.objects.get(username="olga"), "taken")
    cases = [
        ({"name": ""}, "This field is required."),
        ({"name": "x", "other_models": "ok bad name!"}, "'name!': 1-200 letters, digits"),
        ({"name": "x", "requests_per_minute": "0"}, "greater than or equal to 1"),
        ({"name": "x", "tokens_per_minute": "lots"}, "Enter a whole number."),
        ({"name": "x", "expires_at": "2001-01-01T00:00"}, "expires_at is in the past"),
        ({"name": "x", "expires_at": "soon"}, "Enter a valid date/time."),
        ({"name": "taken"}, "olga has a key named 'taken' already"),
        ({"name": "x", "models": ["not-deployed"]}, "Select a valid choice."),
    ]
    for form, reason in cases:
        response = browser.post("/api-keys/", form)
        assert response.status_code == 400, form
        page = html.unescape(response.content.decode())
        assert reason in page, form
        assert new_key(page) is None
    assert ApiKey.objects.count() == 1


def test_an_operator_may_not_pick_an_owner_and_an_admin_may() -> None:
    olga = logged_in(Role.OPERATOR, username="olga")
    bob = make_user("bob")
    assert 'name="owner"' not in olga.get("/api-keys/").content.decode()
    assert olga.post("/api-keys/", {"name": "for-bob", "owner": "bob"}).status_code == 200
    assert ApiKey.objects.get(name="for-bob").owner.username == "olga"  # the field is not there: ignored

    admin = logged_in(Role.ADMIN, username="ada")
    page = admin.get("/api-keys/").content.decode()
    assert 'name="owner"' in page and "owner: olga" in page  # every key, with its owner
    response = admin.post("/api-keys/", {"name": "bobs-app", "owner": "bob"})
    assert response.status_code == 200 and new_key(response.content.decode())
    assert ApiKey.objects.get(name="bobs-app").owner == bob
    assert AuditEntry.objects.filter(action="api_key.create", actor_name="ada").count() == 1
    assert admin.post("/api-keys/", {"name": "x", "owner": "nobody"}).status_code == 400


def test_people_see_only_their_own_keys() -> None:
    olga = logged_in(Role.OPERATOR, username="olga")
    bobs = make_key(make_user("bob"), "bobs-secret-app")
    page = olga.get("/api-keys/").content.decode()
    assert "bobs-secret-app" not in page and "No keys yet" in page
    assert olga.post(f"/api-keys/{bobs.pk}/revoke/", **HTMX).status_code == 404
    bobs.refresh_from_db()
    assert not bobs.revoked


def test_revoke_answers_the_fresh_row_and_a_second_revoke_says_why_not() -> None:
    browser = logged_in(Role.OPERATOR, username="olga")
    key = make_key(User.objects.get(username="olga"))
    page = browser.get("/api-keys/").content.decode()
    assert f'hx-post="/api-keys/{key.pk}/revoke/"' in page and "hx-confirm=" in page

    response = browser.post(f"/api-keys/{key.pk}/revoke/", **HTMX)
    assert response.status_code == 200
    row = response.content.decode()
    assert row.startswith(f'<div id="api-key-{key.pk}" class="tr" role="row">')
    assert "revoked" in row and "Revoke</button>" not in row
    assert "is revoked: every ingress refuses it" in row and 'hx-swap-oob="true"' in row
    key.refresh_from_db()
    assert key.revoked and AuditEntry.objects.get(action="api_key.revoke").actor_name == "olga"

    again = browser.post(f"/api-keys/{key.pk}/revoke/", **HTMX)
    assert again.status_code == 409 and "was revoked already" in again.content.decode()
    assert AuditEntry.objects.filter(action="api_key.revoke").count() == 1


def test_an_admin_revokes_anyones_key_and_without_htmx_lands_on_the_page() -> None:
    admin = logged_in(Role.ADMIN, username="ada")
    key = make_key(make_user("bob"))
    response = admin.post(f"/api-keys/{key.pk}/revoke/", follow=True)
    assert response.redirect_chain == [("/api-keys/", 302)]
    assert "is revoked" in response.content.decode()
    key.refresh_from_db()
    assert key.revoked


def test_the_snippets_call_the_gateway_with_the_key() -> None:
    curl, python = snippets("sk-flt-abc", "http://127.0.0.1:8080", "smol")
    assert curl.startswith("curl http://127.0.0.1:8080/v1/chat/completions")
    assert '"model": "smol"' in curl and "Bearer sk-flt-abc" in curl
    assert 'api_key="sk-flt-abc"' in python and 'model="smol"' in python


def test_an_admin_sees_a_deactivated_persons_key_as_suspended() -> None:
    olga = make_user("olga")
    key = make_key(olga)
    browser = logged_in(Role.ADMIN)
    account_actions.deactivate_user(Actor.system("tests"), olga)
    page = browser.get("/api-keys/").content.decode()
    assert f'id="api-key-{key.pk}"' in page
    assert '<span class="state state-failed">suspended</span><div class="hint">its owner is deactivated</div>' in page
