"""A worker's process tree: every process it started, found wherever it went, and ended together.

An engine worker (``flotilla run out=vllm``, ``out=sglang``, ...) starts processes of its own: vLLM's engine
core and its workers, SGLang's schedulers and detokenizer. When the worker dies without stopping them (an
out-of-memory kill, a SIGKILL), they are left running, holding the GPU memory its replacement needs. Neither
the worker's process group nor the parent links find them all by then: an engine may put a process in a
session of its own (setsid), and an orphan is adopted by init.

What they all keep is the environment they were started with: a process inherits its parent's, and
``/proc/PID/environ`` shows it as it was at exec, or, for a process forked without exec, as its parent's was.
So a worker is started with ``TREE_VARIABLE`` set to a mark of its own (the agent sets it; ``flotilla run``
started by hand sets it and executes itself again, so that its very first environment has it: see
launcher/worker_tree.py), and its tree is every process whose environment holds that mark (Jenkins ends
what a build left behind the same way). One thing would hide the mark: setproctitle, which flotilla run,
vLLM and SGLang name their processes with, writes the title over that first environment, unless
``SPT_NOENV`` is set; so the mark always comes with it (``marked_environment``), and titles are only as long
as the command lines. A process started with an environment of its own making escapes the mark; one that
stayed in the worker's process group is still found by the group.

Why not the alternatives. A parent-death signal (``PR_SET_PDEATHSIG``) must be set by each child itself,
between fork and exec, where vLLM's and SGLang's own spawning gives no hook; it fires when the *thread* that
forked the child ends, not the process; and it reaches one generation only. A child subreaper
(``PR_SET_CHILD_SUBREAPER``) in the worker does nothing when the worker itself is what was killed: its orphans
go on up. A cgroup per worker (``cgroup.kill``) would be best, but needs a delegated cgroup tree (systemd's
``Delegate=``), which a plain agent unit, a container or a development machine does not have.

Members are signalled through pidfds opened after a member was found and checked again once opened, so that
a pid the kernel gave to another process in between is never signalled.
"""

import contextlib
import os
import secrets
import select
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

#: The variable whose value marks every process of one worker's tree.
TREE_VARIABLE = "FLOTILLA_WORKER_TREE"
#: How long what a worker left behind may take to end on SIGTERM before it is killed.
DEFAULT_GRACE_S = 10.0
#: How long processes may take to end once sent SIGKILL (one in uninterruptible sleep, in a GPU driver say,
#: takes until its system call returns) before they are reported as not ended.
_KILL_WAIT_S = 10.0
# A tree that keeps starting processes while it is ended is scanned again, this many times at most.
_MAX_ROUNDS = 20
# Where pidfds are missing (kernels before 5.3), how often an end is looked for.
_POLL_S = 0.1


def new_mark(owner_pid: int | None = None) -> str:
    """A mark no other tree has; ``owner_pid``, when given, is the pid of the process that made it for itself
    (``marked_by``)."""
    token = secrets.token_hex(12)
    return token if owner_pid is None else f"{owner_pid}-{token}"


def marked_environment(mark: str) -> dict[str, str]:
    """The variables that mark a tree ``mark``: ``TREE_VARIABLE``, and ``SPT_NOENV`` so that no process title
    written by setproctitle hides it."""
    return {TREE_VARIABLE: mark, "SPT_NOENV": "1"}


def marked_by(mark: str) -> int | None:
    """The pid of the process that made ``mark`` for itself (``new_mark(owner_pid)``), else None."""
    owner, sep, _ = mark.partition("-")
    return int(owner) if sep and owner.isdigit() else None


@dataclass(frozen=True)
class Tree:
    """Which processes are one worker's: those whose environment holds ``mark``, and the members of process
    group ``group`` (the worker's own, named by its pid), all started no earlier than the worker
    (``started_after``, in clock ticks since boot, as ``/proc/PID/stat`` counts)."""

    mark: str | None
    group: int | None = None
    started_after: int = 0


@dataclass(frozen=True)
class _Stat:
    state: str
    group: int
    start_time: int


def _stat(pid: int) -> _Stat | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ")": split after the last one.
    fields = text[text.rindex(")") + 2 :].split()
    return _Stat(state=fields[0], group=int(fields[2]), start_time=int(fields[19]))


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot, or None if it has ended (a zombie has)."""
    stat = _stat(pid)
    return None if stat is None or stat.state == "Z" else stat.start_time


def _group_is_the_workers(tree: Tree) -> bool:
    """Whether ``tree.group`` still names the worker's group: the pid that leads it is the worker's (alive, or a
    zombie not yet reaped), or nobody's (a group outlives its leader while it has members, and its id is not
    given to another process meanwhile). A live process of another start time was given the pid after the
    worker was reaped and its group emptied: that group is not the worker's."""
    if tree.group is None:
        return False
    leader = _stat(tree.group)
    return leader is None or leader.state == "Z" or leader.start_time == tree.started_after


class _Matcher:
    """Tells the tree's running processes from others (what ``members`` scans /proc with)."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self.needle = None if tree.mark is None else f"{TREE_VARIABLE}={tree.mark}".encode()
        self.by_group = _group_is_the_workers(tree)

    def member(self, pid: int) -> _Stat | None:
        """``pid``'s stat when it is a running member, else None."""
        stat = _stat(pid)
        if stat is None or stat.state == "Z" or stat.start_time < self.tree.started_after:
            return None  # gone, ended (a zombie holds no memory), or older than the worker
        if self.by_group and stat.group == self.tree.group and pid != self.tree.group:
            return stat
        return stat if self.needle is not None and _has_mark(pid, self.needle) else None


def _has_mark(pid: int, needle: bytes) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's process (which a worker cannot have started)
        return False
    return needle in environ.split(b"\0")


def members(tree: Tree) -> list[int]:
    """The pids of the tree's running processes, this one excepted."""
    return _scan(_Matcher(tree))


def _scan(matcher: _Matcher) -> list[int]:
    own = os.getpid()
    return sorted(
        pid
        for entry in os.scandir("/proc")
        if entry.name.isdigit() and (pid := int(entry.name)) != own and matcher.member(pid) is not None
    )


@dataclass
class _Member:
    pid: int
    start_time: int
    pidfd: int | None

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signum)
            elif self.running():
                os.kill(self.pid, signum)

    def running(self) -> bool:
        stat = _stat(self.pid)
        return stat is not None and stat.state != "Z" and stat.start_time == self.start_time


def _open(tree: Tree) -> list[_Member]:
    """The tree's members, each held by a pidfd opened after it was found and checked once more after: what the
    pidfd names is then surely a member (a pid given to another process meanwhile fails the second check)."""
    matcher = _Matcher(tree)
    opened = []
    for pid in _scan(matcher):
        try:
            pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        except OSError:  # no pidfds (Linux before 5.3): by pid, checked by its start time before each signal
            pidfd = None
        if (stat := matcher.member(pid)) is None:
            if pidfd is not None:
                os.close(pidfd)
            continue
        opened.append(_Member(pid, stat.start_time, pidfd))
    return opened


def _wait(held: list[_Member], deadline: float) -> list[_Member]:
    """Wait until every member has ended or ``deadline`` (``time.monotonic()``) has passed; those still running."""
    poller = select.poll()
    by_fd = {member.pidfd: member for member in held if member.pidfd is not None}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    without_fd = [member for member in held if member.pidfd is None]
    while by_fd or without_fd:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        # A pidfd is readable once its process has ended: an event, not a poll (but for members without one).
        for fd, _ in poller.poll(1000 * (min(left, _POLL_S) if without_fd else left)):
            poller.unregister(fd)
            del by_fd[fd]
        without_fd = [member for member in without_fd if member.running()]
    return [*by_fd.values(), *without_fd]


@dataclass
class Ending:
    """What ``end_tree`` did: the pids it ended, and those still running after SIGKILL (``remaining``)."""

    ended: list[int] = field(default_factory=list)
    remaining: list[int] = field(default_factory=list)


def end_tree(tree: Tree, grace_s: float = DEFAULT_GRACE_S) -> Ending:
    """End every process of ``tree``: SIGTERM (they may clean up: shared memory, sockets), then SIGKILL to those
    still running after ``grace_s``; returns once all have ended, or after a last wait after SIGKILL. Blocking:
    the agent calls it in a thread."""
    ending = Ending()
    signum = signal.SIGTERM
    deadline = time.monotonic() + grace_s
    for _ in range(_MAX_ROUNDS):
        held = _open(tree)
        if not held:
            return ending
        try:
            for member in held:
                member.signal(signum)
            running = _wait(held, deadline)
        finally:
            for member in held:
                if member.pidfd is not None:
                    os.close(member.pidfd)
        still = {member.pid for member in running}
        ending.ended += [member.pid for member in held if member.pid not in still]
        if running:
            if signum == signal.SIGKILL:
                ending.remaining = sorted(still)
                return ending
            signum = signal.SIGKILL
            deadline = time.monotonic() + _KILL_WAIT_S
    ending.remaining = members(tree)  # it kept starting processes faster than they were ended
    return ending
