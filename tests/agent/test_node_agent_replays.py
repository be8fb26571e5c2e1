"""Old orders, replayed or delivered late, and instance ids reused, on a node agent with tiny Python children as
its workers (tests/agent/test_node_agent_operations.py's harness).

A stop names the start it stops (attempt, incarnation): a copy of an old one leaves what replaced its worker
running. A start of another incarnation of the id (a control plane whose database was restored from an older
backup) replaces the worker whatever its attempt, and the reports say which incarnation they are about. The
periodic comparison with the control plane's list reports what the list has running here and nothing runs."""

import os
from pathlib import Path

import msgspec

from agent.control_plane_client import AgentInstance, InstanceReport
from agent.workers.processes import process_start_time
from runtime.fleet_contract.tasks import StartInstance, StopInstance
from tests.agent import test_node_agent_operations as operations
from tests.agent.test_node_agent_operations import (
    StandInControlPlane,
    launches,
    make_agent,
    ready_after_starting,
    start,
    started_agent,
)
from tests.agent.test_supervisor import SocketReadiness, pid_gone

OLD, NEW = "0" * 31 + "a", "0" * 31 + "b"
child, readiness = operations.child, operations.readiness  # the harness's fixtures


def incarnation(request: StartInstance, value: str) -> StartInstance:
    return msgspec.structs.replace(request, incarnation=value)


def alive(pid: int | None) -> bool:
    return pid is not None and process_start_time(pid) is not None


async def test_a_stop_of_an_older_attempt_leaves_the_worker_that_replaced_it_running(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    control_plane = StandInControlPlane()
    async with started_agent(tmp_path, child, readiness, control_plane) as agent:
        await agent.accept_start(start(2, attempt=1))
        await ready_after_starting(control_plane, 2)
        await agent.accept_start(start(2, attempt=2))
        current = await ready_after_starting(control_plane, 2)

        # The stop of attempt 1, sent before its restart and delivered (or re-sent) only now; then attempt 3.
        # An instance's operations run in order, so had the old stop stopped the worker, its "stopped" would
        # be the next news; a replacement by a newer attempt sends none.
        await agent.accept_stop(StopInstance(instance_id=2, attempt=1, reason="scale-down of long ago"))
        await agent.accept_start(start(2, attempt=3))
        replacing = await control_plane.next_state(2, "starting")
        assert replacing.attempt == 3 and replacing.pid != current.pid
        await pid_gone(current.pid or 0)
        await control_plane.next_state(2, "ready")

        await agent.accept_stop(StopInstance(instance_id=2, attempt=3))
        assert (await control_plane.next_state(2, "stopped")).attempt == 3
        assert launches(tmp_path, 2) == 3


async def test_another_incarnation_of_the_id_replaces_the_worker_and_its_stop_leaves_the_worker_alone(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    control_plane = StandInControlPlane()
    async with started_agent(tmp_path, child, readiness, control_plane) as agent:
        await agent.accept_start(incarnation(start(5), OLD))
        old = await ready_after_starting(control_plane, 5)
        assert old.incarnation == OLD

        # The restored control plane stops its own instance 5, which never ran here: the old worker stays,
        # and the stop is confirmed for the incarnation it names.
        await agent.accept_stop(StopInstance(instance_id=5, attempt=0, incarnation=NEW))
        assert await control_plane.next() == (5, InstanceReport(state="stopped", attempt=0, incarnation=NEW))
        assert alive(old.pid)

        # Its start, at the same attempt as the old worker's: not a repeat, a replacement.
        await agent.accept_start(incarnation(start(5), NEW))
        starting = await control_plane.next_state(5, "starting")
        assert starting.incarnation == NEW and starting.pid != old.pid
        await pid_gone(old.pid or 0)
        ready = await control_plane.next_state(5, "ready")
        assert (ready.attempt, ready.incarnation) == (0, NEW)
        assert launches(tmp_path, 5) == 2


async def test_a_restarted_agent_remembers_its_workers_incarnation(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    before = StandInControlPlane()
    old = make_agent(tmp_path, child, readiness, before)
    await old.start()
    await old.accept_start(incarnation(start(6, attempt=1), OLD))
    ready = await ready_after_starting(before, 6)
    await old.close()  # the worker keeps running

    after = StandInControlPlane()
    after.instances = [AgentInstance(id=6, state="ready", attempt=1, incarnation=NEW)]  # a restored database
    async with started_agent(tmp_path, child, readiness, after):
        await pid_gone(ready.pid or 0)  # disowned: another instance has its id now
        assert [(i, r.state) for i, r in after.pending() if r.state == "stopped"] == []  # its "stopped" is not news


async def test_the_periodic_comparison_reports_what_the_control_plane_has_running_here_and_nothing_runs(
    tmp_path: Path, child: Path, readiness: SocketReadiness
) -> None:
    control_plane = StandInControlPlane()
    # Listed from the first comparison on: on a busy machine the worker may still be starting after the 0.1 s
    # listing lag, and an instance the list leaves out is disowned (its worker stopped before it is ready).
    control_plane.instances = [AgentInstance(id=1, state="starting", attempt=0, incarnation=OLD)]
    async with started_agent(tmp_path, child, readiness, control_plane, reconcile_s=0.2, listing_lag_s=0.1) as agent:
        await agent.accept_start(incarnation(start(1), OLD))
        running = await ready_after_starting(control_plane, 1)
        control_plane.instances = [
            AgentInstance(id=1, state="ready", attempt=0, incarnation=OLD),  # runs here: nothing to say
            AgentInstance(id=2, state="ready", attempt=3, incarnation=NEW),  # its worker was lost without a word
            AgentInstance(id=3, state="stopping", attempt=0, incarnation=NEW),  # its stop never came
            AgentInstance(id=4, state="pending", attempt=0),  # its start is on its way
        ]
        reports = {}
        while len(reports) < 2:
            instance_id, report = await control_plane.next()
            reports[instance_id] = report
        assert sorted(reports) == [2, 3]
        assert (reports[2].state, reports[2].attempt, reports[2].incarnation) == ("failed", 3, NEW)
        assert "no worker of this instance runs on node node-a" in reports[2].reason
        assert reports[3] == InstanceReport(state="stopped", attempt=0, incarnation=NEW)
        assert alive(running.pid) and os.getpid() != running.pid
