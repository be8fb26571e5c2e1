"""Sending node agents their tasks: the ``Dispatcher`` boundary, and its Celery implementation.

The reconciler and the log view talk to agents only through a Dispatcher, so tests can put a recording
one in its place and assert what went to which queue. ``CeleryDispatcher`` publishes the payloads of
``runtime.fleet_contract.tasks`` as JSON onto queue ``node.<name>``, which only that node's agent consumes, each
signed with the keys of the node's agent tokens (runtime/fleet_contract/signing.py): an agent acts on nothing else.
"""

import contextlib
import time
import uuid
from typing import Protocol

import msgspec
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeout
from kombu.exceptions import OperationalError
from kombu.utils.url import maybe_sanitize_url

from controlplane.accounts.task_keys import node_task_keys
from controlplane.errors import ControlPlaneError
from runtime.fleet_contract.signing import sign_payload
from runtime.fleet_contract.tasks import (
    TASK_LOG_TAIL,
    TASK_SET_ADAPTERS,
    TASK_START_INSTANCE,
    TASK_STOP_INSTANCE,
    LogTailRequest,
    SetAdapters,
    StartInstance,
    StopInstance,
    TaskStamp,
    node_queue,
)


class DispatchError(ControlPlaneError):
    """A task did not reach a node's agent, or its answer did not come back (the broker is unreachable)."""


class NodeDidNotAnswer(DispatchError):
    """A node's agent did not answer a task in time (it is down, or busy, or its queue is not consumed)."""


class AgentFailed(DispatchError):
    """A node's agent answered a task with an error (it knows no such instance, its log is unreadable)."""


class Dispatcher(Protocol):
    """Where the control plane's tasks for agents go. Every method raises DispatchError when the task
    cannot be handed over; ``expires_s`` is how long an unconsumed task stays valid (a later pass sends
    a fresh one), so that an agent that comes back after a long absence does not act on stale orders
    (judged on the control plane's clock: runtime/fleet_contract/tasks.py's ``TaskStamp``)."""

    def start_instance(self, node: str, message: StartInstance, *, expires_s: float) -> None: ...

    def stop_instance(self, node: str, message: StopInstance, *, expires_s: float) -> None: ...

    def set_adapters(self, node: str, message: SetAdapters, *, expires_s: float) -> None: ...

    def log_tail(self, node: str, request: LogTailRequest, *, timeout_s: float) -> str:
        """The text the node's agent answers. Raises NodeDidNotAnswer after ``timeout_s``, AgentFailed
        when the agent reports an error, DispatchError when the broker is unreachable."""
        ...


class CeleryDispatcher:
    """A Dispatcher over a Celery app's broker (and its result backend, for answers)."""

    def __init__(self, celery: Celery) -> None:
        self.celery = celery

    def start_instance(self, node: str, message: StartInstance, *, expires_s: float) -> None:
        self._send(TASK_START_INSTANCE, node, message, expires_s=expires_s, wants_answer=False)

    def stop_instance(self, node: str, message: StopInstance, *, expires_s: float) -> None:
        self._send(TASK_STOP_INSTANCE, node, message, expires_s=expires_s, wants_answer=False)

    def set_adapters(self, node: str, message: SetAdapters, *, expires_s: float) -> None:
        self._send(TASK_SET_ADAPTERS, node, message, expires_s=expires_s, wants_answer=False)

    def log_tail(self, node: str, request: LogTailRequest, *, timeout_s: float) -> str:
        result = self._send(TASK_LOG_TAIL, node, request, expires_s=timeout_s, wants_answer=True)
        try:
            answer = result.get(timeout=timeout_s)
        except CeleryTimeout as exc:
            raise NodeDidNotAnswer(f"node {node} did not answer in {timeout_s:g} s") from exc
        except (OperationalError, OSError) as exc:
            raise DispatchError(f"the answer of node {node} could not be read from {self._broker}: {exc}") from exc
        except Exception as exc:  # the agent's task raised: Celery re-raises its error here, of any type
            raise AgentFailed(f"node {node} could not give the log: {exc}") from exc
        finally:
            with contextlib.suppress(OperationalError, OSError):
                result.forget()  # the answer is read: do not keep it in Redis until it expires
        if not isinstance(answer, str):
            raise AgentFailed(f"node {node} answered with {type(answer).__name__}, not the log's text")
        return answer

    @property
    def _broker(self) -> str:
        return str(maybe_sanitize_url(self.celery.conf.broker_url))

    def _send(
        self, task: str, node: str, payload: TaskStamp, *, expires_s: float, wants_answer: bool
    ) -> "CeleryResult":
        # Stamped (single-use, valid for ``expires_s`` on the control plane's clock), then signed last, over
        # the payload as it goes: the agent checks both before it decodes anything else. No Celery
        # ``expires``: it is outside the signature and judged on the agent's clock alone.
        stamped = msgspec.structs.replace(payload, nonce=uuid.uuid4().hex, issued_at=time.time(), valid_for_s=expires_s)
        argument = sign_payload(task, msgspec.to_builtins(stamped), node_task_keys(node))
        try:
            result: CeleryResult = self.celery.send_task(
                task,
                args=[argument],
                queue=node_queue(node),
                # Fire-and-forget tasks neither store a result nor subscribe to one.
                ignore_result=not wants_answer,
                # One attempt: the reconciler retries on its next pass, an API caller gets an answer now.
                retry=False,
            )
        except (OperationalError, OSError) as exc:
            raise DispatchError(f"the broker {self._broker} did not take {task} for node {node}: {exc}") from exc
        except RuntimeError as exc:
            # How Celery's Redis result backend says it could not subscribe to the answer (Redis is down).
            raise DispatchError(f"the result backend {self._broker} is unreachable: {exc}".strip()) from exc
        return result


class CeleryResult(Protocol):
    """What this module uses of Celery's AsyncResult."""

    def get(self, timeout: float) -> object: ...

    def forget(self) -> None: ...
