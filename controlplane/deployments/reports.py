"""What an agent reports about an instance, as plain data ``instances.report_instance_state`` takes (the API
validates, then builds it)."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class InstanceReport:
    """An agent's news about one instance: its state and what it knows about the process."""

    state: str
    reason: str = ""
    pid: int | None = None
    endpoint_instance_id: int | None = None
    download_progress: float | None = None
    #: The start this report is about (the instance's ``restarts`` when it was sent); None: not said.
    attempt: int | None = None
    #: With "failed": retrying cannot fix it (a bad argument, a repository that does not exist).
    permanent: bool = False
