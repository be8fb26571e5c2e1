"""A real control plane for agent tests: ``uvicorn controlplane.asgi:application`` on a free port, on its own
SQLite database, with ``manage.py`` run against the same database (tokens, placement)."""

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from tests.servers import free_port, stop_process

REPOSITORY = Path(__file__).resolve().parents[2]
START_TIMEOUT = 60.0
T = TypeVar("T")


class ControlPlaneServer:
    """The control plane as a process; ``restart()`` keeps its port and database."""

    def __init__(self, directory: Path, *, broker_url: str, template: Path | None = None) -> None:
        """``template``: a migrated database to start from (copied), which saves each test the migrations."""
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.port = free_port()
        self.log_path = directory / "controlplane.log"
        self.env = {
            **os.environ,
            "FLOTILLA_DATA_DIR": str(directory),
            "DATABASE_URL": f"sqlite:///{self.database}",
            "FLOTILLA_SECRET_KEY": "agent-tests-" + "k" * 40,
            "FLOTILLA_BROKER_URL": broker_url,
            "FLOTILLA_LOG": "info",
        }
        self.process: subprocess.Popen[bytes] | None = None
        self._migrated = template is not None
        if template is not None:
            shutil.copyfile(template, self.database)

    @property
    def database(self) -> Path:
        return self.directory / "controlplane.sqlite3"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def manage(self, *args: str) -> str:
        """``manage.py ARGS`` against this control plane's database; its stdout. Raises CalledProcessError."""
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=REPOSITORY,
            env=self.env,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(f"manage.py {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
        return done.stdout

    def migrate(self) -> None:
        """Create the database's tables (once)."""
        if not self._migrated:
            self.manage("migrate", "--verbosity", "0")
            self._migrated = True

    def agent_token(self, node: str) -> str:
        return self.manage("createtoken", "--agent", node).strip()

    def person_token(self, username: str, role: str) -> str:
        return self.manage("createtoken", "--user", username, "--role", role).strip()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> None:
        assert self.process is None, "the control plane is running already"
        self.migrate()
        command = [
            sys.executable,
            "-m",
            "uvicorn",
            "controlplane.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http",
            "controlplane.http_protocol:HeadDeadlineProtocol",
        ]
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(
                command, cwd=REPOSITORY, env=self.env, stdout=log_file, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the control plane exited with {self.process.returncode}:\n{self.log()}")
            try:
                httpx.get(self.url + "/api/v1/", timeout=1.0)
                return
            except httpx.TransportError:
                time.sleep(0.05)  # polling a process we do not control: there is no event to await
        raise RuntimeError(f"the control plane did not answer within {START_TIMEOUT} s:\n{self.log()}")

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, signal.SIGTERM)
            self.process = None

    def kill(self) -> None:
        """SIGKILL, as a crash or a lost machine would: connections are refused at once."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def client(self, token: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=10.0)


def wait_for(what: str, probe: Callable[[], T], timeout_s: float = 60.0, *, explain: Callable[[], str] = str) -> T:
    """Poll ``probe`` until it returns something true, and return that (or fail, saying ``what`` and ``explain()``).

    For state held by other processes (the control plane's database, a process table): there is no event
    to await from here.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{explain()}")
        time.sleep(0.1)


def json_of(response: httpx.Response) -> Any:
    assert response.status_code < 300, f"{response.request.method} {response.request.url}: {response.text}"
    return response.json()


def add_mocker_model(operator: httpx.Client, name: str, gguf: Path) -> dict[str, Any]:
    """Register ``gguf`` (its tokenizer) as a 1 GiB mocker model through the API; the model as it answers."""
    body = {"name": name, "source_kind": "gguf", "source": str(gguf), "engine": "mocker", "memory_bytes": 1 << 30}
    model: dict[str, Any] = json_of(operator.post("/api/v1/models/", json=body))
    return model
