"""Rows for control-plane tests, made through the same actions the API uses (plain functions)."""

from typing import Any

from django.db.models import Max

from controlplane.accounts import actions as account_actions
from controlplane.accounts.models import Role, User
from controlplane.audit.records import Actor
from controlplane.catalog import actions as catalog_actions
from controlplane.catalog.models import LanguageModel
from controlplane.deployments import instances as instance_actions
from controlplane.deployments import pipelines as pipeline_actions
from controlplane.deployments import upkeep
from controlplane.deployments.instance_states import InstanceState
from controlplane.deployments.models import Instance, Pipeline
from controlplane.deployments.pipelines import GroupSpec
from controlplane.fleet import actions as fleet_actions
from controlplane.fleet.models import Node
from runtime.fleet_contract.reports import GpuReport, InstanceReport, NodeReport

GiB = 1 << 30
TEST_ACTOR = Actor.system("tests")


def make_user(username: str = "alice", role: Role = Role.OPERATOR) -> User:
    return account_actions.create_user(TEST_ACTOR, username, role)


def person_token(user: User) -> str:
    _, key = account_actions.create_person_token(TEST_ACTOR, user)
    return key


def agent_token(node_name: str) -> str:
    _, key = account_actions.create_agent_token(TEST_ACTOR, node_name)
    return key


def make_model(name: str = "smol", **fields: Any) -> LanguageModel:
    values: dict[str, Any] = {
        "source_kind": LanguageModel.SourceKind.HUGGING_FACE,
        "source": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "engine": "mocker",
        "memory_bytes": None,
    }
    values.update(fields)
    return catalog_actions.create_model(TEST_ACTOR, name=name, **values)


def node_report(
    gpus_gib: tuple[float, ...] = (), *, memory_gib: float = 64, used_gib: float = 0, uuids: tuple[str, ...] = ()
) -> NodeReport:
    """A node's report with GPUs of ``gpus_gib``; ``uuids``: theirs, in index order (none: the agent says none)."""
    gpus = [
        GpuReport(
            index=index,
            name="Simulated GPU",
            uuid=uuids[index] if uuids else "",
            memory_total_bytes=int(size * GiB),
            memory_used_bytes=int(used_gib * GiB),
        )
        for index, size in enumerate(gpus_gib)
    ]
    return NodeReport(
        address="127.0.0.1",
        cpu_count=8,
        memory_total_bytes=int(memory_gib * GiB),
        memory_available_bytes=int(memory_gib * GiB),
        gpus=gpus,
    )


def make_node(name: str = "gpu-a", gpus_gib: tuple[float, ...] = (80, 80), *, memory_gib: float = 64) -> Node:
    return fleet_actions.register_node(Actor.agent(name), name, node_report(gpus_gib, memory_gib=memory_gib))


def deploy(
    name: str = "smol",
    model: LanguageModel | None = None,
    *,
    replicas: int = 1,
    gpus_per_replica: int = 0,
    **settings: Any,
) -> Pipeline:
    model = model or make_model(f"{name}-model".replace("/", "-"))
    spec = GroupSpec(replicas=replicas, gpus_per_replica=gpus_per_replica)
    return pipeline_actions.deploy_pipeline(TEST_ACTOR, name=name, model=model, groups=[spec], **settings)


def run_instance(instance: Instance, state: str = InstanceState.READY) -> Instance:
    """Bring a placed instance to ``state`` as its agent would report it (its worker: 0xabc, then 0xabd …
    by instance, since no two instances share a worker)."""
    assert instance.node is not None, "place the instance first"
    others = Instance.objects.exclude(pk=instance.pk).aggregate(last=Max("endpoint_instance_id"))["last"]
    worker_id = instance.endpoint_instance_id or (0xABC if others is None else max(others + 1, 0xABC))
    report = InstanceReport(state=state, pid=4242, endpoint_instance_id=worker_id)
    return instance_actions.report_instance_state(
        Actor.agent(instance.node.name), instance.node.name, instance.pk, report
    )


def placed_instance() -> Instance:
    """One instance of a pipeline "chat" (1 GPU), placed on node gpu-a (one 80 GiB GPU)."""
    make_node("gpu-a", (80,))
    deploy("chat", gpus_per_replica=1)
    upkeep.place_pending_instances(TEST_ACTOR)
    return Instance.objects.get()
