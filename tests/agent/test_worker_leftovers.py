"""Nothing a worker started outlives it: a worker killed with SIGKILL (as the out-of-memory killer kills) is
reported failed only once every process of its tree has ended, those in sessions of their own included, and
so is one that dies while the agent is restarting, or after a new agent adopted it.

The worker is a tiny Python program started as the supervisor starts `flotilla run`, whose "engine" starts
processes as SGLang's does (tests/process_trees.py); readiness is an announcement on a Unix socket, as in
tests/agent/test_supervisor.py.
"""

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.workers.supervisor import Supervisor, WorkerState
from tests.agent.test_supervisor import (
    SocketReadiness,
    Statuses,
    kill_recorded_workers,
    pid_gone,
    readiness,
    socket_dir,
    spec,
)
from tests.process_trees import ENGINE_PROCESSES, Leftovers, running, tree_pids

__all__ = ["readiness", "socket_dir"]  # fixtures, used by name

WORKER = (
    ENGINE_PROCESSES
    + """
import os, signal, socket
with socket.socket(socket.AF_UNIX) as ready:
    ready.connect(os.environ["READY_SOCKET"])
    ready.sendall(b"%d\\n" % os.getpid())
while True:
    signal.pause()
"""
)


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    yield path
    kill_recorded_workers(tmp_path / "state")


@pytest.fixture
def leftovers() -> Iterator[Leftovers]:
    seen = Leftovers()
    yield seen
    seen.kill()


def make_supervisor(tmp_path: Path, worker: Path, readiness: SocketReadiness, statuses: Statuses) -> Supervisor:
    return Supervisor(
        node="node-a",
        state_dir=tmp_path / "state",
        log_dir=tmp_path / "logs",
        readiness=readiness,
        on_status=statuses,
        command=[sys.executable, str(worker)],
        # One of its processes ignores SIGTERM: it is killed once this is over.
        leftover_grace_s=0.5,
        base_env={**os.environ, "READY_SOCKET": str(readiness.path)},
    )


async def start_tree(
    supervisor: Supervisor, statuses: Statuses, instance_id: int, leftovers: Leftovers
) -> tuple[int, list[int]]:
    """Start a worker and wait until it is ready; its pid and its engine's processes."""
    supervisor.start(spec(instance_id, "sglang"))
    pid = (await statuses.next(WorkerState.STARTING)).pid
    await statuses.next(WorkerState.READY)
    assert pid is not None
    tree = tree_pids(supervisor.log_tail(instance_id))
    leftovers.add(tree)
    assert running(tree) == tree
    return pid, tree


async def test_a_worker_killed_with_sigkill_is_reported_failed_once_every_process_it_started_has_ended(
    tmp_path: Path, worker: Path, readiness: SocketReadiness, leftovers: Leftovers
) -> None:
    statuses = Statuses()
    supervisor = make_supervisor(tmp_path, worker, readiness, statuses)
    pid, tree = await start_tree(supervisor, statuses, 1, leftovers)
    os.kill(pid, signal.SIGKILL)  # the worker alone, not its group: as the out-of-memory killer does
    failed = await statuses.next(WorkerState.FAILED)
    assert failed.exit_signal == signal.SIGKILL
    assert running(tree) == []  # before the failure was reported: its replacement finds nothing of it


async def test_an_adopted_worker_and_one_that_died_while_the_agent_restarted_leave_nothing_behind(
    tmp_path: Path, worker: Path, readiness: SocketReadiness, leftovers: Leftovers
) -> None:
    before = Statuses()
    old = make_supervisor(tmp_path, worker, readiness, before)
    kept_pid, kept_tree = await start_tree(old, before, 2, leftovers)
    lost_pid, lost_tree = await start_tree(old, before, 3, leftovers)
    await old.close()  # the agent restarts: its workers keep running
    os.kill(lost_pid, signal.SIGKILL)  # and one dies while no agent watches
    await pid_gone(lost_pid)

    after = Statuses()
    new = make_supervisor(tmp_path, worker, readiness, after)
    assert await new.adopt() == [2]
    assert running(lost_tree) == []  # ended before adopt() returned, so before the failure was reported
    ready, failed = sorted([await after.next(), await after.next()], key=lambda status: status.instance_id)
    assert (ready.state, failed.state, failed.instance_id) == (WorkerState.READY, WorkerState.FAILED, 3)

    assert running(kept_tree) == kept_tree
    os.kill(kept_pid, signal.SIGKILL)  # the adopted one: not the new agent's child
    failed = await after.next(WorkerState.FAILED)
    assert failed.instance_id == 2
    assert running(kept_tree) == []
