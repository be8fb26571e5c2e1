"""The agent compares its workers with the control plane's list of the node's instances, periodically and when
an answer casts doubt on them, and stops the ones it disowns; with tiny Python children as workers and the
stand-in control plane of tests/agent/test_node_agent_operations.py.

A list that cannot be had stops nothing, and a start that arrives while the list is on its way is not
mistaken for an orphan. The whole path with a real control plane is in tests/agent/test_node_agent.py."""

import asyncio
import logging
import time
from pathlib import Path

import pytest

from agent.control_plane_client import AgentInstance
from agent.node_agent import NodeAgent
from agent.workers.processes import process_start_time
from tests.agent.test_node_agent_operations import StandInControlPlane, child, make_agent, readiness, start
from tests.agent.test_supervisor import SocketReadiness, pid_gone

pytestmark = pytest.mark.timeout(60)
__all__ = ["child", "readiness"]  # fixtures


async def run_ready(agent: NodeAgent, control_plane: StandInControlPlane, *instance_ids: int) -> dict[int, int]:
    """Start the instances' workers (attempt 0) and wait until each is ready; their pids."""
    for instance_id in instance_ids:
        await agent.accept_start(start(instance_id))
    pids: dict[int, int] = {}
    while len(pids) < len(instance_ids):
        instance_id, report = await control_plane.next()
        if report.state == "ready" and report.pid is not None:
            pids[instance_id] = report.pid
    return pids


async def stopped(agent: NodeAgent, pids: dict[int, int], *instance_ids: int) -> None:
    """Wait until the instances' workers have ended and the agent has done stopping them."""
    await asyncio.gather(*(pid_gone(pids[instance_id]) for instance_id in instance_ids))
    async with asyncio.timeout(10):
        while set(instance_ids) & set(agent.supervisor.instances()):  # noqa: ASYNC110 - no event says it
            await asyncio.sleep(0.01)  # the supervisor forgets a worker a moment after it ended


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "agent.instances.ownership_checks"]


async def test_workers_the_control_plane_disowns_are_stopped_within_one_comparison_period(
    tmp_path: Path, child: Path, readiness: SocketReadiness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    control_plane = StandInControlPlane()
    control_plane.instances = [AgentInstance(id=i, state="ready", attempt=0) for i in (1, 2, 3, 4)]
    agent = make_agent(tmp_path, child, readiness, control_plane, reconcile_s=0.5, listing_lag_s=0)
    await agent.start()
    try:
        pids = await run_ready(agent, control_plane, 1, 2, 3, 4)
        control_plane.instances = [
            AgentInstance(id=1, state="ready", attempt=0),  # still this node's
            AgentInstance(id=3, state="pending", attempt=1),  # evicted, restarted, placed here again
            AgentInstance(id=4, state="stopping", attempt=0),  # stopped while its stop task is on its way
        ]  # and 2 moved to another node
        changed = time.monotonic()
        await stopped(agent, pids, 2, 3, 4)
        assert time.monotonic() - changed < 0.5 + 5, "one period, and the stop"
        await control_plane.next_state(4, "stopped")  # the stop the control plane waits for
        assert process_start_time(pids[1]) is not None
        assert agent.supervisor.instances() == [1]

        logged = messages(caplog)
        assert (
            "instance 2 is no longer placed on this node (found by the comparison with the control plane every "
            "0.5 s): stopping its worker" in logged
        )
        newer = "the control plane is at attempt 1 of instance 3 (pending), this worker runs attempt 0 ("
        assert any(m.startswith(newer) for m in logged)
        # 2 and 3 are not reported stopped: the control plane would refuse it (2 is another node's, 3 is newer).
        assert control_plane.pending() == []
    finally:
        await agent.supervisor.stop_all()
        await agent.close()


async def test_a_control_plane_that_cannot_be_asked_stops_nothing(
    tmp_path: Path, child: Path, readiness: SocketReadiness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    control_plane = StandInControlPlane()
    control_plane.instances = [AgentInstance(id=1, state="ready", attempt=0)]
    agent = make_agent(tmp_path, child, readiness, control_plane, reconcile_s=0.05, listing_lag_s=0)
    await agent.start()
    try:
        pids = await run_ready(agent, control_plane, 1)
        control_plane.instances = []  # what it would answer, could it be asked
        control_plane.unreachable = True
        asked = control_plane.listed
        while control_plane.listed < asked + 5:  # five comparisons that found no list
            control_plane.asked.clear()
            await control_plane.asked.wait()
        assert agent.supervisor.instances() == [1] and process_start_time(pids[1]) is not None
        assert not any("stopping its worker" in m for m in messages(caplog))
    finally:
        await agent.supervisor.stop_all()
        await agent.close()


async def test_an_answer_that_casts_doubt_is_followed_by_a_comparison_at_once(
    tmp_path: Path, child: Path, readiness: SocketReadiness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    control_plane = StandInControlPlane()
    control_plane.instances = [AgentInstance(id=1, state="ready", attempt=0), AgentInstance(id=2, state="ready")]
    agent = make_agent(tmp_path, child, readiness, control_plane, listing_lag_s=0)  # the period is an hour
    await agent.start()
    try:
        pids = await run_ready(agent, control_plane, 1, 2)
        # A 409 about instance 2 alone is no reason to stop it: the list still has it.
        control_plane.instances = [AgentInstance(id=2, state="ready")]
        control_plane.doubts.put_nowait("the control plane answered 409 to instance 2's state ready")
        await stopped(agent, pids, 1)
        assert (
            "instance 1 is no longer placed on this node (the control plane answered 409 to instance 2's state "
            "ready): stopping its worker" in messages(caplog)
        )
        assert agent.supervisor.instances() == [2] and process_start_time(pids[2]) is not None
    finally:
        await agent.supervisor.stop_all()
        await agent.close()


class ListOnItsWay(StandInControlPlane):
    """Answers the list as it was when asked, once ``gate`` opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()

    async def list_instances(self) -> list[AgentInstance]:
        listing = await super().list_instances()
        await self.gate.wait()
        return listing


async def test_a_start_that_arrives_while_the_list_is_on_its_way_is_not_taken_for_an_orphan(
    tmp_path: Path, child: Path, readiness: SocketReadiness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    control_plane = ListOnItsWay()
    agent = make_agent(tmp_path, child, readiness, control_plane, listing_lag_s=0)
    await agent.start()
    try:
        control_plane.gate.clear()
        control_plane.asked.clear()
        control_plane.doubts.put_nowait("a doubt")
        await control_plane.asked.wait()  # the list (without instance 1) is on its way
        pids = await run_ready(agent, control_plane, 1)
        control_plane.instances = [AgentInstance(id=1, state="ready", attempt=0)]
        control_plane.gate.set()
        control_plane.asked.clear()
        control_plane.doubts.put_nowait("another doubt")
        await control_plane.asked.wait()  # comparisons run one after another: the first one is done
        assert agent.supervisor.instances() == [1] and process_start_time(pids[1]) is not None
        assert not any("stopping its worker" in m for m in messages(caplog))
    finally:
        await agent.supervisor.stop_all()
        await agent.close()
