"""This machine's id as the agent finds it, and how its client takes the control plane's 409 for another
machine's node name: fatal, like a rejected token."""

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from agent.control_plane_client import ControlPlaneClient, NodeReport, OtherMachine, TokenRejected
from agent.machine_identity import STATE_FILE, local_machine_id, valid_machine_id
from launcher.agent_command import agent_settings, build_agent_parser
from runtime.backoff import Backoff
from runtime.errors import ConfigError

REFUSAL = (
    "node node-a is registered by machine m1; this is machine m2: give this agent another --name, or delete "
    "the node first"
)
REPORT = NodeReport(
    name="node-a",
    address="10.0.0.5",
    labels={},
    cpu_count=8,
    memory_total_bytes=1 << 35,
    memory_available_bytes=1 << 34,
    agent_version="test",
    gpus=[],
    machine_id="m2",
)


def test_the_system_machine_id_is_used_when_there_is_one(tmp_path: Path) -> None:
    system = tmp_path / "machine-id"
    system.write_text("3d1219c7c4c5404aaa1f6d2a48adfda4\n")
    assert local_machine_id(tmp_path / "state", [system]) == "3d1219c7c4c5404aaa1f6d2a48adfda4"
    assert not (tmp_path / "state").exists()


def test_without_one_a_random_id_is_made_once_and_kept_in_the_state_dir(tmp_path: Path) -> None:
    empty = tmp_path / "empty-machine-id"
    empty.write_text("")  # as an image's /etc/machine-id is before its first boot
    missing = tmp_path / "missing"
    made = local_machine_id(tmp_path / "state", [missing, empty])
    assert len(made) == 32
    assert (tmp_path / "state" / STATE_FILE).read_text().strip() == made
    assert local_machine_id(tmp_path / "state", [missing, empty]) == made
    assert local_machine_id(tmp_path / "other-state", [missing]) != made


def test_a_kept_id_that_is_not_one_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_text("not an id!")
    with pytest.raises(ConfigError, match="remove the file, or give --machine-id"):
        local_machine_id(tmp_path, [tmp_path / "missing"])


@pytest.mark.parametrize("text", ["", "-x", "a b", "x" * 129, "m1;rm"])
def test_an_id_the_control_plane_would_refuse_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="is not a machine id"):
        valid_machine_id(text)


class Answers:
    """The agent endpoints: 409 with REFUSAL for ``refused`` paths, 200 otherwise; what was sent."""

    def __init__(self, *refused: str) -> None:
        self.refused = set(refused)
        self.sent: list[tuple[str, object]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append((request.url.path, json.loads(request.content)))
        if request.url.path in self.refused:
            return httpx.Response(409, json={"detail": REFUSAL})
        return httpx.Response(200, json={"name": "node-a", "state": "online", "draining": False})


async def test_registration_refused_for_another_machine_is_fatal_with_the_control_planes_words() -> None:
    answers = Answers("/api/v1/agent/register/")
    transport = httpx.MockTransport(answers)
    async with ControlPlaneClient(
        "http://cp", "flt_x", node="node-a", transport=transport, backoff=Backoff(0.01, 0.01)
    ) as client:
        with pytest.raises(OtherMachine) as raised:
            await client.register(REPORT)
        assert str(raised.value) == f"the control plane at http://cp refused this agent: {REFUSAL}"
        assert isinstance(raised.value, TokenRejected)  # the agent stops with exit code 2, as for a bad token
        assert client.rejected.done() and client.rejected.result() is raised.value
    # Sent with the machine id; asked twice (a first 409 may be this agent's own earlier try racing it).
    assert [body["machine_id"] for _, body in answers.sent] == ["m2", "m2"]  # type: ignore[index]


async def test_a_heartbeat_refused_for_another_machine_is_fatal() -> None:
    transport = httpx.MockTransport(Answers("/api/v1/agent/heartbeat/"))
    async with ControlPlaneClient("http://cp", "flt_x", node="node-a", transport=transport) as client:
        await client.register(REPORT)
        with pytest.raises(OtherMachine, match="is registered by machine m1"):
            await client.heartbeat(REPORT)
        assert isinstance(await asyncio.wait_for(client.rejected, 1), OtherMachine)


def test_the_machine_id_comes_from_its_flag_or_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOTILLA_MACHINE_ID", raising=False)
    parser = build_agent_parser()
    flags = ["--control-plane", "http://10.0.0.1:8000", "--token", "flt_x", "--name", "gpu-a"]
    assert agent_settings(parser, parser.parse_args([*flags, "--machine-id", "rack-3.slot-7"])).machine_id == (
        "rack-3.slot-7"
    )
    assert agent_settings(parser, parser.parse_args(flags)).machine_id == ""  # this machine's own, found at start
    monkeypatch.setenv("FLOTILLA_MACHINE_ID", "from-env")
    parser = build_agent_parser()
    assert agent_settings(parser, parser.parse_args(flags)).machine_id == "from-env"
