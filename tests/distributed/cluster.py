"""A distributed deployment for tests: workers and an ingress as real processes on real etcd and NATS."""

import base64
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.infra import EtcdServer, NatsServer
from tests.servers import Server, start_server, stop_process

_BANNER = re.compile(r"Flotilla worker ([0-9a-f]+) \(pid (\d+)\)")


@dataclass
class Worker:
    process: subprocess.Popen[bytes]
    log_path: Path
    instance_id: str = ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        stop_process(self.process, signal.SIGTERM)


@dataclass
class Cluster:
    etcd: EtcdServer
    nats: NatsServer
    directory: Path
    lease_ttl: float = 2.0
    workers: list[Worker] = field(default_factory=list)
    servers: list[Server] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "ETCD_ENDPOINTS": self.etcd.endpoint,
            "NATS_SERVER": self.nats.url,
            "FLOTILLA_LEASE_TTL": str(self.lease_ttl),
            "FLOTILLA_STREAM_SILENCE_S": "1",
            "FLOTILLA_STREAM_HEARTBEAT_S": "0.2",
            "FLOTILLA_LOG": "info",
            **extra,
        }

    def start_worker(
        self, address: str, *args: str, delay_ms: int = 0, env: dict[str, str] | None = None, timeout: float = 60
    ) -> Worker:
        """Start `flotilla run in=ADDRESS ARGS` and wait for its banner (it has registered by then)."""
        [worker] = self.start_workers(1, address, *args, delay_ms=delay_ms, env=env, timeout=timeout)
        return worker

    def start_workers(
        self,
        count: int,
        address: str,
        *args: str,
        delay_ms: int = 0,
        env: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> list[Worker]:
        """Start ``count`` workers of `flotilla run in=ADDRESS ARGS` at once, then wait for each one's banner:
        their starts overlap instead of adding up."""
        return self.start_each([(address, args)] * count, delay_ms=delay_ms, env=env, timeout=timeout)

    def start_each(
        self,
        workers: "list[tuple[str, tuple[str, ...]]]",
        *,
        delay_ms: int = 0,
        env: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> list[Worker]:
        """Start a worker for each ``(address, args)`` at once, then wait for each one's banner."""
        started = [self._launch(address, args, delay_ms, env) for address, args in workers]
        deadline = time.monotonic() + timeout
        for worker in started:
            self._wait_for_banner(worker, deadline, timeout)
        return started

    def _launch(self, address: str, args: tuple[str, ...], delay_ms: int, env: dict[str, str] | None) -> Worker:
        log_path = self.directory / f"worker-{len(self.workers)}.log"
        command = [sys.executable, "-m", "launcher.cli", "run", f"in={address}", *args]
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.env(FLOTILLA_TOKEN_ECHO_DELAY_MS=str(delay_ms), **(env or {})),
            )
        worker = Worker(process, log_path)
        self.workers.append(worker)
        return worker

    @staticmethod
    def _wait_for_banner(worker: Worker, deadline: float, timeout: float) -> None:
        while time.monotonic() < deadline:
            if (found := _BANNER.search(worker.log())) is not None:
                worker.instance_id = found.group(1)
                return
            if worker.process.poll() is not None:
                raise RuntimeError(f"worker exited with {worker.process.returncode}:\n{worker.log()}")
            time.sleep(0.05)  # waiting on another process's output: no event to await
        raise RuntimeError(f"worker did not register in {timeout}s:\n{worker.log()}")

    def start_ingress(self, *args: str) -> Server:
        log_path = self.directory / f"ingress-{len(self.servers)}.log"
        server = start_server(["out=dyn", *args], log_path, env=self.env())
        self.servers.append(server)
        return server

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()
        for server in self.servers:
            server.stop()


def wait_until(condition: "object", timeout: float, message: str) -> None:
    """Poll ``condition()`` until true; other processes' state has no event to await."""
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.05)


def served_models(server: Server) -> list[str]:
    data = httpx.get(server.api_url + "/models", timeout=5).json()["data"]
    return sorted(model["id"] for model in data)


def etcd_leases(etcd: EtcdServer, prefix: str) -> dict[str, int]:
    """The keys under ``prefix`` in etcd and the lease each is attached to (0: none), over its JSON API."""
    return {base64.b64decode(kv["key"]).decode(): int(kv.get("lease", 0)) for kv in _etcd_range(etcd, prefix)}


def etcd_values(etcd: EtcdServer, prefix: str) -> dict[str, str]:
    """The keys under ``prefix`` in etcd and their values, over its JSON API."""
    return {
        base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")).decode()
        for kv in _etcd_range(etcd, prefix)
    }


def etcd_put(etcd: EtcdServer, key: str | bytes, value: str | bytes) -> None:
    """Put ``key`` in etcd, over its JSON API (as a worker's registration, without a lease); bytes go as
    they are (what a process that is not Flotilla's could write)."""
    body = {"key": _b64(key), "value": _b64(value)}
    httpx.post(etcd.endpoint + "/v3/kv/put", json=body, timeout=5).raise_for_status()


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def _etcd_range(etcd: EtcdServer, prefix: str) -> list[dict[str, str]]:
    encode = _b64
    # The range end is the prefix with its last byte incremented: every key that starts with it.
    range_end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    body = {"key": encode(prefix), "range_end": encode(range_end)}
    reply = httpx.post(etcd.endpoint + "/v3/kv/range", json=body, timeout=5)
    reply.raise_for_status()
    kvs: list[dict[str, str]] = reply.json().get("kvs", [])
    return kvs
