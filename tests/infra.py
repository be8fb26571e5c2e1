"""Real etcd, NATS and Redis servers for tests, on free loopback ports, each with its own data directory.

Both keep their ports across restarts, so clients that hold the address can reconnect, which is what
the resilience tests exercise.
"""

import abc
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from tests.servers import free_port, stop_process

START_TIMEOUT = 20.0


class _Process(abc.ABC):
    """One server process with its log in ``directory/server.log``; subclasses say how to run it."""

    def __init__(self, name: str, directory: Path) -> None:
        self.name = name
        self.directory = directory
        self.data_dir = directory / "data"
        self.log_path = directory / "server.log"
        self.process: subprocess.Popen[bytes] | None = None

    @abc.abstractmethod
    def command(self) -> list[str]:
        """The command line that starts the server."""

    @abc.abstractmethod
    def ready(self) -> bool:
        """Whether the server answers yet."""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> None:
        """Start the server and return once it answers; raise RuntimeError with its log otherwise."""
        assert self.process is None, f"{self.name} is already running"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # Append, so that the log of a restarted server still shows what happened before.
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(self.command(), stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise RuntimeError(f"{self.name} exited with {code} at start:\n{self.log()}")
            if self.ready():
                return
            time.sleep(0.02)  # polling a process we do not control: there is no event to await
        self.kill()
        raise RuntimeError(f"{self.name} did not become ready in {START_TIMEOUT}s:\n{self.log()}")

    def stop(self) -> None:
        """Stop gracefully (SIGTERM), killing it if it does not exit in 10 s."""
        if self.process is None:
            return
        stop_process(self.process, signal.SIGTERM)
        self.process = None

    def kill(self) -> None:
        """Kill it (SIGKILL), as a crash or a power cut would."""
        if self.process is None:
            return
        self.process.kill()
        self.process.wait()
        self.process = None

    def restart(self, wipe: bool = False) -> None:
        """Stop and start again on the same ports; ``wipe`` deletes its data first (a fresh server)."""
        self.stop()
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self.start()


class EtcdServer(_Process):
    """A one-member etcd cluster; ``endpoint`` is ``http://127.0.0.1:PORT``."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        super().__init__("etcd", directory)
        self.port = port or free_port()
        self.peer_port = free_port()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            "etcd",
            "--name=t",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.endpoint}",
            f"--advertise-client-urls={self.endpoint}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=t={peer}",
        ]

    def ready(self) -> bool:
        # /health answers true only once the member has a leader and serves requests.
        try:
            response = httpx.get(self.endpoint + "/health", timeout=1.0)
        except httpx.TransportError:
            return False
        return response.status_code == 200 and response.json().get("health") == "true"


class NatsServer(_Process):
    """nats-server with JetStream (unless ``jetstream=False``); ``url`` is ``nats://127.0.0.1:PORT``."""

    def __init__(self, directory: Path, port: int | None = None, *, jetstream: bool = True) -> None:
        super().__init__("nats-server", directory)
        self.port = port or free_port()
        self.jetstream = jetstream

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        jetstream = ["-js", "-sd", str(self.data_dir)] if self.jetstream else []
        return ["nats-server", *jetstream, "-a", "127.0.0.1", "-p", str(self.port)]

    def ready(self) -> bool:
        # The server greets every client with an INFO line once it accepts connections.
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as sock:
                return sock.recv(4096).startswith(b"INFO ")
        except OSError:
            return False


class RedisServer(_Process):
    """redis-server (Celery's broker); ``url`` is ``redis://127.0.0.1:PORT/0``. Persistence is off, as a
    broker in a test needs none, so ``restart`` gives an empty server."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        super().__init__("redis-server", directory)
        self.port = port or free_port()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return [
            "redis-server",
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "no",
        ]

    def ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False
