"""Send the control plane's change notices to the channel layer from a thread of its own.

Actions run in request threads (and in the Celery worker): a change there must not wait for Redis,
nor fail when Redis is gone. ``publish`` only records the notice (a burst of notices about one row
becomes one) and wakes the publisher's thread, which sends them with the channel layer on its own
event loop. A failed send is logged (at most once per ``FAILURE_REPORT_S``) and its notices dropped:
the next change sends a fresh one, and a page loaded later shows the truth anyway.

Each send has its own deadline, and up to ``SEND_CONCURRENCY`` groups are sent to at once (each group's
notices in order, one after another). The deadline tells a
layer that does not answer from one that is merely busy: under a burst of API calls a batch holds hundreds of
notices (audit entries are never merged), and one deadline for the whole batch, sent a round trip at a time
on a process whose request threads hold the GIL, dropped whole batches of a layer that answered every send
(issue 39: 268 notices in four minutes).
"""

import asyncio
import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

from channels.layers import BaseChannelLayer, get_channel_layer

from controlplane.live.groups import Changed, Kind, changed
from runtime.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

#: One send gives up after this (a Redis that accepts connections but does not answer); the rest of its batch
#: is dropped with it.
SEND_TIMEOUT_S = 5.0
#: Sends in flight at once: their round trips overlap.
SEND_CONCURRENCY = 16
FAILURE_REPORT_S = 30.0
#: At exit, how long the process waits for its last notices to leave.
EXIT_FLUSH_S = 2.0

Key = tuple[Kind, int]


class Publisher:
    """Notices of changed rows, sent to their groups by a daemon thread started on first use (per process:
    a forked Celery worker starts its own)."""

    def __init__(self, layer: Callable[[], BaseChannelLayer | None] = get_channel_layer) -> None:
        self._layer = layer
        self._lock = threading.Lock()
        self._pending: dict[Key, set[str]] = {}
        self._wakeup = threading.Event()
        self._idle = threading.Condition(self._lock)
        self._sending = False
        self._pid: int | None = None
        # Only the publisher's thread logs through it.
        self._failures = RateLimitedLog(log, period_s=FAILURE_REPORT_S, held_level=logging.DEBUG)
        self.sent = 0  # group sends made, for tests and logs
        self.failed = 0  # batches that failed
        self.dropped = 0  # group sends given up

    def publish(self, kind: Kind, row_id: int, groups: Iterable[str]) -> None:
        """Tell ``groups`` that row ``row_id`` of ``kind`` changed, soon, from the publisher's thread.

        Never blocks on I/O and never raises for the layer's sake.
        """
        with self._lock:
            if self._pid != os.getpid():
                self._start()
            self._pending.setdefault((kind, row_id), set()).update(groups)
        self._wakeup.set()

    def flush(self, timeout: float) -> bool:
        """Wait until every notice published so far has been sent (or dropped); False after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending or self._sending:
                left = deadline - time.monotonic()
                if left <= 0 or self._pid != os.getpid():
                    return False
                self._idle.wait(left)
        return True

    def _start(self) -> None:
        # Under the lock. A process forked from one whose thread ran (Celery's prefork pool) has no such
        # thread: what it inherited of the state is dropped with it.
        first = self._pid is None
        self._pid = os.getpid()
        self._pending = {}
        self._sending = False
        thread = threading.Thread(target=self._run, name="live-publisher", daemon=True)
        thread.start()
        if first:
            atexit.register(self.flush, EXIT_FLUSH_S)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        while True:
            self._wakeup.wait()
            with self._lock:
                self._wakeup.clear()
                batch, self._pending = self._pending, {}
                self._sending = True
            try:
                loop.run_until_complete(self._send(batch))
            finally:
                with self._idle:
                    self._sending = False
                    self._idle.notify_all()

    async def _send(self, batch: dict[Key, set[str]]) -> None:
        if not batch:
            return
        layer = self._layer()
        if layer is None:
            return
        # Each group's notices in the order they came (a page hears a list's change before a row's in it, as
        # it did when every send went one after another); the groups' sends overlap.
        by_group: dict[str, list[Changed]] = {}
        for (kind, row_id), groups in batch.items():
            for group in groups:
                by_group.setdefault(group, []).append(changed(kind, row_id))
        total = sum(len(messages) for messages in by_group.values())
        gate = asyncio.Semaphore(SEND_CONCURRENCY)
        sent_before = self.sent

        async def send(group: str, messages: list[Changed]) -> None:
            async with gate:
                for message in messages:
                    async with asyncio.timeout(SEND_TIMEOUT_S):
                        await layer.group_send(group, dict(message))
                    self.sent += 1

        try:
            # The first failure cancels the sends left: the layer is unreachable, not slow.
            async with asyncio.TaskGroup() as sending:
                for group in sorted(by_group):
                    sending.create_task(send(group, by_group[group]))
        except* Exception as failures:  # the layer's errors are Redis's, OSError, timeouts: none may escape
            self.failed += 1
            dropped = total - (self.sent - sent_before)
            self.dropped += dropped
            self._report(failures.exceptions[0], dropped, layer)

    def _report(self, exc: BaseException, notices: int, layer: BaseChannelLayer) -> None:
        self._failures.warning(
            f"live updates: cannot reach the channel layer at {layer_address(layer)} ({describe(exc)}); {notices} "
            "change notice(s) dropped, dashboards show them on their next change or reload"
        )


def describe(exc: BaseException) -> str:
    """``ConnectionError: Error 111 connecting to ...``: redis-py's own reprs say less."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def layer_address(layer: BaseChannelLayer) -> str:
    """Where ``layer`` sends (its Redis hosts, passwords hidden), for messages."""
    hosts = getattr(layer, "hosts", None)
    if not hosts:
        return type(layer).__name__
    return ", ".join(_without_password(str(host.get("address", host))) for host in hosts)


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not at:
        return url
    user = credentials.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}" if user else f"{scheme}{sep}***@{host}"
