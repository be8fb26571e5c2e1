"""LoRA adapters through the REST API: a model's adapters in the catalog (list, add, delete) and loading them on a
pipeline at run time, with the permissions of the rest of the API and a 400 naming what is wrong."""

from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings
from rest_framework.test import APIClient

from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import Adapter, LanguageModel
from controlplane.deployments.models import Pipeline, WorkerGroup
from tests.controlplane.factories import make_model

pytestmark = pytest.mark.django_db

SQL = {"name": "smol-sql", "source_kind": "hf", "source": "acme/smol-sql-lora", "revision": "v1"}


def deployed(client: APIClient, name: str = "chat", model: str = "smol", **group: Any) -> int:
    response = client.post(
        "/api/v1/pipelines/", {"name": name, "model": model, "groups": [{"replicas": 1, **group}]}, format="json"
    )
    assert response.status_code == 201, response.content
    pipeline_id: int = response.json()["id"]
    return pipeline_id


def added(client: APIClient, model: LanguageModel, **body: Any) -> dict[str, Any]:
    response = client.post(f"/api/v1/models/{model.pk}/adapters/", {**SQL, **body}, format="json")
    assert response.status_code == 201, response.content
    result: dict[str, Any] = response.json()
    return result


def test_an_operator_adds_an_adapter_to_a_model_and_anyone_reads_it(operator: APIClient, reader: APIClient) -> None:
    model = make_model("smol")
    sent = added(operator, model)
    assert (sent["name"], sent["source_display"], sent["pipelines"]) == ("smol-sql", "acme/smol-sql-lora@v1", [])
    listed = reader.get(f"/api/v1/models/{model.pk}/adapters/").json()
    assert [row["name"] for row in listed] == ["smol-sql"]
    assert AuditEntry.objects.filter(action="adapter.create", target_name="smol-sql").exists()


def test_a_reader_may_not_add_or_delete_an_adapter(operator: APIClient, reader: APIClient) -> None:
    model = make_model("smol")
    added(operator, model)
    assert reader.post(f"/api/v1/models/{model.pk}/adapters/", SQL, format="json").status_code == 403
    assert reader.delete(f"/api/v1/models/{model.pk}/adapters/smol-sql/").status_code == 403
    assert Adapter.objects.count() == 1


def test_an_adapter_name_taken_by_another_adapter_in_other_letter_case_is_a_400(operator: APIClient) -> None:
    model = make_model("smol")
    added(operator, model)
    response = operator.post(f"/api/v1/models/{model.pk}/adapters/", {**SQL, "name": "Smol-SQL"}, format="json")
    assert response.status_code == 400
    assert response.json() == {
        "name": [
            "the served name 'Smol-SQL' is taken by adapter 'smol-sql' of model 'smol' (served names may not differ "
            "only in letter case)"
        ]
    }


def test_an_adapter_may_not_take_a_pipelines_served_name_nor_a_pipeline_an_adapters(operator: APIClient) -> None:
    model = make_model("smol")
    deployed(operator)
    response = operator.post(f"/api/v1/models/{model.pk}/adapters/", {**SQL, "name": "CHAT"}, format="json")
    assert response.status_code == 400
    assert "taken by pipeline 'chat'" in response.json()["name"][0]
    added(operator, model)
    response = operator.post(
        "/api/v1/pipelines/", {"name": "SMOL-sql", "model": "smol", "groups": [{"replicas": 1}]}, format="json"
    )
    assert response.status_code == 400
    assert response.json() == {
        "name": ["An adapter in the catalog is served as 'smol-sql' (served names may not differ only in letter case)."]
    }


def test_an_adapter_source_is_checked_as_a_models_is(operator: APIClient, tmp_path: Path) -> None:
    model = make_model("smol")
    url = f"/api/v1/models/{model.pk}/adapters/"
    response = operator.post(url, {**SQL, "source": "not a repo"}, format="json")
    assert response.json() == {"source": ["'not a repo' is not a Hugging Face repo id (owner/name)"]}
    with override_settings(LOCAL_MODEL_ROOTS=[tmp_path]):
        outside = {"name": "local", "source_kind": "folder", "source": "/etc/adapter"}
        response = operator.post(url, outside, format="json")
        assert response.status_code == 400
        assert "outside the local model folders" in response.json()["source"][0]
        inside = {"name": "local", "source_kind": "folder", "source": str(tmp_path / "sql-lora")}
        assert operator.post(url, inside, format="json").status_code == 201
    bad_name = operator.post(url, {**SQL, "name": "has space"}, format="json")
    assert bad_name.status_code == 400 and "letters, digits" in bad_name.json()["name"][0]


def test_loading_an_adapter_serves_it_and_bumps_the_generation_without_a_restart(operator: APIClient) -> None:
    model = make_model("smol")
    added(operator, model)
    added(operator, model, name="smol-chat")
    pipeline_id = deployed(operator)
    response = operator.post(f"/api/v1/pipelines/{pipeline_id}/adapters/", {"adapter": "smol-sql"}, format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body == {
        "pipeline": "chat",
        "generation": 1,
        "loaded": [{"name": "smol-sql", "source": "acme/smol-sql-lora@v1"}],
        "max_loras": 4,
    }
    # The mocker's workers were given the adapter file at their start: they load it as they run.
    assert WorkerGroup.objects.get().generation == 1
    operator.post(f"/api/v1/pipelines/{pipeline_id}/adapters/", {"adapter": "smol-chat"}, format="json")
    assert (Pipeline.objects.get().adapter_generation, WorkerGroup.objects.get().generation) == (2, 1)
    entry = AuditEntry.objects.filter(action="pipeline.load_adapter").first()
    assert entry is not None and entry.after is not None and entry.after["adapters"] == ["smol-chat", "smol-sql"]


def test_a_vllm_pipeline_s_first_load_rolls_its_workers_over_once(operator: APIClient) -> None:
    """vLLM takes adapters only when started with LoRA enabled (``enable_lora``): its workers, started without,
    are replaced one at a time by workers given the adapter file; a later load needs no restart."""
    model = make_model("smol", engine="vllm")
    added(operator, model)
    added(operator, model, name="smol-chat")
    pipeline_id = deployed(operator, engine_args={"max_loras": 2}, gpus_per_replica=1)
    assert WorkerGroup.objects.get().engine == "vllm"
    operator.post(f"/api/v1/pipelines/{pipeline_id}/adapters/", {"adapter": "smol-sql"}, format="json")
    assert WorkerGroup.objects.get().generation == 2
    operator.post(f"/api/v1/pipelines/{pipeline_id}/adapters/", {"adapter": "smol-chat"}, format="json")
    assert (Pipeline.objects.get().adapter_generation, WorkerGroup.objects.get().generation) == (2, 2)


def test_unloading_an_adapter_bumps_the_generation_and_an_unloaded_one_is_a_400(operator: APIClient) -> None:
    model = make_model("smol")
    added(operator, model)
    pipeline_id = deployed(operator)
    operator.post(f"/api/v1/pipelines/{pipeline_id}/adapters/", {"adapter": "smol-sql"}, format="json")
    response = operator.delete(f"/api/v1/pipelines/{pipeline_id}/adapters/smol-sql/")
    assert response.status_code == 200, response.content
    assert (response.json()["generation"], response.json()["loaded"]) == (2, [])
    assert AuditEntry.objects.filter(action="pipeline.unload_adapter").count() == 1
    again = operator.delete(f"/api/v1/pipelines/{pipeline_id}/adapters/smol-sql/")
    assert again.status_code == 400
    assert again.json() == {"adapter": ["pipeline chat has no adapter 'smol-sql' loaded (loaded: none)"]}


def test_loading_an_unknown_adapter_or_another_models_is_a_400_saying_which(operator: APIClient) -> None:
    smol, other = make_model("smol"), make_model("other")
    added(operator, smol)
    added(operator, other, name="other-sql")
    pipeline_id = deployed(operator)
    url = f"/api/v1/pipelines/{pipeline_id}/adapters/"
    unknown = operator.post(url, {"adapter": "nope"}, format="json")
    assert unknown.status_code == 400
    assert unknown.json() == {"adapter": ["model smol has no adapter named 'nope' (its adapters: smol-sql)"]}
    foreign = operator.post(url, {"adapter": "other-sql"}, format="json")
    assert foreign.status_code == 400
    assert foreign.json() == {
        "adapter": ["adapter 'other-sql' adapts model other, and pipeline chat serves model smol"]
    }
    assert Pipeline.objects.get().adapter_generation == 0


def test_loading_more_adapters_than_the_engine_holds_is_a_400(operator: APIClient) -> None:
    model = make_model("smol")
    added(operator, model)
    added(operator, model, name="smol-chat")
    pipeline_id = deployed(operator, engine_args={"max_loras": 1})
    url = f"/api/v1/pipelines/{pipeline_id}/adapters/"
    assert operator.post(url, {"adapter": "smol-sql"}, format="json").status_code == 200
    response = operator.post(url, {"adapter": "smol-chat"}, format="json")
    assert response.status_code == 400
    assert response.json() == {
        "adapter": [
            "pipeline chat's engine holds 1 adapter(s) at once and has 1 loaded (smol-sql): unload one, or raise "
            "max_loras in its engine args"
        ]
    }


def test_an_engine_that_takes_no_adapters_is_a_400_naming_those_that_do(operator: APIClient) -> None:
    model = make_model("echo", engine="echo_core")
    added(operator, model)
    pipeline_id = deployed(operator, model="echo")
    response = operator.post(f"/api/v1/pipelines/{pipeline_id}/adapters/", {"adapter": "smol-sql"}, format="json")
    assert response.status_code == 400
    assert response.json() == {
        "adapter": [
            "pipeline chat's aggregated group runs echo_core, which loads no LoRA adapters (the engines that do: "
            "llamacpp, mocker, sglang, trtllm, vllm)"
        ]
    }


def test_an_adapter_loaded_on_one_pipeline_is_a_409_on_another_and_cannot_be_deleted(operator: APIClient) -> None:
    model = make_model("smol")
    added(operator, model)
    first = deployed(operator)
    second = deployed(operator, name="chat-2")
    loaded = operator.post(f"/api/v1/pipelines/{first}/adapters/", {"adapter": "smol-sql"}, format="json")
    assert loaded.status_code == 200
    response = operator.post(f"/api/v1/pipelines/{second}/adapters/", {"adapter": "smol-sql"}, format="json")
    assert response.status_code == 409
    assert "loaded on pipeline chat" in response.json()["detail"]
    deleting = operator.delete(f"/api/v1/models/{model.pk}/adapters/smol-sql/")
    assert deleting.status_code == 409
    operator.delete(f"/api/v1/pipelines/{first}/adapters/smol-sql/")
    assert operator.delete(f"/api/v1/models/{model.pk}/adapters/smol-sql/").status_code == 204
    assert not Adapter.objects.exists()


def test_a_reader_may_list_a_pipelines_adapters_but_not_load_or_unload(operator: APIClient, reader: APIClient) -> None:
    model = make_model("smol")
    added(operator, model)
    pipeline_id = deployed(operator)
    url = f"/api/v1/pipelines/{pipeline_id}/adapters/"
    assert reader.get(url).json()["loaded"] == []
    assert reader.post(url, {"adapter": "smol-sql"}, format="json").status_code == 403
    operator.post(url, {"adapter": "smol-sql"}, format="json")
    assert reader.delete(f"{url}smol-sql/").status_code == 403
    assert Pipeline.objects.get().adapters.count() == 1
