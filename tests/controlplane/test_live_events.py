"""controlplane.live.events: a row created or deleted tells its list's group, a changed row tells its own
element's groups alone, and a model's change tells the catalog."""

import pytest

from controlplane.audit.models import AuditEntry
from controlplane.audit.records import Actor
from controlplane.catalog import actions as catalog_actions
from controlplane.deployments.pipelines import delete_pipeline, scale_pipeline, stop_pipeline, update_group
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.models import Download
from controlplane.live.events import Notice, notices_of_entry, notices_of_row
from controlplane.live.groups import DOWNLOADS, FLEET_LIST, MODELS, NODES, PIPELINES, pipeline_group
from runtime.fleet_contract.reports import DownloadReport
from tests.controlplane.factories import TEST_ACTOR, deploy, make_model, make_node, node_report

pytestmark = pytest.mark.django_db


def by_key(notices: list[Notice]) -> dict[tuple[str, int], frozenset[str]]:
    return {(kind, row_id): groups for kind, row_id, groups in notices}


def entry_notices(action: str) -> dict[tuple[str, int], frozenset[str]]:
    return by_key(list(notices_of_entry(AuditEntry.objects.filter(action=action).latest("id"))))


def test_a_deployed_pipeline_tells_the_fleet_its_list_and_the_catalog_its_count() -> None:
    pipeline = deploy("alpha")
    notices = entry_notices("pipeline.deploy")
    assert notices[("pipelines", FLEET_LIST)] == {PIPELINES}
    assert notices[("models", FLEET_LIST)] == {MODELS}
    # The row alone goes only to the pipeline's own page: the fleet's pages get it inside the list.
    assert notices[("pipeline", pipeline.pk)] == {pipeline_group(pipeline.pk)}
    assert by_key(list(notices_of_row(pipeline, joined_or_left=True))) == {
        key: groups for key, groups in notices.items() if key[0] != "audit"
    }


def test_a_scaled_pipeline_tells_its_row_alone() -> None:
    pipeline = deploy("alpha")
    scale_pipeline(TEST_ACTOR, pipeline, 2)
    notices = entry_notices("pipeline.scale")
    assert notices[("pipeline", pipeline.pk)] == {PIPELINES, pipeline_group(pipeline.pk)}
    assert ("pipelines", FLEET_LIST) not in notices and ("models", FLEET_LIST) not in notices


def test_an_update_its_workers_restart_for_tells_its_page_the_instance_list() -> None:
    pipeline = deploy("alpha")
    update_group(TEST_ACTOR, pipeline, engine_args={"speedup_ratio": 2})
    # Every running instance is an old one now: their rows say so without waiting for a row of their own.
    notices = entry_notices("pipeline.update_group")
    assert notices[("instances", pipeline.pk)] == {pipeline_group(pipeline.pk)}
    assert notices[("pipeline", pipeline.pk)] == {PIPELINES, pipeline_group(pipeline.pk)}


def test_a_deleted_pipeline_tells_the_fleet_its_list() -> None:
    pipeline = stop_pipeline(TEST_ACTOR, deploy("alpha"))
    delete_pipeline(TEST_ACTOR, pipeline)
    notices = entry_notices("pipeline.delete")
    assert notices[("pipelines", FLEET_LIST)] == {PIPELINES}
    assert notices[("pipeline", pipeline.pk)] == {pipeline_group(pipeline.pk)}


def test_a_registered_node_tells_the_list_and_a_heartbeat_tells_the_row() -> None:
    node = make_node("gpu-a", (80,))
    assert entry_notices("node.register")[("nodes", FLEET_LIST)] == {NODES}
    assert by_key(list(notices_of_row(node, joined_or_left=True))) == {("nodes", FLEET_LIST): {NODES}}
    assert by_key(list(notices_of_row(node))) == {("node", node.pk): {NODES}}
    # A GPU changes its node's row, even when it is added.
    gpu = fleet_actions.heartbeat(Actor.agent("gpu-a"), "gpu-a", node_report((80, 80))).gpus.latest("index")
    assert by_key(list(notices_of_row(gpu, joined_or_left=True))) == {("node", node.pk): {NODES}}


def test_a_new_download_tells_the_list_and_its_progress_tells_the_row() -> None:
    make_node("gpu-a")
    model = make_model("smol")
    report = DownloadReport(state="downloading", bytes_done=1, bytes_total=4)
    fleet_actions.report_download(Actor.agent("gpu-a"), "gpu-a", model.pk, report)
    download = Download.objects.get()
    assert by_key(list(notices_of_row(download, joined_or_left=True))) == {("downloads", FLEET_LIST): {DOWNLOADS}}
    assert by_key(list(notices_of_row(download))) == {("download", download.pk): {DOWNLOADS}}


def test_every_change_of_a_model_tells_the_catalog() -> None:
    model = make_model("smol")
    catalog_actions.update_model(TEST_ACTOR, model, default_engine_args={"speedup_ratio": 10})
    catalog_actions.delete_model(TEST_ACTOR, model)
    for action in ("model.create", "model.update", "model.delete"):
        assert entry_notices(action)[("models", FLEET_LIST)] == {MODELS}, action
    assert by_key(list(notices_of_row(model))) == {("models", FLEET_LIST): {MODELS}}
