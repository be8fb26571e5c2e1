"""A throwaway PostgreSQL 15 server (Debian's binaries) on a free loopback port, in its own directory.

PostgreSQL refuses to run as root, so under root the server runs as the ``postgres`` system user that
Debian's package creates. Durability is switched off: the data lives only as long as the test.
"""

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import psycopg

from tests.servers import free_port, stop_process

BIN = Path("/usr/lib/postgresql/15/bin")
START_TIMEOUT = 30.0
SUPERUSER = "flotilla"


def available() -> bool:
    return (BIN / "initdb").exists() and (os.geteuid() != 0 or _system_user() is not None)


def _system_user() -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        return None


class PostgresServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="flotilla-postgres-"))
        self.process: subprocess.Popen[bytes] | None = None
        self._run_as = _system_user() if os.geteuid() == 0 else None

    @property
    def url(self) -> str:
        return f"postgres://{SUPERUSER}@127.0.0.1:{self.port}/postgres"

    def __enter__(self) -> "PostgresServer":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        """initdb, start the server, and return once it accepts connections (RuntimeError with its log if not)."""
        if self._run_as is not None:
            os.chown(self.directory, self._run_as.pw_uid, self._run_as.pw_gid)
        data, log = self.directory / "data", self.directory / "server.log"
        self._run([str(BIN / "initdb"), "-D", str(data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--no-sync"])
        command = [
            str(BIN / "postgres"),
            "-D", str(data),
            "-p", str(self.port),
            "-k", str(self.directory),
            "-c", "listen_addresses=127.0.0.1",
            "-c", "fsync=off",
            "-c", "synchronous_commit=off",
            "-c", "full_page_writes=off",
        ]  # fmt: skip
        with log.open("ab") as log_file:
            self.process = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, cwd=self.directory, **self._as_user()
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.process.returncode}:\n{log.read_text()}")
            try:
                psycopg.connect(self.url, connect_timeout=1).close()
                return
            except psycopg.OperationalError:
                time.sleep(0.05)  # polling a server we do not control: there is no event to await
        raise RuntimeError(f"postgres did not accept connections in {START_TIMEOUT}s:\n{log.read_text()}")

    def stop(self) -> None:
        """Fast shutdown (SIGINT: roll back open transactions), then delete its directory."""
        if self.process is not None:
            stop_process(self.process, signal.SIGINT)
            self.process = None
        shutil.rmtree(self.directory, ignore_errors=True)

    def _run(self, command: list[str]) -> None:
        result = subprocess.run(command, capture_output=True, text=True, cwd=self.directory, **self._as_user())
        if result.returncode != 0:
            raise RuntimeError(f"{command[0]} failed ({result.returncode}):\n{result.stdout}{result.stderr}")

    def _as_user(self) -> dict[str, object]:
        if self._run_as is None:
            return {}
        return {"user": self._run_as.pw_uid, "group": self._run_as.pw_gid, "extra_groups": []}
