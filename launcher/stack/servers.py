"""etcd, NATS (with JetStream) and Redis as ``flotilla up`` runs them: Debian's binaries, on loopback.

Each server is a command line plus a readiness check; ``launcher.stack.up`` runs them as children.
"""

import asyncio
import contextlib
import os
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from runtime.errors import ConfigError

# Debian puts nats-server in /usr/sbin, which a normal user's PATH leaves out.
_SBIN_DIRS = ("/usr/local/sbin", "/usr/sbin", "/sbin")
_CHECK_TIMEOUT_S = 1.0

ReadyCheck = Callable[[], Awaitable[bool]]


@dataclass(frozen=True)
class ServerSpec:
    """One infrastructure server: how to run it and how to tell that it answers."""

    name: str  # as the user reads it ("etcd", "NATS", "Redis")
    log_name: str  # its log file, in the logs folder
    argv: list[str]
    url: str
    ready: ReadyCheck


def find_binaries(names: tuple[str, ...]) -> dict[str, str]:
    """Each program's path, from PATH or the sbin folders.

    Raises ConfigError naming the missing ones and ``make system-deps``, which installs them.
    """
    search = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN_DIRS])
    found = {name: shutil.which(name, path=search) for name in names}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise ConfigError(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: run `make system-deps` "
            "(Debian packages etcd-server, nats-server, redis-server)"
        )
    return {name: path for name, path in found.items() if path is not None}


#: How much of its history etcd keeps. It keeps every revision until its history is compacted, which it does
#: not do by default: a stack left running would fill etcd's space quota (2 GiB, then every write is refused)
#: with registrations and liveness claims. No reader here resumes a watch from older than a moment ago (a
#: broken watch lists its prefix again), so an hour is ample.
ETCD_HISTORY = "1h"


def etcd_server(binary: str, port: int, peer_port: int, data_dir: Path, history: str = ETCD_HISTORY) -> ServerSpec:
    """A one-member etcd on ``127.0.0.1:port`` that compacts its history older than ``history`` (a duration:
    ``1h``, ``10m``, ``2s``)."""
    url = f"http://127.0.0.1:{port}"
    peer = f"http://127.0.0.1:{peer_port}"
    argv = [
        binary,
        "--name=flotilla",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={url}",
        f"--advertise-client-urls={url}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=flotilla={peer}",
        "--auto-compaction-mode=periodic",
        f"--auto-compaction-retention={history}",
    ]

    async def ready() -> bool:
        # /health says true only once the member has a leader and serves requests.
        try:
            async with httpx.AsyncClient(timeout=_CHECK_TIMEOUT_S) as client:
                response = await client.get(f"{url}/health")
            return response.status_code == 200 and response.json().get("health") == "true"
        except (httpx.HTTPError, ValueError):
            return False

    return ServerSpec("etcd", "etcd", argv, url, ready)


def nats_server(binary: str, port: int, store_dir: Path) -> ServerSpec:
    """nats-server with JetStream (the tokenizers' object store) on ``127.0.0.1:port``."""
    argv = [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store_dir)]

    async def ready() -> bool:
        # The server greets every client with an INFO line once it accepts connections.
        return (await _exchange(port, b"")).startswith(b"INFO ")

    return ServerSpec("NATS", "nats", argv, f"nats://127.0.0.1:{port}", ready)


def redis_server(binary: str, port: int, data_dir: Path) -> ServerSpec:
    """redis-server on ``127.0.0.1:port`` with nothing kept on disk: Celery's tasks are idempotent and the
    reconciler sends again what a lost queue held."""
    argv = [binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data_dir)]
    argv += ["--save", "", "--appendonly", "no"]

    async def ready() -> bool:
        return (await _exchange(port, b"PING\r\n")).startswith(b"+PONG")

    return ServerSpec("Redis", "redis", argv, f"redis://127.0.0.1:{port}/0", ready)


async def _exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` to ``127.0.0.1:port`` and return the first bytes of the answer (b"" on any failure)."""
    try:
        async with asyncio.timeout(_CHECK_TIMEOUT_S):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                if request:
                    writer.write(request)
                    await writer.drain()
                return await reader.read(64)
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except (OSError, TimeoutError):
        return b""
