"""What the planner decided for one group, in words a person can read."""

from dataclasses import dataclass
from typing import Literal

from planner.settings import Role

#: How the desired count was found: from a profile at the targets (``sla``), from load thresholds
#: (``load``), or not at all (``off``: the planner is disabled).
Mode = Literal["sla", "load", "off"]

#: What held the desired count away from what the load asked for, if anything.
Bound = Literal[
    "min_replicas",
    "max_replicas",
    "gpu_budget",
    "in_flight",
    "step",
    "down_window",
    "cooldown",
    "reversal",
    "starting",
]


@dataclass(frozen=True)
class Decision:
    """One group's decision at one moment.

    ``desired`` is what the group should have; ``wanted`` what the load alone asked for, before any bound.
    ``bound`` names what limited it (None: nothing did). ``drain`` is how many replicas a scale-down
    removes, and ``drain_instances`` the ones to take first (the least busy), whose requests finish before
    they stop. ``advisory``: recorded only, the caller acts on nothing.
    """

    role: Role
    current: int
    desired: int
    wanted: int
    mode: Mode
    reason: str
    bound: Bound | None = None
    advisory: bool = False
    drain: int = 0
    drain_instances: tuple[int, ...] = ()

    @property
    def change(self) -> int:
        """Replicas to add (positive) or remove (negative)."""
        return self.desired - self.current

    @property
    def acts(self) -> bool:
        """Whether the caller should change the group's replicas."""
        return self.change != 0 and not self.advisory and self.mode != "off"
