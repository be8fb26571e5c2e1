"""``manage.py live_bridge`` as a process beside a test fleet: the workers' load on NATS, pushed to the
pipeline pages (controlplane/live/bridge.py)."""

import signal
import subprocess
import sys
from pathlib import Path

from tests.agent.control_plane_server import REPOSITORY, ControlPlaneServer, wait_for
from tests.servers import stop_process

#: What the bridge logs once it listens on NATS and talks to the channel layer.
STARTED = "live bridge: NATS at"


class LiveBridge:
    """The bridge of ``control_plane`` (its database and channel layer) on the NATS at ``nats_url``."""

    def __init__(self, control_plane: ControlPlaneServer, nats_url: str, log_path: Path) -> None:
        self.control_plane = control_plane
        self.nats_url = nats_url
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> None:
        """Start it and return once it listens. Raises AssertionError with its log when it does not."""
        command = [sys.executable, "manage.py", "live_bridge", "--nats", self.nats_url]
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(
                command, cwd=REPOSITORY, env=self.control_plane.env, stdout=log_file, stderr=subprocess.STDOUT
            )

        def listening() -> bool:
            assert self.process is not None and self.process.poll() is None, f"the bridge exited:\n{self.log()}"
            return STARTED in self.log()

        wait_for("the live bridge to listen", listening, 30, explain=self.log)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, signal.SIGTERM)
            self.process = None
