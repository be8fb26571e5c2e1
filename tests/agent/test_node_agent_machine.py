"""Two `flotilla agent` processes given one node name on two machines (told apart by ``--machine-id``), with a
real control plane: the second is refused and stops with exit code 2, the first keeps its node (registered
with its machine id and the engines it runs, as the control plane stores them)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.fleet_contract.engine_names import engines_on_this_node
from tests.agent.control_plane_server import REPOSITORY, ControlPlaneServer, json_of, wait_for
from tests.infra import EtcdServer, NatsServer, RedisServer
from tests.servers import stop_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

NODE = "node-a"


def start_agent(
    control_plane: ControlPlaneServer, token: str, machine: str, directory: Path, servers: tuple[str, str, str]
) -> tuple[subprocess.Popen[bytes], Path]:
    redis, etcd, nats = servers
    log_path = directory / f"agent-{machine}.log"
    command = [sys.executable, "-m", "launcher.cli", "agent", "--control-plane", control_plane.url, "--name", NODE]
    command += ["--gpus", "1x24GiB", "--heartbeat-s", "0.5", "--broker", redis, "--machine-id", machine]
    command += ["--state-dir", str(directory / machine / "state"), "--models-dir", str(directory / "models")]
    env = {**os.environ, "FLOTILLA_AGENT_TOKEN": token, "ETCD_ENDPOINTS": etcd, "NATS_SERVER": nats}
    with log_path.open("ab") as log_file:
        process = subprocess.Popen(command, cwd=REPOSITORY, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    return process, log_path


def test_a_second_machine_with_the_nodes_name_is_refused_and_its_agent_exits_2(
    tmp_path: Path, redis_server: RedisServer, etcd_server: EtcdServer, nats_server: NatsServer
) -> None:
    control_plane = ControlPlaneServer(tmp_path / "controlplane", broker_url=redis_server.url)
    control_plane.migrate()
    token = control_plane.agent_token(NODE)
    admin_token = control_plane.person_token("root", "admin")
    control_plane.start()
    servers = (redis_server.url, etcd_server.endpoint, nats_server.url)
    first, first_log = start_agent(control_plane, token, "machine-one", tmp_path, servers)
    try:
        with control_plane.client(admin_token) as admin:

            def node() -> dict[str, object]:
                found = json_of(admin.get("/api/v1/nodes/", params={"name": NODE}))["results"]
                return found[0] if found else {}

            registered = wait_for("the first agent to register", node, explain=lambda: first_log.read_text())
            assert registered["machine_id"] == "machine-one"
            assert registered["engines"] == sorted(engines_on_this_node())  # what its workers can run, stored

            second, second_log = start_agent(control_plane, token, "machine-two", tmp_path, servers)
            assert second.wait(timeout=60) == 2, second_log.read_text()
            said = second_log.read_text()
            assert (
                "refused this agent: node node-a is registered by machine machine-one; this is machine "
                "machine-two: give this agent another --name, or delete the node first"
            ) in said, said
            assert "Traceback" not in said

            assert first.poll() is None, first_log.read_text()  # the first keeps its node, and heartbeats
            assert node()["machine_id"] == "machine-one"
            audit = json_of(admin.get("/api/v1/audit/", params={"action": "node.machine_refused"}))
            # Audited (twice: the agent asks again once, as a first 409 may be its own earlier try racing it).
            assert {entry["actor_name"] for entry in audit["results"]} == {"agent:node-a"}, audit
    finally:
        assert stop_process(first, signal.SIGTERM, timeout=30) == 0, first_log.read_text()
        control_plane.stop()


def test_a_machine_id_that_is_not_one_stops_the_agent_with_exit_code_2_before_it_starts(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "launcher.cli", "agent", "--control-plane", "http://127.0.0.1:9"]
    done = subprocess.run(
        [*command, "--token", "flt_x", "--machine-id", "not an id"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env={**os.environ, "XDG_STATE_HOME": str(tmp_path)},
    )
    assert done.returncode == 2
    assert "--machine-id" in done.stderr and "is not a machine id" in done.stderr
