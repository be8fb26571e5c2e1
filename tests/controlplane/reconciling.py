"""Test doubles of the reconciler's boundaries: a Dispatcher that records what it sends, and a clock."""

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from controlplane.audit.records import Actor
from controlplane.deployments import instances as instance_actions
from controlplane.deployments.models import Instance
from controlplane.deployments.reconciler import Reconciler, ReconcilerSettings
from runtime.fleet_contract.reports import InstanceReport
from runtime.fleet_contract.tasks import (
    TASK_LOG_TAIL,
    TASK_SET_ADAPTERS,
    TASK_START_INSTANCE,
    TASK_STOP_INSTANCE,
    LogTailRequest,
    SetAdapters,
    StartInstance,
    StopInstance,
    node_queue,
)


@dataclass(frozen=True)
class Sent:
    queue: str
    task: str
    message: StartInstance | StopInstance | LogTailRequest | SetAdapters
    expires_s: float


@dataclass
class RecordingDispatcher:
    """Records each task with its queue. ``failure`` is raised instead of sending; ``on_send`` runs
    before each send is recorded (to make something happen in the middle of a pass)."""

    sent: list[Sent] = field(default_factory=list)
    failure: Exception | None = None
    on_send: Callable[[], None] | None = None

    def start_instance(self, node: str, message: StartInstance, *, expires_s: float) -> None:
        self._record(Sent(node_queue(node), TASK_START_INSTANCE, message, expires_s))

    def stop_instance(self, node: str, message: StopInstance, *, expires_s: float) -> None:
        self._record(Sent(node_queue(node), TASK_STOP_INSTANCE, message, expires_s))

    def set_adapters(self, node: str, message: SetAdapters, *, expires_s: float) -> None:
        self._record(Sent(node_queue(node), TASK_SET_ADAPTERS, message, expires_s))

    def log_tail(self, node: str, request: LogTailRequest, *, timeout_s: float) -> str:
        self._record(Sent(node_queue(node), TASK_LOG_TAIL, request, timeout_s))
        return f"the last {request.lines} lines of instance {request.instance_id}"

    def take(self) -> list[tuple[str, str, int]]:
        """What was sent since the last ``take``, as (queue, task, instance id)."""
        taken = [(sent.queue, sent.task, _instance_id(sent.message)) for sent in self.sent]
        self.sent.clear()
        return taken

    def _record(self, sent: Sent) -> None:
        if self.failure is not None:
            raise self.failure
        if self.on_send is not None:
            hook, self.on_send = self.on_send, None
            hook()
        self.sent.append(sent)


class Clock:
    """The reconciler's idea of now, moved by the test."""

    def __init__(self) -> None:
        self.now = timezone.now()

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def catch_up(self) -> None:
        """Jump to the real time: what actions just stamped (a failure's time) is now."""
        self.now = timezone.now()


def make_reconciler(dispatcher: RecordingDispatcher, clock: Clock, **settings: Any) -> Reconciler:
    return Reconciler(dispatcher, ReconcilerSettings(**settings), clock=clock)


def agent_reports(instance: Instance, state: str, reason: str = "", *, worker_id: int | None = None) -> Instance:
    """The instance's agent reports ``state`` (as the agent API would apply it), and its worker's id in etcd."""
    instance.refresh_from_db()
    assert instance.node is not None
    node = instance.node.name
    report = InstanceReport(
        state=state, reason=reason, pid=4242 if state == "ready" else None, endpoint_instance_id=worker_id
    )
    return instance_actions.report_instance_state(Actor.agent(node), node, instance.pk, report)


def _instance_id(message: StartInstance | StopInstance | LogTailRequest | SetAdapters) -> int:
    """The instance a task is about; 0 for a SetAdapters (about a pipeline's workers on the node)."""
    if isinstance(message, SetAdapters):
        return 0
    return message.spec.instance_id if isinstance(message, StartInstance) else message.instance_id
