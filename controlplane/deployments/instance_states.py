"""An instance's state machine: its states, which may follow which, and the groups of states the actions ask
about (drawn in ``controlplane.deployments.models.Instance``'s docstring, which a test holds to it)."""

from django.db import models

from controlplane.errors import InvalidTransition


class InstanceState(models.TextChoices):
    PENDING = "pending"
    DOWNLOADING = "downloading"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


# The one place that says which state may follow which (drawn in Instance's docstring). Forward skips
# along the start path are allowed: an agent reports the latest state, and an earlier report may be lost.
TRANSITIONS: dict[str, frozenset[str]] = {
    InstanceState.PENDING: frozenset(
        {
            InstanceState.DOWNLOADING,
            InstanceState.STARTING,
            InstanceState.READY,
            InstanceState.STOPPING,
            InstanceState.STOPPED,
            InstanceState.FAILED,
        }
    ),
    InstanceState.DOWNLOADING: frozenset(
        {InstanceState.STARTING, InstanceState.READY, InstanceState.STOPPING, InstanceState.FAILED}
    ),
    InstanceState.STARTING: frozenset({InstanceState.READY, InstanceState.STOPPING, InstanceState.FAILED}),
    InstanceState.READY: frozenset({InstanceState.STOPPING, InstanceState.FAILED}),
    # stopping → pending: stopped in order to be restarted in place.
    InstanceState.STOPPING: frozenset({InstanceState.STOPPED, InstanceState.FAILED, InstanceState.PENDING}),
    InstanceState.FAILED: frozenset({InstanceState.PENDING, InstanceState.STOPPED}),
    InstanceState.STOPPED: frozenset(),
}


# States in which an instance counts towards its group's replicas (it runs, or is meant to run again).
LIVE_STATES = frozenset(
    {
        InstanceState.PENDING,
        InstanceState.DOWNLOADING,
        InstanceState.STARTING,
        InstanceState.READY,
        InstanceState.FAILED,
    }
)


# States in which a process may exist on the node, so stopping needs the agent.
PROCESS_STATES = frozenset(
    {InstanceState.DOWNLOADING, InstanceState.STARTING, InstanceState.READY, InstanceState.STOPPING}
)


def check_transition(current: str, new: str) -> None:
    """Raise InvalidTransition unless an instance in ``current`` may move to ``new``."""
    if new not in TRANSITIONS[current]:
        allowed = ", ".join(sorted(TRANSITIONS[current])) or "none (it is final)"
        raise InvalidTransition(f"an instance cannot go from {current} to {new} (from {current}: {allowed})")
