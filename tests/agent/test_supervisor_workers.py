"""The supervisor with real `flotilla run in=dyn://… out=mocker` workers on real etcd and NATS.

Readiness is each worker's registration in etcd (agent/workers/readiness.py), matched by its pid and the
labels the agent gave it; the labels are in the registration for anyone to read.
"""

import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest

from agent.workers.readiness import RegistrationWatch
from agent.workers.supervisor import Supervisor, WorkerState
from runtime.cluster.discovery import INSTANCES_PREFIX, Discovery
from runtime.endpoint import InstanceEntry
from runtime.fleet_contract.tasks import WorkerSpec
from tests.agent.test_supervisor import Statuses, kill_recorded_workers
from tests.infra import EtcdServer, NatsServer

pytestmark = pytest.mark.timeout(120)

LEASE_TTL = 3.0


@pytest.fixture(autouse=True)
def no_worker_left(tmp_path: Path) -> Iterator[None]:
    yield
    kill_recorded_workers(tmp_path / "state")


@pytest.fixture
async def discovery(etcd_server: EtcdServer) -> AsyncIterator[Discovery]:
    async with await Discovery.connect([etcd_server.endpoint], lease_ttl=LEASE_TTL, wait=10) as connected:
        yield connected


def make_supervisor(
    tmp_path: Path, etcd: EtcdServer, nats: NatsServer, watch: RegistrationWatch, statuses: Statuses
) -> Supervisor:
    return Supervisor(
        node="node-a",
        state_dir=tmp_path / "state",
        log_dir=tmp_path / "logs",
        readiness=watch,
        on_status=statuses,
        command=[sys.executable, "-m", "launcher.cli"],
        stop_timeout_s=20,
        base_env={
            **os.environ,
            "ETCD_ENDPOINTS": etcd.endpoint,
            "NATS_SERVER": nats.url,
            "FLOTILLA_LEASE_TTL": str(LEASE_TTL),
            "FLOTILLA_DRAIN_S": "1",
            "FLOTILLA_LOG": "info",
        },
    )


def mocker(instance_id: int, replica: int, smollm2: Path) -> WorkerSpec:
    return WorkerSpec(
        instance_id=instance_id,
        pipeline="smollm",
        group="aggregated",
        replica=replica,
        engine="mocker",
        model_path=str(smollm2),
        model_name="smollm",
    )


async def registrations(discovery: Discovery) -> dict[int, InstanceEntry]:
    """The instances registered in etcd, by their endpoint instance id."""
    entries = await discovery.get_prefix(INSTANCES_PREFIX)
    decoded = [msgspec.json.decode(value, type=InstanceEntry) for value in entries.values()]
    return {entry.instance_id: entry for entry in decoded}


async def test_mocker_workers_are_ready_when_registered_and_carry_their_labels(
    tmp_path: Path, etcd_server: EtcdServer, nats_server: NatsServer, discovery: Discovery, smollm2: Path
) -> None:
    watch = RegistrationWatch(discovery)
    watch.start()
    statuses = Statuses()
    supervisor = make_supervisor(tmp_path, etcd_server, nats_server, watch, statuses)
    try:
        supervisor.start(mocker(1, 0, smollm2))
        supervisor.start(mocker(2, 1, smollm2))
        ready = {}
        while len(ready) < 2:
            status = await statuses.next()
            assert status.state in (WorkerState.STARTING, WorkerState.READY), supervisor.log_tail(status.instance_id)
            if status.state is WorkerState.READY:
                ready[status.instance_id] = status
        registered = await registrations(discovery)
        for instance_id, replica in ((1, "0"), (2, "1")):
            entry = registered[ready[instance_id].endpoint_instance_id or 0]
            assert entry.pid == ready[instance_id].pid
            assert entry.labels == {
                "pipeline": "smollm",
                "group": "aggregated",
                "replica": replica,
                "node": "node-a",
                "instance": str(instance_id),
            }

        await supervisor.stop(1)
        stopped = statuses.pending()[-1]
        assert (stopped.state, stopped.exit_code) == (WorkerState.STOPPED, 0)  # drained and exited cleanly
        # A clean exit revokes the worker's lease: its registration is gone at once, not after the TTL.
        assert set(await registrations(discovery)) == {ready[2].endpoint_instance_id}
    finally:
        await supervisor.stop_all()
        await watch.close()


async def test_a_killed_worker_started_again_is_ready_only_once_its_new_process_registers(
    tmp_path: Path, etcd_server: EtcdServer, nats_server: NatsServer, discovery: Discovery, smollm2: Path
) -> None:
    watch = RegistrationWatch(discovery)
    watch.start()
    statuses = Statuses()
    supervisor = make_supervisor(tmp_path, etcd_server, nats_server, watch, statuses)
    try:
        supervisor.start(mocker(3, 0, smollm2))
        await statuses.next(WorkerState.STARTING)
        first = await statuses.next(WorkerState.READY)
        assert first.pid is not None
        os.kill(first.pid, signal.SIGKILL)
        failed = await statuses.next(WorkerState.FAILED)
        assert failed.exit_signal == signal.SIGKILL
        # The control plane starts the instance again (a new attempt) on this node, at once.
        supervisor.start(mocker(3, 0, smollm2))
        await statuses.next(WorkerState.STARTING)
        # The killed worker's registration outlives it until its lease expires; it must not count.
        second = await statuses.next(WorkerState.READY)
        assert second.pid != first.pid
        assert second.endpoint_instance_id != first.endpoint_instance_id
        assert (await registrations(discovery))[second.endpoint_instance_id or 0].pid == second.pid
    finally:
        await supervisor.stop_all()
        await watch.close()


async def test_a_restarted_agent_adopts_a_running_worker_which_stays_registered(
    tmp_path: Path, etcd_server: EtcdServer, nats_server: NatsServer, discovery: Discovery, smollm2: Path
) -> None:
    watch = RegistrationWatch(discovery)
    watch.start()
    statuses = Statuses()
    old = make_supervisor(tmp_path, etcd_server, nats_server, watch, statuses)
    old.start(mocker(4, 0, smollm2))
    await statuses.next(WorkerState.STARTING)
    ready = await statuses.next(WorkerState.READY)
    await old.close()
    await watch.close()

    # The new agent has its own etcd connection and watch, as after a real restart.
    async with await Discovery.connect([etcd_server.endpoint], lease_ttl=LEASE_TTL, wait=10) as second:
        new_watch = RegistrationWatch(second)
        new_watch.start()
        after = Statuses()
        new = make_supervisor(tmp_path, etcd_server, nats_server, new_watch, after)
        try:
            assert await new.adopt() == [4]
            adopted = await after.next(WorkerState.READY)
            assert (adopted.pid, adopted.endpoint_instance_id) == (ready.pid, ready.endpoint_instance_id)
        finally:
            await new.stop_all()
            await new_watch.close()
    assert after.pending()[-1].state is WorkerState.STOPPED
