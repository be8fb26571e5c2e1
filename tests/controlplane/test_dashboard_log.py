"""The pipeline page's log pane: an instance's log tail asked of its node's agent, as the API asks it,
with the API's refusals (409, 503, 502) shown as sentences rather than error pages."""

import pytest

from controlplane.accounts.models import Role
from controlplane.deployments.dispatch import AgentFailed, NodeDidNotAnswer
from controlplane.deployments.models import Instance
from controlplane.fleet.models import Node
from tests.controlplane.factories import deploy, placed_instance
from tests.controlplane.reconciling import RecordingDispatcher
from tests.controlplane.test_dashboard import logged_in

pytestmark = pytest.mark.django_db


def test_the_log_is_asked_of_the_instances_node_for_every_role(log_dispatcher: RecordingDispatcher) -> None:
    instance = placed_instance()
    response = logged_in(Role.READ_ONLY).get(f"/instances/{instance.pk}/log/", {"lines": "20"})
    assert response.status_code == 200
    html = response.content.decode()
    assert f'<pre class="log">the last 20 lines of instance {instance.pk}</pre>' in html
    assert "chat-aggregated-0 on gpu-a" in html
    [sent] = log_dispatcher.sent
    assert (sent.queue, sent.expires_s) == ("node.gpu-a", 5.0)


def test_the_default_is_the_apis_hundred_lines(log_dispatcher: RecordingDispatcher) -> None:
    instance = placed_instance()
    logged_in(Role.OPERATOR).get(f"/instances/{instance.pk}/log/")
    assert log_dispatcher.sent[0].message.lines == 100  # type: ignore[union-attr]


def test_an_unplaced_instance_says_it_has_no_log(log_dispatcher: RecordingDispatcher) -> None:
    deploy("chat")
    instance = Instance.objects.get()
    response = logged_in(Role.OPERATOR).get(f"/instances/{instance.pk}/log/")
    assert response.status_code == 200
    assert "is not placed on a node: it has no worker log" in response.content.decode()
    assert "the API answers 409" in response.content.decode()
    assert log_dispatcher.sent == []


def test_an_offline_node_is_not_asked(log_dispatcher: RecordingDispatcher) -> None:
    instance = placed_instance()
    Node.objects.update(state=Node.State.OFFLINE)
    html = logged_in(Role.OPERATOR).get(f"/instances/{instance.pk}/log/").content.decode()
    assert "node gpu-a is offline: its agent cannot answer" in html and "the API answers 503" in html
    assert log_dispatcher.sent == []


@pytest.mark.parametrize(
    ("failure", "status"),
    [
        (AgentFailed("node gpu-a could not give the log: no such file"), 502),
        (NodeDidNotAnswer("no answer in 5 s"), 503),
    ],
)
def test_an_agents_failure_is_a_sentence_not_an_error_page(
    log_dispatcher: RecordingDispatcher, failure: Exception, status: int
) -> None:
    instance = placed_instance()
    log_dispatcher.failure = failure
    response = logged_in(Role.OPERATOR).get(f"/instances/{instance.pk}/log/")
    assert response.status_code == 200
    html = response.content.decode()
    assert str(failure) in html and f"the API answers {status}" in html


def test_a_bad_line_count_names_the_parameter(log_dispatcher: RecordingDispatcher) -> None:
    instance = placed_instance()
    html = logged_in(Role.OPERATOR).get(f"/instances/{instance.pk}/log/", {"lines": "ten"}).content.decode()
    assert "lines: a whole number from 1 to 10000, not &#x27;ten&#x27;" in html
    assert log_dispatcher.sent == []


def test_the_log_of_an_unknown_instance_is_a_404(log_dispatcher: RecordingDispatcher) -> None:
    assert logged_in(Role.OPERATOR).get("/instances/12345/log/").status_code == 404
