"""Which node runs which engine: agents report theirs at registration and in heartbeats (only the fleet's engine
names are believed), placement puts a replica only where its engine is, and the forms and the pipeline API offer
only the engines some node runs, saying which node has each."""

from collections.abc import Callable
from typing import Any

import pytest
from msgspec.structs import replace
from rest_framework.test import APIClient

from controlplane.accounts.models import Role
from controlplane.audit.models import AuditEntry
from controlplane.audit.records import Actor
from controlplane.deployments.models import Instance, Pipeline
from controlplane.deployments.pipelines import GroupSpec, deploy_pipeline, scale_pipeline
from controlplane.deployments.upkeep import place_pending_instances
from controlplane.errors import Invalid
from controlplane.fleet.actions import register_node
from controlplane.fleet.models import ENGINES_BEFORE_REPORTS, Node
from tests.controlplane.factories import TEST_ACTOR, make_model, node_report
from tests.controlplane.test_dashboard import logged_in

pytestmark = pytest.mark.django_db

INVENTORY: dict[str, Any] = {"cpu_count": 8, "memory_total_bytes": 64 << 30, "memory_available_bytes": 60 << 30}


def make_node_running(name: str, *engines: str, gpus_gib: tuple[float, ...] = ()) -> Node:
    return register_node(Actor.agent(name), name, replace(node_report(gpus_gib), engines=sorted(engines)))


def test_registration_and_heartbeats_carry_the_nodes_engines_and_the_node_api_shows_them(
    agent_client: Callable[[str], APIClient], operator: APIClient
) -> None:
    agent = agent_client("cpu-a")
    body = {"name": "cpu-a", **INVENTORY, "engines": ["mocker", "llamacpp", "echo_full"]}
    response = agent.post("/api/v1/agent/register/", body, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["engines"] == ["echo_full", "llamacpp", "mocker"]
    assert Node.objects.get().engines == ["echo_full", "llamacpp", "mocker"]

    # mistral.rs installed since: the next heartbeat says so, and the change is audited.
    heartbeat = {**INVENTORY, "engines": ["echo_full", "llamacpp", "mistralrs", "mocker"]}
    assert agent.post("/api/v1/agent/heartbeat/", heartbeat, format="json").status_code == 200
    [node] = operator.get("/api/v1/nodes/").json()["results"]
    assert node["engines"] == ["echo_full", "llamacpp", "mistralrs", "mocker"]
    assert operator.get(f"/api/v1/nodes/{node['id']}/").json()["engines"] == node["engines"]
    audited = AuditEntry.objects.filter(action="node.heartbeat").latest("pk")
    assert audited.after["engines"] == node["engines"]

    # A heartbeat that does not say (an older agent's) leaves them as they were.
    assert agent.post("/api/v1/agent/heartbeat/", INVENTORY, format="json").status_code == 200
    assert Node.objects.get().engines == ["echo_full", "llamacpp", "mistralrs", "mocker"]


def test_a_node_whose_agent_never_said_is_taken_to_run_what_older_agents_ran(
    agent_client: Callable[[str], APIClient],
) -> None:
    response = agent_client("old-a").post("/api/v1/agent/register/", {"name": "old-a", **INVENTORY}, format="json")
    assert response.status_code == 200
    assert response.json()["engines"] == list(ENGINES_BEFORE_REPORTS)


@pytest.mark.parametrize("path", ["register", "heartbeat"])
def test_an_engine_name_the_fleet_does_not_have_is_refused_naming_it(
    agent_client: Callable[[str], APIClient], path: str
) -> None:
    agent = agent_client("cpu-a")
    assert agent.post("/api/v1/agent/register/", {"name": "cpu-a", **INVENTORY}, format="json").status_code == 200
    forged = {"name": "cpu-a", **INVENTORY, "engines": ["mocker", "pystr:/tmp/evil.py", "gpt"]}
    response = agent.post(f"/api/v1/agent/{path}/", forged, format="json")
    assert response.status_code == 400
    [message] = response.json()["engines"]
    assert "'gpt'" in message and "'pystr:/tmp/evil.py'" in message and "mocker, llamacpp" in message
    assert Node.objects.get().engines == list(ENGINES_BEFORE_REPORTS)  # nothing of the forged report kept

    too_many = {"name": "cpu-a", **INVENTORY, "engines": ["mocker"] * 33}
    assert "engines" in agent.post(f"/api/v1/agent/{path}/", too_many, format="json").json()


def test_placement_skips_a_node_without_the_engine_and_says_when_no_node_runs_it() -> None:
    make_node_running("cpu-a", "mocker")
    make_node_running("cpu-b", "llamacpp", "mocker")
    gguf = make_model("tiny", source_kind="gguf", source="/models/tiny.gguf", engine="llamacpp")
    chat = deploy_pipeline(TEST_ACTOR, name="chat", model=gguf, groups=[GroupSpec(replicas=2)])
    place_pending_instances(TEST_ACTOR)
    assert sorted(chat.instances.values_list("node__name", flat=True)) == ["cpu-b", "cpu-b"]

    # cpu-b loses llama.cpp (its agent reports again): a third replica has nowhere to go, and says why.
    make_node_running("cpu-b", "mocker")
    scale_pipeline(TEST_ACTOR, chat, 3)
    place_pending_instances(TEST_ACTOR)
    [waiting] = Instance.objects.filter(pipeline=chat, node__isnull=True)
    assert (waiting.node, waiting.state) == (None, "pending")
    assert waiting.reason == "no node runs llamacpp: install it with pip install 'flotilla[llamacpp]' on a node"


def test_the_forms_offer_only_the_engines_some_node_runs_with_their_nodes_and_the_node_page_lists_them() -> None:
    make_node_running("cpu-a", "llamacpp", "mocker")
    make_node_running("cpu-b", "llamacpp")
    make_model("smol")
    browser = logged_in(Role.OPERATOR)
    for page, chosen_first in (("/models/", " selected"), ("/pipelines/", "")):
        html = browser.get(page).content.decode()
        # The Add-model form starts on llama.cpp, not on the simulated engine.
        assert f'<option value="llamacpp"{chosen_first}>llama.cpp (GGUF) — nodes cpu-a, cpu-b</option>' in html, page
        assert '<option value="mocker">mocker (simulated vLLM, no weights) — node cpu-a</option>' in html, page
        assert 'value="vllm"' not in html and 'value="mistralrs"' not in html, page

    nodes_page = browser.get("/nodes/").content.decode()
    assert '<span class="engine">llamacpp</span>, <span class="engine">mocker</span>' in nodes_page

    chosen = {"name": "chat", "model": "smol", "engine": "vllm", "replicas": "1", "gpus_per_replica": "1"}
    response = browser.post("/pipelines/", {**chosen, "router_mode": "round_robin", "placement_policy": "spread"})
    assert response.status_code == 400 and not Pipeline.objects.exists()
    assert "Select a valid choice. vllm is not one of the available choices." in response.content.decode()


def test_with_no_node_registered_the_forms_offer_every_engine_as_having_no_node_yet() -> None:
    html = logged_in(Role.OPERATOR).get("/models/").content.decode()
    assert '<option value="vllm">vLLM — no node yet</option>' in html


def test_the_pipeline_api_refuses_an_engine_no_node_runs_and_says_what_to_do(operator: APIClient) -> None:
    make_node_running("cpu-a", "llamacpp", "mocker")
    make_model("smol")
    make_model("big", source_kind="folder", source="/m/big", engine="vllm")
    body = {"name": "chat", "model": "smol", "groups": [{"replicas": 1, "gpus_per_replica": 1, "engine": "vllm"}]}
    response = operator.post("/api/v1/pipelines/", body, format="json")
    assert response.status_code == 400
    assert response.json() == {
        "groups": [
            "the aggregated group: no node runs vllm; install it with pip install 'flotilla[vllm]' on a node, "
            "or pick an engine a node runs (mocker, llamacpp)"
        ]
    }
    # The model's own engine is checked when the group names none.
    by_model = {"name": "big", "model": "big", "groups": [{"replicas": 1, "gpus_per_replica": 1}]}
    assert "no node runs vllm" in operator.post("/api/v1/pipelines/", by_model, format="json").json()["groups"][0]
    assert not Pipeline.objects.exists()

    body["groups"][0]["engine"] = "llamacpp"
    body["groups"][0]["gpus_per_replica"] = 0
    body["model"] = "tiny"
    make_model("tiny", source_kind="gguf", source="/models/tiny.gguf", engine="llamacpp")
    assert operator.post("/api/v1/pipelines/", body, format="json").status_code == 201


def test_with_no_node_registered_a_pipeline_of_any_engine_is_accepted_and_waits_for_a_node() -> None:
    big = make_model("big", source_kind="folder", source="/m/big", engine="vllm")
    one_gpu = [GroupSpec(replicas=1, gpus_per_replica=1)]
    pipeline = deploy_pipeline(TEST_ACTOR, name="big", model=big, groups=one_gpu)
    place_pending_instances(TEST_ACTOR)
    assert pipeline.instances.get().reason.startswith("no node is registered")

    make_node_running("gpu-a", "mocker", gpus_gib=(80,))
    place_pending_instances(TEST_ACTOR)
    assert pipeline.instances.get().reason.startswith("no node runs vllm: install it with pip install")
    with pytest.raises(Invalid, match="no node runs vllm"):
        deploy_pipeline(TEST_ACTOR, name="big-2", model=big, groups=one_gpu, namespace="b2")
