"""How an action asks for a reconciler pass sooner than the periodic one: ``request_reconcile()``.

Actions that give the reconciler work (a deploy, a scale, a drain, a node that comes back, a failure) call
it inside their transaction; once that commits, the registered sender queues one pass. The sender is
Celery's (``controlplane.celery_app.send_reconcile_request``), registered when Django starts
(``DeploymentsConfig.ready``), so that no domain module names Celery. The periodic pass comes anyway:
this only makes it sooner, and a request that cannot be sent is logged and dropped by the sender.
"""

import logging
from collections.abc import Callable

from django.db import transaction

log = logging.getLogger(__name__)

_sender: Callable[[], object] | None = None


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
