"""`flotilla agent` killed (SIGKILL) in the middle of a model's download, and the agent started after it: the
download resumes where it was, on this node, and the instance becomes ready without being restarted.

Real processes throughout: the control plane (uvicorn, SQLite), Redis, etcd, NATS, the agents, their
download processes, and a fake hub on loopback (tests/agent/fake_hub.py) serving the bundled SmolLM2 GGUF,
which holds the first transfer once one chunk (huggingface_hub writes 10 MiB at a time) is sent.
"""

import signal
from pathlib import Path

import msgspec
import pytest
from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE

from runtime.fleet_contract.tasks import TASK_START_INSTANCE, HubSource
from tests.agent.control_plane_server import wait_for
from tests.agent.fake_hub import FakeHub, running_hub
from tests.agent.test_node_agent import Fleet, fleet, migrated_database

__all__ = ["fleet", "migrated_database"]  # fixtures

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REPO = "acme/smollm2-gguf"


def test_an_agent_killed_mid_download_is_followed_by_one_that_resumes_it_and_the_instance_is_not_restarted(
    fleet: Fleet,
) -> None:
    with running_hub() as hub:
        gguf = fleet.smollm2
        hub.repos[REPO] = {gguf.name: gguf, "README.md": b"SmolLM2 for the tests"}
        hold = hub.hold(gguf.name, DOWNLOAD_CHUNK_SIZE)
        partial = (
            fleet.directory
            / "models"
            / "models--acme--smollm2-gguf"
            / "blobs"
            / f"{FakeHub.etag(gguf.name)}.incomplete"
        )
        env = {"HF_ENDPOINT": hub.url}
        first = fleet.start_agent(env=env)
        pipeline, instance = fleet.deploy("downloaded")
        start = msgspec.structs.replace(fleet.start_message(pipeline, instance), source=HubSource(REPO))
        fleet.send(TASK_START_INSTANCE, start)
        fleet.wait_state(instance["id"], "downloading", first)
        wait_for("the first chunk on disk", lambda: partial.exists() and partial.stat().st_size == DOWNLOAD_CHUNK_SIZE)

        first.process.send_signal(signal.SIGKILL)
        first.process.wait(30)
        # Its download process died with it: the hub's held transfer sees the connection closed.
        assert hold.hung_up.wait(30)

        second = fleet.start_agent(env=env)
        ready = fleet.wait_state(instance["id"], "ready", second, timeout_s=120)
        assert (ready["node"], ready["restarts"]) == ("node-a", 0)  # carried on here, not restarted
        assert "resuming its start of attempt 0" in second.log()
        assert "no worker of this instance runs" not in second.log()
        # The second download asked for the rest of the file only: no byte of it was sent twice.
        size = gguf.stat().st_size
        assert [(get.start, get.sent) for get in hub.gets(gguf.name)] == [
            (0, DOWNLOAD_CHUNK_SIZE),
            (DOWNLOAD_CHUNK_SIZE, size - DOWNLOAD_CHUNK_SIZE),
        ]
        model = Path(fleet.directory / "models" / "models--acme--smollm2-gguf" / "snapshots")
        [snapshot] = model.iterdir()
        assert (snapshot / gguf.name).read_bytes() == gguf.read_bytes()
        assert second.stop() == 0
