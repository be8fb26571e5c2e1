"""Worker processes as the supervisor sees them: started, adopted, waited for, signalled, explained.

A worker runs in its own session (its own process group), so that signals meant for the agent do not
reach it and the agent can restart without taking its workers down. A process is known by its pid and
its start time (``/proc/<pid>/stat``, in clock ticks since boot) plus the boot id: a pid the kernel gave
to another process since, or one from before a reboot, is then never mistaken for the worker.

Exits are awaited through a pidfd (Linux 5.3+), which also works for a process the agent did not start
(one it adopted after its own restart): it is then not the parent, so the exit code is unknown.

Nothing a worker started outlives it, however it ends: each worker is started with a mark of its own in its
environment, which its processes inherit wherever they go (another session, adopted by init), and once it
has ended, the processes that hold the mark or are still in its group are ended too (SIGTERM, then SIGKILL
after a grace), before its end is reported (runtime/process_tree.py says why a mark and not a parent-death
signal or a subreaper). So the replacement the control plane starts finds the GPU as the worker found it.
"""

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.workers.worker_user import WorkerUser
from runtime.process_tree import DEFAULT_GRACE_S, Tree, end_tree, marked_environment, new_mark

log = logging.getLogger(__name__)

# Polling is the fallback where pidfds are missing (old kernels): an exit is noticed within this.
_POLL_S = 0.2
_TAIL_CHUNK = 8192


def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``): start times count from the boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot, or None if there is no such process (or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ")": split after the last one.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # exited, not yet reaped: as good as gone
        return None
    return int(fields[19])  # field 22 of the whole line


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended: its exit code, or the signal that killed it; both None when unknown."""

    code: int | None = None
    signal: int | None = None

    @classmethod
    def from_returncode(cls, returncode: int) -> "ExitStatus":
        return cls(signal=-returncode) if returncode < 0 else cls(code=returncode)


# What a person can do about a worker killed by these signals.
_SIGNAL_MEANINGS = {
    signal.SIGKILL: "killed by SIGKILL: the kernel's out-of-memory killer (see `dmesg`), or someone ran kill -9",
    signal.SIGSEGV: "crashed with a segmentation fault (SIGSEGV): a bug in the engine or its native libraries",
    signal.SIGBUS: "crashed with SIGBUS: often a model file that changed or was truncated while mapped",
    signal.SIGABRT: "aborted (SIGABRT): the engine gave up on an internal error",
    signal.SIGILL: "crashed on an illegal instruction (SIGILL): a build for a CPU this machine is not",
    signal.SIGTERM: "was terminated by SIGTERM from outside the agent",
    signal.SIGINT: "was interrupted by SIGINT from outside the agent",
}
#: ``flotilla run`` exits 2 for a bad flag, variable or model: restarting it cannot help (runtime's exit codes).
EXIT_CONFIG = 2


def describe_exit(status: ExitStatus) -> str:
    """Why the worker ended, in words a person can act on (without its log)."""
    if status.signal is not None:
        try:
            name = signal.Signals(status.signal)
        except ValueError:
            return f"was killed by signal {status.signal}"
        return _SIGNAL_MEANINGS.get(name, f"was killed by {name.name}")
    if status.code is None:
        return "exited; its exit code is unknown (the agent was restarted after it started the worker)"
    if status.code == 0:
        return "exited with code 0 without being asked to stop"
    if status.code == EXIT_CONFIG:
        return (
            "refused its configuration (exit code 2): a bad engine argument, variable or model; restarting cannot "
            "help, fix the model or the engine's arguments"
        )
    if status.code == 130:
        return "was interrupted (exit code 130)"
    return f"failed with exit code {status.code}"


def log_tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of the file at ``path`` ("" if it does not exist), read from its end."""
    if lines <= 0:
        return ""
    try:
        with path.open("rb") as file:
            file.seek(0, os.SEEK_END)
            position = file.tell()
            data = b""
            # One more newline than lines wanted: the text before it is a partial line, dropped below.
            while position > 0 and data.count(b"\n") <= lines:
                step = min(_TAIL_CHUNK, position)
                position -= step
                file.seek(position)
                data = file.read(step) + data
    except FileNotFoundError:
        return ""
    text = data.decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


class WorkerProcess:
    """A worker process this agent started (``spawn``) or found running (``adopt``)."""

    def __init__(
        self, pid: int, start_time: int, *, mark: str = "", popen: "subprocess.Popen[bytes] | None" = None
    ) -> None:
        self.pid = pid
        self.start_time = start_time
        #: The mark in its processes' environment (runtime/process_tree.py; "": a worker of an older agent).
        self.mark = mark
        # Only for a process this agent started: it is then the parent, and can read the exit code.
        self._popen = popen

    @classmethod
    def spawn(
        cls, argv: Sequence[str], env: Mapping[str, str], log_path: Path, *, user: WorkerUser | None = None
    ) -> "WorkerProcess":
        """Start ``argv`` in its own session, its tree marked, stdout and stderr appended to ``log_path``; as
        ``user`` when given (agent/workers/worker_user.py: the agent is root), else as the agent. The log is
        opened here and handed over, so the worker needs no access to the log folder. Raises OSError."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        mark = new_mark()
        with log_path.open("ab") as log_file:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**env, **(user.environment() if user else {}), **marked_environment(mark)},
                start_new_session=True,
                close_fds=True,
                **_switch_to(user),
            )
        start_time = process_start_time(popen.pid)
        # A worker that died at once has no start time left to read: 0 never matches a live process.
        return cls(popen.pid, start_time or 0, mark=mark, popen=popen)

    @classmethod
    def adopt(cls, pid: int, start_time: int, recorded_boot_id: str, mark: str = "") -> "WorkerProcess | None":
        """The running process ``pid`` if it is the one recorded (same boot, same start time), else None."""
        if recorded_boot_id != boot_id() or process_start_time(pid) != start_time:
            return None
        return cls(pid, start_time, mark=mark)

    @property
    def is_child(self) -> bool:
        return self._popen is not None

    def is_running(self) -> bool:
        """Whether the process still runs (a zombie does not). Reaps nothing."""
        return process_start_time(self.pid) == self.start_time

    async def wait(self, *, kill_leftovers: bool = False, grace_s: float = DEFAULT_GRACE_S) -> ExitStatus:
        """Wait for the process to end; its exit code when it is this agent's child, else an unknown status.

        ``kill_leftovers``: then end what it left behind (``end_leftovers``) before returning, and before reaping
        it, while its pid still names its group.
        """
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            pidfd = None  # already gone (and reaped)
        except OSError:
            pidfd = None
            await self._poll_until_gone()
        if pidfd is not None:
            try:
                # Adopted: the pid may belong to another process by now; only the recorded one counts.
                if self._popen is not None or process_start_time(self.pid) == self.start_time:
                    await until_readable(pidfd)
            finally:
                os.close(pidfd)
        if kill_leftovers:
            await end_leftovers(self.pid, self.start_time, self.mark, grace_s)
        return self._reap()

    async def _poll_until_gone(self) -> None:
        # Without a pidfd, another process's exit has no event to await: poll /proc.
        while self.is_running():  # noqa: ASYNC110
            await asyncio.sleep(_POLL_S)

    def _reap(self) -> ExitStatus:
        if self._popen is None:
            return ExitStatus()
        # It ended: this returns at once (and reaps the zombie).
        return ExitStatus.from_returncode(self._popen.wait())

    def terminate(self) -> None:
        """SIGTERM to the worker itself: it drains, and stops the processes it started."""
        if self.is_running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the worker's whole process group: the worker and anything it started."""
        if self._popen is None and not self.is_running():
            return  # adopted and gone: its pid may name another process's group by now
        self._kill_group()

    def _kill_group(self) -> None:
        if self._popen is not None and self._popen.returncode is not None:
            return  # reaped: its pid is free for another process
        # Its own session, so its group id is its pid; an unreaped leader (even a zombie) keeps that id
        # from being reused.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)


def _switch_to(user: WorkerUser | None) -> dict[str, Any]:
    """Popen's arguments that start the process as ``user``: its uid, its group and only its own supplementary
    groups (not root's), in its working folder; none when ``user`` is None."""
    if user is None:
        return {}
    return {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups), "cwd": user.working_dir()}


async def end_leftovers(pid: int, start_time: int, mark: str, grace_s: float = DEFAULT_GRACE_S) -> None:
    """End every process the worker ``pid`` (started at ``start_time``, its tree marked ``mark``) left behind:
    SIGTERM, then SIGKILL after ``grace_s``; returns once they have ended. Logs what it ended, and what would not."""
    tree = Tree(mark=mark or None, group=pid, started_after=start_time)
    ending = await asyncio.to_thread(end_tree, tree, grace_s)
    if ending.ended:
        log.warning("ended %d processes the worker (pid %d) left behind: %s", len(ending.ended), pid, ending.ended)
    if ending.remaining:
        log.error(
            "processes the worker (pid %d) left behind did not end even after SIGKILL (stuck in the kernel, a GPU "
            "driver say: see `ps -o pid,stat,wchan -p %s`): %s",
            pid,
            ",".join(map(str, ending.remaining)),
            ending.remaining,
        )


async def until_readable(fd: int) -> None:
    """Return once ``fd`` is readable (a pidfd is, once its process has ended)."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        if not ended.done():
            ended.set_result(None)

    loop.add_reader(fd, on_readable)
    try:
        await ended
    finally:
        loop.remove_reader(fd)
