"""What the tests of leftover processes share: an engine's process tree faked, and looks at /proc.

``ENGINE_PROCESSES`` is Python that starts processes as an engine does, SGLang's say, from inside a worker, and
prints ``tree PID …``: a scheduler in the worker's process group; a detokenizer in a session of its own
(setsid), with a child of its own; and a process forked without exec into a session of its own, which ignores
SIGTERM (so the killer must come back with SIGKILL). Neither the worker's group nor its parent links lead to
the last three once the worker is gone.
"""

import contextlib
import os
import select
import signal
import time
from collections.abc import Iterable
from pathlib import Path

ENGINE_PROCESSES = r"""
import os as _os, signal as _signal, subprocess as _subprocess, sys as _sys

def _start_engine_processes():
    sleeper = [_sys.executable, "-c", "import signal; signal.pause()"]
    scheduler = _subprocess.Popen(sleeper)
    parent = (
        "import subprocess, sys, signal\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'])\n"
        "print(child.pid, flush=True)\n"
        "signal.pause()\n"
    )
    detokenizer = _subprocess.Popen(
        [_sys.executable, "-c", parent], start_new_session=True, stdout=_subprocess.PIPE, text=True
    )
    its_child = int(detokenizer.stdout.readline())
    ready_read, ready_write = _os.pipe()
    forked = _os.fork()
    if forked == 0:
        _os.setsid()
        _signal.signal(_signal.SIGTERM, _signal.SIG_IGN)
        _os.write(ready_write, b"!")
        while True:
            _signal.pause()
    _os.read(ready_read, 1)  # it ignores SIGTERM from now on
    print("tree", scheduler.pid, detokenizer.pid, its_child, forked, flush=True)

_start_engine_processes()
"""


def tree_pids(log: str) -> list[int]:
    """The pids of the ``tree PID …`` line in ``log``. Raises StopIteration when there is none."""
    line = next(line for line in log.splitlines() if line.startswith("tree "))
    return [int(pid) for pid in line.split()[1:]]


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), or None if it has ended (a zombie has: it holds no memory)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else int(fields[19])


def running(pids: Iterable[int]) -> list[int]:
    """Those of ``pids`` still running."""
    return [pid for pid in pids if start_time(pid) is not None]


def wait_ended(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait until every one of ``pids`` has ended, or ``timeout_s`` has passed; those still running. (Not our
    children: their ends are awaited through pidfds, which are readable once their process has ended.)"""
    pidfds = {}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            pidfds[os.pidfd_open(pid)] = pid
    deadline = time.monotonic() + timeout_s
    try:
        waiting = set(pidfds)
        while waiting and (left := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select(list(waiting), [], [], left)
            waiting -= set(readable)
        return running(pidfds[fd] for fd in waiting)
    finally:
        for fd in pidfds:
            os.close(fd)


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, their children and so on, as /proc's parent links show them now."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Leftovers:
    """Processes a test saw, killed at its end if still running (a failed test leaves none behind)."""

    def __init__(self) -> None:
        self._seen: dict[int, int] = {}

    def add(self, pids: Iterable[int]) -> None:
        for pid in pids:
            if (started := start_time(pid)) is not None:
                self._seen[pid] = started

    def kill(self) -> None:
        for pid, started in self._seen.items():
            if start_time(pid) == started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
