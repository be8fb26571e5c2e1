"""Which of this node's workers the control plane no longer owns: the agent's comparison, as a pure decision.

The control plane may change its mind about a node's instances while the agent cannot hear it: a node
silent for long enough is evicted (its instances fail and are placed elsewhere), a person stops or
deletes a pipeline, a restart raises an instance's attempt. The agent compares its workers with the
control plane's list of the node's instances (periodically, after an outage, after a refused report)
and stops the workers that list disowns, as Nomad's clients do after a partition: an instance not
listed for this node, listed in a state in which no process should run, listed at a newer attempt
than the worker's, or listed with another incarnation (a restored database gave its id to a new
instance). Whatever the list leaves in doubt (an attempt the agent does not know) is kept: the agent
never stops a worker on a guess.
"""

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from agent.control_plane_client import AgentInstance

#: Listed states in which the control plane wants no process of the instance on its node.
UNWANTED_STATES = frozenset({"stopping", "stopped", "failed"})
#: Listed states in which the control plane expects a process of the instance on its node.
RUNNING_STATES = frozenset({"downloading", "starting", "ready"})


@dataclass(frozen=True)
class Started:
    """Which start a worker runs: the attempt (None: unknown) and the incarnation ("": unknown)."""

    attempt: int | None
    incarnation: str = ""


@dataclass(frozen=True)
class Disowned:
    """A worker the control plane disowns, and why (a sentence about the instance)."""

    instance_id: int
    why: str
    #: The state the instance is listed in; None when it is not listed for this node.
    listed_state: str | None

    @property
    def awaits_stop(self) -> bool:
        """Whether the control plane waits for this worker's "stopped" (it asked for the stop itself)."""
        return self.listed_state == "stopping"


def disowned(
    workers: Mapping[int, Started], listing: Sequence[AgentInstance], *, recent: Set[int] = frozenset()
) -> list[Disowned]:
    """The workers in ``workers`` (instance id -> the start it runs) that ``listing`` (the control plane's
    instances on this node) disowns, by instance id.

    ``recent`` are instances whose start came so shortly before the list was asked for that the list may
    not show them yet (the control plane sends a start as it commits it): missing from it, they are kept.
    """
    rows = {row.id: row for row in listing}
    found = []
    for instance_id, started in sorted(workers.items()):
        attempt = started.attempt
        row = rows.get(instance_id)
        if row is None and instance_id in recent:
            continue
        if row is None:
            found.append(Disowned(instance_id, f"instance {instance_id} is no longer placed on this node", None))
        elif row.incarnation and started.incarnation and row.incarnation != started.incarnation:
            why = (
                f"instance id {instance_id} is another instance now (incarnation {row.incarnation}, this worker's "
                f"is {started.incarnation}): the control plane's database was restored, or its ids reused"
            )
            found.append(Disowned(instance_id, why, None))
        elif row.state in UNWANTED_STATES:
            why = f"the control plane has instance {instance_id} {row.state}"
            found.append(Disowned(instance_id, why, row.state))
        elif row.attempt is not None and attempt is not None and row.attempt > attempt:
            why = (
                f"the control plane is at attempt {row.attempt} of instance {instance_id} ({row.state}), "
                f"this worker runs attempt {attempt}"
            )
            found.append(Disowned(instance_id, why, row.state))
    return found
