"""The catalog offers exactly the fleet's engines (runtime/fleet_contract/engine_names.py), the list agents accept."""

from controlplane.catalog.engines import Engine
from controlplane.deployments.models import WorkerGroup
from runtime.fleet_contract.engine_names import ENGINE_LABELS


def test_the_catalogs_engines_are_the_fleets_with_their_labels_in_order() -> None:
    assert Engine.choices == list(ENGINE_LABELS.items())
    assert Engine.MOCKER == "mocker" and Engine.ECHO_FULL.label == "echo (text)"


def test_a_worker_group_may_name_no_engine_but_the_fleets() -> None:
    assert WorkerGroup._meta.get_field("engine").choices == list(ENGINE_LABELS.items())
