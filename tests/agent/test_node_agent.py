"""`flotilla agent` as a real process, with a real control plane (uvicorn, SQLite), Redis, etcd and NATS.

Tasks go to the agent as the reconciler sends them: a plain Celery app's ``send_task`` onto queue
``node.node-a``. The workers are `flotilla run in=dyn://… out=mocker` processes on simulated GPUs;
the control plane's rows are made through its API (models, pipelines, stops) and ``manage.py``
(tokens, placement).
"""

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from celery import Celery
from celery.result import AsyncResult

from agent.workers.processes import process_start_time
from runtime.fleet_contract.signing import agent_signing_key, sign_payload
from runtime.fleet_contract.tasks import (
    TASK_LOG_TAIL,
    TASK_START_INSTANCE,
    TASK_STOP_INSTANCE,
    LocalSource,
    LogTailRequest,
    StartInstance,
    StopInstance,
    WorkerSpec,
    node_queue,
)
from tests.agent.control_plane_server import REPOSITORY, ControlPlaneServer, add_mocker_model, json_of, wait_for
from tests.agent.test_supervisor import kill_recorded_workers
from tests.infra import EtcdServer, NatsServer, RedisServer
from tests.servers import stop_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NODE = "node-a"
GIB = 1 << 30
PLACE = (
    "from controlplane.audit.records import Actor;"
    "from controlplane.deployments.upkeep import place_pending_instances;"
    "place_pending_instances(Actor.system('tests'))"
)
# What the control plane does to a silent node's instance after FLOTILLA_NODE_EVICT_S: fail it, place it elsewhere.
MOVE_AWAY = (
    "from controlplane.deployments.models import Instance;"
    "Instance.objects.filter(pk={id}).update(node=None, gpu_indexes=[], state='pending', restarts=1)"
)
FAIL = (
    "from controlplane.deployments.models import Instance;"
    "Instance.objects.filter(pk={id}).update(state='failed', reason='{why}')"
)


@dataclass
class Agent:
    """A `flotilla agent` process."""

    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM, and its exit code."""
        return stop_process(self.process, signal.SIGTERM, timeout=30)


@dataclass
class Fleet:
    """The servers, the control plane with an operator's API client, and the agent's settings."""

    control_plane: ControlPlaneServer
    redis: RedisServer
    etcd: EtcdServer
    nats: NatsServer
    operator: httpx.Client
    agent_token: str
    directory: Path
    smollm2: Path
    sender: Celery
    agents: list[Agent] = field(default_factory=list)

    def start_agent(self, *flags: str, token: str | None = None, env: dict[str, str] | None = None) -> Agent:
        log_path = self.directory / "agent.log"
        command = [sys.executable, "-m", "launcher.cli", "agent", "--control-plane", self.control_plane.url]
        command += ["--name", NODE, "--gpus", "2x24GiB", "--heartbeat-s", "0.5", "--broker", self.redis.url]
        command += ["--state-dir", str(self.directory / "state"), "--log-dir", str(self.directory / "logs")]
        command += ["--models-dir", str(self.directory / "models"), *flags]
        env = {
            **os.environ,
            "FLOTILLA_AGENT_TOKEN": token or self.agent_token,
            "ETCD_ENDPOINTS": self.etcd.endpoint,
            "NATS_SERVER": self.nats.url,
            "FLOTILLA_LEASE_TTL": "3",
            "FLOTILLA_DRAIN_S": "1",
            "FLOTILLA_LOG": "info",
            **(env or {}),
        }
        with log_path.open("ab") as log_file:
            process = subprocess.Popen(command, cwd=REPOSITORY, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        agent = Agent(process, log_path)
        self.agents.append(agent)
        return agent

    def deploy(self, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """A pipeline of one mocker replica on one GPU, placed on node-a: (pipeline, instance) as the API shows them."""
        wait_for("node-a to register (placement needs its GPUs)", self.node)
        model = add_mocker_model(self.operator, f"{name}-model", self.smollm2)
        pipeline = json_of(
            self.operator.post(
                "/api/v1/pipelines/",
                json={"name": name, "model": model["name"], "groups": [{"replicas": 1, "gpus_per_replica": 1}]},
            )
        )
        self.control_plane.manage("shell", "-c", PLACE)
        [instance] = json_of(self.operator.get("/api/v1/instances/", params={"pipeline": pipeline["id"]}))["results"]
        assert instance["node"] == NODE, instance
        return pipeline, instance

    def start_message(self, pipeline: dict[str, Any], instance: dict[str, Any], attempt: int = 0) -> StartInstance:
        spec = WorkerSpec(
            instance_id=instance["id"],
            pipeline=pipeline["namespace"],
            group="aggregated",
            replica=instance["replica"],
            engine="mocker",
            model_name=pipeline["name"],
            gpu_indexes=instance["gpu_indexes"],
            gpu_memory_bytes=GIB,
        )
        return StartInstance(spec=spec, source=LocalSource(path=str(self.smollm2)), attempt=attempt)

    def send(self, task: str, payload: object) -> AsyncResult:
        """Send a task to node-a's agent, as the reconciler does: its JSON, for node-a, signed with the key of
        node-a's agent token. Its result is read with ``disable_sync_subtasks=False``: an agent's Celery worker
        that ran in this process (another test's) marked it as one whose tasks must not wait on results."""
        if isinstance(payload, StartInstance | StopInstance):
            payload = msgspec.structs.replace(payload, node=NODE)
        argument = sign_payload(task, msgspec.to_builtins(payload), [agent_signing_key(self.agent_token, NODE)])
        return self.sender.send_task(task, args=[argument], queue=node_queue(NODE))

    def instance(self, instance_id: int) -> dict[str, Any]:
        return json_of(self.operator.get(f"/api/v1/instances/{instance_id}/"))

    def node(self) -> dict[str, Any]:
        """Node node-a as the API shows it ({} until it registers)."""
        found = json_of(self.operator.get("/api/v1/nodes/", params={"name": NODE}))["results"]
        return found[0] if found else {}

    def wait_state(self, instance_id: int, state: str, agent: Agent, timeout_s: float = 60) -> dict[str, Any]:
        def probe() -> dict[str, Any]:
            instance = self.instance(instance_id)
            return instance if instance["state"] == state else {}

        return wait_for(
            f"instance {instance_id} to be {state}",
            probe,
            timeout_s,
            explain=lambda: f"instance: {self.instance(instance_id)}\nagent log:\n{agent.log()[-6000:]}",
        )


@dataclass(frozen=True)
class TemplateDatabase:
    """A control-plane database with its tables and the tokens every test uses, copied by each test:
    migrating and each ``manage.py createtoken`` boot Django, seconds each on these cores."""

    path: Path
    agent_token: str
    operator_token: str


@pytest.fixture(scope="session")
def migrated_database(tmp_path_factory: pytest.TempPathFactory) -> TemplateDatabase:
    template = ControlPlaneServer(tmp_path_factory.mktemp("controlplane-template"), broker_url="redis://127.0.0.1:1/0")
    template.migrate()
    return TemplateDatabase(
        template.database, template.agent_token(NODE), template.person_token("operator", "operator")
    )


@pytest.fixture
def fleet(
    tmp_path: Path,
    redis_server: RedisServer,
    etcd_server: EtcdServer,
    nats_server: NatsServer,
    smollm2: Path,
    migrated_database: TemplateDatabase,
) -> Iterator[Fleet]:
    control_plane = ControlPlaneServer(
        tmp_path / "controlplane", broker_url=redis_server.url, template=migrated_database.path
    )
    agent_token, operator_token = migrated_database.agent_token, migrated_database.operator_token
    control_plane.start()
    sender = Celery("control-plane-in-tests", broker=redis_server.url, backend=redis_server.url)
    with control_plane.client(operator_token) as operator:
        fleet = Fleet(
            control_plane, redis_server, etcd_server, nats_server, operator, agent_token, tmp_path, smollm2, sender
        )
        yield fleet
    for agent in fleet.agents:
        agent.stop()  # after a failed test, the agents it left running
    sender.close()
    control_plane.stop()
    kill_recorded_workers(tmp_path / "state")


def running(pid: int) -> bool:
    return process_start_time(pid) is not None


def test_the_agent_registers_heartbeats_runs_serves_the_log_of_and_stops_a_worker(fleet: Fleet) -> None:
    agent = fleet.start_agent()
    node = wait_for("node-a to register", fleet.node, explain=agent.log)
    assert (node["state"], [gpu["memory_total_bytes"] for gpu in node["gpus"]]) == ("online", [24 * GIB, 24 * GIB])
    first_beat = node["last_heartbeat_at"]
    # The agent reads the control plane's clock from the Date of its answers (agent/control_plane_clock.py).
    assert fleet.operator.get("/api/v1/nodes/").headers.get("date")
    wait_for("a heartbeat", lambda: fleet.node()["last_heartbeat_at"] != first_beat)

    pipeline, placed = fleet.deploy("smol")
    fleet.send(TASK_START_INSTANCE, fleet.start_message(pipeline, placed))
    ready = fleet.wait_state(placed["id"], "ready", agent)
    assert ready["pid"] is not None and running(ready["pid"])
    assert ready["endpoint_instance_id"] is not None
    [gpu] = placed["gpu_indexes"]

    # The simulated GPU's memory used follows the worker on it, heartbeat by heartbeat.
    def gpu_used() -> int:
        return next(g["memory_used_bytes"] for g in fleet.node()["gpus"] if g["index"] == gpu)

    wait_for("the GPU's memory used to show the worker", lambda: gpu_used() == GIB)

    tail = fleet.send(TASK_LOG_TAIL, LogTailRequest(instance_id=placed["id"], lines=200)).get(
        timeout=10, disable_sync_subtasks=False
    )
    assert f"--- flotilla agent: starting instance {placed['id']} ---" in tail

    # Malformed tasks fail with the reason, and the consumer keeps taking tasks.
    fleet.send(TASK_START_INSTANCE, {"spec": "not a spec"})
    with pytest.raises(Exception, match="malformed LogTailRequest"):
        fleet.send(TASK_LOG_TAIL, {"instance_id": "seven"}).get(timeout=10, disable_sync_subtasks=False)
    assert "malformed StartInstance task argument" in agent.log()
    again = fleet.send(TASK_LOG_TAIL, LogTailRequest(instance_id=placed["id"], lines=1)).get(
        timeout=10, disable_sync_subtasks=False
    )
    assert again.strip() and again in tail + again  # one line, still answered

    json_of(fleet.operator.post(f"/api/v1/pipelines/{pipeline['id']}/stop/"))
    assert fleet.instance(placed["id"])["state"] == "stopping"
    fleet.send(TASK_STOP_INSTANCE, StopInstance(instance_id=placed["id"], reason="pipeline stopped", grace_s=10))
    fleet.wait_state(placed["id"], "stopped", agent)
    wait_for("the worker to end", lambda: not running(ready["pid"]))
    wait_for("the GPU's memory to be free again", lambda: gpu_used() == 0)

    assert agent.stop() == 0, agent.log()


def test_a_restarted_agent_adopts_its_running_worker_and_watches_it(fleet: Fleet) -> None:
    agent = fleet.start_agent()
    pipeline, placed = fleet.deploy("smol")
    fleet.send(TASK_START_INSTANCE, fleet.start_message(pipeline, placed))
    pid = fleet.wait_state(placed["id"], "ready", agent)["pid"]

    assert agent.stop() == 0, agent.log()
    assert running(pid), "SIGTERM stops the agent only: its workers keep serving"

    agent = fleet.start_agent()
    wait_for("the new agent to adopt the worker", lambda: f"(pid {pid})" in agent.log(), explain=agent.log)
    # A duplicate of the start (a redelivery) changes nothing: the adopted worker is that attempt.
    fleet.send(TASK_START_INSTANCE, fleet.start_message(pipeline, placed))
    fleet.send(TASK_LOG_TAIL, LogTailRequest(instance_id=placed["id"], lines=1)).get(
        timeout=10, disable_sync_subtasks=False
    )
    assert fleet.wait_state(placed["id"], "ready", agent)["pid"] == pid
    assert running(pid)

    # The new agent watches it: a worker killed under it is reported failed, with why.
    os.kill(pid, signal.SIGKILL)
    failed = fleet.wait_state(placed["id"], "failed", agent)
    assert "exit code is unknown" in failed["reason"], failed
    assert agent.stop() == 0


def test_reports_made_while_the_control_plane_is_down_arrive_when_it_is_back(fleet: Fleet) -> None:
    agent = fleet.start_agent()
    wait_for("node-a to register", fleet.node, explain=agent.log)
    pipeline, placed = fleet.deploy("smol")

    fleet.control_plane.kill()
    fleet.send(TASK_START_INSTANCE, fleet.start_message(pipeline, placed))
    worker_log = fleet.directory / "logs" / f"instance-{placed['id']}.log"
    wait_for("the worker to start", lambda: worker_log.exists() and " serves " in worker_log.read_text())
    assert agent.process.poll() is None, agent.log()

    fleet.control_plane.start()
    ready = fleet.wait_state(placed["id"], "ready", agent)
    assert ready["pid"] is not None and running(ready["pid"])
    # The agent says so once the answer that carried the ready report is back: the control plane may show the
    # report a moment before the agent has read that answer.
    wait_for("the agent to say the control plane is back", lambda: "answers again" in agent.log(), explain=agent.log)
    assert agent.log().count("cannot reach the control plane") == 1, "one warning per outage"
    assert agent.stop() == 0


def test_workers_the_control_plane_stopped_while_the_agent_was_down_are_stopped_when_it_is_back(
    fleet: Fleet,
) -> None:
    agent = fleet.start_agent()
    pipeline, placed = fleet.deploy("smol")
    fleet.send(TASK_START_INSTANCE, fleet.start_message(pipeline, placed))
    pid = fleet.wait_state(placed["id"], "ready", agent)["pid"]
    assert agent.stop() == 0

    json_of(fleet.operator.post(f"/api/v1/pipelines/{pipeline['id']}/stop/"))
    agent = fleet.start_agent()
    fleet.wait_state(placed["id"], "stopped", agent)
    wait_for("the worker to end", lambda: not running(pid))
    assert agent.stop() == 0


def test_workers_whose_instances_the_control_plane_moved_or_stopped_are_stopped_within_a_comparison_period(
    fleet: Fleet,
) -> None:
    agent = fleet.start_agent("--reconcile-s", "1")
    moved_pipeline, moved = fleet.deploy("moved")
    stopped_pipeline, stopped = fleet.deploy("stopped")
    fleet.send(TASK_START_INSTANCE, fleet.start_message(moved_pipeline, moved))
    fleet.send(TASK_START_INSTANCE, fleet.start_message(stopped_pipeline, stopped))
    moved_pid = fleet.wait_state(moved["id"], "ready", agent)["pid"]
    stopped_pid = fleet.wait_state(stopped["id"], "ready", agent)["pid"]

    fleet.control_plane.manage("shell", "-c", MOVE_AWAY.format(id=moved["id"]))
    # Stopped through the API, its stop task lost (no reconciler runs here to send it, or send it again).
    json_of(fleet.operator.post(f"/api/v1/pipelines/{stopped_pipeline['id']}/stop/"))
    wait_for("the moved instance's worker to end", lambda: not running(moved_pid), 30, explain=agent.log)
    fleet.wait_state(stopped["id"], "stopped", agent, timeout_s=30)
    wait_for("the stopped instance's worker to end", lambda: not running(stopped_pid), 30, explain=agent.log)
    assert (
        f"instance {moved['id']} is no longer placed on this node (found by the comparison with the control plane "
        "every 1 s): stopping its worker" in agent.log()
    )
    assert f"the control plane has instance {stopped['id']} stopping (found by the comparison" in agent.log()
    assert agent.stop() == 0


def test_workers_the_control_plane_moved_during_an_outage_are_stopped_as_soon_as_it_answers_again(
    fleet: Fleet,
) -> None:
    agent = fleet.start_agent("--reconcile-s", "600")  # so that only the control plane's return can stop it
    pipeline, placed = fleet.deploy("smol")
    fleet.send(TASK_START_INSTANCE, fleet.start_message(pipeline, placed))
    pid = fleet.wait_state(placed["id"], "ready", agent)["pid"]

    fleet.control_plane.kill()
    wait_for("the agent to be cut off", lambda: "cannot reach the control plane" in agent.log(), explain=agent.log)
    fleet.control_plane.manage("shell", "-c", MOVE_AWAY.format(id=placed["id"]))  # evicted while cut off
    assert running(pid), "an unreachable control plane is no reason to stop anything"

    fleet.control_plane.start()
    wait_for("the worker to end", lambda: not running(pid), 30, explain=agent.log)
    # Whichever the agent hears first once the control plane is back: the comparison of its instances with the
    # control plane's ("may have changed it during the outage"), or a 403 to a report of the instance's state
    # (the control plane no longer places it here). Both stop the worker for the same reason.
    stopped = re.search(
        rf"instance {placed['id']} is no longer placed on this node \((the control plane may have changed it during"
        rf"|the control plane answered 403 to instance {placed['id']}'s state)",
        agent.log(),
    )
    assert stopped is not None, agent.log()
    assert agent.stop() == 0


def test_a_report_the_control_plane_declines_makes_the_agent_stop_the_worker_its_list_disowns(fleet: Fleet) -> None:
    agent = fleet.start_agent("--reconcile-s", "600")  # so that only the declined report can stop it
    pipeline, placed = fleet.deploy("smol")
    fleet.send(TASK_START_INSTANCE, fleet.start_message(pipeline, placed))
    pid = fleet.wait_state(placed["id"], "ready", agent)["pid"]

    # The control plane failed it (a deadline, an eviction): a redelivered start makes the agent report "ready"
    # again, which cannot follow "failed" (409).
    fleet.control_plane.manage("shell", "-c", FAIL.format(id=placed["id"], why="too slow"))
    fleet.send(TASK_START_INSTANCE, fleet.start_message(pipeline, placed))
    wait_for("the worker to end", lambda: not running(pid), 30, explain=agent.log)
    assert (
        f"the control plane has instance {placed['id']} failed (the control plane answered 409 to instance "
        f"{placed['id']}'s state ready): stopping its worker" in agent.log()
    )
    assert fleet.instance(placed["id"])["state"] == "failed"
    assert agent.stop() == 0


def test_a_token_the_control_plane_rejects_stops_the_agent_with_exit_code_2(fleet: Fleet) -> None:
    agent = fleet.start_agent(token="flt_not-a-token")
    assert agent.process.wait(timeout=60) == 2
    assert "rejected the agent token of node node-a (401: unknown or revoked token)" in agent.log()
    assert "Traceback" not in agent.log()

    other = fleet.control_plane.agent_token("node-b")
    agent = fleet.start_agent(token=other)
    assert agent.process.wait(timeout=60) == 2
    assert "(403: this token belongs to node node-b, not node-a)" in agent.log()


def test_sigterm_stops_the_agent_cleanly_while_the_control_plane_broker_and_etcd_are_down(fleet: Fleet) -> None:
    agent = fleet.start_agent()
    wait_for("the agent to take tasks", lambda: "taking tasks from queue node.node-a" in agent.log(), explain=agent.log)
    fleet.control_plane.kill()
    fleet.redis.kill()
    fleet.etcd.kill()
    wait_for(
        "the agent to notice that its servers are gone",
        lambda: "Cannot connect to redis" in agent.log() and "cannot reach the control plane" in agent.log(),
        explain=agent.log,
    )
    agent.process.send_signal(signal.SIGTERM)
    assert agent.process.wait(timeout=20) == 0, agent.log()
