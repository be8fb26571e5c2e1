"""Start-up of `flotilla run` before etcd and NATS: it says what is missing, waits, and stops cleanly."""

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from runtime.cluster.discovery import INSTANCES_PREFIX, Discovery
from tests.infra import EtcdServer, NatsServer
from tests.servers import free_port, stop_process

REPO_ROOT = Path(__file__).resolve().parents[2]
# The warnings come one second after the first attempt; this bound only keeps a broken build from
# hanging the test, and leaves room for a slow interpreter start on a loaded machine.
WARNING_WITHIN = 15.0


class Output:
    """The lines a process writes, read on a thread, so that a test can wait for the ones it expects."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def expect(self, *texts: str, within: float = WARNING_WITHIN) -> list[str]:
        """The first line containing each of ``texts``, in any order; fail after ``within`` seconds."""
        found: dict[str, str] = {}
        deadline = time.monotonic() + within
        while len(found) < len(texts):
            try:
                line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                line = None
            if line is None:
                missing = [text for text in texts if text not in found]
                pytest.fail(f"no line with {missing} in:\n" + "\n".join(self.lines))
            self.lines.append(line)
            for text in texts:
                if text in line and text not in found:
                    found[text] = line
        return [found[text] for text in texts]

    def until_exit(self) -> str:
        """Everything, once the process has exited and its output is read to the end."""
        while (line := self._queue.get(timeout=WARNING_WITHIN)) is not None:
            self.lines.append(line)
        return "\n".join(self.lines)


def start_flotilla(*args: str, nats: NatsServer, etcd: EtcdServer) -> tuple[subprocess.Popen[str], Output]:
    env = {**os.environ, "NATS_SERVER": nats.url, "ETCD_ENDPOINTS": etcd.endpoint, "FLOTILLA_LOG": "info"}
    process = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "run", *args],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    return process, Output(process.stdout)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[NatsServer, EtcdServer]]:
    """A NATS and an etcd whose ports are chosen but which are not started (the test starts them)."""
    nats, etcd = NatsServer(tmp_path / "nats"), EtcdServer(tmp_path / "etcd")
    yield nats, etcd
    nats.stop()
    etcd.stop()


async def instances(etcd: EtcdServer, namespace: str) -> dict[str, bytes]:
    async with await Discovery.connect([etcd.endpoint], wait=10) as discovery:
        return await discovery.get_prefix(f"{INSTANCES_PREFIX}{namespace}/")


def test_a_worker_started_before_its_servers_names_both_then_connects_registers_and_says_so(
    servers: tuple[NatsServer, EtcdServer],
) -> None:
    nats, etcd = servers
    started = time.monotonic()
    process, output = start_flotilla("in=dyn://early.backend.generate", "out=echo_full", nats=nats, etcd=etcd)
    try:
        nats_warning, etcd_warning = output.expect("cannot reach NATS", "cannot reach etcd")
        print(f"both warnings {time.monotonic() - started:.2f} s after the process started")
        assert "WARNING" in nats_warning
        assert nats.url in nats_warning
        assert "start one with `make services` or set NATS_SERVER" in nats_warning
        assert etcd.endpoint in etcd_warning
        assert "start one with `make services` or set ETCD_ENDPOINTS" in etcd_warning
        assert process.poll() is None, "it keeps trying: a supervisor relies on that"

        nats.start()
        etcd.start()
        output.expect("connected to NATS", "connected to etcd", "serves 'echo' on dyn://early")
        assert len(asyncio.run(instances(etcd, "early"))) == 1

        assert stop_process(process, signal.SIGTERM) == 0
    finally:
        process.kill()
        process.wait()


def test_sigterm_while_the_ingress_waits_for_its_servers_exits_promptly_and_cleanly(
    servers: tuple[NatsServer, EtcdServer],
) -> None:
    nats, etcd = servers
    process, output = start_flotilla("in=http", "out=dyn", "--http-port", str(free_port()), nats=nats, etcd=etcd)
    try:
        output.expect("cannot reach NATS", "cannot reach etcd")
        process.send_signal(signal.SIGTERM)
        # Far below the 10 s a supervisor waits before it kills.
        assert process.wait(timeout=10) == 0
        everything = output.until_exit()
        assert "stopped by SIGTERM while waiting for etcd and NATS" in everything
        assert "Traceback" not in everything
    finally:
        process.kill()
        process.wait()


def test_the_systemd_units_do_not_restart_a_configuration_error() -> None:
    for unit in (REPO_ROOT / "deploy" / "systemd").glob("*.service"):
        text = unit.read_text()
        assert "Restart=on-failure" in text, unit.name
        assert "RestartPreventExitStatus=2" in text, unit.name
