"""The Playground page: every role may open it; it offers the running pipelines' served names and the
gateway's URL for the browser to call, says what to set without one, and never carries a key."""

import re

import pytest
from django.test import Client

from controlplane.accounts.models import Role, User
from controlplane.apikeys import actions
from controlplane.audit.records import Actor
from controlplane.deployments.pipelines import stop_pipeline
from runtime.fleet_contract.api_keys import key_hash
from tests.controlplane.factories import TEST_ACTOR, deploy
from tests.controlplane.test_dashboard import logged_in

pytestmark = pytest.mark.django_db

GATEWAY = "http://127.0.0.1:8080"


def model_options(page: str) -> list[str]:
    select = re.search(r'<select id="pg-model">(.*?)</select>', page, re.S)
    assert select, "no model list on the page"
    return re.findall(r'<option value="([^"]*)">', select.group(1))


def test_anonymous_visitors_are_sent_to_the_login_page() -> None:
    response = Client().get("/playground/")
    assert (response.status_code, response["Location"]) == (302, "/login/?next=/playground/")


@pytest.mark.parametrize("role", [Role.READ_ONLY, Role.OPERATOR, Role.ADMIN])
def test_every_role_may_chat_from_the_page_linked_in_the_nav(role: Role, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_GATEWAY_URL", GATEWAY)
    deploy("chat")
    browser = logged_in(role)
    assert '<a href="/playground/">Playground</a>' in browser.get("/").content.decode()
    response = browser.get("/playground/")
    assert response.status_code == 200
    page = response.content.decode()
    assert 'id="pg-send">Send<' in page and "playground.js" in page


def test_the_models_offered_are_the_running_pipelines_served_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_GATEWAY_URL", GATEWAY)
    deploy("zeta-chat")
    deploy("alpha-chat")
    stop_pipeline(TEST_ACTOR, deploy("stopped-chat"))
    page = logged_in(Role.READ_ONLY).get("/playground/").content.decode()
    assert model_options(page) == ["alpha-chat", "zeta-chat"]
    assert 'id="pg-send">Send<' in page  # enabled


def test_the_browser_is_given_the_gateways_url_to_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_GATEWAY_URL", GATEWAY + "/")
    deploy("chat")
    page = logged_in(Role.OPERATOR).get("/playground/").content.decode()
    assert f'data-gateway="{GATEWAY}"' in page and f'<code id="pg-gateway">{GATEWAY}</code>' in page


def test_without_a_gateway_url_the_page_says_what_to_set_and_cannot_send(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOTILLA_GATEWAY_URL", raising=False)
    deploy("chat")
    page = logged_in(Role.OPERATOR).get("/playground/").content.decode()
    assert "No gateway configured: set <code>FLOTILLA_GATEWAY_URL</code>" in page
    assert 'id="pg-send" disabled>' in page and 'data-gateway=""' in page


def test_a_malformed_gateway_url_is_a_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_GATEWAY_URL", "gateway:8080")
    page = logged_in(Role.OPERATOR).get("/playground/").content.decode()
    assert "FLOTILLA_GATEWAY_URL must be the gateway&#x27;s http(s) base URL" in page
    assert 'id="pg-send" disabled>' in page


def test_without_a_running_pipeline_the_page_says_to_deploy_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_GATEWAY_URL", GATEWAY)
    page = logged_in(Role.OPERATOR).get("/playground/").content.decode()
    assert "No running pipeline to chat with" in page and 'id="pg-send" disabled>' in page


def test_no_key_is_in_the_page_and_its_fields_are_never_posted_to_the_control_plane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLOTILLA_GATEWAY_URL", GATEWAY)
    deploy("chat")
    browser = logged_in(Role.OPERATOR, username="olga")
    olga = User.objects.get(username="olga")
    _, secret = actions.create_key(Actor.person(olga), olga, "app")
    page = browser.get("/playground/").content.decode()
    assert secret not in page and key_hash(secret) not in page
    assert 'id="pg-key" type="password"' in page
    # The form has no method, action or named field: without its script, nothing in it goes anywhere.
    form = re.search(r'<form id="playground".*?</form>', page, re.S)
    assert form and not re.search(r"\b(name|method|action)=", form.group(0))
    # The page takes no POST: a key could not be sent to it if a script tried.
    assert browser.post("/playground/", {"key": secret}).status_code == 405
