"""How an action asks for a reconciler pass sooner than the periodic one: ``request_reconcile()``.

Actions that give the reconciler work (a deploy, a scale, a drain, a node that comes back, a failure) call
it inside their transaction; once that commits, the registered sender queues one pass. The sender is
Celery's (``controlplane.celery_app.send_reconcile_request``), registered when Django starts
(``DeploymentsConfig.ready``), so that no domain module names Celery. The periodic pass comes anyway:
this only makes it sooner, and a request that cannot be sent is logged and dropped by the sender.

The sender runs on a thread of its own (``SendingThread``), never in the request that committed: a frozen
broker would otherwise hold every API call that changes something for as long as its publish waits, and
heartbeats queued behind those calls would make healthy nodes look lost. Requests made while one is being
sent become one more send: a pass reads everything committed before it starts.

Sends are at least ``MIN_INTERVAL_S`` apart: the first request after a quiet spell is sent at once, those
that follow within the interval become one send at its end. Sent one per API call, automation's 20
changes a second became 12 reconcile tasks a second (issue 39): passes back to back, each of them twenty
write transactions beside the API's, and every task that found the pass running wrote to the lease to ask
for one more.
"""

import logging
import math
import os
import threading
import time
from collections.abc import Callable

from django.db import transaction

log = logging.getLogger(__name__)

_sender: Callable[[], object] | None = None
#: The least time between two sends of a process (the periodic pass comes every 2 s anyway).
MIN_INTERVAL_S = 0.5


class SendingThread:
    """Calls ``send`` on a daemon thread, once per burst of calls and at most once per ``min_interval_s``
    (started on first use, per process: a forked process starts its own). Calling it never blocks on the
    broker and never raises."""

    def __init__(self, send: Callable[[], object], *, min_interval_s: float = 0.0) -> None:
        self._send = send
        self._min_interval_s = min_interval_s
        self._lock = threading.Condition()
        self._wanted = False
        self._sending = False
        self._pid: int | None = None

    def __call__(self) -> None:
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="reconcile requests", daemon=True).start()
            self._wanted = True
            self._lock.notify_all()

    def settle(self, timeout: float) -> bool:
        """Wait until every request made so far has been sent (or failed); False after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._wanted or self._sending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def _run(self) -> None:
        sent_at = -math.inf
        while True:
            with self._lock:
                while not self._wanted:
                    self._lock.wait()
                # Requests within the interval of the last send wait for its end, and go as one.
                while (left := sent_at + self._min_interval_s - time.monotonic()) > 0:
                    self._lock.wait(left)
                self._wanted, self._sending = False, True
            sent_at = time.monotonic()
            try:
                self._send()
            except Exception:  # the sender logs what it expects; nothing may end this thread
                log.exception("a reconcile request could not be sent; the periodic pass will come")
            finally:
                with self._lock:
                    self._sending = False
                    self._lock.notify_all()


def settle(timeout: float = 5.0) -> bool:
    """Wait until the reconcile requests made so far are sent, when the sender is a ``SendingThread``
    (tests, and a process about to exit); False after ``timeout`` s."""
    send = _sender
    return send.settle(timeout) if isinstance(send, SendingThread) else True


def set_sender(send: Callable[[], object]) -> None:
    """Make ``send`` (no arguments; it queues one pass) what ``request_reconcile`` calls after a commit."""
    global _sender
    _sender = send


def request_reconcile() -> None:
    """Ask for a reconciler pass once the current transaction commits (at once outside of one)."""
    send = _sender
    if send is None:
        # Only a process that loaded the models without Django's app registry gets here.
        log.warning("no reconciler pass asked for: no sender is registered; the periodic pass will come")
        return
    transaction.on_commit(send)
