"""The starts the agent is carrying out, kept on disk until their worker is launched, for an agent that
restarts meanwhile to carry them on.

A start's download may take an hour; an agent restarted in the middle of it (an upgrade, a crash) would
otherwise find no worker of the instance, report it failed, and have the control plane start it again,
perhaps on another node, with the partial files left here for nothing. So each accepted start is kept in
``<state_dir>/start-<instance id>.json`` (the task's payload, as msgspec encodes it) from when it is accepted
until its worker is launched, it fails, or a stop or a newer start takes its place; the next agent resumes
it (agent/instances/startup_reconcile.py) if the control plane still wants that start here. A file that
cannot be written only costs that: the next agent then reports the instance missing, as before.
"""

import logging
from pathlib import Path

import msgspec

from runtime.fleet_contract.tasks import StartInstance

log = logging.getLogger(__name__)


class StartFiles:
    """The ``start-<instance id>.json`` files of the agent's ``state_dir``."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def save(self, request: StartInstance) -> None:
        """Keep ``request`` as its instance's start under way; a disk that refuses is logged, not raised."""
        path = self._path(request.spec.instance_id)
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(".tmp")
            temporary.write_bytes(msgspec.json.encode(request))
            temporary.replace(path)  # whole or not at all: an agent killed mid-write leaves the old file
        except OSError as exc:
            log.warning(
                "cannot keep instance %d's start in %s (%s): an agent restarted before its worker is launched "
                "will not resume it",
                request.spec.instance_id,
                self.state_dir,
                exc,
            )

    def load_all(self) -> list[StartInstance]:
        """Every start kept, by instance id; a file that cannot be read is logged and removed."""
        starts = []
        for path in sorted(self.state_dir.glob("start-*.json")):
            try:
                request = msgspec.json.decode(path.read_bytes(), type=StartInstance)
            except (OSError, msgspec.DecodeError) as exc:
                log.warning("ignoring %s, which holds no start this agent can read (%s)", path, exc)
                path.unlink(missing_ok=True)
                continue
            if path.name != self._path(request.spec.instance_id).name:
                log.warning("ignoring %s, which holds a start of instance %d", path, request.spec.instance_id)
                path.unlink(missing_ok=True)
                continue
            starts.append(request)
        return starts

    def forget(self, instance_id: int) -> None:
        self._path(instance_id).unlink(missing_ok=True)

    def forget_start(self, request: StartInstance) -> None:
        """Remove the instance's file if it still holds ``request`` (a newer start may have replaced it)."""
        path = self._path(request.spec.instance_id)
        try:
            kept = msgspec.json.decode(path.read_bytes(), type=StartInstance)
        except (OSError, msgspec.DecodeError):
            return
        if (kept.attempt, kept.incarnation) == (request.attempt, request.incarnation):
            path.unlink(missing_ok=True)

    def _path(self, instance_id: int) -> Path:
        return self.state_dir / f"start-{instance_id}.json"
