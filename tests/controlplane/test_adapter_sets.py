"""A pipeline's LoRA adapters reaching its nodes: in each start (WorkerSpec.adapters) and as SetAdapters tasks the
reconciler sends the nodes running its workers, when the set changes and again periodically, signed like every
task."""

import pytest
from celery import Celery
from django.test import override_settings

from controlplane.catalog.adapters import create_adapter
from controlplane.deployments import adapters as adapter_actions
from controlplane.deployments.dispatch import CeleryDispatcher
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance, Pipeline
from controlplane.deployments.reconciler import Reconciler, ReconcilerSettings
from runtime.fleet_contract.signing import agent_signing_key, signature_ok
from runtime.fleet_contract.tasks import (
    TASK_SET_ADAPTERS,
    AdapterSource,
    HubSource,
    LocalSource,
    SetAdapters,
    StartInstance,
    decode_task_argument,
)
from tests.controlplane.factories import TEST_ACTOR, agent_token, deploy, make_model, make_node, run_instance
from tests.controlplane.reconciling import Clock, RecordingDispatcher, make_reconciler
from tests.controlplane.test_celery_dispatch import celery, next_message  # noqa: F401 (a fixture)
from tests.infra import RedisServer

pytestmark = pytest.mark.django_db

SQL = AdapterSource(name="smol-sql", source=HubSource(repo_id="acme/smol-sql-lora", revision="v1"))


def chat_with_sql_loaded() -> Pipeline:
    make_node("gpu-a", (80,))
    model = make_model("smol")
    create_adapter(TEST_ACTOR, model, name="smol-sql", source_kind="hf", source="acme/smol-sql-lora", revision="v1")
    pipeline = deploy("chat", model)
    adapter_actions.load_adapter(TEST_ACTOR, pipeline, "smol-sql")
    return pipeline


def ready_instances(reconciler: Reconciler) -> None:
    reconciler.run_once()
    for instance in Instance.objects.filter(state=InstanceState.PENDING, node__isnull=False):
        run_instance(instance)


def adapter_sets(dispatcher: RecordingDispatcher) -> list[tuple[str, SetAdapters]]:
    sets = [(sent.queue, sent.message) for sent in dispatcher.sent if isinstance(sent.message, SetAdapters)]
    dispatcher.sent.clear()
    return sets


def test_a_worker_starts_with_its_pipelines_adapters() -> None:
    chat_with_sql_loaded()
    dispatcher = RecordingDispatcher()
    make_reconciler(dispatcher, Clock()).run_once()
    [start] = [sent.message for sent in dispatcher.sent if isinstance(sent.message, StartInstance)]
    assert (start.spec.adapters, start.spec.adapter_generation, start.spec.lora_file) == ([SQL], 1, None)


def test_a_pipeline_that_never_had_adapters_starts_its_workers_without_and_gets_no_set() -> None:
    make_node("gpu-a", (80,))
    deploy("chat", make_model("smol"))
    dispatcher = RecordingDispatcher()
    reconciler = make_reconciler(dispatcher, Clock())
    ready_instances(reconciler)
    reconciler.run_once()
    [start] = [sent.message for sent in dispatcher.sent if isinstance(sent.message, StartInstance)]
    assert (start.spec.adapters, start.spec.adapter_generation) == ([], 0)
    assert adapter_sets(dispatcher) == []


def test_the_set_goes_to_the_node_running_the_pipeline_at_once_when_changed_and_again_later() -> None:
    pipeline = chat_with_sql_loaded()
    dispatcher, clock = RecordingDispatcher(), Clock()
    # The node stays online while the test's clock moves (its heartbeats are not simulated).
    reconciler = make_reconciler(dispatcher, clock, resend_after_s=30.0, node_timeout_s=600, evict_after_s=600)
    ready_instances(reconciler)
    reconciler.run_once()
    [(queue, sent)] = adapter_sets(dispatcher)
    assert (queue, sent.pipeline, sent.node) == ("node.gpu-a", "chat", "gpu-a")
    assert (sent.adapters, sent.generation) == ([SQL], 1)

    reconciler.run_once()
    assert adapter_sets(dispatcher) == []  # sent, and not due again yet
    clock.advance(31)
    reconciler.run_once()
    assert [message.generation for _, message in adapter_sets(dispatcher)] == [1]  # re-sent: idempotent

    adapter_actions.unload_adapter(TEST_ACTOR, pipeline, "smol-sql")
    reconciler.run_once()
    [(_, unloaded)] = adapter_sets(dispatcher)
    assert (unloaded.adapters, unloaded.generation) == ([], 2)


def test_a_local_adapter_is_sent_as_a_path_on_the_nodes() -> None:
    make_node("gpu-a", (80,))
    model = make_model("smol")
    folder = "/srv/adapters/sql"
    with override_settings(LOCAL_MODEL_ROOTS=["/srv"]):
        create_adapter(TEST_ACTOR, model, name="sql", source_kind="folder", source=folder)
    pipeline = deploy("chat", model)
    adapter_actions.load_adapter(TEST_ACTOR, pipeline, "sql")
    dispatcher = RecordingDispatcher()
    make_reconciler(dispatcher, Clock()).run_once()
    [start] = [sent.message for sent in dispatcher.sent if isinstance(sent.message, StartInstance)]
    assert start.spec.adapters == [AdapterSource(name="sql", source=LocalSource(path=folder))]


def test_the_set_is_signed_for_the_nodes_agent_only(celery: Celery, redis_server: RedisServer) -> None:  # noqa: F811
    token = agent_token("gpu-a")
    agent_token("gpu-b")
    chat_with_sql_loaded()
    reconciler = Reconciler(CeleryDispatcher(celery), ReconcilerSettings())
    reconciler.run_once()
    for row in Instance.objects.filter(state=InstanceState.PENDING, node__isnull=False):
        run_instance(row)
    reconciler.run_once()

    message = next_message(redis_server.url, "node.gpu-a")  # the start
    while message.headers["task"] != TASK_SET_ADAPTERS:
        message = next_message(redis_server.url, "node.gpu-a")
    args, _, _ = message.decode()
    sent = decode_task_argument(args[0], SetAdapters)
    assert (sent.pipeline, sent.node, sent.adapters, sent.generation) == ("chat", "gpu-a", [SQL], 1)
    assert len(sent.nonce) == 32 and sent.valid_for_s == ReconcilerSettings().resend_after_s
    assert signature_ok(TASK_SET_ADAPTERS, args[0], agent_signing_key(token, "gpu-a"))
    assert not signature_ok(TASK_SET_ADAPTERS, args[0], agent_signing_key(token, "gpu-b"))
