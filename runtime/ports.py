"""Choosing a free TCP port for a server that another process will start, a moment later.

The usual way, binding port 0 and closing the socket, returns a port from the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default). The kernel hands the same range out to every
outgoing connection and every other ``bind(0)``, so in the seconds before the server binds it (a vLLM engine binds
its KV event publisher after loading its weights) the port can be taken: CI lost a vLLM worker so ("Address
already in use (addr='tcp://*:40191')"). Ports chosen here lie outside that range, where the kernel never puts a
socket of its own, and each is checked free when it is chosen (strictly: not even a closed connection's TIME_WAIT
on it, whatever the server's socket options).

Other processes of this host choose ports the same way (the test suite's workers, an agent starting several
engines), so a port chosen here is written in a ledger, a file in the temporary directory under an exclusive lock,
and no process of this user chooses it again for ``HOLD_S`` seconds: by then its server has bound it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

#: The lowest port chosen: below it lie the well-known and commonly configured ports (8000, 8080, 9090...).
LOWEST = 10000
#: The kernel's ephemeral range when /proc does not say (Linux's default).
DEFAULT_EPHEMERAL = (32768, 60999)
#: How long a chosen port is held from every other choice on this host: long enough for its server to start.
HOLD_S = 180.0
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")

# The ports this process chose, with when: where the ledger cannot be written, they alone are held.
_chosen_here: dict[int, float] = {}


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range, both ends included."""
    try:
        low, high = (int(part) for part in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def ports_free(ports: Iterable[int], host: str = "127.0.0.1", *, reuse_address: bool = False) -> bool:
    """Whether each of ``ports`` can be bound on ``host`` now. With ``reuse_address``, as servers that set
    SO_REUSEADDR bind (etcd, NATS, ZMQ, uvicorn): a port in TIME_WAIT after a stopped server counts as free."""
    try:
        for port in ports:
            with socket.socket() as probe:
                if reuse_address:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
    except OSError:
        return False
    return True


def ledger_path() -> Path:
    """Where this user's processes write the ports they chose."""
    return Path(tempfile.gettempdir()) / f"flotilla-ports-{os.getuid()}"


@contextlib.contextmanager
def _held_ports() -> Iterator[dict[int, float]]:
    """The ports chosen on this host in the last ``HOLD_S`` seconds (port: when), the ledger locked meanwhile;
    what the caller adds is written back. Without a usable ledger, this process's own choices."""
    now = time.time()
    for port, at in list(_chosen_here.items()):
        if now - at >= HOLD_S:
            del _chosen_here[port]
    try:
        ledger = open(ledger_path(), "a+", encoding="ascii")  # noqa: SIM115 (closed below, after the lock)
    except OSError as exc:
        log.debug("port ledger %s unusable (%s): holding this process's choices only", ledger_path(), exc)
        yield _chosen_here
        return
    with ledger:
        fcntl.flock(ledger.fileno(), fcntl.LOCK_EX)  # released when the file closes
        ledger.seek(0)
        held = dict(_chosen_here)
        for line in ledger:
            fields = line.split()
            with contextlib.suppress(ValueError, IndexError):
                port, at = int(fields[0]), float(fields[1])
                if now - at < HOLD_S:
                    held[port] = at
        before = set(held)
        yield held
        _chosen_here.update({port: held[port] for port in set(held) - before})
        ledger.seek(0)
        ledger.truncate()
        ledger.writelines(f"{port} {at}\n" for port, at in held.items())


def _candidates(count: int) -> list[range]:
    """The stretches of ports outside the ephemeral range that ``count`` consecutive ports can start in."""
    low, high = ephemeral_range()
    spans = [range(LOWEST, low - count + 1), range(high + 1, 65536 - count + 1)]
    return [span for span in spans if len(span) > 0]


def _pick(spans: list[range]) -> int:
    """A port drawn evenly from all of ``spans``."""
    index = random.randrange(sum(len(span) for span in spans))
    for span in spans:
        if index < len(span):
            return span[index]
        index -= len(span)
    raise AssertionError("an index within the spans' total length")


def free_ports(count: int = 1, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """The first of ``count`` consecutive ports outside the kernel's ephemeral range that are free on ``host`` now
    and that no process of this user chose in the last ``HOLD_S`` seconds; they are held from now. Raises
    OSError when ``attempts`` random tries find none."""
    spans = _candidates(count)
    if spans:
        with _held_ports() as held:
            for _ in range(attempts):
                first = _pick(spans)
                wanted = range(first, first + count)
                if any(port in held for port in wanted) or not ports_free(wanted, host):
                    continue
                now = time.time()
                held.update(dict.fromkeys(wanted, now))
                return first
    raise OSError(f"no {count} consecutive free ports on {host} outside the ephemeral range {ephemeral_range()}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` now, outside the kernel's ephemeral range, held from other choices."""
    return free_ports(1, host)
