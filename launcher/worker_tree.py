"""``flotilla run`` started by hand: its tree marked, and a guard that ends it once ``flotilla run`` has ended.

Under the agent, a worker's tree is the agent's to end (agent/workers/processes.py): the agent marks it when it
starts the worker. Started any other way (a shell, a unit of its own, ``flotilla up``'s gateway) nobody would,
and a ``flotilla run out=vllm`` killed by the out-of-memory killer would leave vLLM's engine core holding the
GPU. So ``flotilla run``, when its environment has no mark, makes one naming itself, executes itself again so
that the mark is in the environment it was started with (the one a process forked without exec shows:
runtime/process_tree.py), and starts a guard: a small process that waits for ``flotilla run`` to end, however
it ends, and then ends every process of its tree (SIGTERM, SIGKILL after a grace).

The guard detaches itself (it forks, and its first process exits at once), so that it is not a child of
``flotilla run``: an engine that kills its parent's children as it exits (SGLang does) does not reach it, and
``kill -9 -PGID`` of the worker's group does not either (it runs in a session of its own). It does not hold the
mark itself, so it is not part of the tree it ends.

A ``flotilla run`` whose environment has a mark another process made leaves its tree to that process: a worker
started by the agent, or one started from another worker's tree, which ends with that tree.

``python -m launcher.worker_tree PID START_TIME MARK`` runs the guard (``start_guard`` does).
"""

import logging
import os
import select
import subprocess
import sys
import time

from runtime.process_tree import (
    DEFAULT_GRACE_S,
    TREE_VARIABLE,
    Tree,
    end_tree,
    marked_by,
    marked_environment,
    new_mark,
    start_time,
)

log = logging.getLogger(__name__)

# Where pidfds are missing (kernels before 5.3), how often the guard looks whether flotilla run has ended.
_POLL_S = 0.5


def mark_own_tree() -> None:
    """Give this process's tree a mark naming it, unless its environment has one: set ``TREE_VARIABLE`` (and
    ``SPT_NOENV``: ``marked_environment``) and execute this program again with them (same pid, arguments and
    start time). Returns when the tree is marked, or when this program cannot be executed again (logged: then
    only the processes started with exec carry the mark)."""
    if TREE_VARIABLE in os.environ:
        return
    os.environ.update(marked_environment(new_mark(os.getpid())))
    if not sys.executable or len(sys.orig_argv) < 2:
        log.warning("cannot execute flotilla run again (no interpreter path): its forked processes are not marked")
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    except OSError as exc:
        log.warning("cannot execute flotilla run again (%s): its forked processes are not marked", exc)


def start_guard(grace_s: float = DEFAULT_GRACE_S) -> None:
    """Start the guard of this process's tree when this process marked it for itself (``mark_own_tree``); a tree
    marked by another (the agent) is that one's to end. Returns once the guard has detached itself; a guard that
    cannot be started is logged, and the run goes on without it."""
    mark = os.environ.get(TREE_VARIABLE, "")
    own = os.getpid()
    if marked_by(mark) != own:
        return
    started = start_time(own)
    if started is None:  # cannot be: a running process reads its own start time
        return
    environment = {name: value for name, value in os.environ.items() if name != TREE_VARIABLE}
    command = [sys.executable, "-m", "launcher.worker_tree", str(own), str(started), mark, repr(grace_s)]
    try:
        # Its stdout is not flotilla run's (whose reader would wait for the guard's end as well); its stderr is.
        subprocess.run(
            command,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("cannot start the guard of this run's processes (%s): killed, it may leave them running", exc)


def _wait_for_end(pid: int, started: int) -> None:
    """Return once the process ``pid`` that started at ``started`` has ended (at once if it has already)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfds (Linux before 5.3)
        while start_time(pid) == started:
            time.sleep(_POLL_S)
        return
    try:
        # Checked once the pidfd is open: it names the same process as the pid then, surely flotilla run.
        if start_time(pid) == started:
            select.select([pidfd], [], [])  # readable once it has ended
    finally:
        os.close(pidfd)


def guard(pid: int, started: int, mark: str, grace_s: float) -> int:
    """Detach, wait for ``flotilla run`` (``pid``) to end, then end its tree; 1 if some of it would not end."""
    if os.fork() > 0:
        return 0  # the first process: flotilla run waits for it to end
    _wait_for_end(pid, started)
    ending = end_tree(Tree(mark=mark, started_after=started), grace_s)
    if ending.ended:
        print(
            f"flotilla: ended {len(ending.ended)} processes flotilla run (pid {pid}) left behind: {ending.ended}",
            file=sys.stderr,
            flush=True,
        )
    if ending.remaining:
        print(
            f"flotilla: processes flotilla run (pid {pid}) left behind did not end even after SIGKILL: "
            f"{ending.remaining}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    worker, started, tree_mark, grace = sys.argv[1:5]
    sys.exit(guard(int(worker), int(started), tree_mark, float(grace)))
