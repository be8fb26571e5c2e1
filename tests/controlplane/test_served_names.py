"""The control plane tells the ingresses which model names its pipelines serve (and whether they run), so
a stopped pipeline's model is a 503 "no ready replica" there rather than a 404: published after each
change commits, and kept equal to the database by a sync."""

from collections.abc import Callable
from typing import Any

import pytest

from controlplane.deployments import pipelines, served_names
from runtime.fleet_contract.served_names import SERVED_NAMES_PREFIX
from tests.controlplane.factories import TEST_ACTOR, deploy
from tests.distributed.cluster import etcd_put, etcd_values
from tests.infra import EtcdServer

pytestmark = pytest.mark.django_db


@pytest.fixture
def etcd(etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> EtcdServer:
    monkeypatch.setenv("ETCD_ENDPOINTS", etcd_server.endpoint)
    return etcd_server


@pytest.fixture
def committing(django_capture_on_commit_callbacks: Any) -> Callable[[], Any]:
    return lambda: django_capture_on_commit_callbacks(execute=True)


def test_a_pipelines_name_and_state_reach_etcd_as_it_is_deployed_stopped_and_deleted(
    etcd: EtcdServer, committing: Callable[[], Any]
) -> None:
    with committing():
        pipeline = deploy("org/chat")
    assert etcd_values(etcd, SERVED_NAMES_PREFIX) == {"flotilla/served-names/org/chat": '{"state":"running"}'}
    with committing():
        pipelines.stop_pipeline(TEST_ACTOR, pipeline)
    assert etcd_values(etcd, SERVED_NAMES_PREFIX) == {"flotilla/served-names/org/chat": '{"state":"stopped"}'}
    with committing():
        pipelines.delete_pipeline(TEST_ACTOR, pipeline)
    assert etcd_values(etcd, SERVED_NAMES_PREFIX) == {}


def test_the_sync_puts_back_what_is_missing_and_removes_what_no_pipeline_serves(etcd: EtcdServer) -> None:
    deploy("chat")  # published by nobody: the commit's callbacks do not run here
    etcd_put(etcd, "flotilla/served-names/ghost", '{"state":"running"}')
    report = served_names.sync()
    assert (report.written, report.deleted) == (1, 1)
    assert etcd_values(etcd, SERVED_NAMES_PREFIX) == {"flotilla/served-names/chat": '{"state":"running"}'}
