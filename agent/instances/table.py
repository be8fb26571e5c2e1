"""What the node agent knows of each instance it was asked to start or stop, or found running.

Every part of the agent reads the same entries: the task intake (agent/tasks/intake.py) decides by an
entry's attempt and operation whether a start is new, a repeat or stale; the reports
(agent/instances/reports.py) name the entry's attempt and keep its last report; the comparison with the
control plane (agent/instances/ownership_checks.py) leaves alone the workers whose start is too recent for the
list it compares with, which is why the table also counts the starts it has accepted.
"""

import asyncio
import time
from dataclasses import dataclass, field

from agent.control_plane_client import InstanceReport


@dataclass(eq=False)
class InstanceEntry:
    """What the agent knows of one instance."""

    #: The control plane's attempt this node runs or ran; None when unknown (adopted without a record).
    attempt: int | None
    #: The instance's incarnation this node runs or ran (runtime/fleet_contract/tasks.py); "" when unknown.
    incarnation: str = ""
    #: The latest operation (a start or a stop); the next one waits for it.
    operation: "asyncio.Task[None] | None" = field(default=None, repr=False)
    #: Whether ``operation`` is a start (which a stop or a newer start cancels, if it is still under way).
    starting: bool = False
    #: The last report sent about it, sent again when a duplicate start asks.
    last_report: InstanceReport | None = None
    #: Which start this agent accepted last (a count): a list asked for before it may not show it yet.
    accepted: int = 0
    #: When (time.monotonic()) it was accepted.
    accepted_at: float = 0.0

    @property
    def underway(self) -> bool:
        """Whether an operation (a start or a stop) on the instance has not finished."""
        return self.operation is not None and not self.operation.done()

    @property
    def stopping(self) -> bool:
        """Whether a stop of the instance has not finished."""
        return self.underway and not self.starting


class InstanceTable:
    """Every instance's entry, by instance id, and the count of starts accepted so far."""

    def __init__(self) -> None:
        self._entries: dict[int, InstanceEntry] = {}
        #: How many starts the agent has accepted; an entry's ``accepted`` is its start's number.
        self.starts_accepted = 0

    def get(self, instance_id: int) -> InstanceEntry | None:
        return self._entries.get(instance_id)

    def entry(self, instance_id: int) -> InstanceEntry:
        """The instance's entry, made (its attempt unknown) if it has none."""
        return self._entries.setdefault(instance_id, InstanceEntry(attempt=None))

    def add(self, instance_id: int, attempt: int | None, incarnation: str = "") -> InstanceEntry:
        entry = self._entries[instance_id] = InstanceEntry(attempt=attempt, incarnation=incarnation)
        return entry

    def items(self) -> list[tuple[int, InstanceEntry]]:
        return list(self._entries.items())

    def count_start(self, entry: InstanceEntry) -> None:
        """Number the start just accepted for ``entry``'s instance, and note when it was accepted."""
        self.starts_accepted += 1
        entry.accepted, entry.accepted_at = self.starts_accepted, time.monotonic()
