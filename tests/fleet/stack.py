"""A whole fleet as real processes, for the fleet tests, bench/fleet_scale.py and bench/planner_ramp.py.

The control plane under uvicorn on a SQLite file, its Celery worker with beat (the reconciler), two
`flotilla agent` processes (node-a, node-b, two simulated 24 GiB GPUs each unless told otherwise) and a
gateway (`flotilla run in=http out=dyn`), over the Redis, etcd and NATS it is given; the planner's loop
(`manage.py planner`) when a test or bench starts it. Models and pipelines go through the REST API with an
operator's token, as a person would make them.
"""

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agent.workers.processes import process_start_time
from tests.agent.control_plane_server import REPOSITORY, ControlPlaneServer, add_mocker_model, json_of, wait_for
from tests.agent.test_supervisor import kill_recorded_workers
from tests.infra import EtcdServer, NatsServer, RedisServer
from tests.servers import Server, start_server, stop_process

NODES = ("node-a", "node-b")
#: The mocker answers a token in 1/1000 of the simulated time: requests take milliseconds.
MOCKER_ARGS = {"speedup_ratio": 1000}
#: Seconds without a heartbeat before the reconciler calls a node offline (agents beat every 0.5 s).
NODE_TIMEOUT_S = 3.0
#: Seconds without a heartbeat before a node's instances are evicted (when no guard holds).
NODE_EVICT_S = 5.0


def running(pid: int) -> bool:
    return process_start_time(pid) is not None


@dataclass
class Agent:
    """A `flotilla agent` process for one node."""

    node: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass
class FleetStack:
    """The control plane, its reconciler, the agents and the gateway; ``start()`` brings all up."""

    directory: Path
    redis: RedisServer
    etcd: EtcdServer
    nats: NatsServer
    smollm2: Path
    template: Path | None = None
    #: Simulated 24 GiB GPUs per node.
    gpus_per_node: int = 2
    control_plane: ControlPlaneServer = field(init=False)
    reconciler: subprocess.Popen[bytes] | None = field(default=None, init=False)
    agents: dict[str, Agent] = field(default_factory=dict, init=False)
    gateway: Server | None = field(default=None, init=False)
    planners: list[subprocess.Popen[bytes]] = field(default_factory=list, init=False)
    operator: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.control_plane = ControlPlaneServer(
            self.directory / "controlplane", broker_url=self.redis.url, template=self.template
        )
        # The reconciler (in the Celery worker) reads these; a short interval and timeout keep tests short.
        self.control_plane.env |= {
            "FLOTILLA_RECONCILE_S": "0.5",
            "FLOTILLA_NODE_TIMEOUT_S": str(NODE_TIMEOUT_S),
            "FLOTILLA_NODE_EVICT_S": str(NODE_EVICT_S),
            "FLOTILLA_RESTART_BACKOFF_MAX_S": "0",
            "FLOTILLA_STOP_GRACE_S": "5",
            "ETCD_ENDPOINTS": self.etcd.endpoint,  # to fence the workers of a lost node
        }
        self.control_plane.migrate()
        self.agent_tokens = {node: self.control_plane.agent_token(node) for node in NODES}
        self.operator = self.control_plane.client(self.control_plane.person_token("operator", "operator"))

    def serving_env(self) -> dict[str, str]:
        return {"ETCD_ENDPOINTS": self.etcd.endpoint, "NATS_SERVER": self.nats.url}

    # --- processes ---------------------------------------------------------------------------------

    def start(self) -> None:
        """The gateway, control plane, reconciler and both agents (registered)."""
        # The gateway first (it needs only etcd and NATS), so that the dashboard's overview knows where it is.
        # The dashboard's playground calls the gateway from the browser: the control plane's origin may (CORS).
        allowed = {"FLOTILLA_ALLOWED_ORIGINS": self.control_plane.url}
        self.gateway = start_server(["out=dyn"], self.directory / "gateway.log", env=self.serving_env() | allowed)
        self.control_plane.env["FLOTILLA_GATEWAY_URL"] = self.gateway.base_url
        self.start_control_plane()
        for node in NODES:
            self.start_agent(node)
        for node in NODES:
            wait_for(f"{node} to register", lambda node=node: self.node(node), explain=self.logs)  # type: ignore[misc]

    def start_control_plane(self) -> None:
        """uvicorn and the Celery worker with beat (one process: the reconciler's pass and its schedule)."""
        self.control_plane.start()
        command = [sys.executable, "-m", "celery", "-A", "controlplane.celery_app", "worker", "-B"]
        command += ["-Q", "controlplane", "--concurrency", "1", "--pool", "solo", "--loglevel", "info"]
        command += ["-s", str(self.directory / "controlplane" / "celerybeat-schedule")]
        with (self.directory / "reconciler.log").open("ab") as log_file:
            self.reconciler = subprocess.Popen(
                command, cwd=REPOSITORY, env=self.control_plane.env, stdout=log_file, stderr=subprocess.STDOUT
            )

    def stop_control_plane(self) -> None:
        """SIGTERM both (a restart: the database stays)."""
        if self.reconciler is not None:
            stop_process(self.reconciler, signal.SIGTERM, timeout=20)
            self.reconciler = None
        self.control_plane.stop()

    def start_agent(self, node: str) -> Agent:
        log_path = self.directory / f"agent-{node}.log"
        state = self.directory / node
        command = [sys.executable, "-m", "launcher.cli", "agent", "--control-plane", self.control_plane.url]
        command += ["--name", node, "--gpus", f"{self.gpus_per_node}x24GiB", "--heartbeat-s", "0.5"]
        command += ["--broker", self.redis.url]
        command += ["--state-dir", str(state / "state"), "--log-dir", str(state / "logs")]
        command += ["--models-dir", str(state / "models")]
        env = {
            **os.environ,
            **self.serving_env(),
            "FLOTILLA_AGENT_TOKEN": self.agent_tokens[node],
            "FLOTILLA_LEASE_TTL": "3",
            "FLOTILLA_DRAIN_S": "1",
            "FLOTILLA_LOG": "info",
        }
        with log_path.open("ab") as log_file:
            process = subprocess.Popen(command, cwd=REPOSITORY, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        self.agents[node] = Agent(node, process, log_path)
        return self.agents[node]

    def start_planner(self, interval_s: float = 1.0) -> subprocess.Popen[bytes]:
        """One more `manage.py planner` process (on the control plane's database, with its gateway URL and
        NATS), logging to ``planner-N.log`` (N counts from 1: ``planner_log(N)``)."""
        number = len(self.planners) + 1
        command = [sys.executable, "manage.py", "planner", "--interval", str(interval_s)]
        env = {**self.control_plane.env, "NATS_SERVER": self.nats.url}
        with self.planner_log_path(number).open("ab") as log_file:
            process = subprocess.Popen(command, cwd=REPOSITORY, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        self.planners.append(process)
        return process

    def planner_log_path(self, number: int) -> Path:
        return self.directory / f"planner-{number}.log"

    def planner_log(self, number: int) -> str:
        path = self.planner_log_path(number)
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """Everything, workers included (an agent's SIGTERM leaves its workers running, on purpose)."""
        for planner in self.planners:
            stop_process(planner, signal.SIGTERM, timeout=10)
        pids = [i["pid"] for i in self.instances() if i["pid"]] if self.control_plane.process else []
        if self.gateway is not None:
            self.gateway.stop()
        for agent in self.agents.values():
            stop_process(agent.process, signal.SIGTERM, timeout=20)
        for pid in pids:
            if running(pid):
                os.killpg(pid, signal.SIGKILL)
        # Workers of a SIGKILLed agent outlive it (as on a node cut off the network) and the API no longer
        # lists them once their instances moved: the agents' own records name them.
        for node in NODES:
            kill_recorded_workers(self.directory / node / "state")
        self.stop_control_plane()
        self.operator.close()

    def logs(self) -> str:
        """The tails of the agents' and the reconciler's logs, for a failure's message."""
        parts = [f"--- {a.node} ---\n{a.log()[-3000:]}" for a in self.agents.values()]
        reconciler = self.directory / "reconciler.log"
        if reconciler.exists():
            parts.append(f"--- reconciler ---\n{reconciler.read_text(errors='replace')[-3000:]}")
        for number in range(1, len(self.planners) + 1):
            parts.append(f"--- planner {number} ---\n{self.planner_log(number)[-3000:]}")
        return "\n".join(parts)

    # --- the API -----------------------------------------------------------------------------------

    def deploy(
        self,
        name: str,
        *,
        replicas: int,
        gpus: int = 1,
        router: dict[str, Any] | None = None,
        engine_args: dict[str, Any] | None = None,
    ) -> int:
        """A model and a pipeline of mocker workers with the SmolLM2 tokenizer (``engine_args``: the mocker's,
        MOCKER_ARGS when None); the pipeline's id."""
        model = add_mocker_model(self.operator, f"{name}-model", self.smollm2)
        args = MOCKER_ARGS if engine_args is None else engine_args
        group = {"replicas": replicas, "gpus_per_replica": gpus, "engine_args": args}
        body: dict[str, Any] = {"name": name, "model": model["name"], "groups": [group]}
        if router is not None:
            body["router"] = router
        return int(json_of(self.operator.post("/api/v1/pipelines/", json=body))["id"])

    def scale(self, pipeline: int, replicas: int) -> None:
        json_of(self.operator.post(f"/api/v1/pipelines/{pipeline}/scale/", json={"replicas": replicas}))

    def pipeline(self, pipeline: int) -> dict[str, Any]:
        return dict(json_of(self.operator.get(f"/api/v1/pipelines/{pipeline}/")))

    def instances(self, pipeline: int | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"page_size": 500}
        if pipeline is not None:
            params["pipeline"] = pipeline
        return list(json_of(self.operator.get("/api/v1/instances/", params=params))["results"])

    def node(self, name: str) -> dict[str, Any]:
        """The node as the API shows it ({} until it registers)."""
        found = json_of(self.operator.get("/api/v1/nodes/", params={"name": name}))["results"]
        return dict(found[0]) if found else {}

    def wait_ready(self, pipeline: int, count: int, timeout_s: float = 60) -> list[dict[str, Any]]:
        """Wait until exactly ``count`` of the pipeline's instances are ready and none is on its way."""

        def probe() -> list[dict[str, Any]]:
            found = self.instances(pipeline)
            ready = [i for i in found if i["state"] == "ready"]
            settling = [i for i in found if i["state"] not in ("ready", "stopped", "failed")]
            return ready if len(ready) == count and not settling else []

        return wait_for(
            f"{count} ready instances of pipeline {pipeline}",
            probe,
            timeout_s,
            explain=lambda: f"instances: {self.instances(pipeline)}\n{self.logs()}",
        )

    # --- the gateway -------------------------------------------------------------------------------

    def complete(self, model: str, prompt: str = "Hello fleet", max_tokens: int = 4) -> httpx.Response:
        assert self.gateway is not None
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
        return httpx.post(self.gateway.api_url + "/completions", json=body, timeout=30)

    def served_models(self) -> list[str]:
        assert self.gateway is not None
        return sorted(m["id"] for m in httpx.get(self.gateway.api_url + "/models", timeout=5).json()["data"])

    def served_by(self, model: str, instances: set[str], attempts: int = 40) -> set[str]:
        """Send completions until each of ``instances`` (hex ids) answered one or attempts run out; who did."""
        seen: set[str] = set()
        for attempt in range(attempts):
            reply = self.complete(model, prompt=f"request {attempt} to {model}")
            if reply.status_code == 200:
                seen.add(reply.headers["x-flotilla-instance"])
            if instances <= seen:
                break
        return seen
