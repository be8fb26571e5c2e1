"""The user the engine workers run as, when the agent runs as root: not the agent's, so they cannot read its token.

An engine runs a model's code (``trust_remote_code``) and serves its users' prompts: it is the least trusted
process on a node. The agent's token speaks for the node to the control plane, and signs its tasks. A worker
never gets the token in its environment (agent/workers/spec.py); but a worker running as the agent's own user
could still read the token's file, the agent's ``/proc/PID/environ`` and its memory. So where the agent runs
as root (deploy/systemd/flotilla-agent.service), each worker is started as an unprivileged user of its own,
``--worker-user`` (FLOTILLA_WORKER_USER, ``flotilla-worker``, which deploy/install.sh creates): its uid, its
group and that user's supplementary groups (``video``, ``render``: the GPUs' device files on some systems), its
home as HOME and working folder. A switch from root to another user drops every capability, so a worker can
neither read the root-owned token file (mode 0600), nor the agent's process files, nor switch back.

What the worker needs is kept within its reach: its log is opened by the agent and handed to it as its output
(the log folder stays the agent's), and the models folder is shared with the worker's group
(``share_models_dir``): owned by it, setgid so that what is downloaded into it later belongs to it too, group
read and search, nothing for others; the agent's umask becomes 027 so that new files are group-readable. Its
other files (state, the hub's token) are in folders of group root, which the worker is not in.

An agent that is not root cannot switch users: its workers run as it does (``flotilla up``, a development
machine), and docs/operations.md says what then protects the token and what does not.
"""

import grp
import logging
import os
import pwd
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import ConfigError

log = logging.getLogger(__name__)

#: The user deploy/install.sh creates for the workers.
DEFAULT_WORKER_USER = "flotilla-worker"
FLAG = "--worker-user (FLOTILLA_WORKER_USER)"
#: The agent's umask once it shares the models folder: files group-readable, nothing for others.
SHARED_UMASK = 0o027


@dataclass(frozen=True)
class WorkerUser:
    """Who the workers run as: ``uid``, ``gid`` and supplementary ``groups``, with ``home`` their HOME."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    def environment(self) -> dict[str, str]:
        """The variables that name the user, over the agent's own (its HOME would be root's)."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}

    def working_dir(self) -> str:
        """Where a worker starts: its home, or / when it has none (``nobody``'s is /nonexistent)."""
        return self.home if os.path.isdir(self.home) else "/"


def lookup_user(name: str) -> WorkerUser:
    """The user ``name`` of this machine (its groups included). Raises KeyError when there is none."""
    entry = pwd.getpwnam(name)
    groups = tuple(sorted(set(os.getgrouplist(entry.pw_name, entry.pw_gid))))
    return WorkerUser(entry.pw_name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir)


def resolve_worker_user(
    name: str | None, *, euid: int | None = None, lookup: Callable[[str], WorkerUser] = lookup_user
) -> WorkerUser | None:
    """The user the workers switch to; None when they run as the agent does.

    ``name`` is the flag's value (None: not given); ``euid`` the agent's (default: this process's). Raises
    ConfigError for a user that does not exist, for root, and for another user when the agent is not root
    (it could not switch).
    """
    euid = os.geteuid() if euid is None else euid
    if not name:
        if euid == 0:
            log.warning(
                "the agent runs as root and %s is not set: its engine workers run as root too, and can read its "
                "token. Set FLOTILLA_WORKER_USER=%s (deploy/install.sh creates that user)",
                FLAG,
                DEFAULT_WORKER_USER,
            )
        return None
    try:
        user = lookup(name)
    except KeyError:
        raise ConfigError(
            f"{FLAG}: there is no user {name!r} on this machine: create it (deploy/install.sh creates "
            f"{DEFAULT_WORKER_USER}: useradd --system --create-home --home-dir /var/lib/{DEFAULT_WORKER_USER} "
            f"--shell /usr/sbin/nologin {DEFAULT_WORKER_USER}), or leave the variable unset"
        ) from None
    if user.uid == 0:
        raise ConfigError(f"{FLAG}: {name!r} is root: the workers would hold every privilege; name another user")
    if user.uid == euid:
        return None  # the agent's own user: nothing to switch
    if euid != 0:
        raise ConfigError(
            f"{FLAG}: only an agent running as root can start its workers as {name!r} (this one runs as uid "
            f"{euid}); leave the variable unset and the workers run as the agent does"
        )
    return user


def share_models_dir(models_dir: Path, user: WorkerUser) -> int:
    """Make ``models_dir`` (created if missing) and what it holds readable by ``user``'s group and nobody else's;
    set the process's umask to ``SHARED_UMASK``, so that later downloads are too. Returns how many entries were
    changed. Symbolic links are left as they are (the hub's snapshots point into its blobs, shared here).

    Raises ConfigError when the agent may not change them (it owns neither them nor the group).
    """
    os.umask(SHARED_UMASK)
    models_dir.mkdir(parents=True, exist_ok=True)
    changed = 0
    try:
        changed += _share(models_dir, user.gid, directory=True)
        for root, directories, files in os.walk(models_dir):
            for name in directories:
                path = Path(root, name)
                if not path.is_symlink():
                    changed += _share(path, user.gid, directory=True)
            for name in files:
                path = Path(root, name)
                if not path.is_symlink():
                    changed += _share(path, user.gid, directory=False)
    except PermissionError as exc:
        raise ConfigError(
            f"{FLAG}: cannot share the models folder {models_dir} with group {_group_name(user.gid)}: {exc}. The "
            f"agent must own it and be in that group (SupplementaryGroups= in flotilla-agent.service)"
        ) from None
    if changed:
        log.info("shared %d entries of %s with the workers' group %s", changed, models_dir, _group_name(user.gid))
    return changed


def _share(path: Path, gid: int, *, directory: bool) -> int:
    """Give ``path`` group ``gid``, group read (and search, setgid for a folder), nothing for others; 1 when
    something changed."""
    status = path.stat()
    mode = stat.S_IMODE(status.st_mode)
    wanted = (mode | stat.S_IRGRP) & ~stat.S_IRWXO & ~stat.S_IWGRP
    if directory:
        wanted |= stat.S_IXGRP | stat.S_ISGID
    if status.st_gid == gid and mode == wanted:
        return 0
    if status.st_gid != gid:
        os.chown(path, -1, gid)
    os.chmod(path, wanted)  # after chown, which clears the setgid bit
    return 1


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
