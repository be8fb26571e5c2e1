"""Each worker's attempt, kept on disk beside its record, so that an agent that restarts knows it.

The control plane counts the starts of an instance (its ``attempt``): a start at a newer attempt replaces
the worker, one at an older attempt is ignored (agent/tasks/intake.py). The supervisor's records
(agent/workers/records.py) say which spec a worker runs but not at which attempt, so the agent keeps that in
``<state_dir>/attempt-<instance id>``: the attempt, then the instance's incarnation (runtime/fleet_contract/
tasks.py) when the start named one, on one line. A file that cannot be written only costs the next agent
that knowledge: it then takes the next start of the instance to name the worker's attempt.
"""

import logging
import re
from collections.abc import Set
from pathlib import Path

from runtime.fleet_contract.tasks import INCARNATION_PATTERN

log = logging.getLogger(__name__)


class AttemptFiles:
    """The ``attempt-<instance id>`` files of the agent's ``state_dir``."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def save(self, instance_id: int, attempt: int, incarnation: str = "") -> None:
        """Record the start the instance's worker runs; a disk that refuses is logged, not raised."""
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._path(instance_id).write_text(f"{attempt} {incarnation}".strip())
        except OSError as exc:
            log.warning("cannot record instance %d's attempt in %s (%s)", instance_id, self.state_dir, exc)

    def load(self, instance_id: int) -> tuple[int | None, str]:
        """The recorded attempt and incarnation; (None, "") when there is none, or it cannot be read."""
        try:
            words = self._path(instance_id).read_text().split()
            attempt = int(words[0])
        except (OSError, ValueError, IndexError):
            return None, ""
        incarnation = words[1] if len(words) == 2 and re.fullmatch(INCARNATION_PATTERN, words[1]) else ""
        return attempt, incarnation

    def forget(self, instance_id: int) -> None:
        self._path(instance_id).unlink(missing_ok=True)

    def forget_all_but(self, keep: Set[int]) -> None:
        """Remove the files of every instance not in ``keep`` (and any file not named by an instance id)."""
        for path in self.state_dir.glob("attempt-*"):
            number = path.name.removeprefix("attempt-")
            if not number.isdigit() or int(number) not in keep:
                path.unlink(missing_ok=True)

    def _path(self, instance_id: int) -> Path:
        return self.state_dir / f"attempt-{instance_id}"
