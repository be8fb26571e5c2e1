"""This machine's id, which the agent sends with its registration and heartbeats.

The control plane keeps the first machine id a node is registered with, and refuses (409) another machine
that registers or heartbeats under the same node name (controlplane/fleet/machines.py): two machines given
one ``--name`` would otherwise share one task queue silently.

The id is systemd's ``/etc/machine-id`` (or D-Bus's copy): stable across reboots and reinstalls of the
agent, unique per installed system, and not secret. Where there is none (a minimal container), a random id
is made once and kept in the agent's state directory. ``--machine-id`` (``FLOTILLA_MACHINE_ID``) overrides
both, for tests and for containers whose /etc/machine-id is the image's.
"""

import logging
import re
import uuid
from collections.abc import Sequence
from pathlib import Path

from runtime.errors import ConfigError

log = logging.getLogger(__name__)

SYSTEM_FILES = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))
#: The file in the state directory that keeps a made-up id.
STATE_FILE = "machine-id"
# What the control plane accepts (controlplane/fleet/machines.py MACHINE_ID_PATTERN).
_VALID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def valid_machine_id(text: str) -> str:
    """``text`` stripped, if it is a machine id the control plane accepts. Raises ConfigError otherwise."""
    value = text.strip()
    if not _VALID.fullmatch(value):
        raise ConfigError(
            f"{value!r} is not a machine id: 1-128 letters, digits, '.', '_', ':' or '-', starting with a letter "
            "or digit"
        )
    return value


def local_machine_id(state_dir: Path, system_files: Sequence[Path] = SYSTEM_FILES) -> str:
    """This machine's id: the first of ``system_files`` that holds one, else the one kept in ``state_dir``
    (made and kept there the first time). Raises ConfigError when none can be read or kept."""
    for path in system_files:
        try:
            return valid_machine_id(path.read_text())
        except (OSError, ConfigError):
            continue  # missing, unreadable, or empty (an image's /etc/machine-id before first boot)
    kept = state_dir / STATE_FILE
    try:
        return valid_machine_id(kept.read_text())
    except FileNotFoundError:
        pass
    except (OSError, ConfigError) as exc:
        raise ConfigError(
            f"cannot read this machine's id from {kept} ({exc}): remove the file, or give --machine-id"
        ) from exc
    made = uuid.uuid4().hex
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        kept.write_text(made + "\n")
    except OSError as exc:
        raise ConfigError(
            f"this machine has no /etc/machine-id and {kept} cannot be written ({exc}): give --machine-id"
        ) from exc
    log.info("this machine has no /etc/machine-id: made machine id %s, kept in %s", made, kept)
    return made
