"""The dashboard's overview page: login required, and what it shows of the fleet."""

import pytest
from django.test import Client

from controlplane.audit.records import Actor
from controlplane.deployments.actions import place_pending_instances
from controlplane.fleet.models import Instance
from tests.controlplane.factories import deploy, make_node, make_user, run_instance

pytestmark = pytest.mark.django_db


@pytest.fixture
def browser() -> Client:
    user = make_user("viewer")
    user.set_password("a long passphrase")
    user.save()
    client = Client()
    assert client.login(username="viewer", password="a long passphrase")
    return client


def test_anonymous_visitors_are_sent_to_the_login_page_and_come_back_after_it() -> None:
    client = Client()
    response = client.get("/")
    assert (response.status_code, response["Location"]) == (302, "/login/?next=/")
    user = make_user("bob")
    user.set_password("a long passphrase")
    user.save()
    refused = client.post("/login/?next=/", {"username": "bob", "password": "wrong"})
    assert refused.status_code == 200 and b"do not match an account" in refused.content
    accepted = client.post("/login/", {"username": "bob", "password": "a long passphrase", "next": "/"})
    assert (accepted.status_code, accepted["Location"]) == (302, "/")


def test_an_empty_fleet_says_what_to_do_next(browser: Client) -> None:
    page = browser.get("/").content.decode()
    assert "No pipelines yet" in page and "No nodes yet: start an agent with" in page


def test_the_overview_shows_nodes_gpus_pipelines_ready_over_desired_and_why_the_rest_wait(browser: Client) -> None:
    make_node("gpu-a", gpus_gib=(24,))
    ready = deploy("chat", replicas=1, gpus_per_replica=1)
    waiting = deploy("big", replicas=1, gpus_per_replica=4)
    place_pending_instances(Actor.system("test"))
    run_instance(Instance.objects.get(pipeline=ready))
    page = browser.get("/").content.decode()
    assert "gpu-a" in page and "#0" in page and "24 GiB" in page
    # chat: its one replica is ready; big cannot be placed, and the page says why.
    assert '<td class="full">1 / 1</td>' in page
    assert '<td class="short">0 / 1</td>' in page and "1 pending" in page
    reason = Instance.objects.get(pipeline=waiting).reason
    assert reason and reason in page
    assert "pipeline.deploy" in page  # the audit log's latest events
