"""Who may call what: every endpoint against anonymous, read-only, operator, admin and agent tokens."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.accounts.actions import deactivate_user
from controlplane.accounts.models import ApiToken, Role, User
from controlplane.deployments.evacuation import drain_node
from controlplane.deployments.pipelines import stop_pipeline
from controlplane.deployments.upkeep import place_pending_instances
from tests.controlplane.factories import (
    TEST_ACTOR,
    agent_token,
    deploy,
    make_model,
    make_node,
    make_user,
    run_instance,
)

pytestmark = pytest.mark.django_db

ANONYMOUS, AGENT = "anonymous", "agent"
PEOPLE = [Role.READ_ONLY, Role.OPERATOR, Role.ADMIN]


@dataclass
class World:
    """One of everything, so that every allowed call can succeed."""

    free_model: int
    running: int
    stopped: int
    instance: int
    busy_node: int
    draining_node: int
    idle_node: int
    token: int
    person: int
    inactive_person: int


@pytest.fixture
def world() -> World:
    busy = make_node("gpu-a", (80,))
    draining = make_node("gpu-b", (80,))
    idle = make_node("gpu-c", (80,))
    drain_node(TEST_ACTOR, draining)
    running = deploy("chat", gpus_per_replica=1, pinned_nodes=["gpu-a"])
    place_pending_instances(TEST_ACTOR)
    instance = run_instance(running.instances.select_related("node", "pipeline", "group").get())
    stopped = stop_pipeline(TEST_ACTOR, deploy("old"))
    agent_token("gpu-z")
    return World(
        free_model=make_model("unused").pk,
        running=running.pk,
        stopped=stopped.pk,
        instance=instance.pk,
        busy_node=busy.pk,
        draining_node=draining.pk,
        idle_node=idle.pk,
        token=ApiToken.objects.get(node_name="gpu-z").pk,
        person=make_user("pat", Role.READ_ONLY).pk,
        inactive_person=deactivate_user(TEST_ACTOR, make_user("ian", Role.READ_ONLY)).pk,
    )


@dataclass(frozen=True)
class Call:
    method: str
    path: str  # formatted with the World's fields
    needs: Role | str  # the lowest role, or AGENT
    body: dict[str, Any] | None = None

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


CALLS = [
    Call("get", "/api/v1/models/", Role.READ_ONLY),
    Call("get", "/api/v1/models/{free_model}/", Role.READ_ONLY),
    Call(
        "post",
        "/api/v1/models/",
        Role.OPERATOR,
        {"name": "new", "source_kind": "hf", "source": "a/b", "engine": "mocker"},
    ),
    Call("patch", "/api/v1/models/{free_model}/", Role.OPERATOR, {"memory_bytes": 1}),
    Call("delete", "/api/v1/models/{free_model}/", Role.OPERATOR),
    Call("get", "/api/v1/nodes/", Role.READ_ONLY),
    Call("get", "/api/v1/nodes/{busy_node}/", Role.READ_ONLY),
    Call("post", "/api/v1/nodes/{idle_node}/drain/", Role.OPERATOR),
    Call("post", "/api/v1/nodes/{draining_node}/undrain/", Role.OPERATOR),
    Call("delete", "/api/v1/nodes/{idle_node}/", Role.ADMIN),
    Call("get", "/api/v1/pipelines/", Role.READ_ONLY),
    Call("get", "/api/v1/pipelines/{running}/", Role.READ_ONLY),
    Call("post", "/api/v1/pipelines/", Role.OPERATOR, {"name": "new", "model": "unused", "groups": [{"replicas": 1}]}),
    Call("patch", "/api/v1/pipelines/{running}/", Role.OPERATOR, {"router": {"mode": "kv"}}),
    Call("post", "/api/v1/pipelines/{running}/scale/", Role.OPERATOR, {"replicas": 2}),
    Call("post", "/api/v1/pipelines/{running}/stop/", Role.OPERATOR),
    Call("post", "/api/v1/pipelines/{stopped}/start/", Role.OPERATOR),
    Call("delete", "/api/v1/pipelines/{stopped}/", Role.OPERATOR),
    Call("get", "/api/v1/instances/", Role.READ_ONLY),
    Call("get", "/api/v1/instances/{instance}/", Role.READ_ONLY),
    Call("post", "/api/v1/instances/{instance}/restart/", Role.OPERATOR),
    Call("get", "/api/v1/downloads/", Role.READ_ONLY),
    Call("get", "/api/v1/audit/", Role.OPERATOR),
    Call("get", "/api/v1/tokens/", Role.ADMIN),
    Call("post", "/api/v1/tokens/", Role.ADMIN, {"kind": "agent", "node_name": "gpu-y"}),
    Call("delete", "/api/v1/tokens/{token}/", Role.ADMIN),
    Call("get", "/api/v1/people/", Role.ADMIN),
    Call("get", "/api/v1/people/{person}/", Role.ADMIN),
    Call("post", "/api/v1/people/", Role.ADMIN, {"username": "newcomer", "role": "operator"}),
    Call("patch", "/api/v1/people/{person}/", Role.ADMIN, {"role": "operator"}),
    Call("post", "/api/v1/people/{person}/deactivate/", Role.ADMIN),
    Call("post", "/api/v1/people/{inactive_person}/reactivate/", Role.ADMIN),
    Call("post", "/api/v1/people/{person}/reset-password/", Role.ADMIN),
    Call("get", "/api/v1/me/", Role.READ_ONLY),
    Call("get", "/api/v1/me/tokens/", Role.READ_ONLY),
    Call("post", "/api/v1/agent/register/", AGENT, {"name": "gpu-a", "gpus": []}),
    Call("post", "/api/v1/agent/heartbeat/", AGENT, {"gpus": [{"index": 0, "memory_total_bytes": 1}]}),
    Call("get", "/api/v1/agent/instances/", AGENT),
    Call("post", "/api/v1/agent/instances/{instance}/state/", AGENT, {"state": "failed", "reason": "test"}),
]


def client_as(who: Role | str, client_for: Callable[[Role | None], APIClient]) -> APIClient:
    if who == ANONYMOUS:
        return client_for(None)
    if who == AGENT:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {agent_token('gpu-a')}")
        return client
    assert isinstance(who, Role)
    return client_for(who)


def allowed(call: Call, who: Role | str) -> bool:
    if call.needs == AGENT or who in (AGENT, ANONYMOUS):
        return call.needs == who
    assert isinstance(who, Role) and isinstance(call.needs, Role)
    return who.rank >= call.needs.rank


@pytest.mark.parametrize("who", [ANONYMOUS, *PEOPLE, AGENT], ids=str)
@pytest.mark.parametrize("call", CALLS, ids=str)
def test_each_endpoint_admits_exactly_the_roles_it_should(
    call: Call, who: Role | str, world: World, client_for: Callable[[Role | None], APIClient]
) -> None:
    client = client_as(who, client_for)
    response = getattr(client, call.method)(call.path.format(**vars(world)), call.body, format="json")
    if allowed(call, who):
        assert response.status_code in (200, 201, 204), response.content
    elif who == ANONYMOUS:
        assert response.status_code == 401
        assert response["WWW-Authenticate"] == "Bearer"
    else:
        assert response.status_code == 403, response.content


def test_an_agent_token_acts_only_for_its_own_node(world: World) -> None:
    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION=f"Bearer {agent_token('gpu-b')}")
    response = other.post(f"/api/v1/agent/instances/{world.instance}/state/", {"state": "ready"}, format="json")
    assert response.status_code == 403
    assert "is on node gpu-a, not on node gpu-b" in response.json()["detail"]
    response = other.post("/api/v1/agent/register/", {"name": "gpu-a"}, format="json")
    assert response.status_code == 403
    assert response.json()["detail"] == "this token belongs to node gpu-b, not gpu-a"
    assert other.get("/api/v1/agent/instances/").json() == []


def test_unknown_and_malformed_tokens_are_refused() -> None:
    for header in ("Bearer flt_nope", "Bearer", "Bearer a b", "Token \u00e9t\u00e9"):
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=header)
        assert client.get("/api/v1/models/").status_code == 401, header


def test_a_deactivated_persons_token_stops_working(client_for: Callable[[Role | None], APIClient]) -> None:
    client = client_for(Role.ADMIN)
    assert client.get("/api/v1/models/").status_code == 200
    User.objects.update(is_active=False)
    assert client.get("/api/v1/models/").status_code == 401


def test_a_revoked_token_stops_working(admin: APIClient) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {agent_token('gpu-a')}")
    token = ApiToken.objects.get(node_name="gpu-a")
    assert admin.delete(f"/api/v1/tokens/{token.pk}/").status_code == 204
    assert client.get("/api/v1/agent/instances/").status_code == 401


def test_a_denied_person_is_told_which_role_is_needed(reader: APIClient) -> None:
    response = reader.post("/api/v1/models/", {}, format="json")
    assert response.json()["detail"] == "this needs the operator role; yours is read-only"
