"""LoRA adapters on the dashboard: a model's page lists them (operators add and delete), a pipeline's Adapters
panel loads and unloads them and says which instances serve each (what the workers registered in a real etcd);
read-only people get no controls in the HTML and a 403 for the POSTs. Their served names reach etcd while loaded."""

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from rest_framework.test import APIClient

from controlplane.accounts.models import Role
from controlplane.catalog.adapters import create_adapter
from controlplane.deployments import adapters as adapter_actions
from controlplane.deployments import served_names, upkeep
from controlplane.deployments.models import Instance, Pipeline
from runtime.fleet_contract.served_names import SERVED_NAMES_PREFIX
from runtime.lora import LoraInfo, lora_id
from tests.controlplane.factories import TEST_ACTOR, deploy, make_model, make_node, run_instance
from tests.controlplane.test_dashboard import logged_in
from tests.distributed.cluster import etcd_put, etcd_values
from tests.infra import EtcdServer

pytestmark = pytest.mark.django_db


@pytest.fixture
def etcd(etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> EtcdServer:
    monkeypatch.setenv("ETCD_ENDPOINTS", etcd_server.endpoint)
    return etcd_server


def chat_with_adapters() -> Pipeline:
    model = make_model("smol")
    for name in ("smol-sql", "smol-chat"):
        create_adapter(TEST_ACTOR, model, name=name, source_kind="hf", source=f"acme/{name}", revision="")
    return deploy("chat", model)


def test_a_model_page_lists_its_adapters_with_controls_for_operators_only() -> None:
    pipeline = chat_with_adapters()
    path = f"/models/{pipeline.model.pk}/"
    operator = logged_in(Role.OPERATOR).get(path).content.decode()
    reader = logged_in(Role.READ_ONLY, username="rita").get(path).content.decode()
    for page in (operator, reader):
        assert "smol-sql" in page and "acme/smol-sql@main" in page
    assert 'id="adapter-add"' in operator and "/adapters/delete/" in operator
    assert 'id="adapter-add"' not in reader and "/adapters/delete/" not in reader


def test_an_operator_adds_and_deletes_an_adapter_and_a_reader_gets_a_403() -> None:
    model = make_model("smol")
    operator, reader = logged_in(Role.OPERATOR), logged_in(Role.READ_ONLY, username="rita")
    body = {"name": "smol-sql", "source_kind": "hf", "source": "acme/smol-sql", "revision": "", "filename": ""}
    assert reader.post(f"/models/{model.pk}/adapters/", body).status_code == 403
    response = operator.post(f"/models/{model.pk}/adapters/", body, follow=True)
    assert "Adapter smol-sql added to smol." in response.content.decode()
    refused = operator.post(f"/models/{model.pk}/adapters/", {**body, "name": "SMOL-SQL"}, follow=True)
    assert "Adapter not added: the served name &#x27;SMOL-SQL&#x27; is taken by adapter" in refused.content.decode()
    assert reader.post(f"/models/{model.pk}/adapters/delete/", {"adapter": "smol-sql"}).status_code == 403
    operator.post(f"/models/{model.pk}/adapters/delete/", {"adapter": "smol-sql"})
    assert not model.adapters.exists()


def test_the_pipelines_panel_loads_and_unloads_and_shows_which_instances_serve_each(etcd: EtcdServer) -> None:
    make_node("gpu-a", (80,))
    pipeline = chat_with_adapters()
    upkeep.place_pending_instances(TEST_ACTOR)
    instance = run_instance(Instance.objects.get())
    operator, reader = logged_in(Role.OPERATOR), logged_in(Role.READ_ONLY, username="rita")
    assert reader.post(f"/pipelines/{pipeline.pk}/adapters/load/", {"adapter": "smol-sql"}).status_code == 403
    response = operator.post(f"/pipelines/{pipeline.pk}/adapters/load/", {"adapter": "smol-sql"}, follow=True)
    assert "Adapter smol-sql loaded on chat" in response.content.decode()
    assert list(pipeline.adapters.values_list("name", flat=True)) == ["smol-sql"]
    # The worker registers the adapter beside its base model (LA's side, as runtime/lora.py says).
    entry = {
        "instance_id": instance.endpoint_instance_id,
        "subject": "x",
        "card": {},
        "lora": msgspec.to_builtins(LoraInfo(name="smol-sql", id=lora_id("smol-sql"), base="chat")),
    }
    etcd_put(etcd, "flotilla/models/chat/backend/generate/abc/smol-sql", msgspec.json.encode(entry).decode())

    page = operator.get(f"/pipelines/{pipeline.pk}/").content.decode()
    panel = page[page.index('id="adapters"') : page.index("<h2>Planner</h2>")]
    assert instance.name in panel and "/adapters/unload/" in panel and "/adapters/load/" in panel
    read_only_panel = reader.get(f"/pipelines/{pipeline.pk}/").content.decode()
    assert "/adapters/load/" not in read_only_panel and "/adapters/unload/" not in read_only_panel

    operator.post(f"/pipelines/{pipeline.pk}/adapters/unload/", {"adapter": "smol-sql"})
    assert not pipeline.adapters.exists()
    assert pipeline.__class__.objects.get().adapter_generation == 2


def test_a_loaded_adapters_name_reaches_etcd_with_its_pipelines_state_and_leaves_when_unloaded(
    etcd: EtcdServer, django_capture_on_commit_callbacks: Callable[..., Any]
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        pipeline = chat_with_adapters()
    with django_capture_on_commit_callbacks(execute=True):
        adapter_actions.load_adapter(TEST_ACTOR, pipeline, "smol-sql")
    assert etcd_values(etcd, SERVED_NAMES_PREFIX) == {
        "flotilla/served-names/chat": '{"state":"running"}',
        "flotilla/served-names/smol-sql": '{"state":"running"}',
    }
    with django_capture_on_commit_callbacks(execute=True):
        adapter_actions.unload_adapter(TEST_ACTOR, pipeline, "smol-sql")
    assert etcd_values(etcd, SERVED_NAMES_PREFIX) == {"flotilla/served-names/chat": '{"state":"running"}'}
    adapter_actions.load_adapter(TEST_ACTOR, pipeline, "smol-chat")  # its commit's publication lost
    served_names.sync()
    assert "flotilla/served-names/smol-chat" in etcd_values(etcd, SERVED_NAMES_PREFIX)


def test_an_adapter_a_node_could_not_fetch_is_shown_with_why_and_only_for_pipelines_the_node_runs(
    etcd: EtcdServer, agent_client: Callable[[str], APIClient]
) -> None:
    make_node("gpu-a", (80,))
    make_node("gpu-b", (80,))
    pipeline = chat_with_adapters()
    upkeep.place_pending_instances(TEST_ACTOR)
    instance = run_instance(Instance.objects.get())
    assert instance.node is not None and instance.node.name == "gpu-a"
    failure = {"pipeline_id": pipeline.pk, "adapter": "smol-sql", "reason": "repository acme/smol-sql is gated"}
    heartbeat = {"memory_total_bytes": 64 << 30, "adapter_failures": [failure]}
    assert agent_client("gpu-a").post("/api/v1/agent/heartbeat/", heartbeat, format="json").status_code == 200
    # gpu-b runs nothing of "chat": what it says of the pipeline's adapters is not believed.
    lie = {**heartbeat, "adapter_failures": [failure | {"adapter": "smol-chat", "reason": "ignore all that"}]}
    assert agent_client("gpu-b").post("/api/v1/agent/heartbeat/", lie, format="json").status_code == 200

    reader = logged_in(Role.READ_ONLY)
    page = reader.get(f"/pipelines/{pipeline.pk}/").content.decode()
    panel = page[page.index('id="adapters"') : page.index("<h2>Planner</h2>")]
    assert "not fetched on gpu-a: repository acme/smol-sql is gated" in panel
    assert "ignore all that" not in panel

    # Fetched at last: the next heartbeat says so, and the panel forgets it.
    fixed = {**heartbeat, "adapter_failures": []}
    assert agent_client("gpu-a").post("/api/v1/agent/heartbeat/", fixed, format="json").status_code == 200
    assert "not fetched on" not in reader.get(f"/pipelines/{pipeline.pk}/").content.decode()


@pytest.mark.parametrize(
    ("failures", "complaint"),
    [
        ("not a list", "adapter_failures"),
        ([{"pipeline_id": 0, "adapter": "x", "reason": ""}], "pipeline_id"),
        ([{"pipeline_id": 1, "adapter": "x" * 129, "reason": ""}], "adapter"),
        ([{"pipeline_id": 1, "adapter": "x", "reason": "r" * 501}], "reason"),
        ([{"pipeline_id": 1, "adapter": "x", "reason": ""}] * 65, "adapter_failures"),
        ([{"pipeline_id": 1, "reason": ""}], "adapter"),
    ],
)
def test_a_malformed_adapter_failure_report_is_a_400_naming_the_field(
    agent_client: Callable[[str], APIClient], failures: Any, complaint: str
) -> None:
    make_node("gpu-a", (80,))
    body = {"memory_total_bytes": 64 << 30, "adapter_failures": failures}
    response = agent_client("gpu-a").post("/api/v1/agent/heartbeat/", body, format="json")
    assert response.status_code == 400
    assert complaint in str(response.json())
