"""Which signed tasks are still to be acted on: not expired (on the control plane's clock), not seen before.

A signature proves who wrote a task, not that it is news. A copy of an old one re-sent onto the queue (by
anyone who holds the broker's credentials, which every agent does) is as well signed as the original: an
old stop would stop the worker a later start launched. So every task carries a ``TaskStamp``
(runtime/fleet_contract/tasks.py), inside the signature: a nonce, and when it was issued and for how long
it is valid on the control plane's clock. The agent refuses one past its validity (judged on its estimate
of the control plane's clock, agent/control_plane_clock.py) and one whose nonce it has taken already; it
remembers nonces only while their tasks are valid, since an expired copy is refused for its age anyway.
Tasks from a control plane that stamps nothing (``issued_at`` 0) are taken as before.
"""

import threading
from collections.abc import Callable

from agent.errors import TaskNotAllowed
from runtime.fleet_contract.tasks import TaskStamp

#: How far ahead of the control plane's clock (as estimated) a task may say it was issued: the estimate is
#: good to about a second; more is a task from a control plane whose own processes disagree on the time.
FUTURE_SLACK_S = 5.0


class TaskFreshness:
    """Refuses expired and repeated tasks (``check``); called from the task consumer's thread."""

    def __init__(self, control_plane_now: Callable[[], float]) -> None:
        self._now = control_plane_now
        self._seen: dict[str, float] = {}  # nonce -> when its task stops being valid (control plane's clock)
        self._lock = threading.Lock()

    def check(self, stamp: TaskStamp, task: str) -> None:
        """Raises TaskNotAllowed when ``stamp``'s task has expired, or was taken before; else remembers it."""
        if not stamp.issued_at:
            return  # a control plane that does not stamp its tasks
        now = self._now()
        valid_until = stamp.issued_at + stamp.valid_for_s
        if now > valid_until:
            raise TaskNotAllowed(
                f"task {task} expired: it was issued {now - stamp.issued_at:.0f} s ago (on the control plane's "
                f"clock) and was valid for {stamp.valid_for_s:g} s; the control plane sends a fresh one if it "
                "still wants it"
            )
        if stamp.issued_at > now + FUTURE_SLACK_S:
            raise TaskNotAllowed(
                f"task {task} says it was issued {stamp.issued_at - now:.0f} s from now on the control plane's "
                "clock: its processes' clocks disagree (set up NTP on the control plane's machines)"
            )
        with self._lock:
            for nonce, until in list(self._seen.items()):
                if until < now:
                    del self._seen[nonce]
            if stamp.nonce in self._seen:
                raise TaskNotAllowed(f"task {task} was taken before (nonce {stamp.nonce}): a copy re-sent is ignored")
            if stamp.nonce:
                self._seen[stamp.nonce] = valid_until
