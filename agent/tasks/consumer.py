"""The control plane's tasks for this node, taken from its Celery queue (``node.<name>``) on the broker.

A Celery worker runs embedded in the agent, in a thread of its own, consuming only this node's queue:
``flotilla.agent.start_instance``, ``stop_instance``, ``set_adapters`` and ``log_tail``
(runtime/fleet_contract/tasks.py). It is Celery's ``WorkController`` (the worker without its command line,
signal handlers or logging set-up) with the ``solo`` pool: tasks run one at a time in the consumer's own
thread, which suits them, as each only decodes its payload and hands it to the agent's asyncio loop
(``run_coroutine_threadsafe``). A start or a stop returns once the agent has taken it (the work goes on on the
loop, and its outcome reaches the control plane as state reports); a log tail returns its text, which goes
back through the result backend to the control plane waiting on it.

The broker vouches for nothing: every agent holds its credentials, so any of them, or whoever took one,
can send any node a task. So the consumer takes a task only when it is signed with this node's key
(runtime/fleet_contract/signing.py; checked on the payload as received, before anything is decoded) and, for a
start or a stop, names this node, and only while it is valid and news (agent/tasks/freshness.py: a task
past its validity on the control plane's clock, or a re-sent copy of one taken, is logged and dropped,
never reported). Anything else is refused: logged at warning, its task failed, and
nothing reported, since nothing it says can be believed. A signed start for this node is then checked
(agent/tasks/checks.py: engines this node has, no flag the agent sets itself, no model path); one that is
malformed or fails a check is refused too, and reported to the control plane as the instance failing for
good with ``refused by the agent: <why>`` (the control plane audits the state change). Other malformed
payloads are logged with the reason and fail their task. Either way the consumer goes on. While the broker
cannot be reached, Celery logs its URL and the reason at each attempt and keeps trying.
``stop()`` ends the consumer through Celery's own shutdown flag, which its loop checks between events
and between connection attempts (a signal handler in ``celery worker`` does the same).
"""

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Collection, Coroutine
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol, TypeVar

from celery import Celery  # type: ignore[import-untyped]
from celery.worker import state as worker_state  # type: ignore[import-untyped]
from kombu.utils.url import maybe_sanitize_url

from agent.errors import AgentError, TaskNotAllowed, WorkerError
from agent.tasks.checks import check_adapters, check_start
from agent.tasks.freshness import TaskFreshness
from runtime.errors import ConfigError
from runtime.fleet_contract.broker import celery_redis_settings
from runtime.fleet_contract.engine_names import engines_on_this_node
from runtime.fleet_contract.signing import SIGNATURES_FIELD, SigningKey, signature_ok
from runtime.fleet_contract.tasks import (
    MAX_LOG_LINES,
    TASK_LOG_TAIL,
    TASK_SET_ADAPTERS,
    TASK_START_INSTANCE,
    TASK_STOP_INSTANCE,
    LogTailRequest,
    SetAdapters,
    StartInstance,
    StopInstance,
    TaskStamp,
    decode_task_argument,
    node_queue,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long a task waits for the agent's loop to take its request (a loop that slow is stuck).
HANDOFF_TIMEOUT_S = 30.0
#: Log tail results are read at once by the control plane; an hour is plenty to keep them.
RESULT_EXPIRES_S = 3600


class TaskHandler(Protocol):
    """What the agent does with each task (on its asyncio loop)."""

    async def accept_start(self, request: StartInstance) -> None:
        """Take a start; return once it is under way."""
        ...

    async def accept_stop(self, request: StopInstance) -> None:
        """Take a stop; return once it is under way."""
        ...

    async def log_tail(self, request: LogTailRequest) -> str:
        """The last lines of the instance's log. Raises WorkerError when this node has none."""
        ...

    async def refuse_start(self, instance_id: int, reason: str, attempt: int | None = None) -> None:
        """Report that a start of ``instance_id`` (at ``attempt``, if known) was refused: it fails for good."""
        ...

    async def set_adapters(self, request: SetAdapters) -> None:
        """Take a pipeline's adapter set; return once it is under way (agent/adapter_files.py)."""
        ...


class TaskRefused(AgentError):
    """A task could not be handed to the agent (its loop did not take it in time)."""


def celery_app(broker_url: str, node: str, *, result_backend: str | None = None) -> Celery:
    """The agent's Celery app: JSON only, this node's queue as its default, the broker as result backend."""
    queue = node_queue(node)
    backend = result_backend or broker_url
    # No fixups: Celery's Django fixup would set Django up in the agent wherever DJANGO_SETTINGS_MODULE is set.
    app = Celery(f"flotilla-agent-{node}", broker=broker_url, backend=backend, set_as_current=False, fixups=[])
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_default_queue=queue,
        result_expires=RESULT_EXPIRES_S,
        # One task at a time, taken from the queue only when the previous one is done.
        worker_prefetch_multiplier=1,
        # The broker may be down when the agent starts, or go away later: keep trying, for ever.
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        # No remote control (no pidbox queues), no task events: the control plane uses neither.
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
        # Every Redis command bounded: a frozen Redis must not hang an answer, nor a consumer on a dead peer.
        **celery_redis_settings(),
    )
    return app


class TaskConsumer:
    """Consumes node ``node``'s queue on ``broker_url`` in a thread; ``start()``, then ``stop()`` (blocking)."""

    def __init__(
        self,
        *,
        broker_url: str,
        node: str,
        handler: TaskHandler,
        loop: asyncio.AbstractEventLoop,
        signing_key: SigningKey | None,
        result_backend: str | None = None,
        engines: Collection[str] | None = None,
        control_plane_now: Callable[[], float] = time.time,
    ) -> None:
        """``signing_key`` is the node's (``runtime.fleet_contract.signing.agent_signing_key``): tasks not signed with
        it are refused; None takes unsigned tasks (tests of other things only). ``engines`` are those this
        node's workers can run (default: the fleet's engines installed here). ``control_plane_now`` is the
        control plane's clock as the agent estimates it (agent/control_plane_clock.py): tasks expire on it.

        Raises ConfigError for a node name that cannot name a queue.
        """
        self.queue = node_queue(node)
        self.broker_url = broker_url
        self.node = node
        self.engines = frozenset(engines_on_this_node() if engines is None else engines)
        self._signing_key = signing_key
        self._freshness = TaskFreshness(control_plane_now)
        self._handler = handler
        self._loop = loop
        self.app = celery_app(broker_url, node, result_backend=result_backend)
        self._register_tasks()
        self._ready = threading.Event()
        #: Set when the consumer's thread has ended (after ``stop()``, or when Celery gave up: it logs why).
        self.ended = asyncio.Event()
        self._thread: threading.Thread | None = None
        self._worker: Any = None

    def _register_tasks(self) -> None:
        # ``throws``: Celery logs these at info without a traceback; the task body has said why already.
        expected = (ConfigError, WorkerError, TaskRefused, TaskNotAllowed)
        # ``shared=False``: Celery would otherwise add them to every app of the process, its default one too.
        self.app.task(name=TASK_START_INSTANCE, shared=False, ignore_result=True, throws=expected)(self._start_instance)
        self.app.task(name=TASK_STOP_INSTANCE, shared=False, ignore_result=True, throws=expected)(self._stop_instance)
        self.app.task(name=TASK_SET_ADAPTERS, shared=False, ignore_result=True, throws=expected)(self._set_adapters)
        # Celery logs each result: of a log tail, its start is enough.
        self.app.task(name=TASK_LOG_TAIL, shared=False, throws=expected, resultrepr_maxsize=80)(self._log_tail)

    # -- the task bodies (in the consumer's thread) ---------------------------------------------------

    def _start_instance(self, *args: object, **kwargs: object) -> None:
        self._check_signature(args, TASK_START_INSTANCE)
        try:
            request = self._decode(args, kwargs, StartInstance, TASK_START_INSTANCE)
        except ConfigError as exc:
            # Signed: the control plane sent it, and hears why it was refused if the instance is this node's.
            self._refuse_start(_instance_id(args, self.node), str(exc), None)
            raise
        self._check_node(request.node, TASK_START_INSTANCE)
        self._check_fresh(request, TASK_START_INSTANCE)
        try:
            check_start(request, engines=self.engines, node=self.node)
        except TaskNotAllowed as exc:
            log.warning("task %s refused: %s", TASK_START_INSTANCE, exc)
            self._refuse_start(request.spec.instance_id, str(exc), request.attempt)
            raise
        log.info("task: start instance %d (attempt %d)", request.spec.instance_id, request.attempt)
        self._hand_off(self._handler.accept_start(request), TASK_START_INSTANCE)

    def _stop_instance(self, *args: object, **kwargs: object) -> None:
        self._check_signature(args, TASK_STOP_INSTANCE)
        request = self._decode(args, kwargs, StopInstance, TASK_STOP_INSTANCE)
        self._check_node(request.node, TASK_STOP_INSTANCE)
        self._check_fresh(request, TASK_STOP_INSTANCE)
        log.info("task: stop instance %d (%s)", request.instance_id, request.reason or "no reason given")
        self._hand_off(self._handler.accept_stop(request), TASK_STOP_INSTANCE)

    def _set_adapters(self, *args: object, **kwargs: object) -> None:
        self._check_signature(args, TASK_SET_ADAPTERS)
        request = self._decode(args, kwargs, SetAdapters, TASK_SET_ADAPTERS)
        self._check_node(request.node, TASK_SET_ADAPTERS)
        self._check_fresh(request, TASK_SET_ADAPTERS)
        try:
            check_adapters(request.pipeline, [adapter.name for adapter in request.adapters])
        except TaskNotAllowed as exc:
            log.warning("task %s refused: %s", TASK_SET_ADAPTERS, exc)
            raise
        log.info("task: adapter set %d of pipeline %s", request.generation, request.pipeline)
        self._hand_off(self._handler.set_adapters(request), TASK_SET_ADAPTERS)

    def _log_tail(self, *args: object, **kwargs: object) -> str:
        self._check_signature(args, TASK_LOG_TAIL)
        request = self._decode(args, kwargs, LogTailRequest, TASK_LOG_TAIL)
        self._check_fresh(request, TASK_LOG_TAIL)
        if request.lines > MAX_LOG_LINES:
            request = LogTailRequest(instance_id=request.instance_id, lines=MAX_LOG_LINES)
        try:
            return self._hand_off(self._handler.log_tail(request), TASK_LOG_TAIL)
        except WorkerError as exc:
            log.info("task %s: %s", TASK_LOG_TAIL, exc)
            raise

    def _check_signature(self, args: tuple[object, ...], task: str) -> None:
        """Raises TaskNotAllowed (logged) unless the task's argument is signed with this node's key."""
        key = self._signing_key
        if key is None:
            return
        payload = args[0] if args else None
        if signature_ok(task, payload, key):
            return
        signatures = payload.get(SIGNATURES_FIELD) if isinstance(payload, dict) else None
        if not signatures:
            why = "it is not signed"
        else:
            why = f"it is not signed with node {self.node}'s key (key id {key.key_id}), or was changed since"
        message = f"the task did not come from the control plane: {why}"
        log.warning("task %s refused: %s", task, message)
        raise TaskNotAllowed(message)

    def _check_node(self, node: str, task: str) -> None:
        """Raises TaskNotAllowed (logged) unless the task names this node."""
        if node == self.node:
            return
        message = f"the task is for node {node!r}, not {self.node}" if node else "the task names no node"
        log.warning("task %s refused: %s", task, message)
        raise TaskNotAllowed(message)

    def _check_fresh(self, stamp: TaskStamp, task: str) -> None:
        """Raises TaskNotAllowed (logged) for a task past its validity or taken before (agent/tasks/freshness.py).
        Not reported: the control plane sends a fresh task if it still wants one."""
        try:
            self._freshness.check(stamp, task)
        except TaskNotAllowed as exc:
            log.warning("task %s refused: %s", task, exc)
            raise

    def _refuse_start(self, instance_id: int | None, reason: str, attempt: int | None) -> None:
        """Tell the agent (which reports it) that the start of ``instance_id`` was refused; None: unknown."""
        if instance_id is not None:
            self._hand_off(self._handler.refuse_start(instance_id, reason, attempt), TASK_START_INSTANCE)

    def _decode(self, args: tuple[object, ...], kwargs: dict[str, object], kind: type[T], task: str) -> T:
        """The task's one argument as ``kind``. Raises ConfigError (logged here with the reason: the task fails)."""
        try:
            if len(args) != 1 or kwargs:
                raise ConfigError(
                    f"malformed {kind.__name__} task: it takes one argument, got {len(args)} and {len(kwargs)} by name"
                )
            return decode_task_argument(args[0], kind)
        except ConfigError as exc:
            log.warning("task %s refused: %s", task, exc)
            raise

    def _hand_off(self, coroutine: Coroutine[Any, Any, T], task: str) -> T:
        """Run ``coroutine`` on the agent's loop and wait for its result. Raises what it raises, TaskRefused."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(HANDOFF_TIMEOUT_S)
        except FutureTimeout:
            future.cancel()
            message = f"the agent did not take task {task} within {HANDOFF_TIMEOUT_S:.0f} s"
            log.error("%s", message)
            raise TaskRefused(message) from None

    # -- the consumer's thread ------------------------------------------------------------------------

    def start(self) -> None:
        """Start consuming in a thread. The broker need not be up: the consumer connects when it is."""
        if self._thread is not None:
            raise RuntimeError("the task consumer is already running")
        worker_state.should_stop = None
        self.ended.clear()
        self._worker = self.app.WorkController(
            hostname=f"agent@{self.node}",
            pool="solo",
            concurrency=1,
            queues=[self.queue],
            ready_callback=self._on_ready,
            without_heartbeat=True,
            without_mingle=True,
            without_gossip=True,
        )
        self._thread = threading.Thread(target=self._consume, name=f"celery consumer of {self.queue}", daemon=True)
        self._thread.start()
        log.info("consuming Celery queue %s on %s", self.queue, maybe_sanitize_url(self.broker_url))

    def _consume(self) -> None:
        # The worker runs each task through Celery's "current app", which is per thread: this one's is ours.
        self.app.set_current()
        try:
            self._worker.start()
        finally:
            self._loop.call_soon_threadsafe(self.ended.set)

    def _on_ready(self, consumer: object) -> None:
        del consumer
        log.info(
            "connected to the broker at %s: taking tasks from queue %s", maybe_sanitize_url(self.broker_url), self.queue
        )
        self._ready.set()

    def wait_ready(self, timeout_s: float) -> bool:
        """Blocking: whether the consumer connected and consumes within ``timeout_s``."""
        return self._ready.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Blocking: stop consuming (a task running now finishes first) and wait for the thread to end."""
        thread = self._thread
        if thread is None:
            return
        # Celery's worker checks this flag between events and between connection attempts (its own
        # signal handlers set it too); calling the worker's stop() from another thread would race its loop.
        worker_state.should_stop = 0
        thread.join(timeout_s)
        if thread.is_alive():
            log.warning("the Celery consumer did not stop within %.0f s; leaving its thread behind", timeout_s)
        else:
            worker_state.should_stop = None
        self._thread = None
        self._ready.clear()


def _instance_id(args: tuple[object, ...], node: str) -> int | None:
    """The instance a malformed StartInstance for ``node`` names (``args[0]["spec"]["instance_id"]``), if it
    names one and that node."""
    argument = args[0] if len(args) == 1 else None
    if not isinstance(argument, dict) or argument.get("node") != node:
        return None
    spec = argument.get("spec")
    instance_id = spec.get("instance_id") if isinstance(spec, dict) else None
    # bool is an int too; an id is a positive one.
    return instance_id if type(instance_id) is int and instance_id > 0 else None
